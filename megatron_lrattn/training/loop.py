"""The pretraining loop: megatron-core's pipeline schedules, optimizer and LR schedule."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch

from megatron_lrattn.data.datasets import build_gpt_datasets
from megatron_lrattn.data.loader import rank_batches
from megatron_lrattn.data.tokenizer import HFTokenizer
from megatron_lrattn.training.downstream import flatten as flatten_downstream
from megatron_lrattn.training.downstream import make_downstream
from megatron_lrattn.depth.state import uses_two_phase
from megatron_lrattn.depth.payload import log_pipeline_payloads
from megatron_lrattn.training.builder import padded_vocab_size, virtual_stages
from megatron_lrattn.data.datasets import parse_blend
from megatron_lrattn.training.checkpoint import check_save_space, load_checkpoint
from megatron_lrattn.training.checkpoint_io import (
    architecture,
    check_compatible,
    data_identity,
    latest_checkpoint,
    read_meta,
)
from megatron_lrattn.training.checkpointer import Checkpointer
from megatron_lrattn.training.determinism import enable_deterministic
from megatron_lrattn.training.fusions import fused_optimizer_step, use_fused_adamw
from megatron_lrattn.training.optimizer_step import mixed_precision_adamw
from megatron_lrattn.training.resume import describe as describe_start
from megatron_lrattn.training.resume import load_weights, refuse_weights_only, start_point
from megatron_lrattn.training.runtime import Runtime, init_runtime, provenance
from megatron_lrattn.training.schedule import check_resume_schedule, describe_schedule
from megatron_lrattn.training.step import (
    build_train_step,
    check_sequence_parallel,
    num_microbatches,
    step_config,
)
from megatron_lrattn.training.trackers import with_trackers

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        first_valid_loss, first_valid_iteration: the validation before the first step.
        final_valid_loss, final_valid_iteration: the last validation and its iteration
            (before ``iterations`` when the run stopped early between validations).
        iterations: the iteration the run ended at.
        checkpoint: the last checkpoint folder, or None.
        stop_reason: why it stopped before ``--train-iters`` (``exit signal`` for SIGTERM,
            ``interrupt`` for a first Ctrl-C, ``--exit-interval N``,
            ``--exit-duration-in-mins M``), else None.
    """

    first_valid_loss: Optional[float]
    final_valid_loss: Optional[float]
    iterations: int
    checkpoint: Optional[str]
    first_valid_iteration: int = 0
    final_valid_iteration: int = 0
    stop_reason: Optional[str] = None


def _per_chunk(make: Callable[[], Iterator[Dict]], n_chunks: int):
    """One data iterator, or one per model chunk for the interleaved schedule (each chunk
    draws the same micro-batches; only the first and last use them)."""
    return make() if n_chunks == 1 else [make() for _ in range(n_chunks)]


class MetricsWriter:
    """JSON-lines metrics file (rank 0 only).

    A resumed run (``resume_from`` = the loaded iteration) appends, after dropping the
    records of iterations after ``resume_from`` (a killed run logged them, the resumed run
    replays them); ``dropped`` counts them and the run record says so. A fresh run
    replaces the file (with a warning when it held records).
    """

    def __init__(self, path: Optional[str], resume_from: Optional[int], enabled: bool):
        self.f = None
        self.dropped = 0
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resume_from is not None and os.path.isfile(path):
                self.dropped = _drop_replayed(path, resume_from)
                if self.dropped:
                    logger.warning("%s: dropped %d records after iteration %d (the resumed "
                                   "run writes them again)", path, self.dropped, resume_from)
            elif resume_from is None and os.path.isfile(path) and os.path.getsize(path):
                logger.warning("%s: replaced (a fresh run; the records in it are dropped)",
                               path)
            self.f = open(path, "a" if resume_from is not None else "w")

    def write(self, record: Dict) -> None:
        """Append one record; non-finite numbers (a skipped step's loss) are written as
        null so that every line stays strict JSON."""
        if self.f:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                     for k, v in record.items()}
            self.f.write(json.dumps(clean, allow_nan=False) + "\n")
            self.f.flush()

    def close(self) -> None:
        """Close the file."""
        if self.f:
            self.f.close()


def _drop_replayed(path: str, iteration: int) -> int:
    """Rewrite ``path`` (atomically) without the records of iterations after
    ``iteration``; returns how many were dropped. Unparseable lines (a torn last line of
    a killed run) are dropped too."""
    from megatron_lrattn.training.durable import replace_file

    kept, dropped = [], 0
    with open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                dropped += bool(line.strip())
                continue
            if isinstance(record, dict) and (record.get("iteration") or 0) > iteration:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        replace_file(path, "".join(kept))
    return dropped


