"""The pretraining loop: megatron-core's pipeline schedules, optimizer and LR schedule."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_lrattn.data.datasets import build_gpt_datasets, get_batch
from megatron_lrattn.data.tokenizer import HFTokenizer
from megatron_lrattn.depth.state import uses_two_phase
from megatron_lrattn.depth.payload import log_pipeline_payloads
from megatron_lrattn.depth.pipeline import depth_tensor_shapes_fn
from megatron_lrattn.training.arguments import ArgumentError
from megatron_lrattn.training.builder import (
    build_config,
    build_model_chunks,
    build_optimizer,
    padded_vocab_size,
    wrap_model,
)
from megatron_lrattn.training import faults
from megatron_lrattn.training.checkpoint import check_save_space, load_checkpoint
from megatron_lrattn.training.checkpointer import Checkpointer
from megatron_lrattn.training.determinism import enable_deterministic
from megatron_lrattn.training.numerics import NonFiniteError, check_step
from megatron_lrattn.training.runtime import Runtime, init_runtime, provenance
from megatron_lrattn.training.trackers import with_trackers

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run produced: first and last validation loss, iterations, checkpoint."""

    first_valid_loss: Optional[float]
    final_valid_loss: Optional[float]
    iterations: int
    checkpoint: Optional[str]


def _batches(dataset, start_sample: int, mbs: int, dp_rank: int, dp: int) -> Iterator[Dict]:
    """Micro-batches of this data-parallel rank, continuing after ``start_sample`` samples
    of the global order (so a resumed run sees exactly the data it would have seen)."""
    n = len(dataset)
    base = start_sample
    while True:
        idx = [(base + dp_rank * mbs + k) % n for k in range(mbs)]
        samples = [dataset[i] for i in idx]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
        base += mbs * dp


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    mask = loss_mask.view(-1).float()
    loss = (output_tensor.float().view(-1) * mask).sum() / mask.sum().clamp(min=1)
    loss = faults.poison_loss(loss)
    # The schedule divides the returned loss in place: report a copy.
    return loss, {"lm loss": loss.detach().clone()}


def _per_chunk(make: Callable[[], Iterator[Dict]], n_chunks: int):
    """One data iterator, or one per model chunk for the interleaved schedule (each chunk
    draws the same micro-batches; only the first and last use them)."""
    return make() if n_chunks == 1 else [make() for _ in range(n_chunks)]


def _forward_step(device, data_iterator, model):
    tokens, labels, loss_mask, position_ids = get_batch(next(data_iterator), device)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


def _reduce_loss(losses: List[Dict]) -> float:
    """Mean 'lm loss' over micro-batches and data-parallel ranks, made known to all ranks."""
    from megatron.core import parallel_state as ps

    value = torch.zeros(1, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    if ps.is_pipeline_last_stage() and losses:
        value[0] = float(torch.stack([x["lm loss"].float() for x in losses]).mean())
        dist.all_reduce(value, group=ps.get_data_parallel_group())
        value /= ps.get_data_parallel_world_size()
    dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return float(value[0])


class MetricsWriter:
    """JSON-lines metrics file (rank 0 only); appends when resuming."""

    def __init__(self, path: Optional[str], resume: bool, enabled: bool):
        self.f = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "a" if resume else "w")

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


def virtual_stages(args: argparse.Namespace) -> Optional[int]:
    """Virtual pipeline stages per rank from ``--num-layers-per-virtual-pipeline-stage``
    (None without interleaving)."""
    per_virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_virtual is None:
        return None
    return args.num_layers // (args.pipeline_model_parallel_size * per_virtual)


