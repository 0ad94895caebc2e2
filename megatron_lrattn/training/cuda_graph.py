"""A CUDA graph of the training step's forward and backward (``--cuda-graph-impl full_iteration``).

With one micro-batch shape for the whole run, every training step launches the same kernels
on the same memory. After ``--cuda-graph-warmup-steps`` eager steps, the forward-backward
function of the step (every micro-batch's forward, loss and backward, and the gradient
reduction megatron-core runs at its end) is captured once into one CUDA graph; each later
step copies its micro-batches into the graph's static input buffers and replays it, so the
host no longer issues thousands of launches per step. Where the one-kernel optimizer step
runs in the local spec (``training.optimizer_step``; not with the distributed optimizer),
the graph holds the rest of the step as well (a ``tail``): the loss reduction, megatron's
gradient norm and clipping factor and the AdamW kernel, which steps only when the loss and
the norm are finite; the host writes the step's hyperparameters before the replay and reads
[loss, norm, stepped] once after it, so the GPU does not wait on the host inside the step.
Otherwise the optimizer step, the finiteness check and the loss reduction stay eager,
between replays.

megatron-core has the same capture (``megatron.core.full_cuda_graph``), but it keeps the
graph, its inputs and its step counter in class attributes shared by the whole process; here
each training step owns its graph, so several models (the arms of ``lrattn-profile`` and
``benchmarks/bench_step.py``) are captured and replayed side by side in one process; their
graphs share one memory pool (activations are dead between steps, so the models' steps
take turns with the same memory, as they do without graphs).

The whole run uses one non-default stream (:func:`use_capture_stream`), the capture and
the replays included. Validation steps stay eager. With the TE spec the graph holds TE's
work as well: the FP8 weight casts of the step's first micro-batch (megatron-core's schedule
marks it before the capture, so every replay casts the updated weights) and, with delayed
scaling, the amax reductions and scale updates TE runs when the forward's FP8 region ends
and after the backward. The capture needs CUDA, one pipeline
stage (the pipeline schedules' point-to-point shapes and the depth-source cache are not
captured) and no dropout
(megatron-core's RNG tracker switches generator states on the host). The pinned host tables
the depth kernels copy to the device during the capture are kept as long as the graph
(``ops.triton_utils.hold_host_buffers``). The flags and their checks are in
``training.fusions`` (no torch import for ``--help``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Dict, List, Optional

import torch

from megatron_lrattn.ops.triton_utils import hold_host_buffers

logger = logging.getLogger(__name__)


def _model_inputs(batch) -> Dict[str, torch.Tensor]:
    # The dtypes get_batch hands the model: the forward step's own conversions are then
    # no-ops and read the static buffers in place. Other tensors of the batch (a document
    # attention mask) come along as they are.
    from megatron_lrattn.data.datasets import get_batch

    tokens, labels, loss_mask, position_ids = get_batch(batch)
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
           "position_ids": position_ids}
    if isinstance(batch, dict):
        for k, v in batch.items():
            if k not in out and isinstance(v, torch.Tensor):
                out[k] = v
    return out


_capture_stream: Optional[torch.cuda.Stream] = None
_graph_pool = None
_pool_users: "weakref.WeakSet" = weakref.WeakSet()


def _shared_pool(user) -> object:
    """The memory pool of ``user``'s capture: one for every step graph alive in the process.

    Each graph is a whole step whose only outputs are its loss tensors, so a graph's
    activations may reuse the memory another graph's freed activations left, while their
    outputs stay apart. Once every graph of a pool is gone (``lrattn-profile --sequential``
    frees each arm before building the next) the next capture takes a new pool: torch's
    pinned-host allocator keeps a private pool per id and refuses to take an id back after
    its last graph released it (an internal assert in ``capture_begin``).
    """
    global _graph_pool
    if _graph_pool is None or not len(_pool_users):
        _graph_pool = torch.cuda.graph_pool_handle()
    _pool_users.add(user)
    return _graph_pool


def use_capture_stream(device: torch.device) -> torch.cuda.Stream:
    """Make one non-default CUDA stream current for the rest of the process (created on the
    first call) and return it.

    Called before the model and its DDP wrapper are built: autograd runs each backward node
    on the stream that was current when the node was made, and megatron-core's DDP keeps
    every parameter's gradient accumulator from its construction on. Had those been made
    on the default stream, a capture on any other stream would make the default (legacy)
    stream wait for the capturing one, which CUDA refuses. With every step and every node
    on this stream, capture and replay stay on it.
    """
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(_capture_stream)
    return _capture_stream


class StaticBatches:
    """Device buffers for the micro-batches of one step, refilled in place every step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: List[Dict[str, torch.Tensor]] = []

    def fill(self, data_iterator, num_micro: int) -> List[Dict[str, torch.Tensor]]:
        """Copy the next ``num_micro`` micro-batches of ``data_iterator`` into the buffers.

        Raises:
            ValueError: a micro-batch's shape or dtype differs from the captured one.
        """
        for i in range(num_micro):
            batch = _model_inputs(next(data_iterator))
            if i == len(self.buffers):
                self.buffers.append({k: v.to(self.device, copy=True)
                                     for k, v in batch.items()})
                continue
            for k, v in batch.items():
                dst = self.buffers[i][k]
                if v.shape != dst.shape or v.dtype != dst.dtype:
                    raise ValueError(
                        f"CUDA graph input {k!r} of micro-batch {i} is {tuple(v.shape)} "
                        f"{v.dtype}, the captured step has {tuple(dst.shape)} {dst.dtype}")
                dst.copy_(v, non_blocking=True)
        return self.buffers[:num_micro]