QUIET_LOGGERS = ("megatron.core.datasets", "megatron.core.distributed",
                 "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler")
"""megatron-core loggers that log at INFO what the run summarises itself (every DDP bucket's
parameters, the optimizer and dataset config reprs, each index file read): WARNING and
above pass."""


def quiet_megatron_loggers() -> None:
    """Raise ``QUIET_LOGGERS`` to WARNING (their warnings and errors still show)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def log_setup_summary(step, args: argparse.Namespace) -> None:
    """A few lines in place of megatron's config reprs: parameters, DDP buckets, optimizer."""
    buckets = sum(len(getattr(buf, "buckets", ())) for m in step.models
                  for buf in list(getattr(m, "buffers", [])) + list(
                      getattr(m, "expert_parallel_buffers", [])))
    logger.info("model: %s parameters on this rank in %d chunk(s); DDP: %d gradient "
                "bucket(s), reduced in fp32%s", f"{step.num_params:,}", len(step.models),
                buckets, ", distributed optimizer" if args.use_distributed_optimizer else "")
    logger.info("optimizer: AdamW, betas (%g, %g), weight decay %g (none on 1-D tensors), "
                "gradient clipping at %g", args.adam_beta1, args.adam_beta2, args.weight_decay,
                args.clip_grad)


def train_flops_per_token(args: argparse.Namespace, vocab_size: int) -> int:
    """Forward + backward FLOPs per token of the MFU formula (``lrattn-flops``: 6 M + 12 L s a
    k, plus three times the depth reads' forward FLOPs)."""
    from megatron_lrattn.analysis.flops import ModelShape, forward_flops, model_flops_per_token

    shape = ModelShape.from_args(args, vocab_size)
    return model_flops_per_token(shape) + 3 * forward_flops(shape).depth_reads


def pretrain(args: argparse.Namespace, runtime: Optional[Runtime] = None) -> TrainResult:
    """Run pretraining as configured by ``args`` (from ``parse_args``).

    The ``--save`` folder is locked for the run (rank 0; ``save_lock``): a second run
    writing it is refused before anything is written."""
    from megatron_lrattn.training.save_lock import SaveFolderLock

    started = time.monotonic()  # --exit-duration-in-mins counts from here
    lock = None
    if args.save and os.environ.get("RANK", "0") == "0":
        lock = SaveFolderLock(args.save).acquire()
    try:
        return _pretrain(args, runtime, started)
    finally:
        if lock is not None:
            lock.release()


