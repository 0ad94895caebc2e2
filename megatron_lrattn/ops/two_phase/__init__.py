"""Two-phase block reads: phase 1 (``depth_read_multi``: the K read sites of a depth block
against its completed sources, each source read once) and phase 2 (``depth_merge``,
``depth_merge_update``: each site adds the block's running partial sum as one more source).
Readable references in ``reference.py``; fused kernels in ``phase1.py`` and ``merge.py``."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import Tensor

from megatron_lrattn.ops.two_phase.reference import (
    depth_merge_torch,
    depth_merge_update_torch,
    depth_read_multi_naive,
    depth_read_multi_torch,
)
from megatron_lrattn.ops.validation import check_lse, check_norm, check_sources, resolve_backend

__all__ = ["depth_read_multi", "depth_merge", "depth_merge_update", "depth_read_multi_torch",
           "depth_read_multi_naive", "depth_merge_torch", "depth_merge_update_torch"]


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
    check_sources(values, queries[0], keys)
    if resolve_backend(backend, values[0], "depth_read_multi") == "triton":
        from megatron_lrattn.ops.two_phase.phase1 import depth_read_multi_triton

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
    check_sources([out, partial], query, None if partial_key is None else [partial_key] * 2)
    check_lse(lse, out, "depth_merge")
    check_norm(norm_weight, norm_eps, partial, "depth_merge")
    kw = dict(eps=eps, scale=scale, norm_weight=norm_weight, norm_eps=norm_eps)
    if resolve_backend(backend, partial, "depth_merge") == "triton":
        from megatron_lrattn.ops.two_phase.merge import depth_merge_triton

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
    check_sources([out, partial, update], query,
                  None if partial_key is None else [partial_key] * 3)
    check_lse(lse, out, "depth_merge_update")
    check_norm(norm_weight, norm_eps, partial, "depth_merge_update")
    kw = dict(eps=eps, scale=scale, norm_weight=norm_weight, norm_eps=norm_eps)
    if resolve_backend(backend, partial, "depth_merge_update") == "triton":
        from megatron_lrattn.ops.two_phase.merge import depth_merge_update_triton

        return depth_merge_update_triton(out, lse, partial, update, query, partial_key, **kw)
    return depth_merge_update_torch(out, lse, partial, update, query, partial_key, **kw)
