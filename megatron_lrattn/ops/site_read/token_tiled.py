"""Token-tiled Triton kernels of the depth read (d < 512 by default): one program owns ``BT``
tokens times the whole padded width ``BD`` and streams the sources through a pointer table.

    s_i = scale * <q, RMS(k_i)>,   a = softmax_i(s) (fp32),   out = sum_i a_i v_i

Launchers: ``megatron_lrattn.ops.site_read.fused``; derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols):
    # v: [BT, BD] rows of source i in fp32 (masked-off rows/columns read nothing)
    v_ptr = tl.load(v_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
    v_stride = tl.load(vs_tab + i)
    v = tl.load(v_ptr + rows64[:, None] * v_stride + cols[None, :], mask=m2, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _key(i, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, r, eps, scale):
    # projected key i: kf [BT, BR] fp32, logit s and inverse RMS rstd [BT]
    k_ptr = tl.load(k_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
    k_stride = tl.load(ks_tab + i)
    km = rmask[:, None] & (rcols < r)[None, :]
    kf = tl.load(k_ptr + rows64[:, None] * k_stride + rcols[None, :], mask=km, other=0.0)
    kf = kf.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
    s = scale * tl.sum(kf * qk[None, :], axis=1) * rstd
    return kf, s, rstd


@triton.jit
def _stats(i, v, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, keycol, r, eps, scale,
           PROJECTED: tl.constexpr):
    # kf: [BT, BR] projected key (v itself when sliced), logit s and inverse RMS rstd [BT]
    if PROJECTED:
        kf, s, rstd = _key(i, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, r, eps, scale)
    else:
        kf = v
        ss = tl.sum(tl.where(keycol[None, :], v * v, 0.0), axis=1)
        rstd = 1.0 / tl.sqrt(ss / r + eps)
        s = scale * tl.sum(v * qk[None, :], axis=1) * rstd
    return kf, s, rstd


@triton.jit
def _source(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, m2, cols, rcols, rmask,
            qk, keycol, r, eps, scale, PROJECTED: tl.constexpr):
    # v: [BT, BD] fp32 source rows; kf: [BT, BR] projected key (v itself when sliced)
    v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
    kf, s, rstd = _stats(i, v, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, keycol, r, eps,
                         scale, PROJECTED)
    return v, kf, s, rstd


@triton.jit
def query_columns(q_ptr, cols, rcols, d, r, PROJECTED: tl.constexpr):
    # qk: the query laid over the key columns (zero elsewhere); keycol: key-column mask
    keycol = (cols >= d - r) & (cols < d)
    if PROJECTED:
        qk = tl.load(q_ptr + rcols, mask=rcols < r, other=0.0).to(tl.float32)
    else:
        qk = tl.load(q_ptr + (cols - (d - r)), mask=keycol, other=0.0).to(tl.float32)
    return qk, keycol


@triton.jit
def depth_read_token_tiled_fwd_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr, out_ptr,
                                      lse_ptr, T, S, d, r, eps, scale,
                                      PROJECTED: tl.constexpr, BT: tl.constexpr,
                                      BD: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    m2 = rmask[:, None] & (cols < d)[None, :]
    qk, keycol = query_columns(q_ptr, cols, rcols, d, r, PROJECTED)
    m = tl.full([BT], float("-inf"), tl.float32)
    l = tl.zeros([BT], tl.float32)
    acc = tl.zeros([BT, BD], tl.float32)
    for i in range(S):
        v, kf, s, rstd = _source(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, m2, cols,
                                 rcols, rmask, qk, keycol, r, eps, scale, PROJECTED)
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha[:, None] + p[:, None] * v
        l = l * alpha + p
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + rows64[:, None] * d + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m2)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=rmask)


@triton.jit
def depth_read_token_tiled_bwd_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vref, kref,
                                      q_ptr, lse_ptr, g_ptr, g_stride, o_ptr, da_ptr,
                                      gq_part_ptr, T, S, d, r, eps, scale, n_blocks,
                                      PROJECTED: tl.constexpr, HAS_OUT: tl.constexpr,
                                      BT: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # persistent: program p owns token blocks p, p + P, ...; one grad_q partial per program
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    qk, keycol = query_columns(q_ptr, cols, rcols, d, r, PROJECTED)
    gq = tl.zeros_like(qk)
    for tb in range(pid, n_blocks, nprog):
        rows = tb * BT + tl.arange(0, BT)
        rmask = rows < T
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & (cols < d)[None, :]
        g = tl.load(g_ptr + rows64[:, None] * g_stride + cols[None, :], mask=m2, other=0.0)
        g = g.to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        if PROJECTED:
            # values once (dv = a g, exact delta, da_i parked in fp32 scratch), then keys only
            delta = tl.zeros([BT], tl.float32)
            for i in range(S):
                v, kf, s, rstd = _source(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                                         m2, cols, rcols, rmask, qk, keycol, r, eps, scale,
                                         PROJECTED)
                a = tl.exp(s - lse)
                da = tl.sum(g * v, axis=1)
                delta += a * da
                tl.store(da_ptr + i * T + rows64, da, mask=rmask)
                dv_ptr = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
                tl.store(dv_ptr + rows64[:, None] * d + cols[None, :],
                         (a[:, None] * g).to(vref.dtype.element_ty), mask=m2)
            tl.debug_barrier()
            for i in range(S):
                kf, s, rstd = _key(i, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, r, eps,
                                   scale)
                a = tl.exp(s - lse)
                ds = a * (tl.load(da_ptr + i * T + rows64, mask=rmask, other=0.0) - delta)
                # dk = rstd * ds * (scale q - khat * s / r)
                dk = (rstd * ds)[:, None] * (scale * qk[None, :] - kf * (rstd * s / r)[:, None])
                gq += tl.sum((scale * ds * rstd)[:, None] * kf, axis=0)
                dk_ptr = tl.load(dk_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
                km = rmask[:, None] & (rcols < r)[None, :]
                tl.store(dk_ptr + rows64[:, None] * r + rcols[None, :],
                         dk.to(kref.dtype.element_ty), mask=km)
        else:
            # delta = sum_j a_j <g, v_j> = <g, out>
            if HAS_OUT:
                o = tl.load(o_ptr + rows64[:, None] * d + cols[None, :], mask=m2, other=0.0)
                delta = tl.sum(g * o.to(tl.float32), axis=1)
            else:
                delta = tl.zeros([BT], tl.float32)
                for i in range(S):
                    v, kf, s, rstd = _source(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                                             rows64, m2, cols, rcols, rmask, qk, keycol, r,
                                             eps, scale, PROJECTED)
                    delta += tl.exp(s - lse) * tl.sum(g * v, axis=1)
            # with HAS_OUT, delta carries the output's rounding; grad_q is corrected after
            # the loop with the exact delta (dex) and ck = sum_i a_i khat_i
            dex = tl.zeros([BT], tl.float32)
            ck = tl.zeros_like(qk[None, :] * delta[:, None])
            for i in range(S):
                v, kf, s, rstd = _source(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                                         m2, cols, rcols, rmask, qk, keycol, r, eps, scale,
                                         PROJECTED)
                a = tl.exp(s - lse)
                da = tl.sum(g * v, axis=1)
                ds = a * (da - delta)
                if HAS_OUT:
                    dex += a * da
                    ck += (a * rstd)[:, None] * v
                dk = (rstd * ds)[:, None] * (scale * qk[None, :] - v * (rstd * s / r)[:, None])
                gq += tl.sum((scale * ds * rstd)[:, None] * v, axis=0)
                dv = a[:, None] * g + tl.where(keycol[None, :], dk, 0.0)
                dv_ptr = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
                tl.store(dv_ptr + rows64[:, None] * d + cols[None, :],
                         dv.to(vref.dtype.element_ty), mask=m2)
            if HAS_OUT:
                gq += tl.sum((scale * (delta - dex))[:, None] * ck, axis=0)
    if PROJECTED:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + rcols, gq, mask=rcols < r)
    else:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + (cols - (d - r)), gq, mask=keycol)
