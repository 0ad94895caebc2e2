"""megatron-core's mixed-precision optimizer step as one kernel after the gradient norm.

megatron-core's ``Float16OptimizerWithFloat16Params`` (bf16 model weights, fp32 main
weights, the optimizer of every run without ``--use-distributed-optimizer``) and its
``DistributedOptimizer`` (the same, with each data-parallel rank owning a shard of the main
weights and the moments) step in three passes after the gradient norm: the clipping scales
the fp32 gradients in place, torch's AdamW updates the main weights and moments, and the
main weights are copied into the bf16 model weights. ``MixedPrecisionAdamW`` replaces the
three by ``megatron_lrattn.ops.adamw`` (one Triton kernel: the clipping factor applied in
registers, the bf16 copy written in the same pass), and keeps everything else of megatron's
step: its gradient preparation, its gradient norm (the same formula, computed on the
device by ``device_grad_norm``; the value the loop logs) and the clipping factor's formula, and the torch optimizer's parameter groups and state, so checkpoints, the
LR schedule and a run that continues on another path are unchanged.

With the distributed optimizer the kernel writes each rank's shard of the bf16 weights into
megatron's parameter buffer, where megatron's own copy would, and megatron's
``step_with_ready_grads`` then runs with its update and copy stood in for by no-ops, so the
parameter all-gather happens as megatron-core schedules it (at once, or in the next forward
with ``--overlap-param-gather``).

Inside the step's CUDA graph (``training.cuda_graph``, without the distributed optimizer)
the same update runs as device work only (``captured_update``): megatron's gradient norm
without its host read, the clipping factor and the decision to step (loss and norm finite)
computed on the device, the hyperparameters refreshed in place before each replay.

It is the default (``--no-fused-optimizer-step`` keeps megatron's step). It applies on CUDA
where the optimizer is one of those classes (or megatron's chain of them) around torch's
``AdamW`` and the model weights are bf16; ``mixed_precision_adamw`` says why not otherwise,
and the run keeps megatron's own step.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch


if TYPE_CHECKING:   # the kernel module needs Triton, imported where the step is built
    from megatron_lrattn.ops import adamw

logger = logging.getLogger(__name__)


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _kind(part) -> Optional[str]:
    """``"float16"`` (megatron's ``Float16OptimizerWithFloat16Params``), ``"distributed"``
    (its ``DistributedOptimizer``) or None for any other class."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return {Float16OptimizerWithFloat16Params: "float16",
            DistributedOptimizer: "distributed"}.get(type(part))


def _model_main_pairs(part) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(model weights, fp32 main weights) of one megatron optimizer: with the distributed
    optimizer, this rank's shard of each weight in the DDP parameter buffer (where
    megatron's copy writes it before the parameter all-gather) and its main shard."""
    if _kind(part) == "float16":
        return [(model, main)
                for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups)
                for model, main in zip(models, mains)]
    out = []
    for models, mains in zip(part.model_float16_groups, part.shard_fp32_from_float16_groups):
        for model, main in zip(models, mains):
            world = part._get_model_param_range_map(model)["gbuf_world_in_bucket"]
            gbuf, _, bucket = part.model_param_gbuf_map[model]
            data = part.buffers[gbuf].buckets[bucket].param_data
            out.append((data.view(-1)[world.start:world.end], main))
    return out


