"""The training step, built once for ``lrattn-pretrain`` and ``lrattn-profile``.

:func:`build_train_step` assembles this rank's model chunk(s) in megatron's DDP, the
optimizer and LR schedule and the forward-backward function with its per-stage shapes;
:meth:`TrainStep.train` runs one step: zero the gradient buffers, forward + backward over
every micro-batch (megatron's pipeline schedule), the loss reduced over data-parallel ranks,
the finiteness check of loss and gradients (``--on-nonfinite``), then the optimizer step
(gradient clipping inside it) and the LR schedule. The profiler times exactly this step.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lrattn.compat.wgrad_fusion import install as install_wgrad_fusion
from megatron_lrattn.data.datasets import get_batch
from megatron_lrattn.depth.pipeline import depth_tensor_shapes_fn
from megatron_lrattn.model.config import LRAttnResConfig
from megatron_lrattn.training import faults
from megatron_lrattn.training.arg_types import ArgumentError
from megatron_lrattn.training.cuda_graph import StepGraph, use_capture_stream
from megatron_lrattn.training.fusions import (cuda_graph_impl, fused_optimizer_step,
                                              gradient_accumulation_fusion)
from megatron_lrattn.training.builder import (
    build_config,
    build_model_chunks,
    build_optimizer,
    resolve_overlap,
    virtual_stages,
    wrap_model,
)
from megatron_lrattn.training.numerics import check_step
from megatron_lrattn.training.optimizer_step import mixed_precision_adamw

logger = logging.getLogger(__name__)


def use_bf16(args: argparse.Namespace) -> bool:
    """``--bf16``, or on when CUDA is available and the flag is not given."""
    return args.bf16 if args.bf16 is not None else torch.cuda.is_available()


def step_config(args: argparse.Namespace) -> LRAttnResConfig:
    """The model config of a training step (``--deterministic`` sets megatron's
    ``deterministic_mode``; the gradient-accumulation fusion on CUDA, for the DDP-wrapped
    model); raises ``ConfigError`` on refused values."""
    config = build_config(args, use_bf16(args))
    config.deterministic_mode = bool(args.deterministic)
    if gradient_accumulation_fusion(args, torch.cuda.is_available()):
        install_wgrad_fusion()
        config.gradient_accumulation_fusion = True
    return config


def check_sequence_parallel(args: argparse.Namespace) -> None:
    """Refuse ``--sequence-parallel`` when a rank's part of the sequence (s / CP) does not
    split over the tensor-parallel ranks (raises ``ArgumentError``)."""
    tp, cp = args.tensor_model_parallel_size, getattr(args, "context_parallel_size", 1) or 1
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        raise ArgumentError(
            f"--sequence-parallel splits the sequence over tensor-parallel ranks: --seq-length "
            f"{args.seq_length} / --context-parallel-size {cp} is not divisible by "
            f"--tensor-model-parallel-size {tp}")


def num_microbatches(args: argparse.Namespace, dp: int) -> int:
    """Micro-batches per step and data-parallel rank.

    Raises:
        ArgumentError: the global batch does not divide, or too few micro-batches for the
            interleaved schedule.
    """
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs % (mbs * dp):
        raise ArgumentError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp}")
    num_micro = gbs // (mbs * dp)
    pp = args.pipeline_model_parallel_size
    if virtual_stages(args) and (num_micro % pp or (num_micro < 2 * pp
                                                     and not torch.cuda.is_available())):
        raise ArgumentError(
            f"the interleaved schedule needs micro-batches per step ({num_micro}) to be a "
            f"multiple of --pipeline-model-parallel-size {pp}, and at least 2 x it on CPU "
            "(with exactly P megatron's interleaved schedule deadlocks over gloo)")
    return num_micro


def _context_parallel_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group=None):
    """Mean per-token loss over the unmasked tokens, and ``lm loss`` for the report.

    With context parallelism (``cp_group``) each rank holds part of every sequence: the
    token sum and count are all-reduced over the group for the reported mean, and the
    returned loss is this rank's sum over the group's count, times the group size (megatron's
    DDP divides the gradients by the data x context-parallel size), so the reduced gradient
    is the one of the whole sequence's mean.
    """
    mask = loss_mask.view(-1).float()
    total = (output_tensor.float().view(-1) * mask).sum()
    if cp_group is None:
        loss = total / mask.sum().clamp(min=1)
        loss = faults.poison_loss(loss)
        # The schedule divides the returned loss in place: report a copy.
        return loss, {"lm loss": loss.detach().clone()}
    stats = torch.stack([total.detach(), mask.sum()])
    dist.all_reduce(stats, group=cp_group)
    count = stats[1].clamp(min=1)
    loss = faults.poison_loss(total / count * cp_group.size())
    report = faults.poison_loss(stats[0] / count)
    return loss, {"lm loss": report}


def forward_step(device, data_iterator, model):
    """megatron's forward-step function: the next micro-batch through ``model`` (with its
    document attention mask, [b, 1, s, s] True = masked, when the batch has one:
    ``--reset-attention-mask``). With context parallelism the rank keeps its two chunks of
    every sequence (megatron's ``get_batch_on_this_cp_rank``)."""
    batch = next(data_iterator)
    tokens, labels, loss_mask, position_ids = get_batch(batch, device)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is not None:
        mask = mask.to(device, non_blocking=True)
    cp_group = _context_parallel_group()
    if cp_group is not None:
        from megatron.core.utils import get_batch_on_this_cp_rank

        parts = get_batch_on_this_cp_rank(dict(tokens=tokens, labels=labels,
                                               loss_mask=loss_mask, position_ids=position_ids),
                                          cp_group)
        tokens, labels, loss_mask, position_ids = (parts[k] for k in (
            "tokens", "labels", "loss_mask", "position_ids"))
    output = model(tokens, position_ids, mask, labels=labels)
    return output, partial(loss_func, loss_mask, cp_group=cp_group)


def reduce_loss(losses: List[Dict]) -> float:
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


def device_loss(losses: List[Dict]) -> torch.Tensor:
    """``reduce_loss`` without the host read, for a step inside a CUDA graph (one pipeline
    stage): the mean over micro-batches and data-parallel ranks as an fp64 device scalar."""
    from megatron.core import parallel_state as ps

    value = torch.stack([x["lm loss"].float() for x in losses]).mean().double().reshape(1)
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        dist.all_reduce(value, group=ps.get_data_parallel_group())
        value = value / dp
    return value.reshape(())


class CapturedOptimizerStep:
    """The tail of a ``StepGraph``: the loss reduction and the one-kernel optimizer step
    (``MixedPrecisionAdamW.captured_update``) recorded after the backward."""

    def __init__(self, optimizer_step) -> None:
        self.optimizer_step = optimizer_step

    def prepare(self) -> None:
        self.optimizer_step.prepare_capture()
        # the loss reduction's kernels loaded before the capture too
        device = torch.device("cuda", torch.cuda.current_device())
        device_loss([{"lm loss": torch.zeros((), device=device)}])

    def before_replay(self) -> None:
        self.optimizer_step.load_hyperparameters()

    def __call__(self, losses: List[Dict]) -> torch.Tensor:
        return self.optimizer_step.captured_update(device_loss(losses))


def captured_update_obstacles(optimizer_step, args=None) -> List[str]:
    """Why the optimizer step stays out of the step's CUDA graph (empty: it goes in)."""
    if optimizer_step is None:
        return ["megatron-core's optimizer step runs (not the one-kernel step)"]
    out = list(optimizer_step.capture_obstacles())
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        out.append("the TE spec (its captured step is tested with the update eager)")
    if faults.active():
        out.append(f"{faults.ENV} is set (its hooks run between the backward and the step)")
    return out


@dataclass
class StepResult:
    """What one training step did.

    Attributes:
        loss: the reduced loss (the same on every rank).
        ok: the optimizer stepped (False for a skipped step).
        grad_norm: the gradient norm the optimizer saw (None when skipped).
        nonfinite: what was non-finite (``--on-nonfinite skip``), else None.
    """

    loss: float
    ok: bool
    grad_norm: Optional[float]
    nonfinite: Optional[str]


@dataclass
class TrainStep:
    """One rank's training setup and its step.

    Attributes:
        config: the model config.
        models: the DDP-wrapped model chunk(s): one per virtual pipeline stage with
            ``--num-layers-per-virtual-pipeline-stage``.
        optimizer, scheduler: megatron optimizer and LR schedule.
        num_params: parameters of this rank's chunk(s).
        step_kwargs: keyword arguments of the forward-backward function.
        forward_step: the forward-step function (batches go to this rank's device).
        on_nonfinite: ``stop`` or ``skip`` (``--on-nonfinite``).
        graph: the captured forward-backward of training steps
            (``--cuda-graph-impl full_iteration``), else None.
        optimizer_step: what steps the optimizer (``optimizer_step.mixed_precision_adamw``),
            else None: ``optimizer.step``.
    """

    config: LRAttnResConfig
    models: list
    optimizer: object
    scheduler: object
    num_params: int
    step_kwargs: Dict
    forward_step: Callable
    on_nonfinite: str
    graph: Optional[StepGraph] = None
    optimizer_step: Optional[Callable] = None

    def _forward_backward(self, data_iterator, forward_only: bool) -> List[Dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=self.forward_step, data_iterator=data_iterator, model=self.models,
            forward_only=forward_only, **self.step_kwargs)

    def train(self, data_iterator, iteration: int) -> StepResult:
        """One training step (module docstring).

        Args:
            data_iterator: micro-batches (one iterator per model chunk when interleaved).
            iteration: 1-based number of the iteration being computed.

        Raises:
            NonFiniteError: ``--on-nonfinite stop`` and a non-finite loss or gradient.
        """
        for m in self.models:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        faults.set_iteration(iteration)
        if self.graph is not None:
            losses = self.graph(data_iterator)
            if self.graph.stats is not None:
                return self._after_captured_step(self.graph.stats, iteration)
        else:
            losses = self._forward_backward(data_iterator, forward_only=False)
        faults.poison_grads(self.models)
        faults.interrupt()
        loss = reduce_loss(losses)
        # the one-kernel step's gradient norm first: the finiteness check reads it
        norm_first = getattr(self.optimizer_step, "grad_norm", None)
        try:
            nonfinite = check_step(loss, self.models, iteration, self.on_nonfinite,
                                   grad_norm=norm_first() if norm_first else None)
        except BaseException:
            if norm_first:
                self.optimizer_step.discard()
            raise
        if nonfinite is not None:
            # Skipped: optimizer, parameters and LR schedule stay as they were.
            if norm_first:
                self.optimizer_step.discard()
            return StepResult(loss, False, None, nonfinite)
        ok, grad_norm, _ = (self.optimizer_step or self.optimizer.step)()
        self.scheduler.step(increment=1)
        return StepResult(loss, ok, None if grad_norm is None else float(grad_norm), None)

    def _after_captured_step(self, stats: torch.Tensor, iteration: int) -> StepResult:
        # the step's one host read; the graph's kernel stepped only when both are finite
        loss, grad_norm, stepped = stats.tolist()
        if stepped:
            self.scheduler.step(increment=1)
            return StepResult(loss, True, grad_norm, None)
        # weights, moments and step counts are as they were; name what was not finite
        nonfinite = check_step(loss, self.models, iteration, self.on_nonfinite,
                               grad_norm=grad_norm)
        return StepResult(loss, False, None, nonfinite)

    def evaluate(self, make_iterator: Callable[[], object], iters: int) -> float:
        """Mean loss of ``iters`` forward-only steps over ``make_iterator()`` (eval mode)."""
        for m in self.models:
            m.eval()
        data_iterator = make_iterator()
        total = 0.0
        with torch.no_grad():
            for _ in range(iters):
                total += reduce_loss(self._forward_backward(data_iterator, forward_only=True))
        for m in self.models:
            m.train()
        return total / iters


def _data_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def set_sync_funcs(config: LRAttnResConfig, models: List, args: argparse.Namespace) -> None:
    """The schedule's hooks into DDP, as Megatron-LM's ``training.py`` sets them:
    ``no_sync_func`` (gradients reduce only on the last micro-batch), with
    ``--overlap-grad-reduce`` ``grad_sync_func`` (each chunk's reduce starts as its last
    backward ends, aligned across pipeline stages), and with ``--overlap-param-gather``
    under interleaving ``param_sync_func`` (each chunk's all-gather starts before its first
    forward). ``finalize_model_grads`` (the config's) waits for the reduces."""
    def per_chunk(name: str):
        funcs = [getattr(m, name) for m in models]
        return funcs if len(funcs) > 1 else funcs[0]

    config.no_sync_func = per_chunk("no_sync")
    config.grad_sync_func = per_chunk("start_grad_sync") if args.overlap_grad_reduce else None
    aligned = args.overlap_param_gather and virtual_stages(args) is not None
    config.param_sync_func = per_chunk("start_param_sync") if aligned else None


def build_train_step(args: argparse.Namespace, config: LRAttnResConfig, vocab_size: int,
                     num_micro: int, device: torch.device) -> TrainStep:
    """Model chunk(s) in DDP, optimizer, LR schedule and step of this rank.

    Args:
        args: parsed ``lrattn-pretrain`` arguments.
        config: from ``step_config(args)``.
        vocab_size: the padded vocabulary (``padded_vocab_size``).
        num_micro: micro-batches per step (``num_microbatches``).
        device: where batches go.
    """
    resolve_overlap(args, _data_parallel_size())
    graph = cuda_graph_impl(args, device.type == "cuda") == "full_iteration"
    if graph:
        use_capture_stream(device)
    # One chunk, or one per virtual stage sharing the rank's depth-source cache.
    chunks = build_model_chunks(config, args, vocab_size)
    num_params = sum(p.numel() for m in chunks for p in m.parameters())
    models = [wrap_model(m, config, args) for m in chunks]
    set_sync_funcs(config, models, args)
    optimizer, scheduler = build_optimizer(models, config, args)
    step_kwargs = dict(num_microbatches=num_micro, seq_length=args.seq_length,
                       micro_batch_size=args.micro_batch_size,
                       decoder_seq_length=args.seq_length)
    shapes_fn = depth_tensor_shapes_fn(config)
    if shapes_fn is not None:
        # A stage boundary carries several depth sources: per-stage p2p shapes.
        step_kwargs["adjust_tensor_shapes_fn"] = shapes_fn
    step = TrainStep(config, models, optimizer, scheduler, num_params, step_kwargs,
                     partial(forward_step, device), args.on_nonfinite)
    step.optimizer_step = mixed_precision_adamw(optimizer, fused_optimizer_step(args))
    if graph:
        why = captured_update_obstacles(step.optimizer_step, args)
        if why:
            logger.info("CUDA graph: the optimizer step runs eager between replays (%s)",
                        "; ".join(why))
        step.graph = StepGraph(step._forward_backward, num_micro, device,
                               args.cuda_graph_warmup_steps,
                               tail=None if why else CapturedOptimizerStep(step.optimizer_step))
    return step
