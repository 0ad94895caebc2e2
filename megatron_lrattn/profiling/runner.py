"""Build the arms, run them alternating, and measure step time, memory and the depth-read
share of a step.

Every arm is a full training setup built from the same arguments by ``lrattn-pretrain``'s
own step builder (``megatron_lrattn.training.step``: model in megatron DDP, megatron
optimizer, LR schedule), and every step is the training step itself (forward-backward, loss
reduction, finiteness check, optimizer step, LR schedule) on synthetic token batches
(throughput does not depend on the token values).

Memory
------
With all arms alive at once (the default, needed to alternate them), the process holds
every arm's parameters, gradient buffers and optimizer states, so ``max_memory_allocated``
during one arm's step also counts the others. Each arm's ``resident`` bytes are measured
when it is built (memory allocated after the build and one training step, which creates
the optimizer states, minus before); ``peak_memory_bytes`` is ``resident`` plus the
largest growth above the allocation at the start of one of its steps, i.e. the peak the arm
would have alone in a process. With a captured step (``--cuda-graph-impl``) a replay
allocates nothing: the growth while capturing, which the graph's pool holds from then on,
stands for the step's growth. ``process_peak_memory_bytes`` is the raw maximum. On a
1B model each arm holds about 16 bytes per parameter (bf16 weights, fp32 gradient buffer,
fp32 main weights, two fp32 Adam moments), so four arms fit on one H200; for larger
models ``sequential=True`` builds, runs and frees one arm at a time (no alternation).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lrattn.ops import BACKWARD_NODES, fused_kernel_names
from megatron_lrattn.profiling.arms import Arm, arm_args
from megatron_lrattn.training.builder import virtual_stages
from megatron_lrattn.training.runtime import Runtime
from megatron_lrattn.training.step import TrainStep, build_train_step, step_config

logger = logging.getLogger(__name__)

DEPTH_READ_RANGE = "depth_read"
"""The ``record_function`` name around every depth read (``DepthState.read``)."""

_BACKWARD_NODES = BACKWARD_NODES

TOP_OPS = 12
"""How many of the profiled step's most expensive kernels/operators each arm reports."""


@dataclass
class ArmRun:
    """One arm's training setup and what was measured on this rank.

    Attributes:
        arm: the arm.
        step: its training step (``TrainStep``: DDP-wrapped model chunk(s), optimizer, LR
            schedule); None once freed.
        steps_done: training steps run so far (build, warm-up, timed and profiled).
        resident_bytes: memory the arm keeps between steps (module docstring).
        step_times_s: wall time of every timed step.
        step_peak_bytes: largest growth of allocated memory during one timed step.
        process_peak_bytes: largest ``max_memory_allocated`` seen during a timed step.
        depth_read_s, profiled_step_s: depth-read time in the profiled step and its wall time.
        top_ops: the profiled step's ``TOP_OPS`` most expensive kernels (CUDA) or operators
            (CPU) by self time, as (name, seconds).
        losses: the loss of every step, in order (all steps see one fixed batch, so a
            step that trains lowers it).
    """

    arm: Arm
    step: Optional[TrainStep]
    steps_done: int = 0
    resident_bytes: int = 0
    step_times_s: List[float] = field(default_factory=list)
    step_peak_bytes: int = 0
    process_peak_bytes: int = 0
    depth_read_s: Optional[float] = None
    profiled_step_s: Optional[float] = None
    top_ops: List[Tuple[str, float]] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if _cuda() else 0