def obstacles(optimizer) -> List[str]:
    """Why ``MixedPrecisionAdamW`` cannot step ``optimizer`` (empty: it can)."""
    out = []
    if importlib.util.find_spec("triton") is None:
        out.append("Triton is not installed")
    for part in _parts(optimizer):
        kind = _kind(part)
        if kind is None:
            out.append(f"{type(part).__name__} is neither megatron's "
                       "Float16OptimizerWithFloat16Params nor its DistributedOptimizer")
            continue
        if getattr(part, "is_stub_optimizer", False):
            out.append("an optimizer without parameters")
            continue
        inner = part.optimizer
        if type(inner) is not torch.optim.AdamW:
            out.append(f"the inner optimizer is {type(inner).__name__}, not torch's AdamW")
            continue
        if part.grad_scaler is not None:
            out.append("a loss scaler (fp16)")
        cfg = part.config
        if getattr(cfg, "use_precision_aware_optimizer", False):
            out.append("the precision-aware optimizer")
        if math.isfinite(getattr(cfg, "grad_norm_skip_threshold", math.inf)):
            out.append("a finite grad_norm_skip_threshold")
        for g in inner.param_groups:
            for key in ("amsgrad", "maximize", "differentiable"):
                if g.get(key):
                    out.append(f"AdamW with {key}")
        if kind == "distributed":
            ddp = part.ddp_config
            if getattr(ddp, "use_megatron_fsdp", False):
                out.append("Megatron-FSDP")
            if getattr(ddp, "fp8_param_gather", False) or getattr(
                    cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
                out.append("FP8 parameter all-gather")
            if any(g for g in part.model_fp32_groups):
                out.append("model weights in torch.float32")
            models = [p for g in part.model_float16_groups for p in g]
        else:
            models = [p for g in part.float16_groups for p in g]
        other = sorted({str(p.dtype) for p in models if p.dtype != torch.bfloat16})
        if other:
            out.append(f"model weights in {', '.join(other)}")
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda and p.dtype == torch.float32 for p in params):
            out.append("main weights that are not fp32 CUDA tensors")
        # megatron-core >= 0.19 clips parameters tagged with a grad-norm group (MTP's) by
        # their own norm
        if any(getattr(p, "grad_norm_group", None) is not None for p in params + models):
            out.append("parameters in a separately clipped gradient-norm group")
    return list(dict.fromkeys(out))


def _grads_for_norm(part) -> list:
    """The gradients megatron's norm reads (megatron-core 0.19 renamed the method, and there
    it leaves out only separate norm groups, which multi-token prediction alone registers)."""
    get = getattr(part, "get_grads_for_grad_norm", None) or part.get_main_grads_for_grad_norm
    return get()


def _norm_groups(parts) -> List[Tuple[object, List[torch.Tensor]]]:
    """(reduction group, gradients) pairs of megatron's gradient norm over ``parts``, one
    pair per group, as megatron's chained optimizer gathers them."""
    out: dict = {}
    for part in parts:
        group = part.get_grad_stats_parallel_group()
        out.setdefault(id(group), (group, []))[1].extend(_grads_for_norm(part))
    return list(out.values())


