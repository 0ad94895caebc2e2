"""Depth-read op: one public function, several backends with the same semantics."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from megatron_lrattn.ops.reference import depth_read_naive, depth_read_torch

BACKENDS = ("auto", "torch", "triton")

__all__ = ["depth_read", "depth_read_naive", "depth_read_torch", "triton_available", "BACKENDS"]


def triton_available() -> bool:
    """True when the fused Triton backend can be imported."""
    try:
        import lrattn_kernels.depth_read  # noqa: F401
    except ImportError:
        return False
    return True


def _check(values: Sequence[Tensor], query: Tensor, keys: Optional[Sequence[Tensor]]) -> None:
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


def depth_read(
    values: Sequence[Tensor],
    query: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: str = "auto",
) -> Tensor:
    """Softmax over depth sources with rank-r routing keys.

    ``out = sum_i softmax_i(scale * <query, RMS(k_i)>) * values[i]`` with fp32 statistics,
    softmax and accumulation.

    Args:
        values: S tensors [..., d] of one dtype and device, separately allocated (never
            stack them first).
        query: [r] routing query (kept fp32 by the model).
        keys: None for sliced keys (``values[i][..., -r:]``; r == d is standard AttnRes), or
            S tensors [..., r] of projected keys.
        eps: epsilon of the key RMS normalisation.
        scale: logit scale tau.
        backend: ``torch`` (reference), ``triton`` (fused kernels) or ``auto`` (fused on
            CUDA tensors when Triton is available, else the reference).

    Returns:
        Tensor [..., d] in the dtype of ``values``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"depth_read: backend={backend!r}, allowed: {', '.join(BACKENDS)}")
    _check(values, query, keys)
    if backend == "auto":
        backend = "triton" if values[0].is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("depth_read: backend='triton' but lrattn_kernels cannot be imported")
        from lrattn_kernels.depth_read import depth_read_triton

        return depth_read_triton(values, query, keys, eps=eps, scale=scale)
    return depth_read_torch(values, query, keys, eps=eps, scale=scale)
