"""Readable PyTorch depth read: the reference every fused backend is checked against.

For sources v_0..v_{S-1} ([T, d]), keys k_i ([T, r]), a query q ([r], fp32) and scale tau:

    s_i = tau * <q, RMS(k_i)>,   a = softmax_i(s) (fp32),   out = sum_i a_i v_i

Statistics, the softmax and accumulation run in fp32; the output has the sources' dtype.
The autograd function saves only references to its inputs and one fp32 scalar per token
(the log-sum-exp); backward recomputes keys, logits and probabilities from them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def to_acc(t: Tensor) -> Tensor:
    """``t`` in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_keys(k: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """RMS-normalised key and its inverse RMS ([T, r] and [T, 1]) in accumulation dtype."""
    k = to_acc(k)
    rstd = torch.rsqrt(k.pow(2).mean(dim=-1, keepdim=True) + eps)
    return k * rstd, rstd


def depth_read_logits(keys: Sequence[Tensor], query: Tensor, eps: float,
                      scale: float) -> Tensor:
    """Logits ``scale <query, RMS(k_i)>`` of S keys [T, r] ([S, T], accumulation dtype):
    the routing scores of a depth read before its softmax."""
    q = query.to(torch.promote_types(keys[0].dtype, torch.float32))
    return torch.stack([scale * (rms_keys(k, eps)[0] @ q) for k in keys])


class _DepthRead(torch.autograd.Function):
    """out = sum_i softmax_i(tau <q, RMS(k_i)>) v_i on flattened [T, d] sources."""

    @staticmethod
    def forward(ctx, query, eps, scale, r, num_values, *tensors):
        values = tensors[:num_values]
        keys = tensors[num_values:] if len(tensors) > num_values else [v[:, -r:] for v in values]
        logits = depth_read_logits(keys, query, eps, scale)
        lse = torch.logsumexp(logits, dim=0)
        probs = torch.exp(logits - lse)
        acc_dtype = torch.promote_types(values[0].dtype, torch.float32)
        out = torch.zeros(values[0].shape, dtype=acc_dtype, device=values[0].device)
        for a, v in zip(probs, values):
            out.addcmul_(a[:, None], v)
        ctx.save_for_backward(query, lse, *tensors)
        ctx.eps, ctx.scale, ctx.r, ctx.num_values = eps, scale, r, num_values
        return out.to(values[0].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, lse, *tensors = ctx.saved_tensors
        eps, scale, r, nv = ctx.eps, ctx.scale, ctx.r, ctx.num_values
        values = tensors[:nv]
        projected = len(tensors) > nv
        keys = tensors[nv:] if projected else [v[:, -r:] for v in values]
        g = to_acc(grad_out)
        q = query.to(torch.promote_types(keys[0].dtype, torch.float32))
        probs = torch.exp(depth_read_logits(keys, query, eps, scale) - lse)  # [S, T]
        # da_i = <g, v_i>; ds_i = a_i (da_i - sum_j a_j da_j)
        da = torch.stack([(g * v).sum(-1) for v in values])
        ds = probs * (da - (probs * da).sum(0, keepdim=True))
        grad_q = torch.zeros_like(q)
        grad_values: List[Tensor] = []
        grad_keys: List[Tensor] = []
        for i, v in enumerate(values):
            khat, rstd = rms_keys(keys[i], eps)
            grad_q += scale * (ds[i] @ khat)
            dkhat = (scale * ds[i])[:, None] * q  # [T, r]
            dk = rstd * (dkhat - khat * (dkhat * khat).mean(-1, keepdim=True))
            dv = probs[i][:, None] * g
            if projected:
                grad_keys.append(dk.to(keys[i].dtype))
            else:
                dv[:, -r:] += dk
            grad_values.append(dv.to(v.dtype))
        grad_q = grad_q.to(query.dtype) if ctx.needs_input_grad[0] else None
        return (grad_q, None, None, None, None, *grad_values, *grad_keys)


def depth_read_torch(
    values: Sequence[Tensor],
    query: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
) -> Tensor:
    """Reference depth read (custom autograd, fp32 math). Arguments as ``depth_read``."""
    shape = values[0].shape
    d, r = shape[-1], query.shape[-1]
    flat_v = [v.reshape(-1, d) for v in values]
    flat_k = [k.reshape(-1, r) for k in keys] if keys is not None else []
    out = _DepthRead.apply(query, eps, scale, r, len(flat_v), *flat_v, *flat_k)
    return out.reshape(shape)


def depth_read_naive(
    values: Sequence[Tensor],
    query: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
) -> Tensor:
    """The formula written out with plain autograd and in the inputs' own precision
    (for tests: call it on float64 inputs)."""
    r = query.shape[-1]
    if keys is None:
        keys = [v[..., -r:] for v in values]
    k = torch.stack(list(keys))  # [S, ..., r]
    khat = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    a = torch.softmax(scale * (khat * query.to(k.dtype)).sum(-1), dim=0)  # [S, ...]
    return (a.unsqueeze(-1) * torch.stack(list(values))).sum(0)
