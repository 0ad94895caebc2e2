"""Fused Triton phase 1 of the two-phase block schedule: K depth reads over S sources.

    s_ki = scale * <q_k, RMS(k_i)>,   out_k = sum_i softmax_i(s_ki) v_i,   lse_k = logsumexp_i s_ki

``depth_read_multi_triton`` runs the width-chunked passes of ``lrattn_kernels.multi_chunked``
by default (``TUNE["multi_impl"]`` = 4); the kernels in this file are the earlier phase 1
(3: 3-D tiles, 2: 2-D tiles), kept selectable for comparison. In those, one program owns ``BT`` tokens times the padded width ``BD`` and all K queries (padded to
``BK``): it streams every source once, computes the K logits from the key tile and keeps K
online-softmax accumulators [BT, BK, BD] in fp32. Sources, outputs and output gradients go
through pointer tables (``lrattn_kernels.depth_read``), so nothing is stacked. The backward
handles gradients of both ``out`` and ``lse`` (derivation in ``kernels/README.md``); it
streams the sources twice (exact delta_k first), keeps per-program [K, r] query-gradient
partials (persistent grid, fixed order) and reduces them in a second step: no atomics.
Saved for backward: input references and ``lse`` [K, T] fp32.

Envelope (``ValueError`` outside it): that of ``depth_read`` plus 1 <= K; queries are split
into groups of at most ``MAX_TILE // next_pow2(d)`` per kernel call (each group reads the
sources once).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lrattn_kernels import depth_read as _dr
from lrattn_kernels import multi_chunked as _mc
from lrattn_kernels.depth_read import _check_envelope, _load_value, _rows, _tables

# fp32 accumulator elements per program (BT * BK * BD); d=2048 with K<=8 fits one group
MAX_TILE = 16384


@triton.jit
def _key_tile(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, rcols, d, r,
              PROJECTED: tl.constexpr):
    # kf: [BT, BR] fp32 key rows of source i (sliced: the last r columns of the value)
    km = rmask[:, None] & (rcols < r)[None, :]
    if PROJECTED:
        k_ptr = tl.load(k_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
        kf = tl.load(k_ptr + rows64[:, None] * tl.load(ks_tab + i) + rcols[None, :], mask=km,
                     other=0.0)
    else:
        v_ptr = tl.load(v_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
        kf = tl.load(v_ptr + rows64[:, None] * tl.load(vs_tab + i) + (rcols + (d - r))[None, :],
                     mask=km, other=0.0)
    return kf.to(tl.float32)


@triton.jit
def _src(i, live, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, m2, cols, rcols, d,
         r, PROJECTED: tl.constexpr):
    # (v [BT, BD], kf [BT, BR]) of source i; nothing is read unless ``live``
    v = _load_value(i, v_tab, vs_tab, vref, rows64, m2 & live, cols)
    kf = _key_tile(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask & live, rcols, d,
                   r, PROJECTED)
    return v, kf


@triton.jit
def _ring_init(S, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, m2, cols, rcols, d,
               r, PROJECTED: tl.constexpr, DEPTH: tl.constexpr):
    # tiles of sources 0..DEPTH-1 issued ahead (unused slots alias slot 1, nothing read)
    v1, k1 = _src(0, DEPTH >= 1, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, m2,
                  cols, rcols, d, r, PROJECTED)
    v2, k2 = v1, k1
    v3, k3 = v1, k1
    if DEPTH >= 2:
        v2, k2 = _src(tl.minimum(1, S - 1), 1 < S, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                      rows64, rmask, m2, cols, rcols, d, r, PROJECTED)
    if DEPTH >= 3:
        v3, k3 = _src(tl.minimum(2, S - 1), 2 < S, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                      rows64, rmask, m2, cols, rcols, d, r, PROJECTED)
    return v1, k1, v2, k2, v3, k3


@triton.jit
def _ring_next(i, S, v1, k1, v2, k2, v3, k3, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
               rmask, m2, cols, rcols, d, r, PROJECTED: tl.constexpr, DEPTH: tl.constexpr):
    # source i's tiles; the ring advances by one and issues source i + DEPTH (prefetch: one
    # program per SM holds K accumulators, so loads in flight are what limits bandwidth)
    j = tl.minimum(i + DEPTH, S - 1)
    live = i + DEPTH < S
    if DEPTH == 0:
        v, kf = _src(i, True, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, m2,
                     cols, rcols, d, r, PROJECTED)
    else:
        v, kf = v1, k1
        if DEPTH == 1:
            v1, k1 = _src(j, live, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask,
                          m2, cols, rcols, d, r, PROJECTED)
        elif DEPTH == 2:
            v1, k1 = v2, k2
            v2, k2 = _src(j, live, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask,
                          m2, cols, rcols, d, r, PROJECTED)
        else:
            v1, k1 = v2, k2
            v2, k2 = v3, k3
            v3, k3 = _src(j, live, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask,
                          m2, cols, rcols, d, r, PROJECTED)
    return v, kf, v1, k1, v2, k2, v3, k3


@triton.jit
def _logits(kf, qk, r, eps, scale):
    # s: [BT, BK] scaled logits of every query; rstd: [BT] inverse key RMS
    rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
    s = tl.sum(kf[:, None, :] * qk[None, :, :], axis=2) * (scale * rstd)[:, None]
    return s, rstd


@triton.jit
def _fwd_kernel(v_tab, vs_tab, k_tab, ks_tab, o_tab, vref, kref, oref, q_ptr, lse_ptr,
                T, S, K, d, r, eps, scale,
                PROJECTED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BD: tl.constexpr, BR: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    kk = tl.arange(0, BK)
    kmask = kk < K
    m2 = rmask[:, None] & (cols < d)[None, :]
    qk = tl.load(q_ptr + kk[:, None] * r + rcols[None, :],
                 mask=kmask[:, None] & (rcols < r)[None, :], other=0.0).to(tl.float32)
    m = tl.full([BT, BK], float("-inf"), tl.float32)
    l = tl.zeros([BT, BK], tl.float32)
    acc = tl.zeros([BT, BK, BD], tl.float32)
    # PREFETCH: sources issued ahead of the one being reduced (0..3)
    v1, k1, v2, k2, v3, k3 = _ring_init(S, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                                          rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
    for i in range(S):
        v, kf, v1, k1, v2, k2, v3, k3 = _ring_next(
            i, S, v1, k1, v2, k2, v3, k3, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
            rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
        s, rstd = _logits(kf, qk, r, eps, scale)
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha[:, :, None] + p[:, :, None] * v[:, None, :]
        l = l * alpha + p
        m = m_new
    out = acc / l[:, :, None]
    o_ptr = tl.load(o_tab + kk, mask=kmask, other=0).to(tl.pointer_type(oref.dtype.element_ty))
    m3 = m2[:, None, :] & kmask[None, :, None]
    tl.store(o_ptr[None, :, None] + rows64[:, None, None] * d + cols[None, None, :],
             out.to(oref.dtype.element_ty), mask=m3)
    tl.store(lse_ptr + kk[None, :].to(tl.int64) * T + rows64[:, None], m + tl.log(l),
             mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _bwd_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, g_tab, gs_tab, vref, kref, gref,
                q_ptr, lse_ptr, dlse_ptr, gq_part_ptr, T, S, K, d, r, eps, scale, n_blocks,
                PROJECTED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BD: tl.constexpr, BR: tl.constexpr, PREFETCH: tl.constexpr):
    # persistent: program p owns token blocks p, p + P, ...; one [K, r] grad_q partial each
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    kk = tl.arange(0, BK)
    kmask = kk < K
    keycol = (cols >= d - r) & (cols < d)
    qk = tl.load(q_ptr + kk[:, None] * r + rcols[None, :],
                 mask=kmask[:, None] & (rcols < r)[None, :], other=0.0).to(tl.float32)
    g_ptr = tl.load(g_tab + kk, mask=kmask, other=0).to(tl.pointer_type(gref.dtype.element_ty))
    g_str = tl.load(gs_tab + kk, mask=kmask, other=0)
    gq = tl.zeros([BK, BR], tl.float32)
    for tb in range(pid, n_blocks, nprog):
        rows = tb * BT + tl.arange(0, BT)
        rmask = rows < T
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & (cols < d)[None, :]
        g = tl.load(g_ptr[None, :, None] + rows64[:, None, None] * g_str[None, :, None]
                    + cols[None, None, :], mask=m2[:, None, :] & kmask[None, :, None],
                    other=0.0).to(tl.float32)  # [BT, BK, BD]
        lk = rmask[:, None] & kmask[None, :]
        lidx = kk[None, :].to(tl.int64) * T + rows64[:, None]
        lse = tl.load(lse_ptr + lidx, mask=lk, other=0.0)
        dlse = tl.load(dlse_ptr + lidx, mask=lk, other=0.0)
        # delta_k = sum_i a_ki <g_k, v_i> = <g_k, out_k>, exact (fp32 over the sources)
        delta = tl.zeros([BT, BK], tl.float32)
        v1, k1, v2, k2, v3, k3 = _ring_init(S, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                                              rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
        for i in range(S):
            v, kf, v1, k1, v2, k2, v3, k3 = _ring_next(
                i, S, v1, k1, v2, k2, v3, k3, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
            s, rstd = _logits(kf, qk, r, eps, scale)
            delta += tl.exp(s - lse) * tl.sum(g * v[:, None, :], axis=2)
        v1, k1, v2, k2, v3, k3 = _ring_init(S, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                                              rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
        for i in range(S):
            v, kf, v1, k1, v2, k2, v3, k3 = _ring_next(
                i, S, v1, k1, v2, k2, v3, k3, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64,
                rmask, m2, cols, rcols, d, r, PROJECTED, PREFETCH)
            s, rstd = _logits(kf, qk, r, eps, scale)
            a = tl.exp(s - lse)
            ds = a * (tl.sum(g * v[:, None, :], axis=2) - delta + dlse)  # [BT, BK]
            dv = tl.sum(a[:, :, None] * g, axis=1)  # [BT, BD]
            # dk = rstd scale sum_k ds_k q_k - k rstd^2 / r sum_k ds_k s_k
            c = rstd * rstd / r * tl.sum(ds * s, axis=1)
            if PROJECTED:
                dk = (scale * rstd)[:, None] * tl.sum(ds[:, :, None] * qk[None, :, :], axis=1)
                dk = dk - kf * c[:, None]
                dk_ptr = tl.load(dk_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
                tl.store(dk_ptr + rows64[:, None] * r + rcols[None, :],
                         dk.to(kref.dtype.element_ty), mask=rmask[:, None] & (rcols < r)[None, :])
            else:
                qd = tl.load(q_ptr + kk[:, None] * r + (cols - (d - r))[None, :],
                             mask=kmask[:, None] & keycol[None, :], other=0.0).to(tl.float32)
                dk = (scale * rstd)[:, None] * tl.sum(ds[:, :, None] * qd[None, :, :], axis=1)
                dv += tl.where(keycol[None, :], dk - v * c[:, None], 0.0)
            dv_ptr = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
            tl.store(dv_ptr + rows64[:, None] * d + cols[None, :],
                     dv.to(vref.dtype.element_ty), mask=m2)
            gq += tl.sum((ds * (scale * rstd)[:, None])[:, :, None] * kf[:, None, :], axis=0)
    tl.store(gq_part_ptr + pid.to(tl.int64) * K * r + kk[:, None] * r + rcols[None, :], gq,
             mask=kmask[:, None] & (rcols < r)[None, :])


# --- 2-D variant (TUNE["multi_impl"] = 2): only [BT, BD] / [BT, BR] / [BT, BK] / [BK, BR]
# tiles and reductions, the shapes of the single-read kernel. The forward loops over the K
# queries outside the sources (the sources' tiles are re-read from L2 K times, HBM once);
# the backward keeps the sources outside and the queries inside (each g_k tile re-read per
# source). Written to take the 3-D tiles of the kernels above out of a GPU defect hunt
# (kernels/README.md, "Open defect"); same results, same saved tensors.


@triton.jit
def _fwd2d_kernel(v_tab, vs_tab, k_tab, ks_tab, o_tab, vref, kref, oref, q_ptr, lse_ptr,
                  T, S, K, d, r, eps, scale,
                  PROJECTED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                  BR: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    m2 = rmask[:, None] & (cols < d)[None, :]
    q_row = q_ptr
    l_row = lse_ptr
    o_ent = o_tab
    for k in range(K):
        q = tl.load(q_row + rcols, mask=rcols < r, other=0.0).to(tl.float32)
        m = tl.full([BT], float("-inf"), tl.float32)
        l = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BD], tl.float32)
        for i in range(S):
            v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
            kf = _key_tile(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, rcols,
                           d, r, PROJECTED)
            rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
            s = tl.sum(kf * q[None, :], axis=1) * (scale * rstd)
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            acc = acc * alpha[:, None] + p[:, None] * v
            l = l * alpha + p
            m = m_new
        o_ptr = tl.load(o_ent).to(tl.pointer_type(oref.dtype.element_ty))
        tl.store(o_ptr + rows64[:, None] * d + cols[None, :],
                 (acc / l[:, None]).to(oref.dtype.element_ty), mask=m2)
        tl.store(l_row + rows64, m + tl.log(l), mask=rmask)
        q_row += r
        l_row += T
        o_ent += 1


@triton.jit
def _bwd2d_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, g_tab, gs_tab, vref, kref,
                  gref, q_ptr, lse_ptr, dlse_ptr, gq_part_ptr, T, S, K, d, r, eps, scale,
                  n_blocks, PROJECTED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BD: tl.constexpr, BR: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    kk = tl.arange(0, BK)
    keycol = (cols >= d - r) & (cols < d)
    gq = tl.zeros([BK, BR], tl.float32)
    for tb in range(pid, n_blocks, nprog):
        rows = tb * BT + tl.arange(0, BT)
        rmask = rows < T
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & (cols < d)[None, :]
        # pass 1: delta[:, k] = sum_i a_ki <g_k, v_i> = <g_k, out_k>, exact
        delta = tl.zeros([BT, BK], tl.float32)
        for i in range(S):
            v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
            kf = _key_tile(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, rcols,
                           d, r, PROJECTED)
            rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
            q_row = q_ptr
            l_row = lse_ptr
            for k in range(K):
                q = tl.load(q_row + rcols, mask=rcols < r, other=0.0).to(tl.float32)
                s = tl.sum(kf * q[None, :], axis=1) * (scale * rstd)
                lse = tl.load(l_row + rows64, mask=rmask, other=0.0)
                g_ptr = tl.load(g_tab + k).to(tl.pointer_type(gref.dtype.element_ty))
                g = tl.load(g_ptr + rows64[:, None] * tl.load(gs_tab + k) + cols[None, :],
                            mask=m2, other=0.0).to(tl.float32)
                x = tl.exp(s - lse) * tl.sum(g * v, axis=1)
                delta = tl.where(kk[None, :] == k, delta + x[:, None], delta)
                q_row += r
                l_row += T
        # pass 2: ds_ki = a_ki (<g_k, v_i> - delta_k + dlse_k); dv_i, dk_i, grad q_k
        for i in range(S):
            v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
            kf = _key_tile(i, v_tab, vs_tab, k_tab, ks_tab, vref, kref, rows64, rmask, rcols,
                           d, r, PROJECTED)
            rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
            dv = tl.zeros([BT, BD], tl.float32)
            csum = tl.zeros([BT], tl.float32)
            if PROJECTED:
                dkq = tl.zeros([BT, BR], tl.float32)
            else:
                dkq = tl.zeros([BT, BD], tl.float32)
            q_row = q_ptr
            l_row = lse_ptr
            e_row = dlse_ptr
            for k in range(K):
                q = tl.load(q_row + rcols, mask=rcols < r, other=0.0).to(tl.float32)
                s = tl.sum(kf * q[None, :], axis=1) * (scale * rstd)
                a = tl.exp(s - tl.load(l_row + rows64, mask=rmask, other=0.0))
                g_ptr = tl.load(g_tab + k).to(tl.pointer_type(gref.dtype.element_ty))
                g = tl.load(g_ptr + rows64[:, None] * tl.load(gs_tab + k) + cols[None, :],
                            mask=m2, other=0.0).to(tl.float32)
                dk_ = tl.sum(tl.where(kk[None, :] == k, delta, 0.0), axis=1)
                ds = a * (tl.sum(g * v, axis=1) - dk_
                          + tl.load(e_row + rows64, mask=rmask, other=0.0))
                dv += a[:, None] * g
                csum += ds * s
                if PROJECTED:
                    dkq += ds[:, None] * q[None, :]
                else:
                    qd = tl.load(q_row + (cols - (d - r)), mask=keycol, other=0.0)
                    dkq += ds[:, None] * qd.to(tl.float32)[None, :]
                contrib = tl.sum((ds * (scale * rstd))[:, None] * kf, axis=0)
                gq = tl.where(kk[:, None] == k, gq + contrib[None, :], gq)
                q_row += r
                l_row += T
                e_row += T
            # dk = rstd scale sum_k ds_k q_k - k rstd^2 / r sum_k ds_k s_k
            c = rstd * rstd / r * csum
            if PROJECTED:
                dk = (scale * rstd)[:, None] * dkq - kf * c[:, None]
                dk_ptr = tl.load(dk_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
                tl.store(dk_ptr + rows64[:, None] * r + rcols[None, :],
                         dk.to(kref.dtype.element_ty), mask=rmask[:, None] & (rcols < r)[None, :])
            else:
                dv += tl.where(keycol[None, :], (scale * rstd)[:, None] * dkq - v * c[:, None],
                               0.0)
            dv_ptr = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
            tl.store(dv_ptr + rows64[:, None] * d + cols[None, :],
                     dv.to(vref.dtype.element_ty), mask=m2)
    tl.store(gq_part_ptr + pid.to(tl.int64) * K * r + kk[:, None] * r + rcols[None, :], gq,
             mask=(kk < K)[:, None] & (rcols < r)[None, :])


def _impl() -> int:
    """4: the width-chunked passes of ``lrattn_kernels.multi_chunked`` (default); 3: the
    3-D tiles below; 2: the 2-D variant (``TUNE["multi_impl"]``)."""
    return int(_dr.TUNE.get("multi_impl", 4))


def _tiles2d(d: int, r: int, K: int, T: int) -> Tuple[int, int, int, int, int]:
    bd = _dr.pow2(d)
    bk = _dr.pow2(K)
    br = max(16, _dr.pow2(r))
    bt = max(1, min(_dr.TUNE.get("multi2d_tile", 2048) // bd, _dr.pow2(max(T, 1))))
    warps = _dr.TUNE.get("multi2d_warps", max(4, min(16, bt * bd // 1024)))
    return bt, bk, bd, br, warps


def _tiles(d: int, r: int, K: int, T: int) -> Tuple[int, int, int, int, int]:
    """(BT, BK, BD, BR, num_warps) for one group of K queries."""
    bd = _dr.pow2(d)
    # "multi_min_bk": pad the query axis of the tiles to at least this many (masked) rows
    bk = max(_dr.pow2(K), _dr.TUNE.get("multi_min_bk", 1))
    br = max(16, _dr.pow2(r))
    # One token per program unless "multi_tile" asks for more. Compiled with triton 3.6 on an
    # H200, programs of several tokens (BT > 1: d <= 1024 at K <= 8) returned wrong value
    # and key gradients (relative errors 1.6-3.0 at the tiny and study-25m block shapes, and
    # a training curve far off per-site reads); the same kernels at BT = 1 pass and train
    # like per-site reads (benchmarks/results/two_phase_diag_2026-12-01.log). The Triton
    # interpreter gets BT > 1 right, so tests/test_two_phase_ops.py keeps it covered there.
    bt = max(1, min(_dr.TUNE.get("multi_tile", bk * bd) // (bk * bd),
                    _dr.pow2(max(T, 1))))
    warps = _dr.TUNE.get("multi_warps", max(4, min(16, bt * bk * bd // 1024)))
    return bt, bk, bd, br, warps


def _prefetch(backward: bool = False) -> int:
    """Sources issued ahead (0..3). On by default, unlike the single read: one program per
    SM holds the K accumulators, so without it one source row per SM is in flight. The
    backward is at its register limit already. Not yet measured on a GPU."""
    if backward:
        return int(_dr.TUNE.get("multi_bwd_prefetch", 1))
    return int(_dr.TUNE.get("multi_prefetch", 2))


def _programs(n_blocks: int, dev: torch.device) -> int:
    if dev.type == "cuda":
        return min(n_blocks, _dr._sm_count(dev.index) * _dr.TUNE.get("multi_ctas_per_sm", 2))
    return min(n_blocks, 2)


def _forward(vs, ks, queries, eps, scale, split):
    T, d = vs[0].shape
    K, r = queries.shape
    dev = vs[0].device
    if split:
        outs = [_dr._alloc((T, d), vs[0].dtype, dev) for _ in range(K)]
    else:
        outs = _dr._alloc((K, T, d), vs[0].dtype, dev)
    lse = _dr._alloc((K, T), torch.float32, dev)
    if T == 0:
        return outs, lse
    projected = len(ks) > 0
    if projected:
        (v_tab, vs_tab), (k_tab, ks_tab), (o_tab, _) = _tables(vs, ks, list(outs))
    else:
        (v_tab, vs_tab), (o_tab, _) = _tables(vs, list(outs))
        k_tab, ks_tab = v_tab, vs_tab
    if _impl() == 2:
        bt, _, bd, br, warps = _tiles2d(d, r, K, T)
        _fwd2d_kernel[(triton.cdiv(T, bt),)](
            v_tab, vs_tab, k_tab, ks_tab, o_tab, vs[0], ks[0] if projected else vs[0],
            outs[0], queries, lse, T, len(vs), K, d, r, eps, scale,
            PROJECTED=projected, BT=bt, BD=bd, BR=br, num_warps=warps)
        return outs, lse
    bt, bk, bd, br, warps = _tiles(d, r, K, T)
    _fwd_kernel[(triton.cdiv(T, bt),)](
        v_tab, vs_tab, k_tab, ks_tab, o_tab, vs[0], ks[0] if projected else vs[0], outs[0],
        queries, lse, T, len(vs), K, d, r, eps, scale,
        PROJECTED=projected, BT=bt, BK=bk, BD=bd, BR=br, PREFETCH=_prefetch(), num_warps=warps)
    return outs, lse


def _backward(vs, ks, queries, lse, grads, dlse, eps, scale):
    T, d = vs[0].shape
    K, r = queries.shape
    dev = vs[0].device
    projected = len(ks) > 0
    dvs = [_dr._alloc((T, d), v.dtype, dev) for v in vs]
    dks = [_dr._alloc((T, r), k.dtype, dev) for k in ks]
    if T == 0:
        return torch.zeros_like(queries), [t.zero_() for t in dvs], [t.zero_() for t in dks]
    gs = [_rows(g, d) for g in grads]
    two_d = _impl() == 2
    bt, bk, bd, br, warps = (_tiles2d if two_d else _tiles)(d, r, K, T)
    n_blocks = triton.cdiv(T, bt)
    nprog = _programs(n_blocks, dev)
    parts = _dr._alloc((nprog, K, r), torch.float32, dev)
    if projected:
        (v_tab, vs_tab), (k_tab, ks_tab), (dv_tab, _), (dk_tab, _), (g_tab, gs_tab) = \
            _tables(vs, ks, dvs, dks, gs)
    else:
        (v_tab, vs_tab), (dv_tab, _), (g_tab, gs_tab) = _tables(vs, dvs, gs)
        k_tab, ks_tab, dk_tab = v_tab, vs_tab, dv_tab
    kref = ks[0] if projected else vs[0]
    if two_d:
        _bwd2d_kernel[(nprog,)](
            v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, g_tab, gs_tab, vs[0], kref, gs[0],
            queries, lse, dlse.contiguous(), parts, T, len(vs), K, d, r, eps, scale, n_blocks,
            PROJECTED=projected, BT=bt, BK=bk, BD=bd, BR=br, num_warps=warps)
        return parts.sum(0), dvs, dks
    _bwd_kernel[(nprog,)](
        v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, g_tab, gs_tab, vs[0], kref, gs[0],
        queries, lse, dlse.contiguous(), parts, T, len(vs), K, d, r, eps, scale, n_blocks,
        PROJECTED=projected, BT=bt, BK=bk, BD=bd, BR=br, PREFETCH=_prefetch(backward=True),
        num_warps=warps)
    return parts.sum(0), dvs, dks


class _DepthReadMultiTriton(torch.autograd.Function):
    """Phase 1 on flattened [T, d] sources; outputs K tensors (split) or one [K, T, d]."""

    @staticmethod
    def forward(ctx, queries, eps, scale, split, nv, *tensors):
        vs, ks = list(tensors[:nv]), list(tensors[nv:])
        q = queries.contiguous()
        outs, lse = _forward(vs, ks, q, eps, scale, split)
        ctx.save_for_backward(q, lse, *tensors)
        ctx.eps, ctx.scale, ctx.nv, ctx.split = eps, scale, nv, split
        return (*outs, lse) if split else (outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        q, lse, *rest = ctx.saved_tensors
        vs, ks = rest[:ctx.nv], rest[ctx.nv:]
        douts, dlse = grads[:-1], grads[-1]
        if not ctx.split:
            douts = list(douts[0].unbind(0))
        gq, dvs, dks = _backward(vs, ks, q, lse, douts, dlse, ctx.eps, ctx.scale)
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
    """Fused phase 1: K depth reads over the same S sources, each source read once.

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
        ValueError: outside the envelope of ``depth_read_triton``.
    """
    _check_envelope(values, queries[0], keys)
    shape = values[0].shape
    d, r = shape[-1], queries.shape[-1]
    vs = [_rows(v, d) for v in values]
    ks = [_rows(k, r) for k in keys] if keys is not None else []
    impl = _impl()
    default_group = {4: _mc.MAX_GROUP, 3: max(1, MAX_TILE // _dr.pow2(d)), 2: 16}[impl]
    group = _dr.TUNE.get("multi_group", default_group)
    fn = _mc.MultiChunked if impl == 4 else _DepthReadMultiTriton
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for k0 in range(0, queries.shape[0], group):
        res = fn.apply(queries[k0:k0 + group], eps, scale, split, len(vs), *vs, *ks)
        outs += [o.reshape(shape) for o in res[:-1]] if split else [res[0]]
        lses.append(res[-1])
    K = queries.shape[0]
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses)).reshape(K, *shape[:-1])
    if split:
        return outs, lse
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(K, *shape), lse
