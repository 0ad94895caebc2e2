"""Fused Triton phase 2 of the two-phase block schedule: the online-softmax merge.

    l_P = scale * <q, RMS(key(P))>,  m = max(lse, l_P)
    h = (e^(lse - m) out + e^(l_P - m) P) / (e^(lse - m) + e^(l_P - m))

per token, for the phase-1 pair (out [T, d], lse [T] fp32) of one read site and the block's
running partial sum P [T, d] (key: its last r columns, or a projected key [T, r]). One
program owns ``BT`` tokens times the padded width ``BD``; forward and backward each make one
pass over ``out`` and ``P``. The backward returns the gradients of ``out``, ``lse`` (fp32),
``P``, its key and the query (per-program partials reduced in a second step, no atomics).
Optionally P is formed from the previous partial sum and the sub-layer output in the same
pass (``depth_merge_update_triton``), and the merge is followed by the next sub-layer's
RMSNorm (``norm_weight``): the kernel then writes only RMSNorm(h) * w, and its backward
recomputes h from ``out`` and ``P`` and returns the weight gradient the same two-stage way.
Derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_lrattn.ops import triton_utils as tu
from megatron_lrattn.ops import tuning
from megatron_lrattn.ops.validation import check_envelope, check_norm


@triton.jit
def _key_sums(pf, q, qd, keycol, kp_ptr, kp_stride, rows64, rmask, rcols, r,
              PROJECTED: tl.constexpr):
    # (<k, k>, <k, q>) per row of P's key [BT]; sliced keys come from P's loaded rows pf
    # (fp32, [BT, BD]) with the query spread over the key columns qd (zero elsewhere), so
    # that no second key load and no layout of rank width is needed; a projected key is
    # loaded, [BT, BR], and returned as kf for the backward (pf otherwise)
    if PROJECTED:
        km = rmask[:, None] & (rcols < r)[None, :]
        kf = tl.load(kp_ptr + rows64[:, None] * kp_stride + rcols[None, :], mask=km,
                     other=0.0).to(tl.float32)
        s_kk = tl.sum(kf * kf, axis=1)
        s_kq = tl.sum(kf * q[None, :], axis=1)
    else:
        kf = pf
        s_kk = tl.sum(tl.where(keycol[None, :], pf * pf, 0.0), axis=1)
        s_kq = tl.sum(pf * qd[None, :], axis=1)
    return s_kk, s_kq, kf


@triton.jit
def _weights(s_kk, s_kq, lse, r, eps, scale):
    # from the key's row sums and lse, each [BT]: rstd, l_P, a_o = e^(lse-m)/sum, a_p = 1-a_o
    rstd = 1.0 / tl.sqrt(s_kk / r + eps)
    l_p = scale * rstd * s_kq
    m = tl.maximum(lse, l_p)
    w_o = tl.exp(lse - m)
    w_p = tl.exp(l_p - m)
    a_o = w_o / (w_o + w_p)
    return rstd, l_p, a_o, 1.0 - a_o


@triton.jit
def _rms_norm(h, w_ptr, cols, d, norm_eps, act_dtype):
    # y = RMS-normalised h times w, fp32 (h rounded to the activation dtype first, as the
    # unfused read stores it)
    hr = h.to(act_dtype).to(tl.float32)
    nrstd = 1.0 / tl.sqrt(tl.sum(hr * hr, axis=1) / d + norm_eps)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    return hr * nrstd[:, None] * w[None, :]


@triton.jit
def merge_fwd_kernel(o_ptr, o_stride, lse_ptr, p_ptr, p_stride, kp_ptr, kp_stride, q_ptr,
                     h_ptr, y_ptr, y_stride, pn_ptr, w_ptr, T, d, r, eps, scale, norm_eps,
                     PROJECTED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     BR: tl.constexpr, UPDATE: tl.constexpr, NORM: tl.constexpr):
    # UPDATE: the partial sum is p + y, written to pn (rounded as the add would be) and merged
    # NORM: the output is RMSNorm(h) * w of the merged read h rounded to the activation dtype
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    m2 = rmask[:, None] & (cols < d)[None, :]
    keycol = (cols >= d - r) & (cols < d)
    q = tl.load(q_ptr + rcols, mask=rcols < r, other=0.0).to(tl.float32)
    qd = tl.load(q_ptr + (cols - (d - r)), mask=keycol, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + rows64[:, None] * o_stride + cols[None, :], mask=m2, other=0.0)
    pv = tl.load(p_ptr + rows64[:, None] * p_stride + cols[None, :], mask=m2, other=0.0)
    lse = tl.load(lse_ptr + rows64, mask=rmask, other=0.0)
    if UPDATE:
        yv = tl.load(y_ptr + rows64[:, None] * y_stride + cols[None, :], mask=m2, other=0.0)
        pv = (pv.to(tl.float32) + yv.to(tl.float32)).to(pn_ptr.dtype.element_ty)
        tl.store(pn_ptr + rows64[:, None] * d + cols[None, :], pv, mask=m2)
    pf = pv.to(tl.float32)
    s_kk, s_kq, kf = _key_sums(pf, q, qd, keycol, kp_ptr, kp_stride, rows64, rmask, rcols, r,
                               PROJECTED)
    rstd, l_p, a_o, a_p = _weights(s_kk, s_kq, lse, r, eps, scale)
    h = a_o[:, None] * o.to(tl.float32) + a_p[:, None] * pf
    if NORM:
        h = _rms_norm(h, w_ptr, cols, d, norm_eps, h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows64[:, None] * d + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_rows(tb, T, d, o_ptr, o_stride, lse_ptr, p_ptr, p_stride, g_ptr, g_stride, gp_ptr,
              gp_stride, cols, BT: tl.constexpr, ADD_GP: tl.constexpr):
    # the backward's loads for token block tb (masked off past the last block): g, out, P,
    # P's own gradient (g again without ADD_GP) and lse
    rows = tb * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    m2 = rmask[:, None] & (cols < d)[None, :]
    g = tl.load(g_ptr + rows64[:, None] * g_stride + cols[None, :], mask=m2, other=0.0)
    o = tl.load(o_ptr + rows64[:, None] * o_stride + cols[None, :], mask=m2, other=0.0)
    pv = tl.load(p_ptr + rows64[:, None] * p_stride + cols[None, :], mask=m2, other=0.0)
    if ADD_GP:
        gp = tl.load(gp_ptr + rows64[:, None] * gp_stride + cols[None, :], mask=m2, other=0.0)
    else:
        gp = g
    lse = tl.load(lse_ptr + rows64, mask=rmask, other=0.0)
    return g, o, pv, gp, lse


@triton.jit
def merge_bwd_kernel(o_ptr, o_stride, lse_ptr, p_ptr, p_stride, kp_ptr, kp_stride, q_ptr,
                     g_ptr, g_stride, do_ptr, dlse_ptr, dp_ptr, dkp_ptr, gq_part_ptr, gp_ptr,
                     gp_stride, w_ptr, dw_part_ptr, T, d, r, eps, scale, norm_eps, n_blocks,
                     PROJECTED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     BR: tl.constexpr, ADD_GP: tl.constexpr, NORM: tl.constexpr,
                     PREFETCH: tl.constexpr):
    # ADD_GP: the partial sum's own gradient (its later uses) is added to the merge's, so
    # that dp is the gradient of both summands of P = p + y
    # NORM: g is the gradient of RMSNorm(h) * w; h is recomputed from out and P (it is not
    # stored), g is turned into dL/dh and the weight gradient is summed per program.
    # Every row sum of the norm comes from the loaded rows alone (h not rounded), in the
    # same round of reductions as the key's (block fwd+bwd 3.27 ms against 3.60 ms with the
    # norm's row sums taken first; one H200, d=2048, S=9, K=6, fused updates and norms)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    keycol = (cols >= d - r) & (cols < d)
    q = tl.load(q_ptr + rcols, mask=rcols < r, other=0.0).to(tl.float32)
    qd = tl.load(q_ptr + (cols - (d - r)), mask=keycol, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    # the query's gradient: over the rank tile for projected keys, over the key columns of
    # the row tile for sliced ones
    if PROJECTED:
        gq = tl.zeros([BR], tl.float32)
    else:
        gq = tl.zeros([BD], tl.float32)
    dw = tl.zeros([BD], tl.float32)
    if PREFETCH:
        g, o, pv, gpv, lse = _bwd_rows(pid, T, d, o_ptr, o_stride, lse_ptr, p_ptr, p_stride,
                                       g_ptr, g_stride, gp_ptr, gp_stride, cols, BT, ADD_GP)
    for tb in range(pid, n_blocks, nprog):
        rows = tb * BT + tl.arange(0, BT)
        rmask = rows < T
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & (cols < d)[None, :]
        if PREFETCH:
            # the next block's loads are in flight while this one is computed and stored
            g_n, o_n, pv_n, gpv_n, lse_n = _bwd_rows(
                tb + nprog, T, d, o_ptr, o_stride, lse_ptr, p_ptr, p_stride, g_ptr, g_stride,
                gp_ptr, gp_stride, cols, BT, ADD_GP)
        else:
            g, o, pv, gpv, lse = _bwd_rows(tb, T, d, o_ptr, o_stride, lse_ptr, p_ptr, p_stride,
                                           g_ptr, g_stride, gp_ptr, gp_stride, cols, BT, ADD_GP)
        gf = g.to(tl.float32)
        pf = pv.to(tl.float32)
        of = o.to(tl.float32)
        s_kk, s_kq, kf = _key_sums(pf, q, qd, keycol, kp_ptr, kp_stride, rows64, rmask, rcols,
                                   r, PROJECTED)
        rstd, l_p, a_o, a_p = _weights(s_kk, s_kq, lse, r, eps, scale)
        if NORM:
            # expanded: h = a_o out + a_p P (unrounded), so every row sum is a sum over loaded
            # rows only (<o,o>, <o,P>, <P,P>, <gw,o>, <gw,P>), independent of the key's
            # reductions; dL/dh = n gw - b h, n = 1/rms(h), b = n^3 <gw, h> / d
            gw = gf * w[None, :]
            s_oo = tl.sum(of * of, axis=1)
            s_op = tl.sum(of * pf, axis=1)
            s_pp = tl.sum(pf * pf, axis=1)
            s_go = tl.sum(gw * of, axis=1)
            s_gp = tl.sum(gw * pf, axis=1)
            s_hh = a_o * a_o * s_oo + 2.0 * a_o * a_p * s_op + a_p * a_p * s_pp
            nrstd = 1.0 / tl.sqrt(s_hh / d + norm_eps)
            b = nrstd * nrstd * nrstd * (a_o * s_go + a_p * s_gp) / d
            h = a_o[:, None] * of + a_p[:, None] * pf
            dw += tl.sum(gf * h * nrstd[:, None], axis=0)
            gf = nrstd[:, None] * gw - b[:, None] * h
            dot_o = nrstd * s_go - b * (a_o * s_oo + a_p * s_op)
            dot_p = nrstd * s_gp - b * (a_o * s_op + a_p * s_pp)
        else:
            dot_o = tl.sum(gf * of, axis=1)
            dot_p = tl.sum(gf * pf, axis=1)
        # two-source softmax: dlse = a_o a_p (<g, out> - <g, P>), dl_P = -dlse
        dlse = a_o * a_p * (dot_o - dot_p)
        dl_p = -dlse
        c = rstd * rstd * l_p / r * dl_p
        dq = scale * rstd * dl_p
        dp = a_p[:, None] * gf
        if PROJECTED:
            dk = dq[:, None] * q[None, :] - kf * c[:, None]
            tl.store(dkp_ptr + rows64[:, None] * r + rcols[None, :],
                     dk.to(dkp_ptr.dtype.element_ty), mask=rmask[:, None] & (rcols < r)[None, :])
            gq += tl.sum(dq[:, None] * kf, axis=0)
        else:
            dk = dq[:, None] * qd[None, :] - pf * c[:, None]
            dp += tl.where(keycol[None, :], dk, 0.0)
            gq += tl.sum(dq[:, None] * pf, axis=0)
        if ADD_GP:
            dp += gpv.to(tl.float32)
        tl.store(do_ptr + rows64[:, None] * d + cols[None, :],
                 (a_o[:, None] * gf).to(do_ptr.dtype.element_ty), mask=m2)
        tl.store(dp_ptr + rows64[:, None] * d + cols[None, :], dp.to(dp_ptr.dtype.element_ty),
                 mask=m2)
        tl.store(dlse_ptr + rows64, dlse, mask=rmask)
        if PREFETCH:
            g, o, pv, gpv, lse = g_n, o_n, pv_n, gpv_n, lse_n
    if PROJECTED:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + rcols, gq, mask=rcols < r)
    else:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + (cols - (d - r)), gq, mask=keycol)
    if NORM:
        tl.store(dw_part_ptr + pid.to(tl.int64) * d + cols, dw, mask=cols < d)


KERNELS = (merge_fwd_kernel, merge_bwd_kernel)


def launch(d: int, r: int, T: int):
    """(settings, tile constexprs) of both merge kernels at width d, key rank r, T tokens."""
    cfg = tuning.merge(d, T)
    return cfg, dict(BT=cfg.tokens, BD=tu.pow2(d),
                     BR=tu.key_tile(r, max(cfg.warps, cfg.bwd_warps)))


def _merge_fwd(q, eps, scale, out, lse, partial, pkey, update, norm_w=None, norm_eps=0.0):
    T, d = partial.shape
    r = q.shape[0]
    h = tu.empty((T, d), partial.dtype, partial.device)
    pn = tu.empty((T, d), partial.dtype, partial.device) if update is not None else None
    projected = pkey is not None
    if T:
        cfg, tiles = launch(d, r, T)
        kp = pkey if projected else partial
        y = update if update is not None else partial
        merge_fwd_kernel[(triton.cdiv(T, cfg.tokens),)](
            out, out.stride(0), lse, partial, partial.stride(0), kp, kp.stride(0), q, h,
            y, y.stride(0), pn if pn is not None else h,
            norm_w if norm_w is not None else q, T, d, r, eps, scale, norm_eps,
            PROJECTED=projected, UPDATE=update is not None, NORM=norm_w is not None,
            num_warps=cfg.warps, **tiles)
    return h, pn


def _merge_bwd(q, eps, scale, out, lse, partial, pkey, grad_h, grad_p, need_gq, norm_w=None,
               norm_eps=0.0):
    T, d = partial.shape
    r = q.shape[0]
    dev = partial.device
    projected = pkey is not None
    norm = norm_w is not None
    do = tu.empty((T, d), out.dtype, dev)
    dp = tu.empty((T, d), partial.dtype, dev)
    dlse = tu.empty((T,), torch.float32, dev)
    dkp = tu.empty((T, r), pkey.dtype, dev) if projected else None
    if T == 0:
        gw = torch.zeros_like(norm_w) if norm else None
        return torch.zeros_like(q), do, dlse, dp, dkp, gw
    g = tu.rows(grad_h, d)
    gp = tu.rows(grad_p, d) if grad_p is not None else g
    cfg, tiles = launch(d, r, T)
    n_blocks = triton.cdiv(T, cfg.tokens)
    nprog = tu.programs(n_blocks, dev, cfg.programs_per_sm)
    parts = tu.empty((nprog, r), torch.float32, dev)
    w_parts = tu.empty((nprog, d), torch.float32, dev) if norm else parts
    kp = pkey if projected else partial
    merge_bwd_kernel[(nprog,)](
        out, out.stride(0), lse, partial, partial.stride(0), kp, kp.stride(0), q,
        g, g.stride(0), do, dlse, dp, dkp if projected else dp, parts, gp, gp.stride(0),
        norm_w if norm else q, w_parts, T, d, r, eps, scale, norm_eps, n_blocks,
        PROJECTED=projected, ADD_GP=grad_p is not None, NORM=norm, PREFETCH=cfg.prefetch,
        num_warps=cfg.bwd_warps, **tiles)
    gq = parts.sum(0).to(q.dtype) if need_gq else None
    gw = w_parts.sum(0).to(norm_w.dtype) if norm else None
    return gq, do, dlse, dp, dkp, gw


class _DepthMergeTriton(torch.autograd.Function):
    """Online-softmax merge on flattened [T, d] rows, optionally followed by RMSNorm;
    grads for out, lse, P, key, query (and the norm weight)."""

    @staticmethod
    def forward(ctx, query, eps, scale, norm_eps, out, lse, partial, pkey, norm_w):
        q = query.contiguous()
        h, _ = _merge_fwd(q, eps, scale, out, lse, partial, pkey, None, norm_w, norm_eps)
        ctx.save_for_backward(q, out, lse, partial, pkey, norm_w)
        ctx.eps, ctx.scale, ctx.norm_eps = eps, scale, norm_eps
        return h

    @staticmethod
    def backward(ctx, grad_h):
        q, out, lse, partial, pkey, norm_w = ctx.saved_tensors
        gq, do, dlse, dp, dkp, gw = _merge_bwd(q, ctx.eps, ctx.scale, out, lse, partial, pkey,
                                               grad_h, None, ctx.needs_input_grad[0], norm_w,
                                               ctx.norm_eps)
        return (gq, None, None, None, do, dlse, dp, dkp, gw)


class _DepthMergeUpdateTriton(torch.autograd.Function):
    """P = partial + update formed, written and merged in one pass (optionally followed by
    RMSNorm); the backward adds P's own gradient to the merge's in the same pass and
    returns it for both summands."""

    @staticmethod
    def forward(ctx, query, eps, scale, norm_eps, out, lse, partial, update, pkey, norm_w):
        q = query.contiguous()
        h, pn = _merge_fwd(q, eps, scale, out, lse, partial, pkey, update, norm_w, norm_eps)
        ctx.save_for_backward(q, out, lse, pn, pkey, norm_w)
        ctx.eps, ctx.scale, ctx.norm_eps = eps, scale, norm_eps
        return h, pn

    @staticmethod
    def backward(ctx, grad_h, grad_p):
        q, out, lse, pn, pkey, norm_w = ctx.saved_tensors
        gq, do, dlse, dp, dkp, gw = _merge_bwd(q, ctx.eps, ctx.scale, out, lse, pn, pkey,
                                               grad_h, grad_p, ctx.needs_input_grad[0], norm_w,
                                               ctx.norm_eps)
        return (gq, None, None, None, do, dlse, dp, dp, dkp, gw)


def depth_merge_triton(
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
    """Fused phase-2 merge of one site's phase-1 result with the partial sum P.

    Args:
        out: [..., d] phase-1 output (bf16, fp16 or fp32).
        lse: [...] phase-1 log-sum-exp (fp32).
        partial: [..., d] partial sum of the block, dtype of ``out``.
        query: [r] query of the site.
        partial_key: None for sliced keys (last r columns of P) or [..., r].
        eps: epsilon of the key RMS normalisation.
        scale: logit scale tau.
        norm_weight: [d] weight of the next sub-layer's RMSNorm; when given the result is
            ``RMSNorm(h) * norm_weight`` (h rounded to the activation dtype, then normalised
            in fp32), and h itself is never written: the backward recomputes it.
        norm_eps: that RMSNorm's epsilon (> 0; needed with ``norm_weight``).

    Returns:
        Tensor [..., d] in the dtype of ``partial``: h, or its RMSNorm.

    Raises:
        ValueError: outside the envelope (``validation.check_envelope``), or a norm weight
            that is not [d].
    """
    check_envelope([out, partial], query, None if partial_key is None else [partial_key])
    shape = partial.shape
    d, r = shape[-1], query.shape[-1]
    neps = check_norm(norm_weight, norm_eps, partial, "depth_merge_triton")
    h = _DepthMergeTriton.apply(
        query, eps, scale, neps, tu.rows(out, d), lse.reshape(-1).float().contiguous(),
        tu.rows(partial, d), tu.rows(partial_key, r) if partial_key is not None else None,
        norm_weight.contiguous() if norm_weight is not None else None)
    return h.reshape(shape)


def depth_merge_update_triton(
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
    """Fused partial-sum update and phase-2 merge: P = partial + update, then the merge of
    the site's phase-1 result with P, in one pass (5 row transfers instead of 6 forward, 6
    instead of 8 backward; with the next RMSNorm fused, 5 and 6 instead of 7 and 9, and h is
    not kept for the norm's backward).

    Args:
        out, lse, query, eps, scale, norm_weight, norm_eps: as in ``depth_merge_triton``.
        partial: [..., d] partial sum before this sub-layer's output.
        update: [..., d] the sub-layer output added to it (dtype of ``partial``).
        partial_key: None for sliced keys (the last r columns of P) or the projected key of
            the updated P, [..., r].

    Returns:
        (h, P): the merged read [..., d] (its RMSNorm with ``norm_weight``) and the updated
        partial sum [..., d], both in the dtype of ``partial``; P equals
        ``partial + update`` bit for bit.
    """
    check_envelope([out, partial, update], query,
                   None if partial_key is None else [partial_key])
    shape = partial.shape
    d, r = shape[-1], query.shape[-1]
    neps = check_norm(norm_weight, norm_eps, partial, "depth_merge_update_triton")
    h, pn = _DepthMergeUpdateTriton.apply(
        query, eps, scale, neps, tu.rows(out, d), lse.reshape(-1).float().contiguous(),
        tu.rows(partial, d), tu.rows(update, d),
        tu.rows(partial_key, r) if partial_key is not None else None,
        norm_weight.contiguous() if norm_weight is not None else None)
    return h.reshape(shape), pn.reshape(shape)