def _pretrain(args: argparse.Namespace, runtime: Optional[Runtime], started: float
              ) -> TrainResult:
    from megatron.core import parallel_state as ps

    quiet_megatron_loggers()
    check_sequence_parallel(args)
    if args.deterministic:
        enable_deterministic()
    rt = runtime or init_runtime(args.tensor_model_parallel_size,
                                 args.pipeline_model_parallel_size, args.seed,
                                 vp=virtual_stages(args), cp=args.context_parallel_size)
    config = step_config(args)
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    num_micro = num_microbatches(args, rt.dp)

    n_evals = args.train_iters // args.eval_interval + 2
    sizes = (args.train_iters * gbs, args.eval_iters * gbs * n_evals, args.eval_iters * gbs)
    masking = dict(reset_position_ids=args.reset_position_ids,
                   reset_attention_mask=args.reset_attention_mask,
                   eod_mask_loss=args.eod_mask_loss,
                   create_attention_mask=args.reset_attention_mask)
    if args.mock_data:
        from megatron_lrattn.data.mock import MockTokenizer, build_mock_datasets

        tokenizer_dir = args.tokenizer_model
        tokenizer = (HFTokenizer(tokenizer_dir) if tokenizer_dir
                     else MockTokenizer(args.vocab_size))
        data_path, split = ["mock"], args.split
        train_ds, valid_ds, _ = build_mock_datasets(
            tokenizer, args.seq_length, seed=args.seed, num_samples=sizes, split=split,
            cache_dir=os.path.join(args.cache_dir, "index") if args.cache_dir else None,
            **masking)
        logger.info("data: --mock-data, synthetic tokens (%r)", tokenizer)
    else:
        if args.data_path is None:
            from megatron_lrattn.data.default_corpus import ensure_default_data

            default = ensure_default_data(cache_dir=args.cache_dir)
            data_path, tokenizer_dir = default.data_prefix, default.tokenizer_dir
            split = default.split if args.split == "969,30,1" else args.split
            logger.info("data: embedded standard-library corpus at %s", default.root)
        else:
            data_path, tokenizer_dir, split = args.data_path, args.tokenizer_model, args.split
        tokenizer = HFTokenizer(tokenizer_dir)
        train_ds, valid_ds, _ = build_gpt_datasets(
            data_path, tokenizer, args.seq_length, split=split, seed=args.seed,
            num_samples=sizes,
            cache_dir=os.path.join(args.cache_dir, "index") if args.cache_dir else None,
            **masking)
    logger.info("data: %d training and %d validation samples of %d tokens%s", len(train_ds),
                len(valid_ds), args.seq_length, "".join(
                    f", --{k.replace('_', '-')}" for k, v in masking.items()
                    if v and k != "create_attention_mask"))

    vocab = padded_vocab_size(tokenizer.vocab_size, rt.tp)
    step = build_train_step(args, config, vocab,
                            num_micro, rt.device)
    models, optimizer, scheduler = step.models, step.optimizer, step.scheduler
    log_setup_summary(step, args)
    if args.save:
        check_save_space(args.save, step.num_params, config.bf16, rt.dp)

    records = {"architecture": architecture(args, config, tokenizer.vocab_size),
               "data": (data_identity(*parse_blend(data_path), split, tokenizer_dir)
                        if not args.mock_data else
                        {"mock": True, "vocab_size": tokenizer.vocab_size, "split": split})}
    iteration, consumed = 0, 0
    start = start_point(args)
    if start.path and start.weights_only:
        meta = load_weights(start.path, models, config, records["architecture"])
        if start.keep_progress:
            iteration, consumed = meta["iteration"], meta["consumed_samples"]
    elif start.path:
        path = latest_checkpoint(start.path)
        meta = read_meta(path)
        refuse_weights_only(meta, path, start.path)
        # The model and data first (load_checkpoint checks them again), then the schedule.
        check_compatible(meta, config, path, records["architecture"], records["data"])
        check_resume_schedule(meta.get("scheduler"), scheduler, args, path)
        meta = load_checkpoint(start.path, models, optimizer, scheduler, config, records)
        use_fused_adamw(optimizer, args.fused_adamw)  # not the saved run's setting
        # the loaded moments and step counts on this run's optimizer-step path
        step.optimizer_step = mixed_precision_adamw(optimizer, fused_optimizer_step(args))
        iteration, consumed = meta["iteration"], meta["consumed_samples"]
    resumed = iteration if start.keep_progress else None
    logger.info(describe_start(start, args))
    logger.info("schedule: %s", describe_schedule(args))
    info = dict(provenance(), params=step.num_params, world_size=rt.world_size, tp=rt.tp,
                pp=rt.pp, cp=rt.cp, dp=rt.dp, residual=config.residual, key=config.key_type,
                rank=config.key_rank, num_blocks=config.num_blocks, bf16=config.bf16)
    logger.info("run: %s", json.dumps(info))
    if config.uses_depth_attention:
        two_phase = uses_two_phase(config, torch.device("cuda" if torch.cuda.is_available()
                                                        else "cpu"))
        logger.info("depth reads: %s schedule (--depth-schedule %s), %s backend%s",
                    "two-phase block" if two_phase else "per-site",
                    getattr(config, "depth_schedule", "auto"), config.depth_backend,
                    ("; merges apply the next RMSNorm (--fuse-depth-norm)"
                     if config.fuse_depth_norm else "; RMSNorm after the merges "
                     "(--no-fuse-depth-norm)") if two_phase else "")
    logger.info("args: %s", json.dumps(vars(args), default=str))

    dp_rank = ps.get_data_parallel_rank()
    if rt.is_main:
        log_pipeline_payloads(config, args.seq_length, mbs)

    def valid_batches():
        # Every validation reads the same first batches: in this process, no workers.
        return _per_chunk(lambda: rank_batches(valid_ds, 0, mbs, dp_rank, rt.dp), len(models))

    def evaluate() -> float:
        return step.evaluate(valid_batches, args.eval_iters)

    downstream = make_downstream(args, tokenizer_dir, models[0], tokenizer.vocab_size,
                                 rt.is_main)

    # From here on SIGTERM saves and exits instead of killing the run.
    same_folder = bool(start.path and args.save and resumed is not None) and (
        os.path.realpath(start.path) == os.path.realpath(args.save))
    checkpointer = Checkpointer(args, models, optimizer, scheduler, config, records,
                                loaded=iteration if same_folder else None)
    writer = MetricsWriter(args.log_json, resume_from=resumed, enabled=rt.is_main)
    metrics = with_trackers(writer, args, enabled=rt.is_main)
    try:
        return _train(args, step, rt, models, optimizer, checkpointer, metrics, evaluate,
                      train_ds, dp_rank, vocab, iteration, consumed, downstream,
                      dict(info, **({"resumed_from": iteration, "dropped_records":
                                     writer.dropped} if resumed is not None else {}),
                           **({"started_from": start.path} if start.path else {})),
                      started)
    except BaseException:
        checkpointer.abort()
        metrics.close()
        raise


