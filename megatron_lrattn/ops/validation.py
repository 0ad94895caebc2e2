"""The one validation layer of the depth ops: argument checks, backend choice and the envelope
of the fused kernels. Every public op and every Triton entry point checks through here."""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton")

MAX_WIDTH = 8192
MAX_SOURCES = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_available() -> bool:
    """True when the fused Triton backend can be imported."""
    try:
        import megatron_lrattn.ops.site_read.fused  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_sources(values: Sequence[Tensor], query: Tensor,
                  keys: Optional[Sequence[Tensor]]) -> None:
    """Refuse sources, query and keys that do not form one depth read (``depth_read``'s
    argument rules: S same-shaped tensors [..., d], a 1-D query [r], S keys [..., r])."""
    if isinstance(values, Tensor) or len(values) == 0:
        raise ValueError("depth_read: values must be a non-empty sequence of tensors [..., d]")
    ref = values[0]
    for i, v in enumerate(values):
        if v.shape != ref.shape or v.dtype != ref.dtype or v.device != ref.device:
            raise ValueError(
                f"depth_read: values[{i}] is {tuple(v.shape)} {v.dtype} on {v.device}, "
                f"values[0] is {tuple(ref.shape)} {ref.dtype} on {ref.device}; all must match"
            )
    if query.dim() != 1:
        raise ValueError(f"depth_read: query must be 1-D [r], got shape {tuple(query.shape)}")
    r, d = query.shape[0], ref.shape[-1]
    if keys is None:
        if not 1 <= r <= d:
            raise ValueError(f"depth_read: sliced keys need 1 <= r <= d, got r={r}, d={d}")
        return
    if isinstance(keys, Tensor) or len(keys) != len(values):
        raise ValueError(f"depth_read: keys must be a sequence of {len(values)} tensors [..., r]")
    for i, k in enumerate(keys):
        if k.shape != (*ref.shape[:-1], r) or k.device != ref.device:
            raise ValueError(
                f"depth_read: keys[{i}] is {tuple(k.shape)} on {k.device}, expected "
                f"{(*ref.shape[:-1], r)} on {ref.device}"
            )


def check_lse(lse: Tensor, out: Tensor, where: str) -> None:
    """The phase-1 log-sum-exp must be [...] for an output [..., d]."""
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"{where}: lse is {tuple(lse.shape)}, expected {tuple(out.shape[:-1])}")


def check_norm(weight: Optional[Tensor], eps: Optional[float], like: Tensor,
               where: str) -> float:
    """Check the optional fused RMSNorm (weight [d] on the rows' device, eps a finite number
    > 0); returns the epsilon as a float (0.0 without a norm)."""
    if weight is None:
        if eps is not None:
            raise ValueError(f"{where}: norm_eps={eps!r} given without norm_weight")
        return 0.0
    d = like.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"{where}: norm_weight must be [d] = [{d}], got {tuple(weight.shape)}")
    if weight.device != like.device:
        raise ValueError(f"{where}: norm_weight is on {weight.device}, the rows on "
                         f"{like.device}")
    if eps is None or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{where}: norm_eps must be a finite number > 0 with norm_weight, "
                         f"got {eps!r}")
    return float(eps)


def resolve_backend(backend: str, like: Tensor, where: str) -> str:
    """``torch`` or ``triton`` for ``backend`` (``auto``: Triton on CUDA tensors when it can be
    imported); refuses an unknown name, and ``triton`` when it cannot be imported."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend={backend!r}, allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if like.is_cuda and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError(f"{where}: backend='triton' but Triton cannot be imported")
    return backend


def check_envelope(values: Sequence[Tensor], query: Tensor,
                   keys: Optional[Sequence[Tensor]]) -> None:
    """Refuse what the fused kernels do not support (1 <= S <= 256 sources, 1 <= d <= 8192,
    projected r <= 8192, bf16 / fp16 / fp32, CUDA tensors or the interpreter) with a
    ``ValueError`` that names the torch backend as the way out."""
    S, d, r = len(values), values[0].shape[-1], query.shape[-1]
    where = "megatron_lrattn.ops (triton)"
    if not 1 <= S <= MAX_SOURCES:
        raise ValueError(f"{where}: S={S} sources, supported 1..{MAX_SOURCES}")
    if not 1 <= d <= MAX_WIDTH:
        raise ValueError(f"{where}: d={d}, supported 1..{MAX_WIDTH}; use backend='torch'")
    if keys is None and not 1 <= r <= d:
        raise ValueError(f"{where}: sliced keys need 1 <= r <= d, got r={r}, d={d}")
    if keys is not None and not 1 <= r <= MAX_WIDTH:
        raise ValueError(f"{where}: projected r={r}, supported 1..{MAX_WIDTH}")
    for name, ts in (("values", values), ("keys", keys or [])):
        for t in ts:
            if t.dtype not in DTYPES:
                raise ValueError(f"{where}: {name} dtype {t.dtype}, supported {DTYPES}; "
                                 "use backend='torch' for float64")
    if not values[0].is_cuda and not interpreting():
        raise ValueError(f"{where}: CPU tensors need TRITON_INTERPRET=1; use backend='torch'")