class StepGraph:
    """The forward-backward function of one training step, captured and replayed.

    Args:
        forward_backward: ``fn(data_iterator, forward_only) -> losses`` (the eager step).
        num_micro: micro-batches per step.
        device: the CUDA device of the batches.
        warmup_steps: eager steps before the capture.
        tail: the rest of the step recorded after the backward: ``tail(losses) -> Tensor``,
            with ``tail.prepare()`` called once before the capture and
            ``tail.before_replay()`` before every replay; None: forward and backward only.
    """

    def __init__(self, forward_backward: Callable, num_micro: int, device: torch.device,
                 warmup_steps: int, tail=None):
        self.forward_backward = forward_backward
        self.num_micro = num_micro
        self.inputs = StaticBatches(device)
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.losses = None
        self.tail = tail
        self._tail_out: Optional[torch.Tensor] = None
        self.stats: Optional[torch.Tensor] = None
        """The tail's output of the last call when it replayed the graph, else None (an eager
        step: the caller runs the rest of the step itself)."""
        self.keep: List[torch.Tensor] = []
        # Largest growth of allocated memory while capturing: the step's activations,
        # which the graph's pool keeps for its replays (the replays themselves allocate
        # nothing there, so max_memory_allocated around a replay does not show them).
        self.capture_peak_bytes = 0
        self.stream = torch.cuda.current_stream(device)
        if self.stream == torch.cuda.default_stream(device):
            raise RuntimeError("StepGraph: build the model after use_capture_stream()")

    def __call__(self, data_iterator) -> List[Dict]:
        batches = self.inputs.fill(data_iterator, self.num_micro)
        if self.graph is None and self.steps >= self.warmup_steps:
            if self.tail is not None:
                self.tail.prepare()
            self._capture(batches)
        self.steps += 1
        if self.graph is not None:
            if self.tail is not None:
                self.tail.before_replay()
            self.graph.replay()
            self.stats = self._tail_out
            return self.losses
        self.stats = None
        return self.forward_backward(iter(batches), False)

    def _capture(self, batches) -> None:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # (The process's peak statistics restart here: the capture's growth is measured.)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with hold_host_buffers(self.keep), torch.cuda.graph(
                graph, pool=_shared_pool(self), stream=self.stream,
                capture_error_mode="thread_local"):
            self.losses = self.forward_backward(iter(batches), False)
            if self.tail is not None:
                self._tail_out = self.tail(self.losses)
        torch.cuda.synchronize()
        self.capture_peak_bytes = torch.cuda.max_memory_allocated() - before
        self.graph = graph
        logger.info("captured the training step's forward and backward%s in a CUDA graph "
                    "after %d eager steps",
                    "" if self.tail is None else ", loss, gradient norm and optimizer step",
                    self.steps)