def _train(args, step, rt, models, optimizer, checkpointer, metrics, evaluate, train_ds,
           dp_rank, vocab, iteration, consumed, downstream, info, started) -> TrainResult:
    """The loop from the first evaluation to the final checkpoint."""
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    metrics.write({"type": "run", **info})
    bar = None
    if rt.is_main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.train_iters, initial=iteration, desc="train", unit="it",
                   dynamic_ncols=True)
    first_valid = evaluate()
    metrics.write({"type": "valid", "iteration": iteration, "loss": first_valid})
    logger.info("validation loss at iteration %d: %.4f", iteration, first_valid)
    first_iteration = last_valid_iteration = iteration
    last_valid = first_valid
    stop_reason = None
    train_iter = _per_chunk(lambda: rank_batches(train_ds, consumed, mbs, dp_rank, rt.dp,
                                                 num_workers=args.num_workers), len(models))
    tokens_per_step = gbs * args.seq_length
    step_flops = train_flops_per_token(args, vocab) * tokens_per_step
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        result = step.train(train_iter, iteration + 1)
        loss = result.loss
        if result.nonfinite is not None:
            logger.warning("iteration %d skipped: %s", iteration + 1, result.nonfinite)
        iteration += 1
        consumed += gbs
        dt = time.perf_counter() - t0
        lr = optimizer.param_groups[0]["lr"]
        record = {"type": "train", "iteration": iteration, "loss": loss,
                  "grad_norm": result.grad_norm, "lr": lr,
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                  "tflops_per_gpu": step_flops / (dt * rt.world_size) / 1e12,
                  "consumed_samples": consumed, "skipped": not result.ok,
                  "nonfinite": result.nonfinite,
                  "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                                      if torch.cuda.is_available() else None)}
        record["mfu"] = record["tflops_per_gpu"] / args.peak_tflops
        metrics.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if iteration % args.log_interval == 0:
            gn = record["grad_norm"]
            logger.info("iter %d loss %.4f grad_norm %s lr %.3e tokens/s %.0f TFLOP/s/GPU %.3g "
                        "MFU %.2g%%", iteration, loss, "skipped" if gn is None else f"{gn:.4g}",
                        lr, tokens_per_step / dt, record["tflops_per_gpu"], 100 * record["mfu"])
        if iteration % args.eval_interval == 0 or iteration == args.train_iters:
            last_valid, last_valid_iteration = evaluate(), iteration
            metrics.write({"type": "valid", "iteration": iteration, "loss": last_valid})
            logger.info("validation loss at iteration %d: %.4f", iteration, last_valid)
        if downstream is not None and (iteration % args.downstream_eval_interval == 0
                                       or iteration == args.train_iters):
            scores = flatten_downstream(downstream())
            if scores:
                metrics.write({"type": "downstream", "iteration": iteration, **scores})
                logger.info("downstream at iteration %d: %s", iteration, ", ".join(
                    f"{k} {v:.4g}" for k, v in scores.items()))
        checkpointer.after_iteration(iteration, consumed)
        if getattr(args, "exit_interval", None) and iteration % args.exit_interval == 0:
            logger.info("--exit-interval %d: stopping at iteration %d%s", args.exit_interval,
                        iteration, " (saving)" if args.save else "")
            stop_reason = f"--exit-interval {args.exit_interval}"
            break
        minutes = getattr(args, "exit_duration_in_mins", None)
        reason = checkpointer.exit_requested(
            time_up=bool(minutes) and time.monotonic() - started > 60 * minutes)
        if reason:
            logger.info("%s %s: %s at iteration %d", reason,
                        "reached" if reason.startswith("--") else "received",
                        "saving and exiting" if args.save else "exiting (no --save)", iteration)
            stop_reason = reason
            break
    if bar is not None:
        bar.close()
    checkpoint = checkpointer.finish(iteration, consumed)
    metrics.close()
    return TrainResult(first_valid, last_valid, iteration, checkpoint,
                       first_valid_iteration=first_iteration,
                       final_valid_iteration=last_valid_iteration, stop_reason=stop_reason)
