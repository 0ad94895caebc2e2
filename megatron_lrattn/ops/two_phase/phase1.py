"""Fused phase 1 of the two-phase block schedule: launchers of the width-chunked passes
(``phase1_kernels.py``), their autograd Function and ``depth_read_multi_triton``.

Nothing [T, d]-sized is kept in fp32: the saved tensors are the inputs, s, rstd and lse.
Query gradients: fixed-order per-program partials reduced afterwards, no atomics.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import triton
from torch import Tensor

from megatron_lrattn.ops import triton_utils as tu
from megatron_lrattn.ops import tuning
from megatron_lrattn.ops.two_phase.phase1_kernels import (
    phase1_coef_kernel,
    phase1_dkeys_kernel,
    phase1_dots_kernel,
    phase1_dvalues_kernel,
    phase1_logits_kernel,
    phase1_lse_kernel,
    phase1_values_kernel,
)
from megatron_lrattn.ops.validation import check_envelope

KERNELS = (phase1_logits_kernel, phase1_lse_kernel, phase1_values_kernel, phase1_dots_kernel,
           phase1_coef_kernel, phase1_dvalues_kernel, phase1_dkeys_kernel)


def _forward(vs: List[Tensor], ks: List[Tensor], q: Tensor, eps: float, scale: float,
             split: bool):
    """(outs, lse, s, rstd) of one query group; outs: K tensors [T, d] or one [K, T, d]."""
    T, d = vs[0].shape
    K, r = q.shape
    S = len(vs)
    dev = vs[0].device
    outs = ([tu.empty((T, d), vs[0].dtype, dev) for _ in range(K)] if split
            else tu.empty((K, T, d), vs[0].dtype, dev))
    lse = tu.empty((K, T), torch.float32, dev)
    s = tu.empty((T, S, K), torch.float32, dev)
    rstd = tu.empty((T, S), torch.float32, dev)
    if T == 0:
        return outs, lse, s, rstd
    projected = len(ks) > 0
    out_list = list(outs)
    if projected:
        (v_tab, vs_tab), (k_tab, ks_tab), (o_tab, _) = tu.tables(vs, ks, out_list)
    else:
        (v_tab, vs_tab), (o_tab, _) = tu.tables(vs, out_list)
        k_tab, ks_tab = v_tab, vs_tab
    cfg = tuning.phase1(d, r, T, vs[0].dtype)
    bk = tu.pow2(K)
    keys = ks if projected else vs
    # the keys' rows start on 16 bytes (sliced: d - r elements into each value row)
    ka = tu.vector_rows([keys], r) and (projected
                                        or (d - r) % (16 // vs[0].element_size()) == 0)
    phase1_logits_kernel[(triton.cdiv(T, cfg.logit_tokens), S)](
        v_tab, vs_tab, k_tab, ks_tab, vs[0], keys[0], q, s, rstd, T, S, K, d, r, eps, scale,
        PROJECTED=projected, BT=cfg.logit_tokens, BK=max(16, bk), RC=cfg.logit_chunk, KA=ka,
        PREC=cfg.logit_precision, num_warps=cfg.logit_warps)
    phase1_lse_kernel[(T,)](s, lse, T, S, K, BS=tu.pow2(S), BK=bk, num_warps=1)
    bc = cfg.value_chunk
    phase1_values_kernel[(triton.cdiv(d, bc), T)](
        v_tab, vs_tab, o_tab, vs[0], out_list[0], s, lse, T, S, K, d, BK=bk, BC=bc,
        A=tu.vector_rows([vs, out_list], d), num_warps=cfg.value_warps)
    return outs, lse, s, rstd


def _backward(vs: List[Tensor], ks: List[Tensor], q: Tensor, s: Tensor, rstd: Tensor,
              lse: Tensor, grads: Sequence[Tensor], dlse: Tensor, scale: float):
    """(grad of q [K, r] fp32, value gradients, projected-key gradients) of one group."""
    T, d = vs[0].shape
    K, r = q.shape
    S = len(vs)
    dev = vs[0].device
    projected = len(ks) > 0
    dvs = [tu.empty((T, d), v.dtype, dev) for v in vs]
    dks = [tu.empty((T, r), k.dtype, dev) for k in ks]
    if T == 0:
        return torch.zeros_like(q, dtype=torch.float32), [t.zero_() for t in dvs], \
            [t.zero_() for t in dks]
    gs = [tu.rows(g.to(vs[0].dtype), d) for g in grads]
    dlse = dlse.float().contiguous()
    cfg = tuning.phase1(d, r, T, vs[0].dtype)
    bk, bs = tu.pow2(K), tu.pow2(S)
    bc1 = cfg.dots_chunk
    nc1 = triton.cdiv(d, bc1)
    dots = tu.empty((T, nc1, S, K), torch.float32, dev)
    groups = [vs, dvs, gs] + ([ks, dks] if projected else [])
    tabs = tu.tables(*groups)
    (v_tab, vs_tab), (dv_tab, _), (g_tab, gs_tab) = tabs[:3]
    aligned = tu.vector_rows([vs, dvs, gs], d)
    bc = cfg.grad_chunk
    nc = triton.cdiv(d, bc)
    c0 = nc if projected else (d - r) // bc  # chunks from c0 on hold sliced key columns
    # the dot pass also writes the value gradients of the columns below c0 (no key columns:
    # they need no dots), from the output-gradient chunks it holds
    phase1_dots_kernel[(nc1, T)](
        v_tab, vs_tab, g_tab, gs_tab, dv_tab, vs[0], gs[0], s, lse, dots, T, S, K, d, nc1,
        c0 * bc, BK=bk, BC1=bc1, A=aligned, DV=c0 > 0, num_warps=cfg.dots_warps)
    # the per-source scalars of the gradient passes, once per token
    coef = tu.empty((T, S, 2, bk), torch.float32, dev)
    cc = tu.empty((T, S), torch.float32, dev)
    phase1_coef_kernel[(T,)](s, rstd, lse, dlse, dots, coef, cc, T, S, K, nc1, r, scale,
                             BK=bk, BS=bs, num_warps=1)
    del dots
    nprog = tu.programs(T, dev, cfg.programs_per_sm)
    parts = tu.empty((nprog, K, r), torch.float32, dev)
    if c0 < nc:
        phase1_dvalues_kernel[(nc - c0, nprog)](
            v_tab, vs_tab, g_tab, gs_tab, dv_tab, vs[0], gs[0], q, coef, cc, parts, T, S, K, d,
            r, c0, BK=bk, BC=bc, A=aligned, num_warps=cfg.grad_warps)
    if projected:
        (k_tab, ks_tab), (dk_tab, _) = tabs[3:]
        phase1_dkeys_kernel[(nprog,)](
            k_tab, ks_tab, dk_tab, ks[0], q, coef, cc, parts, T, S, K, r, BK=bk,
            BR=max(16, tu.pow2(r)), num_warps=cfg.key_warps)
    return parts.sum(0), dvs, dks


class _Phase1Triton(torch.autograd.Function):
    """One query group of phase 1 on flattened [T, d] sources; outputs K tensors (split) or
    one [K, T, d], then lse."""

    @staticmethod
    def forward(ctx, queries, eps, scale, split, nv, *tensors):
        vs, ks = list(tensors[:nv]), list(tensors[nv:])
        q = queries.contiguous()
        outs, lse, s, rstd = _forward(vs, ks, q, eps, scale, split)
        ctx.save_for_backward(q, lse, s, rstd, *tensors)
        ctx.scale, ctx.nv, ctx.split = scale, nv, split
        return (*outs, lse) if split else (outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        q, lse, s, rstd, *rest = ctx.saved_tensors
        vs, ks = list(rest[:ctx.nv]), list(rest[ctx.nv:])
        douts, dlse = grads[:-1], grads[-1]
        if not ctx.split:
            douts = list(douts[0].unbind(0))
        gq, dvs, dks = _backward(vs, ks, q, s, rstd, lse, douts, dlse, ctx.scale)
        gq = gq.to(q.dtype) if ctx.needs_input_grad[0] else None
        return (gq, None, None, None, None, *dvs, *dks)


def depth_read_multi_triton(
    values: Sequence[Tensor],
    queries: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    split: bool = False,
):
    """Fused phase 1: K depth reads over the same S sources, each source read once per pass.

    Args:
        values: S tensors [..., d] (bf16, fp16 or fp32), separately allocated.
        queries: [K, r] queries (fp32 recommended; math is fp32 regardless).
        keys: None for sliced keys or S tensors [..., r] of projected keys.
        eps: epsilon of the key RMS normalisation.
        scale: logit scale tau.
        split: return a list of K separately allocated outputs instead of one [K, ..., d].

    Returns:
        (out, lse): out [K, ..., d] (or K tensors [..., d]) in the values' dtype and
        lse [K, ...] fp32.

    Raises:
        ValueError: outside the envelope (``validation.check_envelope``).
    """
    check_envelope(values, queries[0], keys)
    shape = values[0].shape
    d, r = shape[-1], queries.shape[-1]
    vs = [tu.rows(v, d) for v in values]
    ks = [tu.rows(k, r) for k in keys] if keys is not None else []
    group = tuning.phase1(d, r, vs[0].shape[0], vs[0].dtype).group
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for k0 in range(0, queries.shape[0], group):
        res = _Phase1Triton.apply(queries[k0:k0 + group], eps, scale, split, len(vs), *vs, *ks)
        outs += [o.reshape(shape) for o in res[:-1]] if split else [res[0]]
        lses.append(res[-1])
    K = queries.shape[0]
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses)).reshape(K, *shape[:-1])
    if split:
        return outs, lse
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(K, *shape), lse
