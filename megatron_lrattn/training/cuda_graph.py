"""A CUDA graph of the training step's forward and backward (``--cuda-graph-impl full_iteration``).

With one micro-batch shape for the whole run, every training step launches the same kernels
on the same memory. After ``--cuda-graph-warmup-steps`` eager steps, the forward-backward
function of the step (every micro-batch's forward, loss and backward, and the gradient
reduction megatron-core runs at its end) is captured once into one CUDA graph; each later
step copies its micro-batches into the graph's static input buffers and replays it, so the
host no longer issues thousands of launches per step. The optimizer step, the finiteness
check and the loss reduction stay eager, between replays.

megatron-core has the same capture (``megatron.core.full_cuda_graph``), but it keeps the
graph, its inputs and its step counter in class attributes shared by the whole process; here
each training step owns its graph, so several models (the arms of ``lrattn-profile`` and
``benchmarks/bench_step.py``) are captured and replayed side by side in one process.

Validation steps stay eager. The capture needs CUDA, one pipeline stage (the pipeline
schedules' point-to-point shapes and the depth-source cache are not captured) and no dropout
(megatron-core's RNG tracker switches generator states on the host). The pinned host tables
the depth kernels copy to the device during the capture are kept as long as the graph
(``ops.triton_utils.hold_host_buffers``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Dict, List, Optional

from megatron_lrattn.training.arg_types import ArgumentError

logger = logging.getLogger(__name__)

CUDA_GRAPH_IMPLS = ("none", "full_iteration")


def add_cuda_graph_args(group) -> None:
    """``--cuda-graph-impl`` and ``--cuda-graph-warmup-steps`` (megatron-LM's names)."""
    group.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
                       help="full_iteration: capture the training step's forward and backward "
                            "in one CUDA graph and replay it (CUDA, one pipeline stage; "
                            "default: none)")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=3, metavar="N",
                       help="eager training steps before the capture (default: 3)")


def check_cuda_graph_args(args: argparse.Namespace, cuda: bool) -> None:
    """Refuse a CUDA graph where it cannot run (raises ``ArgumentError``)."""
    if getattr(args, "cuda_graph_impl", "none") == "none":
        return
    if not cuda:
        raise ArgumentError("--cuda-graph-impl full_iteration needs a CUDA device; "
                            "use --cuda-graph-impl none on the CPU")
    if args.pipeline_model_parallel_size != 1:
        raise ArgumentError(
            "--cuda-graph-impl full_iteration captures one pipeline stage: it needs "
            f"--pipeline-model-parallel-size 1 (got {args.pipeline_model_parallel_size})")
    dropout = [f"--{k.replace('_', '-')} {getattr(args, k)}"
               for k in ("hidden_dropout", "attention_dropout") if getattr(args, k, 0) or 0]
    if dropout:
        raise ArgumentError(
            f"--cuda-graph-impl full_iteration runs without dropout (megatron-core's RNG "
            f"tracker switches generator states on the host): got {', '.join(dropout)}")
    if args.cuda_graph_warmup_steps < 1:
        raise ArgumentError(f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}: "
                            "at least 1 eager step must run before the capture")


def _to_static(batch: Dict[str, torch.Tensor], device) -> Dict[str, torch.Tensor]:
    # The dtypes get_batch hands the model, on the device: the forward step's own
    # conversions are then no-ops and read the static buffers in place.
    from megatron_lrattn.data.datasets import get_batch

    tokens, labels, loss_mask, position_ids = get_batch(batch, device)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids}


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
            batch = _to_static(next(data_iterator), self.device)
            if i == len(self.buffers):
                self.buffers.append({k: v.clone() for k, v in batch.items()})
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
    """

    def __init__(self, forward_backward: Callable, num_micro: int, device: torch.device,
                 warmup_steps: int):
        import torch

        self.forward_backward = forward_backward
        self.num_micro = num_micro
        self.inputs = StaticBatches(device)
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.losses = None
        self.keep: List[torch.Tensor] = []
        self.stream = torch.cuda.Stream(device)

    def __call__(self, data_iterator) -> List[Dict]:
        import torch

        batches = self.inputs.fill(data_iterator, self.num_micro)
        if self.graph is None and self.steps >= self.warmup_steps:
            self._capture(batches)
        self.steps += 1
        if self.graph is not None:
            self.graph.replay()
            return self.losses
        # Eager warm-up steps on the side stream the capture uses, as torch asks.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            losses = self.forward_backward(iter(batches), False)
        torch.cuda.current_stream().wait_stream(self.stream)
        return losses

    def _capture(self, batches) -> None:
        import torch

        from megatron_lrattn.ops.triton_utils import hold_host_buffers

        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with hold_host_buffers(self.keep), torch.cuda.graph(
                graph, stream=self.stream, capture_error_mode="thread_local"):
            self.losses = self.forward_backward(iter(batches), False)
        torch.cuda.synchronize()
        self.graph = graph
        logger.info("captured the training step's forward and backward in a CUDA graph "
                    "after %d eager steps", self.steps)