def pretrain(args: argparse.Namespace, runtime: Optional[Runtime] = None) -> TrainResult:
    """Run pretraining as configured by ``args`` (from ``parse_args``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if args.sequence_parallel and args.seq_length % args.tensor_model_parallel_size:
        raise ArgumentError(
            f"--sequence-parallel splits the sequence over tensor-parallel ranks: --seq-length "
            f"{args.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}"
        )
    if args.deterministic:
        enable_deterministic()
    rt = runtime or init_runtime(args.tensor_model_parallel_size,
                                 args.pipeline_model_parallel_size, args.seed,
                                 vp=virtual_stages(args))
    bf16 = args.bf16 if args.bf16 is not None else torch.cuda.is_available()
    config = build_config(args, bf16)
    config.deterministic_mode = bool(args.deterministic)
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs % (mbs * rt.dp):
        raise ArgumentError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {rt.dp}"
        )
    num_micro = gbs // (mbs * rt.dp)
    pp = args.pipeline_model_parallel_size
    if virtual_stages(args) and (num_micro % pp or (num_micro < 2 * pp
                                                     and not torch.cuda.is_available())):
        raise ArgumentError(
            f"the interleaved schedule needs micro-batches per step ({num_micro}) to be a "
            f"multiple of --pipeline-model-parallel-size {pp}, and at least 2 x it on CPU "
            "(with exactly P megatron's interleaved schedule deadlocks over gloo)"
        )

    if args.data_path is None:
        from megatron_lrattn.data.default_corpus import ensure_default_data

        default = ensure_default_data(cache_dir=args.cache_dir)
        data_path, tokenizer_dir = default.data_prefix, default.tokenizer_dir
        split = default.split if args.split == "969,30,1" else args.split
        logger.info("data: embedded standard-library corpus at %s", default.root)
    else:
        data_path, tokenizer_dir, split = args.data_path, args.tokenizer_model, args.split
    tokenizer = HFTokenizer(tokenizer_dir)
    n_evals = args.train_iters // args.eval_interval + 2
    train_ds, valid_ds, _ = build_gpt_datasets(
        data_path, tokenizer, args.seq_length, split=split, seed=args.seed,
        num_samples=(args.train_iters * gbs, args.eval_iters * gbs * n_evals, args.eval_iters * gbs),
        cache_dir=os.path.join(args.cache_dir, "index") if args.cache_dir else None,
    )

    chunks = build_model_chunks(config, args, padded_vocab_size(tokenizer.vocab_size, rt.tp))
    n_params = sum(p.numel() for m in chunks for p in m.parameters())
    models = [wrap_model(m, config, args.use_distributed_optimizer) for m in chunks]
    config.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
    optimizer, scheduler = build_optimizer(models, config, args)
    if args.save:
        check_save_space(args.save, n_params, bf16, rt.dp)

    iteration, consumed = 0, 0
    if args.load:
        meta = load_checkpoint(args.load, models, optimizer, scheduler, config)
        iteration, consumed = meta["iteration"], meta["consumed_samples"]
    info = dict(provenance(), params=n_params, world_size=rt.world_size, tp=rt.tp, pp=rt.pp,
                dp=rt.dp, residual=config.residual, key=config.key_type, rank=config.key_rank,
                num_blocks=config.num_blocks, bf16=bf16)
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

    fwd_bwd = get_forward_backward_func()
    dp_rank = ps.get_data_parallel_rank()
    step_kwargs = dict(num_microbatches=num_micro, seq_length=args.seq_length,
                       micro_batch_size=mbs, decoder_seq_length=args.seq_length)
    shapes_fn = depth_tensor_shapes_fn(config)
    if rt.is_main:
        log_pipeline_payloads(config, args.seq_length, mbs)
    if shapes_fn is not None:
        # A stage boundary carries several depth sources: per-stage p2p shapes.
        step_kwargs["adjust_tensor_shapes_fn"] = shapes_fn
    forward_step = partial(_forward_step, rt.device)

    def evaluate() -> float:
        for m in models:
            m.eval()
        valid_iter = _per_chunk(lambda: _batches(valid_ds, 0, mbs, dp_rank, rt.dp), len(models))
        total = 0.0
        with torch.no_grad():
            for _ in range(args.eval_iters):
                losses = fwd_bwd(forward_step_func=forward_step, data_iterator=valid_iter,
                                 model=models, forward_only=True, **step_kwargs)
                total += _reduce_loss(losses)
        for m in models:
            m.train()
        return total / args.eval_iters

    # From here on SIGTERM saves and exits instead of killing the run.
    checkpointer = Checkpointer(args, models, optimizer, scheduler, config)
    metrics = with_trackers(MetricsWriter(args.log_json, resume=bool(args.load),
                                          enabled=rt.is_main), args, enabled=rt.is_main)
    metrics.write({"type": "run", **info})
    bar = None
    if rt.is_main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.train_iters, initial=iteration, desc="train", unit="it",
                   dynamic_ncols=True)
    first_valid = evaluate()
    metrics.write({"type": "valid", "iteration": iteration, "loss": first_valid})
    logger.info("validation loss at iteration %d: %.4f", iteration, first_valid)
    last_valid = first_valid
    train_iter = _per_chunk(lambda: _batches(train_ds, consumed, mbs, dp_rank, rt.dp),
                            len(models))
    tokens_per_step = gbs * args.seq_length
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        for m in models:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        faults.set_iteration(iteration + 1)
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=train_iter,
                         model=models, forward_only=False, **step_kwargs)
        faults.poison_grads(models)
        loss = _reduce_loss(losses)
        try:
            nonfinite = check_step(loss, models, iteration + 1, args.on_nonfinite)
        except NonFiniteError:
            checkpointer.close()
            metrics.close()
            raise
        if nonfinite is None:
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
        else:
            # Skipped: optimizer, parameters and LR schedule stay as they were.
            ok, grad_norm = False, None
            logger.warning("iteration %d skipped: %s", iteration + 1, nonfinite)
        iteration += 1
        consumed += gbs
        dt = time.perf_counter() - t0
        lr = optimizer.param_groups[0]["lr"]
        record = {"type": "train", "iteration": iteration, "loss": loss,
                  "grad_norm": None if grad_norm is None else float(grad_norm), "lr": lr,
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                  "consumed_samples": consumed, "skipped": not ok, "nonfinite": nonfinite,
                  "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                                      if torch.cuda.is_available() else None)}
        metrics.write(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if iteration % args.log_interval == 0:
            logger.info("iter %d loss %.4f grad_norm %s lr %.3e tokens/s %.0f", iteration, loss,
                        record["grad_norm"], lr, tokens_per_step / dt)
        if iteration % args.eval_interval == 0 or iteration == args.train_iters:
            last_valid = evaluate()
            metrics.write({"type": "valid", "iteration": iteration, "loss": last_valid})
            logger.info("validation loss at iteration %d: %.4f", iteration, last_valid)
        checkpointer.after_iteration(iteration, consumed)
        if getattr(args, "exit_interval", None) and iteration % args.exit_interval == 0:
            logger.info("--exit-interval %d: stopping at iteration %d%s", args.exit_interval,
                        iteration, " (saving)" if args.save else "")
            break
        if checkpointer.exit_requested():
            logger.info("exit signal received: %s at iteration %d",
                        "saving and exiting" if args.save else "exiting (no --save)", iteration)
            break
    if bar is not None:
        bar.close()
    checkpoint = checkpointer.finish(iteration, consumed)
    metrics.close()
    return TrainResult(first_valid, last_valid, iteration, checkpoint)
