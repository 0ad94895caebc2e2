"""Readable PyTorch two-phase block reads: the reference the fused kernels are checked against.

Phase 1 (``depth_read_multi_torch``) reads the S completed sources of a depth block for the
K queries of the block's read sites at once and returns, per query k,

    out_k = sum_i softmax_i(s_ki) v_i,   lse_k = logsumexp_i(s_ki),   s_ki = tau <q_k, RMS(k_i)>

Phase 2 (``depth_merge_torch``) adds the running partial sum P of the block as one more
source with an online-softmax step:

    l_P = tau <q_k, RMS(key(P))>,  m = max(lse_k, l_P)
    h = (e^(lse_k - m) out_k + e^(l_P - m) P) / (e^(lse_k - m) + e^(l_P - m))

which equals the depth read of q_k over [v_0.., P]. Both run plain autograd in fp32 (fp64 for
fp64 inputs); the outputs have the sources' dtype, ``lse`` is fp32.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_lrattn.ops.site_read.reference import rms_keys, to_acc


def depth_read_multi_torch(
    values: Sequence[Tensor],
    queries: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    split: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Reference phase 1. Arguments and returns as ``megatron_lrattn.ops.depth_read_multi``."""
    r = queries.shape[-1]
    if keys is None:
        keys = [v[..., -r:] for v in values]
    q = queries.to(torch.promote_types(keys[0].dtype, torch.float32))
    logits = torch.stack([scale * (rms_keys(k, eps)[0] @ q.t()) for k in keys])  # [S, ..., K]
    lse = torch.logsumexp(logits, dim=0)  # [..., K]
    probs = torch.exp(logits - lse)
    out = sum(p.movedim(-1, 0).unsqueeze(-1) * to_acc(v) for p, v in zip(probs, values))
    out = out.to(values[0].dtype)  # [K, ..., d]
    lse = lse.movedim(-1, 0).float() if lse.dtype != torch.float64 else lse.movedim(-1, 0)
    return (list(out.unbind(0)) if split else out), lse


def depth_merge_torch(
    out: Tensor,
    lse: Tensor,
    partial: Tensor,
    query: Tensor,
    partial_key: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    norm_weight: Optional[Tensor] = None,
    norm_eps: Optional[float] = None,
) -> Tensor:
    """Reference phase 2. Arguments and returns as ``megatron_lrattn.ops.depth_merge``."""
    if norm_weight is not None:
        h = depth_merge_torch(out, lse, partial, query, partial_key, eps=eps, scale=scale)
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), norm_weight, norm_eps)
    r = query.shape[-1]
    key = partial[..., -r:] if partial_key is None else partial_key
    khat, _ = rms_keys(key, eps)
    l_p = scale * (khat @ query.to(khat.dtype))  # [...]
    lse = lse.to(l_p.dtype)
    m = torch.maximum(lse, l_p)
    w_o, w_p = torch.exp(lse - m), torch.exp(l_p - m)
    w_o, w_p, total = w_o.unsqueeze(-1), w_p.unsqueeze(-1), (w_o + w_p).unsqueeze(-1)
    return ((w_o * to_acc(out) + w_p * to_acc(partial)) / total).to(partial.dtype)


def depth_merge_update_torch(
    out: Tensor,
    lse: Tensor,
    partial: Tensor,
    update: Tensor,
    query: Tensor,
    partial_key: Optional[Tensor] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    norm_weight: Optional[Tensor] = None,
    norm_eps: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference fused update and merge. Arguments and returns as
    ``megatron_lrattn.ops.depth_merge_update``."""
    new = partial + update
    return depth_merge_torch(out, lse, new, query, partial_key, eps=eps, scale=scale,
                             norm_weight=norm_weight, norm_eps=norm_eps), new


def depth_read_multi_naive(
    values: Sequence[Tensor],
    queries: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """Phase 1 written out per query in the inputs' own precision (tests: float64)."""
    r = queries.shape[-1]
    if keys is None:
        keys = [v[..., -r:] for v in values]
    k = torch.stack(list(keys))
    khat = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for q in queries:
        s = scale * (khat * q.to(k.dtype)).sum(-1)  # [S, ...]
        outs.append((torch.softmax(s, 0).unsqueeze(-1) * torch.stack(list(values))).sum(0))
        lses.append(torch.logsumexp(s, 0))
    return torch.stack(outs), torch.stack(lses)
