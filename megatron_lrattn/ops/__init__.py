"""Depth-read op: one public function, several backends with the same semantics."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_lrattn.ops.reference import depth_read_naive, depth_read_torch
from megatron_lrattn.ops.two_phase import (
    depth_merge_torch,
    depth_merge_update_torch,
    depth_read_multi_naive,
    depth_read_multi_torch,
)

BACKENDS = ("auto", "torch", "triton")

__all__ = ["depth_read", "depth_read_naive", "depth_read_torch", "depth_read_multi",
           "depth_read_multi_torch", "depth_read_multi_naive", "depth_merge", "depth_merge_torch",
           "depth_merge_update", "depth_merge_update_torch",
           "triton_available", "BACKENDS"]


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


def _resolve(backend: str, like: Tensor, where: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend={backend!r}, allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if like.is_cuda and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError(f"{where}: backend='triton' but lrattn_kernels cannot be imported")
    return backend


def _check_norm(weight: Optional[Tensor], eps: Optional[float], like: Tensor,
                where: str) -> None:
    if weight is None:
        if eps is not None:
            raise ValueError(f"{where}: norm_eps={eps!r} given without norm_weight")
        return
    d = like.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"{where}: norm_weight must be [d] = [{d}], got {tuple(weight.shape)}")
    if weight.device != like.device:
        raise ValueError(f"{where}: norm_weight is on {weight.device}, the rows on "
                         f"{like.device}")
    if eps is None or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{where}: norm_eps must be a finite number > 0 with norm_weight, "
                         f"got {eps!r}")


def depth_read_multi(
    values: Sequence[Tensor],
    queries: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: str = "auto",
    split: bool = False,
):
    """Phase 1 of the two-phase block schedule: K depth reads over the same S sources.

    Every source is read once for all K queries (the read sites of one depth block against
    its completed sources). Row k equals ``depth_read(values, queries[k], keys)``.

    Args:
        values: S tensors [..., d] (embedding and completed blocks), separately allocated.
        queries: [K, r] queries of the K read sites (fp32).
        keys: None for sliced keys (last r coordinates of each value) or S tensors [..., r].
        eps, scale: key RMS epsilon and logit scale tau, as in ``depth_read``.
        backend: ``torch``, ``triton`` or ``auto``.
        split: return the outputs as a list of K separately allocated tensors [..., d]
            (each site's gradient then flows without materialising a [K, ..., d] buffer).

    Returns:
        (out, lse): out [K, ..., d] in the values' dtype (a list of K tensors when
        ``split``); lse [K, ...] fp32 log-sum-exp of the scaled logits (float64 for
        float64 inputs on the torch backend).
    """
    if queries.dim() != 2 or queries.shape[0] == 0:
        raise ValueError(f"depth_read_multi: queries must be [K, r] with K >= 1, got "
                         f"{tuple(queries.shape)}")
    _check(values, queries[0], keys)
    if _resolve(backend, values[0], "depth_read_multi") == "triton":
        from lrattn_kernels.depth_read_multi import depth_read_multi_triton

        return depth_read_multi_triton(values, queries, keys, eps=eps, scale=scale, split=split)
    return depth_read_multi_torch(values, queries, keys, eps=eps, scale=scale, split=split)


def depth_merge(
    out: Tensor,
    lse: Tensor,
    partial: Tensor,
    query: Tensor,
    partial_key: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: str = "auto",
    norm_weight: Optional[Tensor] = None,
    norm_eps: Optional[float] = None,
) -> Tensor:
    """Phase 2 of the two-phase block schedule: add the partial sum P as one more source.

    ``h = (e^(lse - m) out + e^(l_P - m) P) / (e^(lse - m) + e^(l_P - m))`` with
    ``l_P = scale <query, RMS(key(P))>`` and ``m = max(lse, l_P)``; with (out, lse) from
    ``depth_read_multi`` over sources V this equals ``depth_read([*V, P], query)``.

    Args:
        out: [..., d] phase-1 output of this site.
        lse: [...] fp32 phase-1 log-sum-exp of this site.
        partial: [..., d] running partial sum of the block (same dtype as ``out``).
        query: [r] query of this site.
        partial_key: None for sliced keys (``partial[..., -r:]``) or [..., r].
        eps, scale, backend: as in ``depth_read``.
        norm_weight: optional [d] weight of the RMSNorm that follows the read (the next
            sub-layer's PreNorm): the result is then ``rms_norm(h, norm_weight, norm_eps)``
            instead of h, fused into the merge by the Triton backend (h is not written).
        norm_eps: that norm's epsilon (> 0), required with ``norm_weight``.

    Returns:
        Tensor [..., d] in the dtype of ``partial``: h, or its RMSNorm.
    """
    _check([out, partial], query, None if partial_key is None else [partial_key, partial_key])
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"depth_merge: lse is {tuple(lse.shape)}, expected "
                         f"{tuple(out.shape[:-1])}")
    _check_norm(norm_weight, norm_eps, partial, "depth_merge")
    kw = dict(eps=eps, scale=scale, norm_weight=norm_weight, norm_eps=norm_eps)
    if _resolve(backend, partial, "depth_merge") == "triton":
        from lrattn_kernels.depth_merge import depth_merge_triton

        return depth_merge_triton(out, lse, partial, query, partial_key, **kw)
    return depth_merge_torch(out, lse, partial, query, partial_key, **kw)


def depth_merge_update(
    out: Tensor,
    lse: Tensor,
    partial: Tensor,
    update: Tensor,
    query: Tensor,
    partial_key: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: str = "auto",
    norm_weight: Optional[Tensor] = None,
    norm_eps: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Phase 2 fused with the partial-sum update: ``P = partial + update``, then
    ``depth_merge(out, lse, P, query, partial_key)``.

    The fused kernel forms, writes and merges P in one pass and, in the backward, adds P's
    own gradient (its later uses as a source) to the merge's, so the sub-layer output is
    not added in a separate pass.

    Args:
        out, lse, query, eps, scale, backend, norm_weight, norm_eps: as in ``depth_merge``.
        partial: [..., d] the block's partial sum before this sub-layer's output.
        update: [..., d] that output (same dtype).
        partial_key: None for sliced keys or the projected key [..., r] of the updated P.

    Returns:
        (h, P): the merged read (its RMSNorm with ``norm_weight``) and the updated partial
        sum, [..., d] each; P is ``partial + update`` exactly.
    """
    _check([out, partial, update], query,
           None if partial_key is None else [partial_key] * 3)
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"depth_merge_update: lse is {tuple(lse.shape)}, expected "
                         f"{tuple(out.shape[:-1])}")
    _check_norm(norm_weight, norm_eps, partial, "depth_merge_update")
    kw = dict(eps=eps, scale=scale, norm_weight=norm_weight, norm_eps=norm_eps)
    if _resolve(backend, partial, "depth_merge_update") == "triton":
        from lrattn_kernels.depth_merge import depth_merge_update_triton

        return depth_merge_update_triton(out, lse, partial, update, query, partial_key, **kw)
    return depth_merge_update_torch(out, lse, partial, update, query, partial_key, **kw)
