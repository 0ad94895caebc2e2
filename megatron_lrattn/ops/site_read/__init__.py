"""The depth read of one read site: the public ``depth_read`` and its backends (the readable
reference in ``reference.py``, the fused Triton kernels in ``fused.py``)."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from megatron_lrattn.ops.site_read.reference import (
    depth_read_logits,
    depth_read_naive,
    depth_read_torch,
)
from megatron_lrattn.ops.validation import BACKENDS, check_sources, resolve_backend

__all__ = ["depth_read", "depth_read_torch", "depth_read_naive", "depth_read_logits"]


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
    check_sources(values, query, keys)
    if resolve_backend(backend, values[0], "depth_read") == "triton":
        from megatron_lrattn.ops.site_read.fused import depth_read_triton

        return depth_read_triton(values, query, keys, eps=eps, scale=scale)
    return depth_read_torch(values, query, keys, eps=eps, scale=scale)
