"""The learning-rate schedule: Megatron-LM's schedule flags resolved to iterations, the
scheduler built from them, and what a resumed run does with the schedule a checkpoint saved.

Megatron's meanings:

- ``--train-iters`` or ``--train-samples`` (iterations = samples // global batch), not both.
- ``--lr-decay-iters`` / ``--lr-decay-samples``: length of the decay (default: the whole run).
- ``--lr-warmup-iters`` / ``--lr-warmup-samples`` / ``--lr-warmup-fraction`` (of the decay
  length): one of them.
- On resume the checkpoint's schedule (peak and minimum LR, warm-up, decay length and style,
  weight decay) must equal the run's, unless ``--override-opt_param-scheduler`` (the run's
  flags win; the step count still comes from the checkpoint) or
  ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's values win).

Our scheduler counts iterations (Megatron's counts samples; with a fixed global batch the two
are the same schedule). Sample counts are converted to iterations, rounded up.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Dict, List, Optional, Set

from megatron_lrattn.training.arg_types import ArgumentError

ITERATION_FLAGS = ("train_iters", "lr_decay_iters", "lr_warmup_iters")
SAMPLE_FLAGS = ("train_samples", "lr_decay_samples", "lr_warmup_samples")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolve_schedule(args: argparse.Namespace, explicit: Set[str]) -> None:
    """Set ``args.train_iters``, ``args.lr_decay_iters`` and ``args.lr_warmup_iters`` from
    the iteration-, sample- or fraction-based flags (in place).

    Args:
        args: parsed ``lrattn-pretrain`` arguments (preset values filled in).
        explicit: destinations given on the command line or in ``--config`` (a preset's
            iteration counts give way to sample-based flags; explicit ones conflict).

    Raises:
        ArgumentError: iteration- and sample-based flags mixed, two warm-up flags, a
            warm-up fraction outside [0, 1), or counts that leave nothing to train.
    """
    gbs = args.global_batch_size
    samples = [d for d in SAMPLE_FLAGS if getattr(args, d, None) is not None]
    if samples:
        mixed = [d for d in ITERATION_FLAGS if d in explicit]
        if mixed:
            raise ArgumentError(f"{_flag(samples[0])} and {_flag(mixed[0])}: use sample-based "
                                "or iteration-based schedule flags, not both (Megatron's rule)")
        if args.train_samples is not None:
            args.train_iters = args.train_samples // gbs
            if args.train_iters < 1:
                raise ArgumentError(f"--train-samples {args.train_samples} is less than one "
                                    f"global batch ({gbs})")
        if args.lr_decay_samples is not None:
            args.lr_decay_iters = math.ceil(args.lr_decay_samples / gbs)
        if args.lr_warmup_samples is not None:
            args.lr_warmup_iters = math.ceil(args.lr_warmup_samples / gbs)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_iters < 1:
        raise ArgumentError(f"--lr-decay-iters {args.lr_decay_iters}: must be >= 1")
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None:
        given = [d for d in ("lr_warmup_iters", "lr_warmup_samples") if d in explicit]
        if given:
            raise ArgumentError(f"--lr-warmup-fraction and {_flag(given[0])}: give one warm-up "
                                "length")
        if not 0 <= fraction < 1:
            raise ArgumentError(f"--lr-warmup-fraction {fraction}: must be in [0, 1)")
        args.lr_warmup_iters = int(fraction * args.lr_decay_iters)
    if getattr(args, "override_opt_param_scheduler", False) and getattr(
            args, "use_checkpoint_opt_param_scheduler", False):
        raise ArgumentError("--override-opt_param-scheduler and "
                            "--use-checkpoint-opt_param-scheduler: choose one")


def wsd_decay_iters(args: argparse.Namespace) -> Optional[int]:
    """Length of the WSD decay phase (``--lr-wsd-decay-iters``, default the last 20% of the
    decay length); None for the other styles."""
    if args.lr_decay_style != "WSD":
        return None
    decay = getattr(args, "lr_decay_iters", None) or args.train_iters
    return args.lr_wsd_decay_iters or max(1, decay // 5)


def build_scheduler(optimizer, args: argparse.Namespace):
    """megatron-core's ``OptimizerParamScheduler`` for ``args`` (one step per iteration)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wsd = wsd_decay_iters(args)
    decay = getattr(args, "lr_decay_iters", None) or args.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=bool(
            getattr(args, "use_checkpoint_opt_param_scheduler", False)),
        override_opt_param_scheduler=bool(getattr(args, "override_opt_param_scheduler", False)),
        wsd_decay_steps=wsd,
        lr_wsd_decay_style="linear" if wsd else None,
    )


_COMPARED = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "--lr-warmup-iters"),
             ("lr_decay_steps", "--lr-decay-iters (default --train-iters)"),
             ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"),
             ("wd_incr_steps", "--train-iters"))


def schedule_differences(saved: Dict[str, Any], scheduler) -> List[str]:
    """``flag: checkpoint X, run Y`` for every schedule value that differs."""
    now = scheduler.state_dict()
    out = []
    for key, flag in _COMPARED:
        if key in saved and saved[key] != now[key]:
            out.append(f"{flag}: checkpoint {saved[key]}, run {now[key]}")
    return out


def check_resume_schedule(saved: Optional[Dict[str, Any]], scheduler, args: argparse.Namespace,
                          path: str) -> None:
    """Refuse, in one line, to resume with a schedule that differs from the checkpoint's
    unless a flag says which one wins (Megatron asserts the same).

    Raises:
        CheckpointError: naming the differing values and the two flags.
    """
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    if not saved or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    diffs = schedule_differences(saved, scheduler)
    if diffs:
        raise CheckpointError(
            f"{path}: its LR schedule differs from this run's ({'; '.join(diffs)}); pass "
            "--override-opt_param-scheduler to use this run's schedule from the saved step, or "
            "--use-checkpoint-opt_param-scheduler to keep the saved one")


def describe_schedule(args: argparse.Namespace) -> str:
    """One line: iterations, warm-up, decay style and length, peak and minimum LR."""
    wsd = wsd_decay_iters(args)
    decay = args.lr_decay_iters or args.train_iters
    style = f"{args.lr_decay_style} decay over {decay} iterations" + (
        f" (last {wsd} decaying)" if wsd else "")
    return (f"{args.train_iters} iterations of {args.global_batch_size} samples; warm-up "
            f"{args.lr_warmup_iters}, {style}; lr {args.lr:g} -> {args.min_lr:g}")
