"""Non-finite loss and gradient detection before the optimizer step (``--on-nonfinite``).

After forward-backward (gradients reduced across data-parallel ranks) and before
``optimizer.step()``, every rank sums its contiguous gradient buffers (one pass over the
gradients, no copy: a sum is finite only when every element is) and all ranks agree with one
small all-reduce. Where the one-kernel optimizer step runs (``training.optimizer_step``),
its gradient norm, computed before the update and the same on every rank, is checked
instead, and the gradients are read once, not twice (inside the step's CUDA graph the kernel
itself skips the update, and the host checks afterwards). The loss, already reduced and
broadcast, is checked as well. On a non-finite value the loop either skips the step (the
optimizer's step, its moments and step counts, the parameters and the LR schedule are not
touched) or stops with :class:`NonFiniteError`, which names the iteration and the first
parameter whose gradient holds a non-finite value.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

ON_NONFINITE = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient under ``--on-nonfinite stop``."""


def _grad_tensors(model) -> List[torch.Tensor]:
    # megatron's DDP keeps its gradient buffers in lists (``buffers`` shadows the
    # nn.Module method); any other module falls back to per-parameter gradients.
    buffers = [b for name in ("buffers", "expert_parallel_buffers")
               if isinstance(getattr(model, name, None), (list, tuple))
               for b in getattr(model, name)]
    grads = [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
    if grads:
        return grads
    out = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            out.append(g)
    return out


def grads_finite(models) -> bool:
    """True when every gradient of every rank is finite (a collective on all ranks)."""
    # one sum per buffer, then one flag and one host read for all of them
    sums = [g.sum(dtype=torch.float32) for model in models for g in _grad_tensors(model)]
    if sums:
        flag = (~torch.isfinite(torch.stack(sums))).any().float().reshape(1)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        flag = torch.zeros(1, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() == 0)


def first_nonfinite_grad(models) -> Optional[str]:
    """Name of the first parameter (model order; chunk prefix with several model chunks)
    whose gradient has a non-finite element, over all ranks; None if all are finite.
    A collective on all ranks (only called once something was found)."""
    local = None
    for i, model in enumerate(models):
        module = getattr(model, "module", model)
        for name, p in module.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None and not bool(torch.isfinite(g).all()):
                local = name if len(models) == 1 else f"model{i}.{name}"
                break
        if local is not None:
            break
    if not (dist.is_available() and dist.is_initialized()):
        return local
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, local)
    return next((n for n in names if n is not None), None)


def check_step(loss: float, models, iteration: int, policy: str,
               grad_norm: Optional[float] = None) -> Optional[str]:
    """Check the loss and gradients of ``iteration`` before the optimizer step.

    Args:
        loss: the iteration's reduced loss (the same on every rank).
        models: the DDP-wrapped model chunks.
        iteration: 1-based number of the iteration being computed.
        policy: ``stop`` or ``skip``.
        grad_norm: the global gradient norm when the optimizer step computed it already
            (the same on every rank): the gradients are finite exactly when it is (a
            sum of squares overflowing fp32, an element above ~1e19, counts as
            non-finite too), and no pass of its own over the gradients is made.

    Returns:
        None when everything is finite; otherwise (policy ``skip``) a short description of
        what was non-finite, and the caller must not step the optimizer.

    Raises:
        NonFiniteError: policy ``stop`` and something is non-finite; the message names the
            iteration and the first non-finite tensor.
    """
    if policy not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite {policy!r}: use one of {ON_NONFINITE}")
    loss_ok = math.isfinite(loss)
    grads_ok = grads_finite(models) if grad_norm is None else math.isfinite(grad_norm)
    if grads_ok and loss_ok:
        return None
    name = first_nonfinite_grad(models)
    parts = [] if loss_ok else [f"loss is {loss}"]
    parts.append(f"first non-finite gradient: {name}" if name else "gradients are finite")
    what = "; ".join(parts)
    if policy == "stop":
        raise NonFiniteError(
            f"non-finite values at iteration {iteration} ({what}); stopping before the "
            f"optimizer step (--on-nonfinite skip skips such steps instead)"
        )
    return what
