"""Phase 1 of the two-phase block schedule in width-chunked passes (the default phase 1).

    s_ik = scale * <q_k, RMS(key_i)>,  lse_k = logsumexp_i s_ik,
    out_k = sum_i exp(s_ik - lse_k) v_i                  (K read sites, S completed sources)

The logits need only the r key columns, so they are computed once per block in their own
pass and kept as per-token fp32 scalars; the d-wide work then splits into column chunks, so
a program holds K chunk accumulators instead of K whole rows (the register limit of the
kernels in ``depth_read_multi``, which keep one program per SM):

forward   ``_logits_kernel``  keys -> s [T, S, K], rstd [T, S], lse [K, T] (fp32 scalars)
          ``_values_kernel``  one token x BC columns per program: out_k += a_ik v_i
backward  ``_dots_kernel``    one token x BC1 columns: partial <g_k, v_i> [T, NC1, S, K],
                              and on the columns without key columns dv_i = sum_k a_ik g_k
          ``_coef_kernel``    per token: a_ik, w_ik = scale rstd_i ds_ik and c_i (fp32
                              scalars [T, S, 2, BK] and [T, S]) from s, rstd, lse and the dots
          ``_dvalues_kernel`` chunks holding sliced key columns (persistent over tokens):
                              dv_i plus the key gradient, query-gradient partials
          ``_dkeys_kernel``   projected keys: dk_i and the query-gradient partials

Each source row is read once per pass; nothing [T, d]-sized is kept in fp32 (the saved
tensors are the inputs, s, rstd and lse). Query gradients: fixed-order per-program partials
reduced afterwards, no atomics. Derivation: ``kernels/README.md`` (two-phase block
schedule, "Phase 1").
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lrattn_kernels import depth_read as _dr
from lrattn_kernels.depth_read import _alloc, _tables, pow2

# queries per kernel call: K accumulators of BC columns are held per program
MAX_GROUP = 8


@triton.jit
def _row_chunk(tab, st_tab, i, ref, row64, cols, cmask, A: tl.constexpr):
    # [BC] columns ``cols`` of row ``row64`` of table entry i, in fp32
    p = tl.load(tab + i).to(tl.pointer_type(ref.dtype.element_ty)) + row64 * tl.load(st_tab + i)
    ptrs = p + cols
    if A:  # 16-byte vectors (alignment checked on the host, see depth_read._load_rows)
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), 16)
    return tl.load(ptrs, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _logits_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr, s_ptr, rstd_ptr, lse_ptr,
                   T, S, K, d, r, eps, scale,
                   PROJECTED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   RC: tl.constexpr, KA: tl.constexpr, PREC: tl.constexpr,
                   SPLIT: tl.constexpr):
    # BT tokens per program; the K logits of a source come from [BT, RC] x [RC, BK] products
    # over RC-column chunks of its keys (no cross-thread reduction per query). SPLIT: one
    # source per program (program_id(1)), lse left to _lse_kernel; else every source in
    # turn with an online max/sum for lse (one chunk load in flight per program: the pass
    # is bound by the chain of r/RC * S dependent loads)
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    rc = tl.arange(0, RC)
    kk = tl.arange(0, BK)
    kmask = kk < K
    m = tl.full([BT, BK], float("-inf"), tl.float32)
    l = tl.zeros([BT, BK], tl.float32)
    i0 = 0
    n = S
    if SPLIT:
        i0 = tl.program_id(1)
        n = 1
    for j in range(n):
        i = i0 + j
        if PROJECTED:
            base = tl.load(k_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
            rowp = base + rows64 * tl.load(ks_tab + i)
        else:
            base = tl.load(v_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
            rowp = base + rows64 * tl.load(vs_tab + i) + (d - r)
        ss = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BK], tl.float32)
        for r0 in range(0, r, RC):
            cm = (r0 + rc) < r
            ptrs = rowp[:, None] + (r0 + rc)[None, :]
            if KA:  # 16-byte vectors (alignment checked on the host)
                ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, 16])
            kf = tl.load(ptrs, mask=rmask[:, None] & cm[None, :], other=0.0).to(tl.float32)
            qt = tl.load(q_ptr + kk[None, :] * r + (r0 + rc)[:, None],
                         mask=kmask[None, :] & cm[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(kf * kf, axis=1)
            acc = tl.dot(kf, qt, acc, input_precision=PREC)
        rstd = 1.0 / tl.sqrt(ss / r + eps)
        s = acc * (scale * rstd)[:, None]
        tl.store(s_ptr + (rows64[:, None] * S + i) * K + kk[None, :], s,
                 mask=rmask[:, None] & kmask[None, :])
        tl.store(rstd_ptr + rows64 * S + i, rstd, mask=rmask)
        if not SPLIT:
            m_new = tl.maximum(m, s)
            l = l * tl.exp(m - m_new) + tl.exp(s - m_new)
            m = m_new
    if not SPLIT:
        tl.store(lse_ptr + kk[None, :].to(tl.int64) * T + rows64[:, None], m + tl.log(l),
                 mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _lse_kernel(s_ptr, lse_ptr, T, S, K, BS: tl.constexpr, BK: tl.constexpr):
    # token t: lse_k = logsumexp_i s_ik from the [S, K] logits
    t = tl.program_id(0).to(tl.int64)
    ii = tl.arange(0, BS)
    kk = tl.arange(0, BK)
    kmask = kk < K
    s2 = tl.load(s_ptr + (t * S + ii[:, None]) * K + kk[None, :],
                 mask=(ii < S)[:, None] & kmask[None, :], other=float("-inf"))
    m = tl.where(kmask, tl.max(s2, axis=0), 0.0)  # (padded queries: finite, not stored)
    lse = m + tl.log(tl.where(kmask, tl.sum(tl.exp(s2 - m[None, :]), axis=0), 1.0))
    tl.store(lse_ptr + kk.to(tl.int64) * T + t, lse, mask=kmask)


@triton.jit
def _ring_start(v_tab, vs_tab, vref, t, cols, cmask, S, A: tl.constexpr, PF: tl.constexpr):
    # rows of sources 0..PF-1 in flight (slots past PF alias slot 0, nothing extra read)
    v0 = _row_chunk(v_tab, vs_tab, 0, vref, t, cols, cmask, A)
    v1 = v0
    v2 = v0
    if PF >= 2:
        v1 = _row_chunk(v_tab, vs_tab, tl.minimum(1, S - 1), vref, t, cols, cmask & (1 < S), A)
    if PF >= 3:
        v2 = _row_chunk(v_tab, vs_tab, tl.minimum(2, S - 1), vref, t, cols, cmask & (2 < S), A)
    return v0, v1, v2


@triton.jit
def _ring_step(i, v0, v1, v2, v_tab, vs_tab, vref, t, cols, cmask, S, A: tl.constexpr,
               PF: tl.constexpr):
    # source i's row; the ring issues source i + PF (loads in flight are what a program of
    # one token row has to hide memory latency with)
    j = i + PF
    nxt = _row_chunk(v_tab, vs_tab, tl.minimum(j, S - 1), vref, t, cols, cmask & (j < S), A)
    cur = v0
    if PF == 1:
        v0 = nxt
    elif PF == 2:
        v0 = v1
        v1 = nxt
    else:
        v0 = v1
        v1 = v2
        v2 = nxt
    return cur, v0, v1, v2


@triton.jit
def _values_kernel(v_tab, vs_tab, o_tab, vref, oref, s_ptr, lse_ptr, T, S, K, d,
                   BK: tl.constexpr, BC: tl.constexpr, A: tl.constexpr, PF: tl.constexpr):
    # program (chunk, token): out_k[t, chunk] = sum_i a_ik v_i[t, chunk] for all k
    c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    cols = c * BC + tl.arange(0, BC)
    cmask = cols < d
    kk = tl.arange(0, BK)
    kmask = kk < K
    lse = tl.load(lse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
    acc = tl.zeros([BK, BC], tl.float32)
    v0, v1, v2 = _ring_start(v_tab, vs_tab, vref, t, cols, cmask, S, A, PF)
    for i in range(S):
        v, v0, v1, v2 = _ring_step(i, v0, v1, v2, v_tab, vs_tab, vref, t, cols, cmask, S, A, PF)
        # (the logits read one source ahead were 1% slower on one H200, 2026-12-02)
        a = tl.exp(tl.load(s_ptr + (t * S + i) * K + kk, mask=kmask, other=float("-inf")) - lse)
        acc += a[:, None] * v[None, :]
    op = tl.load(o_tab + kk, mask=kmask, other=0).to(tl.pointer_type(oref.dtype.element_ty))
    ptrs = op[:, None] + t * d + cols[None, :]
    if A:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, 16])
    tl.store(ptrs, acc.to(oref.dtype.element_ty), mask=kmask[:, None] & cmask[None, :])


@triton.jit
def _grad_chunk(g_tab, gs_tab, gref, t, cols, cmask, kk, kmask, A: tl.constexpr):
    # [BK, BC] fp32 columns ``cols`` of row t of the K output gradients
    gp = tl.load(g_tab + kk, mask=kmask, other=0).to(tl.pointer_type(gref.dtype.element_ty))
    ptrs = gp[:, None] + t * tl.load(gs_tab + kk, mask=kmask, other=0)[:, None] + cols[None, :]
    if A:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, 16])
    return tl.load(ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _dots_kernel(v_tab, vs_tab, g_tab, gs_tab, dv_tab, vref, gref, s_ptr, lse_ptr, dots_ptr,
                 T, S, K, d, NC1, dv_end,
                 BK: tl.constexpr, BC1: tl.constexpr, A: tl.constexpr, PF: tl.constexpr,
                 DV: tl.constexpr):
    # program (chunk, token): dots[t, chunk, i, k] = <g_k, v_i> over the chunk's columns;
    # DV: also dv_i = sum_k a_ik g_k on the chunk's columns below dv_end (the columns
    # without key columns, whose gradient needs no dots), from the g chunk already held
    c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    cols = c * BC1 + tl.arange(0, BC1)
    cmask = cols < d
    kk = tl.arange(0, BK)
    kmask = kk < K
    g = _grad_chunk(g_tab, gs_tab, gref, t, cols, cmask, kk, kmask, A)
    base = dots_ptr + (t * NC1 + c) * S * K
    v0, v1, v2 = _ring_start(v_tab, vs_tab, vref, t, cols, cmask, S, A, PF)
    if DV:
        dmask = cmask & (cols < dv_end)  # (dv_end may pass d: projected keys, c0 = nc)
        lse = tl.load(lse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
        s_n = tl.load(s_ptr + t * S * K + kk, mask=kmask, other=float("-inf"))
    for i in range(S):
        v, v0, v1, v2 = _ring_step(i, v0, v1, v2, v_tab, vs_tab, vref, t, cols, cmask, S, A, PF)
        if DV:
            s = s_n
            s_n = tl.load(s_ptr + (t * S + tl.minimum(i + 1, S - 1)) * K + kk, mask=kmask,
                          other=float("-inf"))
        tl.store(base + i * K + kk, tl.sum(g * v[None, :], axis=1), mask=kmask)
        if DV:
            dv = tl.sum(tl.exp(s - lse)[:, None] * g, axis=0)
            dp = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty)) + t * d + cols
            if A:
                dp = tl.max_contiguous(tl.multiple_of(dp, 16), 16)
            tl.store(dp, dv.to(vref.dtype.element_ty), mask=dmask)


@triton.jit
def _coef_kernel(s_ptr, rstd_ptr, lse_ptr, dlse_ptr, dots_ptr, coef_ptr, cc_ptr, T, S, K, NC1,
                 r, scale, BK: tl.constexpr, BS: tl.constexpr):
    # token t: every per-source scalar the gradient passes need, formed once:
    # coef[t, i, 0] = a_ik, coef[t, i, 1] = w_ik = scale rstd_i ds_ik ([BK] rows, zero past
    # K) and cc[t, i] = c_i = rstd_i^2 / r sum_k ds_ik s_ik
    t = tl.program_id(0).to(tl.int64)
    ii = tl.arange(0, BS)
    kk = tl.arange(0, BK)
    smask = ii < S
    kmask = kk < K
    m2 = smask[:, None] & kmask[None, :]
    lse = tl.load(lse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
    dlse = tl.load(dlse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
    s2 = tl.load(s_ptr + (t * S + ii[:, None]) * K + kk[None, :], mask=m2, other=float("-inf"))
    dots = tl.zeros_like(s2)
    for c in range(NC1):
        dots += tl.load(dots_ptr + ((t * NC1 + c) * S + ii[:, None]) * K + kk[None, :], mask=m2,
                        other=0.0)
    a = tl.exp(s2 - lse[None, :])  # zero on the masked entries
    delta = tl.sum(a * dots, axis=0)
    ds = a * (dots - delta[None, :] + dlse[None, :])
    rstd = tl.load(rstd_ptr + t * S + ii, mask=smask, other=0.0)
    c_i = rstd * rstd / r * tl.sum(ds * tl.where(m2, s2, 0.0), axis=1)
    row = coef_ptr + (t * S + ii[:, None]) * (2 * BK) + kk[None, :]
    tl.store(row, a, mask=smask[:, None])
    tl.store(row + BK, ds * (scale * rstd)[:, None], mask=smask[:, None])
    tl.store(cc_ptr + t * S + ii, c_i, mask=smask)


@triton.jit
def _coef_row(coef_ptr, cc_ptr, t, i, S, kk, BK: tl.constexpr):
    # a_ik, w_ik [BK] and c_i of source min(i, S - 1) at token t (see _coef_kernel)
    j = tl.minimum(i, S - 1)
    row = coef_ptr + (t * S + j) * (2 * BK)
    return tl.load(row + kk), tl.load(row + BK + kk), tl.load(cc_ptr + t * S + j)


@triton.jit
def _coef_ring_start(coef_ptr, cc_ptr, t, S, kk, BK: tl.constexpr, PF: tl.constexpr):
    # the coefficients of sources 0..PF-1 in flight, as _ring_start does for the rows
    a0, w0, c0 = _coef_row(coef_ptr, cc_ptr, t, 0, S, kk, BK)
    a1, w1, c1 = a0, w0, c0
    a2, w2, c2 = a0, w0, c0
    if PF >= 2:
        a1, w1, c1 = _coef_row(coef_ptr, cc_ptr, t, 1, S, kk, BK)
    if PF >= 3:
        a2, w2, c2 = _coef_row(coef_ptr, cc_ptr, t, 2, S, kk, BK)
    return a0, w0, c0, a1, w1, c1, a2, w2, c2


@triton.jit
def _coef_ring_step(i, a0, w0, c0, a1, w1, c1, a2, w2, c2, coef_ptr, cc_ptr, t, S, kk,
                    BK: tl.constexpr, PF: tl.constexpr):
    # source i's coefficients; issues those of source i + PF
    an, wn, cn = _coef_row(coef_ptr, cc_ptr, t, i + PF, S, kk, BK)
    a, w, c = a0, w0, c0
    if PF == 1:
        a0, w0, c0 = an, wn, cn
    elif PF == 2:
        a0, w0, c0 = a1, w1, c1
        a1, w1, c1 = an, wn, cn
    else:
        a0, w0, c0 = a1, w1, c1
        a1, w1, c1 = a2, w2, c2
        a2, w2, c2 = an, wn, cn
    return a, w, c, a0, w0, c0, a1, w1, c1, a2, w2, c2


@triton.jit
def _dvalues_kernel(v_tab, vs_tab, g_tab, gs_tab, dv_tab, vref, gref, q_ptr, coef_ptr, cc_ptr,
                    gq_part_ptr, T, S, K, d, r, c0,
                    BK: tl.constexpr, BC: tl.constexpr, A: tl.constexpr, PF: tl.constexpr):
    # program (chunk c0 + c, p) of a chunk holding sliced key columns, persistent over
    # tokens p, p + P, ...: dv_i = sum_k a_ik g_k plus, on the key columns, the key gradient
    # dk_i = sum_k w_ik q_k - c_i k_i; [K, chunk] query-gradient partials. a, w and c come
    # from the coefficient rows (_coef_kernel), PF sources ahead like the source rows
    c = c0 + tl.program_id(0)
    p = tl.program_id(1)
    nprog = tl.num_programs(1)
    cols = c * BC + tl.arange(0, BC)
    cmask = cols < d
    kk = tl.arange(0, BK)
    kmask = kk < K
    keycol = (cols >= d - r) & cmask
    qc = tl.load(q_ptr + kk[:, None] * r + (cols - (d - r))[None, :],
                 mask=kmask[:, None] & keycol[None, :], other=0.0).to(tl.float32)
    gq = tl.zeros([BK, BC], tl.float32)
    for tt in range(p, T, nprog):
        t = p.to(tl.int64) + (tt - p)  # int64 row index (also under the interpreter)
        g = _grad_chunk(g_tab, gs_tab, gref, t, cols, cmask, kk, kmask, A)
        v0, v1, v2 = _ring_start(v_tab, vs_tab, vref, t, cols, keycol, S, A, PF)
        a0, w0, e0, a1, w1, e1, a2, w2, e2 = _coef_ring_start(coef_ptr, cc_ptr, t, S, kk, BK, PF)
        for i in range(S):
            # v: the key columns of source i's chunk (zeros elsewhere)
            v, v0, v1, v2 = _ring_step(i, v0, v1, v2, v_tab, vs_tab, vref, t, cols, keycol, S,
                                       A, PF)
            a, w, c_i, a0, w0, e0, a1, w1, e1, a2, w2, e2 = _coef_ring_step(
                i, a0, w0, e0, a1, w1, e1, a2, w2, e2, coef_ptr, cc_ptr, t, S, kk, BK, PF)
            dk = tl.sum(w[:, None] * qc, axis=0) - v * c_i
            dv = tl.sum(a[:, None] * g, axis=0) + tl.where(keycol, dk, 0.0)
            gq += w[:, None] * v[None, :]
            dp = tl.load(dv_tab + i).to(tl.pointer_type(vref.dtype.element_ty)) + t * d + cols
            if A:
                dp = tl.max_contiguous(tl.multiple_of(dp, 16), 16)
            tl.store(dp, dv.to(vref.dtype.element_ty), mask=cmask)
    tl.store(gq_part_ptr + (p.to(tl.int64) * K + kk[:, None]) * r + (cols - (d - r))[None, :],
             gq, mask=kmask[:, None] & keycol[None, :])


@triton.jit
def _dkeys_kernel(k_tab, ks_tab, dk_tab, kref, q_ptr, coef_ptr, cc_ptr, gq_part_ptr, T, S, K, r,
                  BK: tl.constexpr, BR: tl.constexpr):
    # projected keys, persistent over tokens: dk_i[t] = sum_k w_ik q_k - c_i k_i and [K, r]
    # query-gradient partials (w and c from the coefficient rows)
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    rcols = tl.arange(0, BR)
    rm = rcols < r
    kk = tl.arange(0, BK)
    kmask = kk < K
    q = tl.load(q_ptr + kk[:, None] * r + rcols[None, :], mask=kmask[:, None] & rm[None, :],
                other=0.0).to(tl.float32)
    gq = tl.zeros([BK, BR], tl.float32)
    for tt in range(p, T, nprog):
        t = p.to(tl.int64) + (tt - p)  # int64 row index (also under the interpreter)
        for i in range(S):
            _, w, c_i = _coef_row(coef_ptr, cc_ptr, t, i, S, kk, BK)
            kp = tl.load(k_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
            kf = tl.load(kp + t * tl.load(ks_tab + i) + rcols, mask=rm, other=0.0).to(tl.float32)
            dk = tl.sum(w[:, None] * q, axis=0) - kf * c_i
            dkp = tl.load(dk_tab + i).to(tl.pointer_type(kref.dtype.element_ty))
            tl.store(dkp + t * r + rcols, dk.to(kref.dtype.element_ty), mask=rm)
            gq += w[:, None] * kf[None, :]
    tl.store(gq_part_ptr + (p.to(tl.int64) * K + kk[:, None]) * r + rcols[None, :], gq,
             mask=kmask[:, None] & rm[None, :])


def _tune(key: str, default: int) -> int:
    return int(_dr.TUNE.get(key, default))


def _chunk(d: int, key: str, default: int) -> int:
    """Column chunk of a pass (TUNE ``key``): a power of two, at most the padded width."""
    return max(16, min(pow2(_tune(key, default)), pow2(d)))


def _warps(key: str, bc: int) -> int:
    # default: 8 chunk columns per thread (16-byte bf16 vectors), at most 8 warps
    return _tune(key, max(1, min(8, bc // 256)))


def _aligned(groups: Sequence[Sequence[Tensor]], d: int) -> bool:
    """Whether every row of every tensor starts on 16 bytes and holds whole 16-byte vectors
    (then rows move in 16-byte vectors)."""
    ts = [t for g in groups for t in g]
    vec = 16 // ts[0].element_size()
    return (d % vec == 0 and all(t.data_ptr() % 16 == 0 and t.stride(0) % vec == 0 for t in ts)
            and all(t.element_size() == ts[0].element_size() for t in ts))


def _prefetch(key: str, default: int = 1) -> int:
    """Source rows a pass keeps in flight ahead of the one it works on (1..3). One
    everywhere (one H200, S=9, d=2048: forward 0.831 ms at one, 0.860 ms at three; block
    fwd+bwd with the key-gradient pass at one 2.302 / 3.190 ms against 2.389 / 3.495 ms at
    three, sliced r=d/4 / AttnRes, 2026-12-02)."""
    return max(1, min(3, _tune(key, default)))


def _programs(n: int, dev: torch.device, key: str, per_sm: int) -> int:
    if dev.type == "cuda":
        return max(1, min(n, _dr._sm_count(dev.index) * _tune(key, per_sm)))
    return max(1, min(n, 2))


def forward(vs: List[Tensor], ks: List[Tensor], q: Tensor, eps: float, scale: float,
            split: bool):
    """(outs, lse, s, rstd) of one query group; outs: K tensors [T, d] or one [K, T, d]."""
    T, d = vs[0].shape
    K, r = q.shape
    S = len(vs)
    dev = vs[0].device
    outs = ([_alloc((T, d), vs[0].dtype, dev) for _ in range(K)] if split
            else _alloc((K, T, d), vs[0].dtype, dev))
    lse = _alloc((K, T), torch.float32, dev)
    s = _alloc((T, S, K), torch.float32, dev)
    rstd = _alloc((T, S), torch.float32, dev)
    if T == 0:
        return outs, lse, s, rstd
    projected = len(ks) > 0
    out_list = list(outs)
    if projected:
        (v_tab, vs_tab), (k_tab, ks_tab), (o_tab, _) = _tables(vs, ks, out_list)
    else:
        (v_tab, vs_tab), (o_tab, _) = _tables(vs, out_list)
        k_tab, ks_tab = v_tab, vs_tab
    bk = pow2(K)
    # 128 tokens x 32 key columns per product, one program per token tile and source (one
    # H200, block forward S=9 d=2048, 2026-12-02: 0.794 / 1.074 ms at r = d/4 / d, against
    # 0.801 / 1.106 ms at 64 tokens, 0.849 / 1.282 ms at 32, 0.834 / 1.239 ms with 64-column
    # chunks, 0.820 / 1.180 ms with every source in one program)
    rc = _chunk(r, "mc_logit_chunk", 32)
    bt = max(16, min(_tune("mc_logit_tokens", 128), pow2(T)))
    keys = ks if projected else vs
    # the keys' rows start on 16 bytes (sliced: d - r elements into each value row)
    ka = _aligned([keys], r) and (projected or (d - r) % (16 // vs[0].element_size()) == 0)
    # bf16 / fp16 keys are exact in tf32, so tf32x3 (q split in two) is fp32-accurate there
    prec = "ieee" if vs[0].dtype == torch.float32 or _tune("mc_logit_ieee", 0) else "tf32x3"
    # mc_logit_split: one program per token tile and source, lse in a pass of its own
    split_src = bool(_tune("mc_logit_split", 1))
    _logits_kernel[(triton.cdiv(T, bt), S if split_src else 1)](
        v_tab, vs_tab, k_tab, ks_tab, vs[0], keys[0], q, s, rstd, lse,
        T, S, K, d, r, eps, scale, PROJECTED=projected, BT=bt, BK=max(16, bk), RC=rc, KA=ka,
        PREC=prec, SPLIT=split_src, num_warps=_tune("mc_logit_warps", 4))
    if split_src:
        _lse_kernel[(T,)](s, lse, T, S, K, BS=pow2(S), BK=bk, num_warps=1)
    # 512 columns, 2 warps (one H200, block S=9 d=2048, 2026-12-02: forward 0.766 / 1.044 ms
    # at r = d/4 / d against 0.784 / 1.061 ms with 1024 columns and 4 warps)
    bc = _chunk(d, "mc_chunk", 512)
    _values_kernel[(triton.cdiv(d, bc), T)](
        v_tab, vs_tab, o_tab, vs[0], out_list[0], s, lse, T, S, K, d, BK=bk, BC=bc,
        A=_aligned([vs, out_list], d), PF=_prefetch("mc_prefetch"),
        num_warps=_warps("mc_warps", bc))
    return outs, lse, s, rstd


def backward(vs: List[Tensor], ks: List[Tensor], q: Tensor, s: Tensor, rstd: Tensor,
             lse: Tensor, grads: Sequence[Tensor], dlse: Tensor, scale: float):
    """(grad of q [K, r] fp32, value gradients, projected-key gradients) of one group."""
    T, d = vs[0].shape
    K, r = q.shape
    S = len(vs)
    dev = vs[0].device
    projected = len(ks) > 0
    dvs = [_alloc((T, d), v.dtype, dev) for v in vs]
    dks = [_alloc((T, r), k.dtype, dev) for k in ks]
    if T == 0:
        return torch.zeros_like(q, dtype=torch.float32), [t.zero_() for t in dvs], \
            [t.zero_() for t in dks]
    gs = [_dr._rows(g.to(vs[0].dtype), d) for g in grads]
    dlse = dlse.float().contiguous()
    bk, bs = pow2(K), pow2(S)
    # one warp per 256 columns: the dots reduce within a warp (H200 block sweep, S=9: the
    # block's fwd+bwd 2.51 ms against 2.63 ms at 1024 columns / 4 warps); at most 8 chunks
    # per row, so the transient dot partials stay at 8 S K fp32 per token
    bc1 = _chunk(d, "mc_dots_chunk", max(256, pow2(d) // 8))
    nc1 = triton.cdiv(d, bc1)
    dots = _alloc((T, nc1, S, K), torch.float32, dev)
    groups = [vs, dvs, gs] + ([ks, dks] if projected else [])
    tabs = _tables(*groups)
    (v_tab, vs_tab), (dv_tab, _), (g_tab, gs_tab) = tabs[:3]
    aligned = _aligned([vs, dvs, gs], d)
    bc = _chunk(d, "mc_bwd_chunk", 256)
    nc = triton.cdiv(d, bc)
    c0 = nc if projected else (d - r) // bc  # chunks from c0 on hold sliced key columns
    # the dot pass also writes the value gradients of the columns below c0 (no key columns:
    # they need no dots), from the output-gradient chunks it holds
    _dots_kernel[(nc1, T)](
        v_tab, vs_tab, g_tab, gs_tab, dv_tab, vs[0], gs[0], s, lse, dots, T, S, K, d, nc1,
        c0 * bc, BK=bk, BC1=bc1, A=aligned, PF=_prefetch("mc_dots_prefetch"), DV=c0 > 0,
        num_warps=_warps("mc_dots_warps", bc1))
    # the per-source scalars of the gradient passes, once per token
    coef = _alloc((T, S, 2, bk), torch.float32, dev)
    cc = _alloc((T, S), torch.float32, dev)
    _coef_kernel[(T,)](s, rstd, lse, dlse, dots, coef, cc, T, S, K, nc1, r, scale, BK=bk, BS=bs,
                       num_warps=1)
    del dots
    nprog = _programs(T, dev, "mc_ctas_per_sm", 8)
    parts = _alloc((nprog, K, r), torch.float32, dev)
    if c0 < nc:
        _dvalues_kernel[(nc - c0, nprog)](
            v_tab, vs_tab, g_tab, gs_tab, dv_tab, vs[0], gs[0], q, coef, cc, parts, T, S, K, d, r,
            c0, BK=bk, BC=bc, A=aligned, PF=_prefetch("mc_keys_prefetch", 1),
            num_warps=_warps("mc_bwd_warps", bc))
    if projected:
        (k_tab, ks_tab), (dk_tab, _) = tabs[3:]
        _dkeys_kernel[(nprog,)](
            k_tab, ks_tab, dk_tab, ks[0], q, coef, cc, parts, T, S, K, r, BK=bk,
            BR=max(16, pow2(r)), num_warps=_tune("mc_keys_warps", 4))
    return parts.sum(0), dvs, dks


class MultiChunked(torch.autograd.Function):
    """One query group of phase 1 on flattened [T, d] sources (``depth_read_multi``'s
    default implementation); outputs K tensors (split) or one [K, T, d], then lse."""

    @staticmethod
    def forward(ctx, queries, eps, scale, split, nv, *tensors):
        vs, ks = list(tensors[:nv]), list(tensors[nv:])
        q = queries.contiguous()
        outs, lse, s, rstd = forward(vs, ks, q, eps, scale, split)
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
        gq, dvs, dks = backward(vs, ks, q, s, rstd, lse, douts, dlse, ctx.scale)
        gq = gq.to(q.dtype) if ctx.needs_input_grad[0] else None
        return (gq, None, None, None, None, *dvs, *dks)