def synthetic_batch(mbs: int, seq: int, vocab: int, device: torch.device, seed: int) -> Dict:
    """One micro-batch of random tokens: ``tokens``, ``labels`` (tokens shifted by one),
    ``loss_mask`` (ones) and ``position_ids``, all on ``device``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
    return {
        "tokens": data[:, :-1].contiguous().to(device),
        "labels": data[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(mbs, seq, device=device),
        "position_ids": torch.arange(seq, device=device).expand(mbs, seq).contiguous(),
    }


def build_arm(arm: Arm, args: argparse.Namespace, vocab_size: int, num_micro: int,
              device: torch.device) -> ArmRun:
    """The training step of one arm (this rank's chunk), as ``lrattn-pretrain`` builds it.

    Raises:
        ConfigError: when the arm's configuration is refused.
    """
    a = arm_args(args, arm)
    return ArmRun(arm, build_train_step(a, step_config(a), vocab_size, num_micro, device))


def train_step(run: ArmRun, batches) -> None:
    """One training step of the arm (``TrainStep.train``)."""
    run.steps_done += 1
    run.losses.append(run.step.train(batches, run.steps_done).loss)


def timed_step(run: ArmRun, batches) -> None:
    """``train_step`` between device synchronisations; records time and memory growth."""
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    base = _allocated()
    t0 = time.perf_counter()
    train_step(run, batches)
    _sync()
    run.step_times_s.append(time.perf_counter() - t0)
    if _cuda():
        peak = torch.cuda.max_memory_allocated()
        # A replayed CUDA graph allocates nothing: its activations sit in the graph's
        # pool since the capture, whose growth stands for the step's.
        graph = getattr(run.step, "graph", None)
        in_pool = graph.capture_peak_bytes if graph is not None else 0
        run.step_peak_bytes = max(run.step_peak_bytes, peak - base, in_pool)
        run.process_peak_bytes = max(run.process_peak_bytes, peak, base + in_pool)


def depth_read_kernel_names() -> List[str]:
    """Names of the fused depth-read GPU kernels (the Triton kernels of the depth ops: the
    per-site read and the two-phase schedule's phase 1 and merges; not the cross entropy's);
    empty without Triton."""
    return fused_kernel_names()


def device_kernel_times_us(prof) -> Dict[str, float]:
    """Total device time per kernel name (microseconds) of a finished profile: only the
    events that ran on the GPU, so a CPU-side event of the same name is never counted, and
    no user annotation (``Optimizer.step#...`` ranges mirrored on the GPU timeline span
    kernels that are counted on their own)."""
    from torch.autograd import DeviceType

    out: Dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us()
    return out


def depth_read_time_s(prof, on_cuda: bool) -> float:
    """Depth-read time in a finished ``torch.profiler.profile``.

    On CUDA: the device time of the kernels named exactly as in ``depth_read_kernel_names``
    (exact names: SDPA's ``flash_fwd_kernel`` contains ``_fwd_kernel``). On CPU: the total
    (self + children) time of the ``depth_read`` ranges (forward) plus that of the autograd
    nodes of the depth-read functions (backward).
    """
    if on_cuda:
        names = set(depth_read_kernel_names())
        kernels = device_kernel_times_us(prof)
        return sum(t for k, t in kernels.items() if k.split("(")[0] in names) * 1e-6
    total = 0.0
    for e in prof.key_averages():
        key = e.key
        if key == DEPTH_READ_RANGE or (key.startswith("autograd::engine::evaluate_function: ")
                                       and key.endswith(_BACKWARD_NODES)):
            total += e.cpu_time_total
    return total * 1e-6


def profiled_step(run: ArmRun, batches) -> None:
    """One step under ``torch.profiler``; records the depth-read time and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    _sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        train_step(run, batches)
        _sync()
        wall = time.perf_counter() - t0
    run.depth_read_s = depth_read_time_s(prof, _cuda())
    run.profiled_step_s = wall
    run.top_ops = top_ops(prof, _cuda())


def top_ops(prof, on_cuda: bool, n: int = TOP_OPS) -> List[Tuple[str, float]]:
    """The ``n`` largest times of a finished profile: device kernels on CUDA, operators'
    self CPU time on CPU; names cut to 120 characters."""
    if on_cuda:
        rows = [(k, t) for k, t in device_kernel_times_us(prof).items()]
    else:
        rows = [(e.key, float(e.self_cpu_time_total)) for e in prof.key_averages()]
    rows.sort(key=lambda kv: -kv[1])
    return [(k[:120], t * 1e-6) for k, t in rows[:n]]


def _build_warm(arm: Arm, args, vocab_size: int, num_micro: int, batches,
                device: torch.device) -> ArmRun:
    _sync()
    before = _allocated()
    run = build_arm(arm, args, vocab_size, num_micro, device)
    train_step(run, batches)
    _sync()
    run.resident_bytes = _allocated() - before
    logger.info("built %s: %d parameters on this rank, %.2f GB resident", arm.label,
                run.step.num_params, run.resident_bytes / 1e9)
    return run


def _free(run: ArmRun) -> None:
    run.step = None
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()


def run_arms(arms: List[Arm], args: argparse.Namespace, rt: Runtime, vocab_size: int,
             num_micro: int, rounds: int, steps_per_round: int, warmup_steps: int,
             sequential: bool = False, profile: bool = True) -> List[ArmRun]:
    """Build every arm and time it.

    Alternating (default): build all arms (each warmed by one step), then ``warmup_steps``
    more untimed steps per arm, then ``rounds`` rounds of A B C ... with
    ``steps_per_round`` timed steps each, then one profiled step per arm. Sequential: the
    same per arm, one arm built, run and freed at a time.

    Returns:
        One ``ArmRun`` per arm, with times and memory reduced over ranks (the slowest rank's
        step time, the largest memory, the mean depth-read share).
    """
    batch = synthetic_batch(args.micro_batch_size, args.seq_length, vocab_size, rt.device,
                            args.seed)
    chunks = virtual_stages(args) or 1
    # The interleaved schedule takes one iterator per model chunk.
    batches = itertools.repeat(batch) if chunks == 1 else [itertools.repeat(batch)] * chunks

    def finish(run: ArmRun) -> None:
        if profile:
            profiled_step(run, batches)

    runs: List[ArmRun] = []
    if sequential:
        for arm in arms:
            run = _build_warm(arm, args, vocab_size, num_micro, batches, rt.device)
            for _ in range(warmup_steps):
                train_step(run, batches)
            for _ in range(rounds * steps_per_round):
                timed_step(run, batches)
            finish(run)
            _free(run)
            runs.append(run)
    else:
        runs = [_build_warm(arm, args, vocab_size, num_micro, batches, rt.device)
                for arm in arms]
        for run in runs:
            for _ in range(warmup_steps):
                train_step(run, batches)
        for r in range(rounds):
            for run in runs:
                for _ in range(steps_per_round):
                    timed_step(run, batches)
            logger.info("round %d/%d: %s", r + 1, rounds, ", ".join(
                f"{run.arm.name} {statistics.median(run.step_times_s) * 1e3:.1f} ms"
                for run in runs))
        for run in runs:
            finish(run)
    _reduce_over_ranks(runs, rt)
    return runs


def _reduce_over_ranks(runs: List[ArmRun], rt: Runtime) -> None:
    if rt.world_size == 1:
        return
    for run in runs:
        t = torch.tensor(run.step_times_s + [run.profiled_step_s or 0.0], dtype=torch.float64,
                         device=rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        run.step_times_s = t[:-1].tolist()
        mem = torch.tensor([run.resident_bytes + run.step_peak_bytes, run.process_peak_bytes,
                            run.resident_bytes], dtype=torch.float64, device=rt.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        run.resident_bytes = int(mem[2])
        run.step_peak_bytes = int(mem[0]) - run.resident_bytes
        run.process_peak_bytes = int(mem[1])
        if run.depth_read_s is not None:
            share = torch.tensor([run.depth_read_s / run.profiled_step_s], dtype=torch.float64,
                                 device=rt.device)
            dist.all_reduce(share)
            run.profiled_step_s = float(t[-1])
            run.depth_read_s = float(share[0]) / rt.world_size * run.profiled_step_s
