"""Triton kernels of phase 1 in width-chunked passes (K read sites, S completed sources).

    s_ik = scale * <q_k, RMS(key_i)>,  lse_k = logsumexp_i s_ik,
    out_k = sum_i exp(s_ik - lse_k) v_i

The logits need only the r key columns, so they are computed once per block in their own
pass and kept as per-token fp32 scalars; the d-wide work then splits into column chunks, so
a program holds K chunk accumulators instead of K whole rows:

forward   ``phase1_logits_kernel``  keys -> s [T, S, K], rstd [T, S] (fp32 scalars)
          ``phase1_lse_kernel``     per token: lse [K, T]
          ``phase1_values_kernel``  one token x BC columns per program: out_k += a_ik v_i
backward  ``phase1_dots_kernel``    one token x BC1 columns: partial <g_k, v_i> [T, NC1, S, K],
                                    and on the columns without key columns dv_i = sum_k a_ik g_k
          ``phase1_coef_kernel``    per token: a_ik, w_ik = scale rstd_i ds_ik, c_i
          ``phase1_dvalues_kernel`` chunks holding sliced key columns (persistent over
                                    tokens): dv_i plus the key gradient, query-gradient partials
          ``phase1_dkeys_kernel``   projected keys: dk_i and the query-gradient partials

Each source row is read once per pass, with the next source's row in flight while one is
reduced. Launchers: ``phase1.py``; derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_chunk(tab, st_tab, i, ref, row64, cols, cmask, A: tl.constexpr):
    # [BC] columns ``cols`` of row ``row64`` of table entry i, in fp32
    p = tl.load(tab + i).to(tl.pointer_type(ref.dtype.element_ty)) + row64 * tl.load(st_tab + i)
    ptrs = p + cols
    if A:  # 16-byte vectors (alignment checked on the host)
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, 16), 16)
    return tl.load(ptrs, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _next_row(i, ahead, v_tab, vs_tab, vref, t, cols, cmask, S, A: tl.constexpr):
    # source i's row (``ahead``, loaded one step earlier) and source i + 1's row, issued now
    j = i + 1
    nxt = _row_chunk(v_tab, vs_tab, tl.minimum(j, S - 1), vref, t, cols, cmask & (j < S), A)
    return ahead, nxt


@triton.jit
def phase1_logits_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr, s_ptr, rstd_ptr,
                         T, S, K, d, r, eps, scale,
                         PROJECTED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         RC: tl.constexpr, KA: tl.constexpr, PREC: tl.constexpr):
    # program (token tile, source i): the K logits of BT tokens from [BT, RC] x [RC, BK]
    # products over RC-column chunks of the keys (no cross-thread reduction per query)
    pid = tl.program_id(0)
    i = tl.program_id(1)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    rc = tl.arange(0, RC)
    kk = tl.arange(0, BK)
    kmask = kk < K
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


@triton.jit
def phase1_lse_kernel(s_ptr, lse_ptr, T, S, K, BS: tl.constexpr, BK: tl.constexpr):
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
def phase1_values_kernel(v_tab, vs_tab, o_tab, vref, oref, s_ptr, lse_ptr, T, S, K, d,
                         BK: tl.constexpr, BC: tl.constexpr, A: tl.constexpr):
    # program (chunk, token): out_k[t, chunk] = sum_i a_ik v_i[t, chunk] for all k
    c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    cols = c * BC + tl.arange(0, BC)
    cmask = cols < d
    kk = tl.arange(0, BK)
    kmask = kk < K
    lse = tl.load(lse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
    acc = tl.zeros([BK, BC], tl.float32)
    ahead = _row_chunk(v_tab, vs_tab, 0, vref, t, cols, cmask, A)
    for i in range(S):
        v, ahead = _next_row(i, ahead, v_tab, vs_tab, vref, t, cols, cmask, S, A)
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
def phase1_dots_kernel(v_tab, vs_tab, g_tab, gs_tab, dv_tab, vref, gref, s_ptr, lse_ptr,
                       dots_ptr, T, S, K, d, NC1, dv_end,
                       BK: tl.constexpr, BC1: tl.constexpr, A: tl.constexpr, DV: tl.constexpr):
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
    ahead = _row_chunk(v_tab, vs_tab, 0, vref, t, cols, cmask, A)
    if DV:
        dmask = cmask & (cols < dv_end)  # (dv_end may pass d: projected keys, c0 = nc)
        lse = tl.load(lse_ptr + kk.to(tl.int64) * T + t, mask=kmask, other=0.0)
        s_n = tl.load(s_ptr + t * S * K + kk, mask=kmask, other=float("-inf"))
    for i in range(S):
        v, ahead = _next_row(i, ahead, v_tab, vs_tab, vref, t, cols, cmask, S, A)
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
def phase1_coef_kernel(s_ptr, rstd_ptr, lse_ptr, dlse_ptr, dots_ptr, coef_ptr, cc_ptr, T, S, K,
                       NC1, r, scale, BK: tl.constexpr, BS: tl.constexpr):
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
    # a_ik, w_ik [BK] and c_i of source min(i, S - 1) at token t (see phase1_coef_kernel)
    j = tl.minimum(i, S - 1)
    row = coef_ptr + (t * S + j) * (2 * BK)
    return tl.load(row + kk), tl.load(row + BK + kk), tl.load(cc_ptr + t * S + j)


@triton.jit
def phase1_dvalues_kernel(v_tab, vs_tab, g_tab, gs_tab, dv_tab, vref, gref, q_ptr, coef_ptr,
                          cc_ptr, gq_part_ptr, T, S, K, d, r, c0,
                          BK: tl.constexpr, BC: tl.constexpr, A: tl.constexpr):
    # program (chunk c0 + c, p) of a chunk holding sliced key columns, persistent over
    # tokens p, p + P, ...: dv_i = sum_k a_ik g_k plus, on the key columns, the key gradient
    # dk_i = sum_k w_ik q_k - c_i k_i; [K, chunk] query-gradient partials. a, w and c come
    # from the coefficient rows, one source ahead like the source rows
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
        ahead = _row_chunk(v_tab, vs_tab, 0, vref, t, cols, keycol, A)
        a_n, w_n, e_n = _coef_row(coef_ptr, cc_ptr, t, 0, S, kk, BK)
        for i in range(S):
            # v: the key columns of source i's chunk (zeros elsewhere)
            v, ahead = _next_row(i, ahead, v_tab, vs_tab, vref, t, cols, keycol, S, A)
            a, w, c_i = a_n, w_n, e_n
            a_n, w_n, e_n = _coef_row(coef_ptr, cc_ptr, t, i + 1, S, kk, BK)
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
def phase1_dkeys_kernel(k_tab, ks_tab, dk_tab, kref, q_ptr, coef_ptr, cc_ptr, gq_part_ptr, T,
                        S, K, r, BK: tl.constexpr, BR: tl.constexpr):
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
