"""Source-tiled Triton kernels of the depth read (d >= 512 by default): one token row per
program and ``BL`` sources per step.

Every source loop is software-pipelined by hand: the rows of step i + 1 are loaded while step
i reduces, and the table entries of step i + 2 while those rows are in flight, so no step
waits on a pointer or a row that could have been asked for earlier (Triton's own pipeliner
waits for every outstanding copy before it may use a pointer read from the table). With
sliced keys the row sums of a step are one multi-operand reduction. Rows move in 16-byte
vectors where the host has checked the alignment (PA, SA, SK). Launchers:
``megatron_lrattn.ops.site_read.fused``; derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_lrattn.ops.site_read.token_tiled import query_columns


@triton.jit
def _tab_ptrs(tab, src, smask, ref):
    # typed pointers of entries src of a pointer table
    a = tl.load(tab + src, mask=smask, other=0)
    return a.to(tl.pointer_type(ref.dtype.element_ty))


@triton.jit
def _row_ptrs(src, smask, row64, tab, st_tab, ref):
    # [BL] pointers to row ``row64`` of the table's tensors src (strides from st_tab)
    st = tl.load(st_tab + src, mask=smask, other=0)
    return _tab_ptrs(tab, src, smask, ref) + row64 * st


@triton.jit
def _src_ptrs(base, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref, BL: tl.constexpr,
              VALS: tl.constexpr, KEYS: tl.constexpr):
    # row pointers of sources base..base+BL-1 (values and/or keys), their indices and mask
    src = base + tl.arange(0, BL)
    smask = src < S
    # (a group not asked for gets the other's pointers as a placeholder, never loaded)
    if VALS:
        vp = _row_ptrs(src, smask, row64, v_tab, vs_tab, vref)
        kp = vp
    if KEYS:
        kp = _row_ptrs(src, smask, row64, k_tab, ks_tab, kref)
        if not VALS:
            vp = kp
    return vp, kp, src, smask


@triton.jit
def _load_rows(rp, smask, cols, cmask, A: tl.constexpr):
    # [BL, BW] rows at the row pointers rp, in their own dtype (masked rows read zeros).
    # A: every row pointer is 16-byte aligned and holds whole 16-byte vectors (checked on
    # the host): declared so that rows move in 16-byte vectors. The compiler cannot see
    # through pointers read from a table, and the hint must sit in the function that loads.
    ptrs = rp[:, None] + cols[None, :]
    if A:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, 16])
    return tl.load(ptrs, mask=smask[:, None] & cmask[None, :], other=0.0)


@triton.jit
def _src_rows(vp, kp, smask, cols, cmask, rcols, r, VALS: tl.constexpr, KEYS: tl.constexpr,
              PA: tl.constexpr, SA: tl.constexpr, SK: tl.constexpr):
    # the value and/or key rows of one step, in their own dtype (a group not asked for
    # gets the other's rows as a placeholder)
    if VALS:
        v = _load_rows(vp, smask, cols, cmask, PA > 1 and SA > 1)
        kf = v
    if KEYS:
        kf = _load_rows(kp, smask, rcols, rcols < r, PA > 1 and SK > 1)
        if not VALS:
            v = kf
    return v, kf


@triton.jit
def _store_rows(tab, src, smask, ref, row64, width, cols, cmask, x, PA: tl.constexpr,
                SA: tl.constexpr):
    # x [BL, BW] into row ``row64`` of the table's tensors (contiguous, row stride width)
    p = _tab_ptrs(tab, src, smask, ref)
    ptrs = p[:, None] + row64 * width + cols[None, :]
    if PA > 1 and SA > 1:  # 16-byte vectors (see _load_rows)
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, PA]), [1, 16])
    tl.store(ptrs, x.to(ref.dtype.element_ty), mask=smask[:, None] & cmask[None, :])


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _sliced_sums(v, g, qk, keycol, r, eps, scale, WITH_G: tl.constexpr):
    # sliced keys, every row sum of a step in one reduction (one cross-warp exchange
    # instead of two or three): logits s, inverse key RMS rstd and (WITH_G) da = <g, v>
    vq = v * qk[None, :]
    vv = tl.where(keycol[None, :], v * v, 0.0)
    if WITH_G:
        sq, ss, da = tl.reduce((vq, vv, g[None, :] * v), 1, _add3)
    else:
        sq, ss = tl.reduce((vq, vv), 1, _add2)
        da = sq
    rstd = 1.0 / tl.sqrt(ss / r + eps)
    return scale * sq * rstd, rstd, da


@triton.jit
def _key_stats(kf, qk, r, eps, scale):
    # logits s and inverse key RMS rstd of key rows kf, [BL] (finite on masked rows)
    rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
    s = scale * tl.sum(kf * qk[None, :], axis=1) * rstd
    return s, rstd


@triton.jit
def _fwd_step(v, kf, smask, qk, keycol, r, eps, scale, m, l, acc, PROJECTED: tl.constexpr):
    # one online-softmax step over a tile of sources (rows in their own dtype)
    v = v.to(tl.float32)
    if PROJECTED:
        s, rstd = _key_stats(kf.to(tl.float32), qk, r, eps, scale)
    else:
        s, rstd, _ = _sliced_sums(v, v, qk, keycol, r, eps, scale, False)
    s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    l = l * alpha + tl.sum(p, axis=0)
    return m_new, l, acc


@triton.jit
def depth_read_source_tiled_fwd_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr,
                                       out_ptr, lse_ptr, T, S, d, r, eps, scale,
                                       PROJECTED: tl.constexpr, BL: tl.constexpr,
                                       BD: tl.constexpr, BR: tl.constexpr, PA: tl.constexpr,
                                       SA: tl.constexpr, SK: tl.constexpr):
    row64 = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < d
    rcols = tl.arange(0, BR)
    qk, keycol = query_columns(q_ptr, cols, rcols, d, r, PROJECTED)
    m = tl.max(tl.full([BL], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BL], tl.float32), axis=0)
    acc = tl.zeros([BD], tl.float32)
    vp, kp, src, sm = _src_ptrs(0, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref, BL,
                                True, PROJECTED)
    v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, True, PROJECTED, PA, SA, SK)
    vp, kp, src, sm_n = _src_ptrs(BL, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                                  BL, True, PROJECTED)
    for base in tl.range(0, S, BL, num_stages=1):
        v_n, kf_n = _src_rows(vp, kp, sm_n, cols, cmask, rcols, r, True, PROJECTED, PA, SA, SK)
        vp, kp, src, sm_nn = _src_ptrs(base + 2 * BL, S, row64, v_tab, vs_tab, k_tab, ks_tab,
                                       vref, kref, BL, True, PROJECTED)
        m, l, acc = _fwd_step(v, kf, sm, qk, keycol, r, eps, scale, m, l, acc, PROJECTED)
        v, kf, sm, sm_n = v_n, kf_n, sm_n, sm_nn
    tl.store(out_ptr + row64 * d + cols, (acc / l).to(out_ptr.dtype.element_ty), mask=cmask)
    tl.store(lse_ptr + row64, m + tl.log(l))


@triton.jit
def _bwd_step(MODE: tl.constexpr, v, kf, src, smask, row64, T, d, dv_tab, dk_tab, vref, kref,
              da_ptr, cols, cmask, rcols, qk, keycol, r, eps, scale, g, gk, lse, delta, gq,
              dex, ck, HAS_OUT: tl.constexpr, KC: tl.constexpr, PA: tl.constexpr,
              SA: tl.constexpr, SK: tl.constexpr):
    # one step of a backward pass over a tile of sources (rows in their own dtype):
    # MODE 0: delta = sum_i a_i <g, v_i> (sliced keys without a saved output);
    # MODE 1: sliced keys, dv (value and key parts in one store) and the query gradient;
    # MODE 2: projected keys, pass 1: dv = a g, <g, v_i> parked in scratch, exact delta;
    # MODE 3: projected keys, pass 2: dk and the query gradient from the keys alone.
    # KC (sliced keys, modes 0 and 1): the key columns arrive as a row of their own (kf,
    # [BL, BR], read d - r elements into each value row), so the query, its gradient and
    # the correction are r wide instead of the padded row; dv is stored in two parts, the
    # value columns (a g) and the key columns (a gk + dk)
    if MODE == 3:
        kf = kf.to(tl.float32)
        s, rstd = _key_stats(kf, qk, r, eps, scale)
        a = tl.where(smask, tl.exp(s - lse), 0.0)
        da = tl.load(da_ptr + src.to(tl.int64) * T + row64, mask=smask, other=0.0)
        ds = a * (da - delta)
        dk = (rstd * ds)[:, None] * (scale * qk[None, :] - kf * (rstd * s / r)[:, None])
        _store_rows(dk_tab, src, smask, kref, row64, r, rcols, rcols < r, dk, PA, SK)
        gq += tl.sum((scale * ds * rstd)[:, None] * kf, axis=0)
    else:
        v = v.to(tl.float32)
        if MODE == 2 or KC:
            kf = kf.to(tl.float32)
        else:
            kf = v
        if KC:
            sq, ss = tl.reduce((kf * qk[None, :], kf * kf), 1, _add2)
            rstd = 1.0 / tl.sqrt(ss / r + eps)
            s = scale * sq * rstd
            da = tl.sum(g[None, :] * v, axis=1)
        elif MODE != 2:
            s, rstd, da = _sliced_sums(v, g, qk, keycol, r, eps, scale, True)
        else:
            s, rstd = _key_stats(kf, qk, r, eps, scale)
            da = tl.sum(g[None, :] * v, axis=1)
        a = tl.where(smask, tl.exp(s - lse), 0.0)
        if MODE == 0:
            delta += tl.sum(a * da, axis=0)
        elif MODE == 2:
            tl.store(da_ptr + src.to(tl.int64) * T + row64, da, mask=smask)
            _store_rows(dv_tab, src, smask, vref, row64, d, cols, cmask,
                        a[:, None] * g[None, :], PA, SA)
            delta += tl.sum(a * da, axis=0)
        else:
            ds = a * (da - delta)
            if HAS_OUT:
                dex += tl.sum(a * da, axis=0)
                ck += tl.sum((a * rstd)[:, None] * kf, axis=0)
            dk = (rstd * ds)[:, None] * (scale * qk[None, :] - kf * (rstd * s / r)[:, None])
            gq += tl.sum((scale * ds * rstd)[:, None] * kf, axis=0)
            if KC:
                _store_rows(dv_tab, src, smask, vref, row64, d, cols, cols < d - r,
                            a[:, None] * g[None, :], PA, SA)
                _store_rows(dv_tab, src, smask, vref, row64, d, (d - r) + rcols, rcols < r,
                            a[:, None] * gk[None, :] + dk, PA, SK)
            else:
                dv = a[:, None] * g[None, :] + tl.where(keycol[None, :], dk, 0.0)
                _store_rows(dv_tab, src, smask, vref, row64, d, cols, cmask, dv, PA, SA)
    return delta, gq, dex, ck


@triton.jit
def _key_ptrs(vp, kp, d, r, KC: tl.constexpr):
    # KC: the sliced keys' row pointers, d - r elements into the value rows
    if KC:
        kp = vp + (d - r)
    return kp


@triton.jit
def _bwd_pass(MODE: tl.constexpr, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab,
              vref, kref, da_ptr, cols, cmask, rcols, qk, keycol, r, eps, scale, g, gk, o, lse,
              delta, gq, dex, ck, HAS_OUT: tl.constexpr, BL: tl.constexpr, KC: tl.constexpr,
              PA: tl.constexpr, SA: tl.constexpr, SK: tl.constexpr):
    # one pass over the sources of one token row (see _bwd_step for MODE). With a saved
    # output (MODE 1, HAS_OUT), delta = <g, out> is reduced after the first rows' loads
    VALS: tl.constexpr = MODE != 3
    PK: tl.constexpr = MODE >= 2  # key pointers from the key tables (projected keys)
    KEYS: tl.constexpr = PK or KC  # key rows loaded (KC: d - r elements into the values)
    vp, kp, src, sm = _src_ptrs(0, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref, BL,
                                VALS, PK)
    kp = _key_ptrs(vp, kp, d, r, KC)
    v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, VALS, KEYS, PA, SA, SK)
    vp, kp, src_n, sm_n = _src_ptrs(BL, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                                    BL, VALS, PK)
    kp = _key_ptrs(vp, kp, d, r, KC)
    if MODE == 1 and HAS_OUT:
        delta = tl.sum(g * o, axis=0)
    for base in tl.range(0, S, BL, num_stages=1):
        v_n, kf_n = _src_rows(vp, kp, sm_n, cols, cmask, rcols, r, VALS, KEYS, PA, SA, SK)
        vp, kp, src_nn, sm_nn = _src_ptrs(base + 2 * BL, S, row64, v_tab, vs_tab, k_tab,
                                          ks_tab, vref, kref, BL, VALS, PK)
        kp = _key_ptrs(vp, kp, d, r, KC)
        delta, gq, dex, ck = _bwd_step(MODE, v, kf, src, sm, row64, T, d, dv_tab, dk_tab, vref,
                                       kref, da_ptr, cols, cmask, rcols, qk, keycol, r, eps,
                                       scale, g, gk, lse, delta, gq, dex, ck, HAS_OUT, KC, PA,
                                       SA, SK)
        v, kf, src, sm, src_n, sm_n = v_n, kf_n, src_n, sm_n, src_nn, sm_nn
    return delta, gq, dex, ck


@triton.jit
def depth_read_source_tiled_bwd_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vref, kref,
                                       q_ptr, lse_ptr, g_ptr, g_stride, o_ptr, da_ptr,
                                       gq_part_ptr, T, S, d, r, eps, scale,
                                       PROJECTED: tl.constexpr, HAS_OUT: tl.constexpr,
                                       BL: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                                       KC: tl.constexpr, PA: tl.constexpr, SA: tl.constexpr,
                                       SK: tl.constexpr):
    # persistent: program p owns token rows p, p + P, ...; one grad_q partial per program.
    # KC: sliced keys read as rows of their own (see _bwd_step), d - r elements into the
    # rows of the value tables (sources and their gradients)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cmask = cols < d
    rcols = tl.arange(0, BR)
    qk, keycol = query_columns(q_ptr, cols, rcols, d, r, PROJECTED or KC)
    gq = tl.zeros_like(qk)
    zero = tl.sum(tl.zeros([BL], tl.float32), axis=0)
    for row in range(pid, T, nprog):
        row64 = tl.cast(row, tl.int64)
        g = tl.load(g_ptr + row64 * g_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        gk = qk
        if KC:
            gk = tl.load(g_ptr + row64 * g_stride + (d - r) + rcols, mask=rcols < r,
                         other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row64)
        dex = zero
        ck = tl.zeros_like(qk)
        if PROJECTED:
            # values once (dv = a g, exact delta, <g, v_i> parked in scratch), then keys only
            delta, gq, dex, ck = _bwd_pass(2, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                           dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                           rcols, qk, keycol, r, eps, scale, g, gk, g, lse,
                                           zero, gq, dex, ck, False, BL, False, PA, SA, SK)
            tl.debug_barrier()
            delta, gq, dex, ck = _bwd_pass(3, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                           dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                           rcols, qk, keycol, r, eps, scale, g, gk, g, lse,
                                           delta, gq, dex, ck, False, BL, False, PA, SA, SK)
        else:
            # delta = sum_i a_i <g, v_i> = <g, out> (exact without a saved output). With
            # HAS_OUT, delta carries the output's rounding; grad_q is corrected after the
            # loop with the exact delta (dex) and ck = sum_i a_i rstd_i v_i
            o = g
            delta = zero
            if HAS_OUT:
                o = tl.load(o_ptr + row64 * d + cols, mask=cmask, other=0.0).to(tl.float32)
            else:
                delta, gq, dex, ck = _bwd_pass(0, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                               dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                               rcols, qk, keycol, r, eps, scale, g, gk, o, lse,
                                               zero, gq, dex, ck, False, BL, KC, PA, SA, SK)
            delta, gq, dex, ck = _bwd_pass(1, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                           dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                           rcols, qk, keycol, r, eps, scale, g, gk, o, lse,
                                           delta, gq, dex, ck, HAS_OUT, BL, KC, PA, SA, SK)
            if HAS_OUT:
                gq += (scale * (delta - dex)) * ck
    if PROJECTED or KC:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + rcols, gq, mask=rcols < r)
    else:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + (cols - (d - r)), gq, mask=keycol)