@torch.no_grad()
def device_grad_norm(groups, device: torch.device) -> torch.Tensor:
    """megatron's global L2 gradient norm (each group's squared norm summed over its ranks,
    then summed and rooted) as an fp64 device scalar, without a host read, so that it can
    be recorded into a CUDA graph: torch's multi-tensor norm per gradient instead of
    megatron-core's fallback without Apex or TE, which reads every tensor's norm on the
    host. Collectives run only over groups of more than one rank."""
    import torch.distributed as dist

    squares = torch.zeros((), dtype=torch.float64, device=device)
    for group, grads in groups:
        if grads:
            norms = torch._foreach_norm(grads)
            total = (torch.linalg.vector_norm(torch.stack(norms)).float() ** 2).reshape(1)
        else:
            total = torch.zeros(1, dtype=torch.float32, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        squares = squares + total.double().reshape(())
    return squares.sqrt()


class MixedPrecisionAdamW:
    """Callable like megatron's ``optimizer.step()``: ``(success, grad_norm, num_zeros)``."""

    def __init__(self, optimizer) -> None:
        from megatron_lrattn.ops import adamw
        self.optimizer = optimizer
        self.parts = []
        for part in _parts(optimizer):
            model_of = {id(main): model for model, main in _model_main_pairs(part)}
            self.parts.append((part, model_of, adamw.AdamWTable()))
        self._pending = None
        self._captured: List[dict] = []
        self._normalize_state()

    def _normalize_state(self) -> None:
        # A checkpoint written by an unfused (CPU) run keeps each step count on the host; one
        # written where megatron-core built TE's or Apex's FusedAdam (a TE install, before
        # the builder asked for torch's AdamW) counts steps per parameter group, not per
        # parameter: without the count the bias corrections would start over.
        for part, _, _ in self.parts:
            for g in part.optimizer.param_groups:
                for p in g["params"]:
                    st = part.optimizer.state.get(p)
                    if st and "step" not in st and "exp_avg" in st and g.get("step") is not None:
                        st["step"] = torch.tensor(float(g["step"]), dtype=torch.float32,
                                                  device=p.device)
                    if st and "step" in st and (st["step"].device != p.device
                                                or st["step"].dtype != torch.float32):
                        st["step"] = st["step"].to(device=p.device, dtype=torch.float32)

    def _tensors(self, part, model_of) -> List[adamw.AdamWTensors]:
        from megatron_lrattn.ops import adamw
        inner = part.optimizer
        out = []
        for gi, g in enumerate(inner.param_groups):
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = inner.state[p]
                if len(st) < 3:  # what torch's fused AdamW creates on its first step
                    st.setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
                    for key in ("exp_avg", "exp_avg_sq"):
                        st.setdefault(key, torch.zeros_like(p, memory_format=torch.preserve_format))
                out.append(adamw.AdamWTensors(p, p.grad, st["exp_avg"], st["exp_avg_sq"],
                                              st["step"], model_of.get(id(p)), gi))
        return out

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The step's first half: megatron's gradient preparation and its gradient norm
        (``device_grad_norm``, one pass
        over the gradients, reduced so that every rank holds the same value), kept for the
        next call, which then launches the update. NaN when the preparation found an
        overflow. The training step checks the gradients' finiteness on this value instead
        of a pass of its own (``numerics.check_step``); ``discard`` drops it when the step
        is skipped."""
        opt = self.optimizer
        if opt.prepare_grads():
            self._pending = (None, math.nan)
            return math.nan
        # the host's share first, while the GPU may still run the backward: the norm's
        # read waits for it
        launches = []
        for part, model_of, table in self.parts:
            tensors = self._tensors(part, model_of)
            if tensors:
                launches.append((part, tensors, table,
                                 table.tables(tensors, tensors[0].param.device)))
        groups = _norm_groups([p for p, _, _ in self.parts])
        device = next((g[0].device for _, g in groups if g), torch.device("cpu"))
        grad_norm = float(device_grad_norm(groups, device))
        self._pending = (launches, grad_norm)
        return grad_norm

    def discard(self) -> None:
        """Forget the norm of ``grad_norm`` (the step is skipped)."""
        self._pending = None

    def __call__(self) -> Tuple[bool, Optional[float], Optional[float]]:
        from megatron_lrattn.ops import adamw
        opt = self.optimizer
        if self._pending is None:
            self.grad_norm()
        (launches, grad_norm), self._pending = self._pending, None
        if launches is None:
            return False, None, None
        num_zeros = opt.count_zeros() if opt.config.log_num_zeros_in_grad else None
        for part, tensors, table, tables in launches:
            scale = 1.0
            clip = part.config.clip_grad  # each optimizer's own, with the global norm
            if clip > 0.0:
                coeff = clip / (float(grad_norm) + 1.0e-6)  # megatron's clipping factor
                if coeff < 1.0:
                    scale = coeff
            hyper = adamw.hyper_table(part.optimizer.param_groups, scale, tensors[0].param.device)
            adamw.multi_tensor_adamw(tensors, hyper, table, tables)
        for part, _, _ in self.parts:
            if _kind(part) == "distributed":
                _gather_params(part)
        return True, grad_norm, num_zeros

    # -- the update inside the step's CUDA graph (training.cuda_graph) -------------------

    def capture_obstacles(self) -> List[str]:
        """Why the update cannot run inside the step's CUDA graph (empty: it can)."""
        out = []
        for part, _, _ in self.parts:
            if _kind(part) != "float16":
                out.append("--use-distributed-optimizer (its parameter all-gather runs from "
                           "the host)")
            if part.config.log_num_zeros_in_grad:
                out.append("log_num_zeros_in_grad")
        return list(dict.fromkeys(out))

    @torch.no_grad()
    def prepare_capture(self) -> None:
        """Host set-up of the captured update, once, after eager steps and before the
        capture: megatron's gradient preparation (which points the main weights' gradients
        at the fp32 gradient buffer, whose addresses the graph keeps), the launch tables,
        the gradients of megatron's norm with their reduction group, and one device row of
        hyperparameters per parameter group that ``load_hyperparameters`` refreshes before
        every replay; then the update runs once on a NaN loss, which leaves everything as
        it was, to load its kernels."""
        from megatron_lrattn.ops import adamw
        if self.optimizer.prepare_grads():
            raise RuntimeError("prepare_capture: the gradient preparation found an overflow")
        self._captured = []
        for part, model_of, table in self.parts:
            tensors = self._tensors(part, model_of)
            if not tensors:
                continue
            device = tensors[0].param.device
            self._captured.append(dict(
                part=part, tensors=tensors, table=table,
                tables=table.tables(tensors, device),
                hyper=adamw.hyper_table(part.optimizer.param_groups, 1.0, device).clone()))
        self._norm_groups = _norm_groups([c["part"] for c in self._captured])
        # once eagerly with a NaN loss, which changes nothing, so that every kernel of the
        # update is loaded before the capture (a module loaded while capturing invalidates it)
        if self._captured:
            device = self._captured[0]["hyper"].device
            nan = torch.full((), math.nan, dtype=torch.float64, device=device)
            self.load_hyperparameters()
            if self.captured_update(nan)[2].item() != 0.0:
                raise RuntimeError("prepare_capture: the update stepped on a NaN loss")

    def load_hyperparameters(self) -> None:
        """Before a replay (stream-ordered, no host wait): each group's lr, weight decay,
        betas and eps as the LR schedule left them into the captured rows."""
        from megatron_lrattn.ops import adamw
        for c in self._captured:
            rows = torch.tensor(adamw.hyper_rows(c["part"].optimizer.param_groups),
                                dtype=torch.float64)
            c["hyper"][:, :5].copy_(rows, non_blocking=True)

    @torch.no_grad()
    def captured_update(self, loss: torch.Tensor) -> torch.Tensor:
        """The optimizer step as device work only, recorded into the step's CUDA graph after
        the backward: megatron's gradient norm (``device_grad_norm``, without the host read),
        megatron's clipping factor, and the kernel,
        which steps only when the norm and ``loss`` (a device scalar) are finite and leaves
        everything as it was otherwise.

        Returns:
            [loss, gradient norm, 1.0 stepped / 0.0 not] (fp64, on the device): the host
            reads it once after the replay.
        """
        from megatron_lrattn.ops import adamw
        device = self._captured[0]["hyper"].device
        grad_norm = device_grad_norm(self._norm_groups, device)
        stepped = (torch.isfinite(grad_norm) & torch.isfinite(loss)).double()
        for c in self._captured:
            clip = c["part"].config.clip_grad
            scale = torch.ones((), dtype=torch.float64, device=device)
            if clip > 0.0:  # megatron's clipping factor, applied below 1
                scale = torch.clamp(clip / (grad_norm + 1.0e-6), max=1.0)
            c["hyper"][:, 5] = scale
            c["hyper"][:, 6] = stepped
            adamw.multi_tensor_adamw(c["tensors"], c["hyper"], c["table"], c["tables"])
        return torch.stack([loss.double().reshape(()), grad_norm, stepped])


def _gather_params(part) -> None:
    """The rest of megatron's ``DistributedOptimizer.step_with_ready_grads`` once the kernel
    has written this rank's shards into the parameter buffer: the parameter all-gather
    (now, or in the next forward with ``--overlap-param-gather``), as the megatron-core
    version at hand does it. Its own update and copy are stood in for by no-ops for the
    call."""
    def nothing(*args, **kwargs):
        return None

    part.optimizer.step = nothing
    part._copy_main_params_to_model_params = nothing
    try:
        part.step_with_ready_grads()
    finally:
        del part.optimizer.step
        del part._copy_main_params_to_model_params


def mixed_precision_adamw(optimizer, enabled: bool = True
                          ) -> Optional[Callable[[], Tuple[bool, Optional[float], Optional[float]]]]:
    """The fused step for ``optimizer`` where it applies and ``enabled``, else None (the run
    keeps ``optimizer.step``); the reason is logged once."""
    if not enabled:
        return None
    why = obstacles(optimizer)
    if why:
        logger.info("optimizer step: megatron-core's (%s)", "; ".join(why))
        return None
    logger.info("optimizer step: clipping, AdamW and the bf16 weight copy in one kernel")
    return MixedPrecisionAdamW(optimizer)
