"""What a run starts from: a fresh model, a checkpoint to resume, or weights to start from.

Megatron-LM's flags and meanings:

- ``--load DIR``: resume (weights, optimizer, LR schedule, iteration, consumed samples).
- ``--finetune``: from ``--load`` take the model weights only; iteration and consumed samples
  start at 0, optimizer and LR schedule start fresh. A weights-only checkpoint (written by
  ``lrattn-convert-megatron``) is started from this way.
- ``--pretrained-checkpoint DIR``: when ``--load`` holds no checkpoint (or is not given),
  start from DIR as with ``--finetune``; once ``--load`` holds one, resume from it (so the
  same command starts a continued-pretraining run and resumes it).
- ``--no-load-optim``: weights, iteration and consumed samples from ``--load``; optimizer
  and LR schedule fresh (the schedule is saved with the optimizer, so it restarts at its
  step 0, as in Megatron).
- ``--no-load-rng``: accepted; our checkpoints hold no RNG state (every run seeds from
  ``--seed``, and the data order comes from the seed and the consumed samples).

A fresh start refuses nothing about the data (other data is the point of starting from
weights); the model settings and architecture must match.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from megatron_lrattn.training.checkpoint_io import (
    CheckpointError,
    check_compatible,
    load_state,
    read_meta,
    resolve_checkpoint,
)

logger = logging.getLogger(__name__)


@dataclass
class StartPoint:
    """Where a run starts.

    Attributes:
        path: the checkpoint folder or ``--save``-style folder to read, or None (fresh).
        weights_only: read the model weights only (``--finetune``, ``--pretrained-checkpoint``
            or ``--no-load-optim``).
        keep_progress: keep the checkpoint's iteration and consumed samples (resume and
            ``--no-load-optim``; not ``--finetune``).
    """

    path: Optional[str]
    weights_only: bool = False
    keep_progress: bool = False


def _holds_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "latest"))


def start_point(args: argparse.Namespace) -> StartPoint:
    """The start point ``args`` ask for (module docstring)."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and not _holds_checkpoint(args.load):
        if args.load:
            logger.info("--load %s holds no checkpoint: starting from the weights of "
                        "--pretrained-checkpoint %s", args.load, pretrained)
        return StartPoint(pretrained, weights_only=True, keep_progress=False)
    if not args.load:
        return StartPoint(None)
    if getattr(args, "finetune", False):
        return StartPoint(args.load, weights_only=True, keep_progress=False)
    if getattr(args, "no_load_optim", False):
        return StartPoint(args.load, weights_only=True, keep_progress=True)
    return StartPoint(args.load, weights_only=False, keep_progress=True)


def is_weights_only(meta: Dict[str, Any]) -> bool:
    """A checkpoint without optimizer state and LR schedule (``lrattn-convert-megatron``)."""
    contents = meta.get("contents")
    return meta.get("scheduler") is None or (contents is not None and "optimizer" not in contents)


def refuse_weights_only(meta: Dict[str, Any], path: str, load_dir: str) -> None:
    """A plain ``--load`` of a weights-only checkpoint: one line saying what to use instead."""
    if is_weights_only(meta):
        source = meta.get("converted_from")
        made = f" (converted from {source})" if source else ""
        raise CheckpointError(
            f"{path} holds model weights only{made}, no optimizer state or LR schedule to "
            f"resume: start from it with --load {load_dir} --finetune (or "
            f"--pretrained-checkpoint {load_dir})")


def load_weights(path: str, models, config, architecture: Optional[Dict[str, Any]]
                 ) -> Dict[str, Any]:
    """Read the model weights of checkpoint (or ``--save`` folder) ``path`` into ``models``.

    The model settings and ``architecture`` must match the checkpoint's (``CheckpointError``
    otherwise); the data it was trained on may differ. Returns its ``lrattn.json``.
    """
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    check_compatible(meta, config, folder, architecture)
    load_state(folder, models)
    return meta


def describe(point: StartPoint, args: argparse.Namespace) -> str:
    """One log line about the start point."""
    if point.path is None:
        return "start: fresh model (seed %d)" % args.seed
    if not point.weights_only:
        return f"start: resuming {point.path}"
    if point.keep_progress:
        return (f"start: weights, iteration and consumed samples of {point.path} "
                "(--no-load-optim: fresh optimizer, LR schedule from step 0)")
    return (f"start: weights of {point.path} (iteration 0, fresh optimizer and LR schedule; "
            "--finetune)")
