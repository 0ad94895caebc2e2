"""Fused Triton depth read: forward and backward for sliced and projected keys.

    s_i = scale * <q, RMS(k_i)>,   a = softmax_i(s) (fp32),   out = sum_i a_i v_i

Sources are never stacked: the host passes a pointer table (int64 ``data_ptr`` of every
source, cast back to a typed pointer inside the kernel) and a row-stride table. Two kernel
families: token-tiled (one program owns ``BT`` tokens times the whole padded width ``BD``;
d < ``SRC_MIN_WIDTH``) and source-tiled (one token row per program, ``BL`` sources per
step, 16-byte vector rows for sliced keys; d >= ``SRC_MIN_WIDTH``), chosen by ``_impl``.
The forward streams the sources once with an online softmax, the backward streams them
once more (twice when ``save_output=False``). Only the fp32 log-sum-exp per token is
written besides the output. Backward derivation: ``kernels/README.md``.

Envelope (outside it a ``ValueError``): 1 <= d <= 8192, 1 <= S <= 256, sliced
1 <= r <= d, projected 1 <= r <= 8192, dtypes bf16 / fp16 / fp32, CUDA tensors (CPU
only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_WIDTH = 8192
MAX_SOURCES = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Test hook: fill every buffer the op allocates with NaN so an unwritten element fails.
POISON = os.environ.get("LRATTN_KERNELS_POISON", "0") == "1"

# Memory/recompute knob: keep a reference to the output for the backward (one read of it
# instead of a second pass over the sources to form delta = <grad_out, out>). The output
# usually stays alive anyway (the next sub-layer's norm saves it); set False when it
# would not, and the backward re-reads every source once more instead.
SAVE_OUTPUT = os.environ.get("LRATTN_DEPTH_READ_SAVE_OUTPUT", "1") == "1"

# Tile overrides for the benchmark's sweep: {"tile": elements per program, "warps": n,
# "ctas_per_sm": persistent backward programs per SM, "prefetch": 1 to load the next
# source while reducing the current one; "src_*" keys for the source-tiled kernels
# (sources, warps, stages, prefetch, fused_sums, maxnreg, ctas_per_sm; "src_bwd_*" for
# the backward); "multi_*" / "mc_*" / "merge_*" keys for the two-phase kernels}. The environment
# variable LRATTN_KERNELS_TUNE (a JSON object of the same keys)
# presets it for a whole process, e.g. a training run with other tiles
# (tools/gpu_box/two_phase_diag.sh).
TUNE: Dict[str, int] = {}


def _tune_from_env() -> Dict[str, int]:
    text = os.environ.get("LRATTN_KERNELS_TUNE", "").strip()
    if not text:
        return {}
    import json

    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
        raise ValueError(f"LRATTN_KERNELS_TUNE must be a JSON object of integers, got {text!r}")
    return {str(k): int(v) for k, v in data.items()}


TUNE.update(_tune_from_env())


@triton.jit
def _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols):
    # v: [BT, BD] rows of source i in fp32 (masked-off rows/columns read nothing)
    v_ptr = tl.load(v_tab + i).to(tl.pointer_type(vref.dtype.element_ty))
    v_stride = tl.load(vs_tab + i)
    v = tl.load(v_ptr + rows64[:, None] * v_stride + cols[None, :], mask=m2, other=0.0)
    return v.to(tl.float32)


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
def _query(q_ptr, cols, rcols, d, r, PROJECTED: tl.constexpr):
    # qk: the query laid over the key columns (zero elsewhere); keycol: key-column mask
    keycol = (cols >= d - r) & (cols < d)
    if PROJECTED:
        qk = tl.load(q_ptr + rcols, mask=rcols < r, other=0.0).to(tl.float32)
    else:
        qk = tl.load(q_ptr + (cols - (d - r)), mask=keycol, other=0.0).to(tl.float32)
    return qk, keycol


@triton.jit
def _fwd_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr, out_ptr, lse_ptr,
                T, S, d, r, eps, scale,
                PROJECTED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                BR: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    m2 = rmask[:, None] & (cols < d)[None, :]
    qk, keycol = _query(q_ptr, cols, rcols, d, r, PROJECTED)
    m = tl.full([BT], float("-inf"), tl.float32)
    l = tl.zeros([BT], tl.float32)
    acc = tl.zeros([BT, BD], tl.float32)
    # PREFETCH: issue the next source's load before this one's reductions
    v_next = _load_value(0, v_tab, vs_tab, vref, rows64, m2, cols)
    for i in range(S):
        v = v_next
        if PREFETCH:
            v_next = _load_value(tl.minimum(i + 1, S - 1), v_tab, vs_tab, vref, rows64,
                                 m2 & (i + 1 < S), cols)
        else:
            v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
        kf, s, rstd = _stats(i, v, k_tab, ks_tab, kref, rows64, rcols, rmask, qk, keycol, r,
                             eps, scale, PROJECTED)
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
def _bwd_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vref, kref,
                q_ptr, lse_ptr, g_ptr, g_stride, o_ptr, da_ptr, gq_part_ptr,
                T, S, d, r, eps, scale, n_blocks,
                PROJECTED: tl.constexpr, HAS_OUT: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, BR: tl.constexpr, PREFETCH: tl.constexpr):
    # persistent: program p owns token blocks p, p + P, ...; one grad_q partial per program
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    rcols = tl.arange(0, BR)
    qk, keycol = _query(q_ptr, cols, rcols, d, r, PROJECTED)
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
            v_next = _load_value(0, v_tab, vs_tab, vref, rows64, m2, cols)
            for i in range(S):
                v = v_next
                if PREFETCH:
                    v_next = _load_value(tl.minimum(i + 1, S - 1), v_tab, vs_tab, vref,
                                         rows64, m2 & (i + 1 < S), cols)
                else:
                    v = _load_value(i, v_tab, vs_tab, vref, rows64, m2, cols)
                kf, s, rstd = _stats(i, v, k_tab, ks_tab, kref, rows64, rcols, rmask, qk,
                                     keycol, r, eps, scale, PROJECTED)
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


# --- Source-tiled kernels (TUNE["impl"] = 1; the default at d >= SRC_MIN_WIDTH): one token
# row per program and BL sources per step, so BL row loads are in flight per program
# instead of one. With PF (the default) every source loop is software-pipelined by hand:
# the rows of step i + 1 are loaded while step i reduces, and the table entries of step
# i + 2 while those rows are in flight, so no step waits on a pointer or a row that could
# have been asked for earlier. (Triton's own pipeliner, ``STAGES`` > 1, cannot do this:
# it waits for every outstanding copy before it may use a pointer read from the table.)
# Rows move in 16-byte vectors where the host has checked the alignment (PA, SA, SK).


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
    # the host, ``_alignment``): declared so that rows move in 16-byte vectors. The
    # compiler cannot see through pointers read from a table (element-wise loads
    # otherwise), and the hint must sit in the function that does the load.
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
def _src_stats(v, kf, qk, keycol, r, eps, scale, PROJECTED: tl.constexpr):
    # logits s and inverse key RMS rstd, [BL] (finite on masked rows: they read zeros)
    if PROJECTED:
        rstd = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) / r + eps)
        s = scale * tl.sum(kf * qk[None, :], axis=1) * rstd
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(keycol[None, :], v * v, 0.0), axis=1) / r + eps)
        s = scale * tl.sum(v * qk[None, :], axis=1) * rstd
    return s, rstd


@triton.jit
def _fwd_src_step(v, kf, smask, qk, keycol, r, eps, scale, m, l, acc,
                  PROJECTED: tl.constexpr, FS: tl.constexpr):
    # one online-softmax step over a tile of sources (rows in their own dtype); FS: the
    # row sums of sliced keys in one reduction
    v = v.to(tl.float32)
    if PROJECTED:
        kf = kf.to(tl.float32)
    else:
        kf = v
    if FS and not PROJECTED:
        s, rstd, _ = _sliced_sums(v, v, qk, keycol, r, eps, scale, False)
    else:
        s, rstd = _src_stats(v, kf, qk, keycol, r, eps, scale, PROJECTED)
    s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    l = l * alpha + tl.sum(p, axis=0)
    return m_new, l, acc


@triton.jit
def _fwd_src_kernel(v_tab, vs_tab, k_tab, ks_tab, vref, kref, q_ptr, out_ptr, lse_ptr,
                    T, S, d, r, eps, scale,
                    PROJECTED: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr,
                    BR: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr,
                    FS: tl.constexpr, PA: tl.constexpr, SA: tl.constexpr,
                    SK: tl.constexpr):
    row64 = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < d
    rcols = tl.arange(0, BR)
    qk, keycol = _query(q_ptr, cols, rcols, d, r, PROJECTED)
    m = tl.max(tl.full([BL], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BL], tl.float32), axis=0)
    acc = tl.zeros([BD], tl.float32)
    if PF:
        vp, kp, src, sm = _src_ptrs(0, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref, BL,
                                    True, PROJECTED)
        v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, True, PROJECTED, PA, SA, SK)
        vp, kp, src, sm_n = _src_ptrs(BL, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref,
                                      BL, True, PROJECTED)
        for base in tl.range(0, S, BL, num_stages=1):
            v_n, kf_n = _src_rows(vp, kp, sm_n, cols, cmask, rcols, r, True, PROJECTED, PA,
                                  SA, SK)
            vp, kp, src, sm_nn = _src_ptrs(base + 2 * BL, S, row64, v_tab, vs_tab, k_tab,
                                           ks_tab, vref, kref, BL, True, PROJECTED)
            m, l, acc = _fwd_src_step(v, kf, sm, qk, keycol, r, eps, scale, m, l, acc,
                                      PROJECTED, FS)
            v, kf, sm, sm_n = v_n, kf_n, sm_n, sm_nn
    else:
        for base in tl.range(0, S, BL, num_stages=STAGES):
            vp, kp, src, sm = _src_ptrs(base, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref,
                                        kref, BL, True, PROJECTED)
            v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, True, PROJECTED, PA, SA, SK)
            m, l, acc = _fwd_src_step(v, kf, sm, qk, keycol, r, eps, scale, m, l, acc,
                                      PROJECTED, FS)
    tl.store(out_ptr + row64 * d + cols, (acc / l).to(out_ptr.dtype.element_ty), mask=cmask)
    tl.store(lse_ptr + row64, m + tl.log(l))


@triton.jit
def _bwd_src_step(MODE: tl.constexpr, v, kf, src, smask, row64, T, d, dv_tab, dk_tab, vref,
                  kref, da_ptr, cols, cmask, rcols, qk, keycol, r, eps, scale, g, gk, lse,
                  delta, gq, dex, ck, HAS_OUT: tl.constexpr, FS: tl.constexpr,
                  KC: tl.constexpr, PA: tl.constexpr, SA: tl.constexpr, SK: tl.constexpr):
    # one step of a backward pass over a tile of sources (rows in their own dtype):
    # MODE 0: delta = sum_i a_i <g, v_i> (sliced keys without a saved output);
    # MODE 1: sliced keys, dv (value and key parts in one store) and the query gradient;
    # MODE 2: projected keys, pass 1: dv = a g, <g, v_i> parked in scratch, exact delta;
    # MODE 3: projected keys, pass 2: dk and the query gradient from the keys alone.
    # KC (sliced keys, modes 0 and 1): the key columns arrive as a row of their own (kf,
    # [BL, BR], read d - r elements into each value row, _key_ptrs), so
    # the query, its gradient and the correction are r wide instead of the padded row;
    # dv is stored in two parts, the value columns (a g) and the key columns (a gk + dk)
    if MODE == 3:
        kf = kf.to(tl.float32)
        s, rstd = _src_stats(kf, kf, qk, keycol, r, eps, scale, True)
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
            if FS:
                sq, ss = tl.reduce((kf * qk[None, :], kf * kf), 1, _add2)
                rstd = 1.0 / tl.sqrt(ss / r + eps)
                s = scale * sq * rstd
            else:
                s, rstd = _src_stats(kf, kf, qk, keycol, r, eps, scale, True)
            da = tl.sum(g[None, :] * v, axis=1)
        elif FS and MODE != 2:
            s, rstd, da = _sliced_sums(v, g, qk, keycol, r, eps, scale, True)
        else:
            s, rstd = _src_stats(v, kf, qk, keycol, r, eps, scale, MODE == 2)
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
def _bwd_src_pass(MODE: tl.constexpr, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab, dv_tab,
                  dk_tab, vref, kref, da_ptr, cols, cmask, rcols, qk, keycol, r, eps, scale,
                  g, gk, o, lse, delta, gq, dex, ck, HAS_OUT: tl.constexpr, BL: tl.constexpr,
                  STAGES: tl.constexpr, PF: tl.constexpr, FS: tl.constexpr,
                  KC: tl.constexpr, PA: tl.constexpr, SA: tl.constexpr, SK: tl.constexpr):
    # one pass over the sources of one token row (see _bwd_src_step for MODE). With a
    # saved output (MODE 1, HAS_OUT), delta = <g, out> is reduced after the first rows'
    # loads are issued.
    VALS: tl.constexpr = MODE != 3
    PK: tl.constexpr = MODE >= 2  # key pointers from the key tables (projected keys)
    KEYS: tl.constexpr = PK or KC  # key rows loaded (KC: d - r elements into the values)
    if PF:
        vp, kp, src, sm = _src_ptrs(0, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref, kref, BL,
                                    VALS, PK)
        kp = _key_ptrs(vp, kp, d, r, KC)
        v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, VALS, KEYS, PA, SA, SK)
        vp, kp, src_n, sm_n = _src_ptrs(BL, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref,
                                        kref, BL, VALS, PK)
        kp = _key_ptrs(vp, kp, d, r, KC)
        if MODE == 1 and HAS_OUT:
            delta = tl.sum(g * o, axis=0)
        for base in tl.range(0, S, BL, num_stages=1):
            v_n, kf_n = _src_rows(vp, kp, sm_n, cols, cmask, rcols, r, VALS, KEYS, PA, SA, SK)
            vp, kp, src_nn, sm_nn = _src_ptrs(base + 2 * BL, S, row64, v_tab, vs_tab, k_tab,
                                              ks_tab, vref, kref, BL, VALS, PK)
            kp = _key_ptrs(vp, kp, d, r, KC)
            delta, gq, dex, ck = _bwd_src_step(MODE, v, kf, src, sm, row64, T, d, dv_tab,
                                               dk_tab, vref, kref, da_ptr, cols, cmask, rcols,
                                               qk, keycol, r, eps, scale, g, gk, lse, delta,
                                               gq, dex, ck, HAS_OUT, FS, KC, PA, SA, SK)
            v, kf, src, sm, src_n, sm_n = v_n, kf_n, src_n, sm_n, src_nn, sm_nn
    else:
        if MODE == 1 and HAS_OUT:
            delta = tl.sum(g * o, axis=0)
        for base in tl.range(0, S, BL, num_stages=STAGES):
            vp, kp, src, sm = _src_ptrs(base, S, row64, v_tab, vs_tab, k_tab, ks_tab, vref,
                                        kref, BL, VALS, PK)
            kp = _key_ptrs(vp, kp, d, r, KC)
            v, kf = _src_rows(vp, kp, sm, cols, cmask, rcols, r, VALS, KEYS, PA, SA, SK)
            delta, gq, dex, ck = _bwd_src_step(MODE, v, kf, src, sm, row64, T, d, dv_tab,
                                               dk_tab, vref, kref, da_ptr, cols, cmask, rcols,
                                               qk, keycol, r, eps, scale, g, gk, lse, delta,
                                               gq, dex, ck, HAS_OUT, FS, KC, PA, SA, SK)
    return delta, gq, dex, ck


@triton.jit
def _bwd_src_kernel(v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vref, kref,
                    q_ptr, lse_ptr, g_ptr, g_stride, o_ptr, da_ptr, gq_part_ptr,
                    T, S, d, r, eps, scale,
                    PROJECTED: tl.constexpr, HAS_OUT: tl.constexpr, BL: tl.constexpr,
                    BD: tl.constexpr, BR: tl.constexpr, STAGES: tl.constexpr,
                    PF: tl.constexpr, FS: tl.constexpr, KC: tl.constexpr, PA: tl.constexpr,
                    SA: tl.constexpr, SK: tl.constexpr):
    # persistent: program p owns token rows p, p + P, ...; one grad_q partial per program.
    # KC: sliced keys read as rows of their own (see _bwd_src_step), d - r elements into
    # the rows of the value tables (sources and their gradients)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cmask = cols < d
    rcols = tl.arange(0, BR)
    qk, keycol = _query(q_ptr, cols, rcols, d, r, PROJECTED or KC)
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
            delta, gq, dex, ck = _bwd_src_pass(2, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                               dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                               rcols, qk, keycol, r, eps, scale, g, gk, g, lse,
                                               zero, gq, dex, ck, False, BL, STAGES, PF, FS,
                                               False, PA, SA, SK)
            tl.debug_barrier()
            delta, gq, dex, ck = _bwd_src_pass(3, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                               dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                               rcols, qk, keycol, r, eps, scale, g, gk, g, lse,
                                               delta, gq, dex, ck, False, BL, STAGES, PF, FS,
                                               False, PA, SA, SK)
        else:
            # delta = sum_i a_i <g, v_i> = <g, out> (exact without a saved output). With
            # HAS_OUT, delta carries the output's rounding; grad_q is corrected after the
            # loop with the exact delta (dex) and ck = sum_i a_i rstd_i v_i
            o = g
            delta = zero
            if HAS_OUT:
                o = tl.load(o_ptr + row64 * d + cols, mask=cmask, other=0.0).to(tl.float32)
            else:
                delta, gq, dex, ck = _bwd_src_pass(0, S, row64, T, d, v_tab, vs_tab, k_tab,
                                                   ks_tab, dv_tab, dk_tab, vref, kref, da_ptr,
                                                   cols, cmask, rcols, qk, keycol, r, eps,
                                                   scale, g, gk, o, lse, zero, gq, dex, ck,
                                                   False, BL, STAGES, PF, FS, KC, PA, SA,
                                                   SK)
            delta, gq, dex, ck = _bwd_src_pass(1, S, row64, T, d, v_tab, vs_tab, k_tab, ks_tab,
                                               dv_tab, dk_tab, vref, kref, da_ptr, cols, cmask,
                                               rcols, qk, keycol, r, eps, scale, g, gk, o, lse,
                                               delta, gq, dex, ck, HAS_OUT, BL, STAGES, PF,
                                               FS, KC, PA, SA, SK)
            if HAS_OUT:
                gq += (scale * (delta - dex)) * ck
    if PROJECTED or KC:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + rcols, gq, mask=rcols < r)
    else:
        tl.store(gq_part_ptr + pid.to(tl.int64) * r + (cols - (d - r)), gq, mask=keycol)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): ``triton.next_power_of_2`` without
    its per-call wrapper cost (it is a constexpr function in Triton 3.6, several
    microseconds a call, a dozen calls per fwd+bwd)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# With POISON, every buffer also gets GUARD NaN elements past its end, recorded in GUARDED,
# so that a test can check that no kernel wrote outside a buffer (``guards_intact``).
GUARD = 64
GUARDED: List[Tuple[Tensor, int]] = []


def _alloc(shape, dtype, device) -> Tensor:
    if POISON:
        n = 1
        for size in shape:
            n *= size
        buf = torch.full((n + GUARD,), float("nan"), dtype=dtype, device=device)
        GUARDED.append((buf, n))
        return buf[:n].view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def guards_intact() -> List[Tuple[int, Tuple[int, ...]]]:
    """(buffer size, indices written past its end) of every buffer allocated since the last
    call whose guard elements are no longer NaN (empty when none was); clears the record."""
    bad = []
    for buf, n in GUARDED:
        hit = (~torch.isnan(buf[n:].float())).nonzero().flatten()
        if hit.numel():
            bad.append((n, tuple(int(i) for i in hit[:8])))
    GUARDED.clear()
    return bad


def _prefetch() -> bool:
    # Off by default: on one H200 (benchmarks/results/prefetch_ab_2026-11-29.log) loading
    # the next source ahead made the forward 10-80% slower and the backward mixed.
    return bool(TUNE.get("prefetch", 0))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tiles(d: int, r: int, projected: bool, T: int) -> Tuple[int, int, int, int]:
    """(BT, BD, BR, num_warps): BT tokens times the padded width per program."""
    bd = pow2(d)
    # Key tiles narrower than 128 columns ran 16x slower on an H200 (r=32: 4.95 ms against
    # 0.31 ms at r=128 for the same values, benchmarks/results/projected_probe_2026-11-29.log);
    # the extra columns are masked.
    br = max(128, pow2(r)) if projected else 1
    # H200 sweep (benchmarks/results/depth_read.csv run of 1b1fc73): 2048-element tiles with
    # 4 warps beat 4096/8 by 5-12 points of copy bandwidth at d=2048 and d=4096
    tile = TUNE.get("tile", 2048)
    bt = max(1, min(tile // bd, pow2(max(T, 1))))
    warps = TUNE.get("warps", max(4, min(16, bt * bd // 1024)))
    return bt, bd, br, warps


# Widths from which the source-tiled kernels run by default (narrower rows keep the
# token-tiled kernels: one row per program would leave most lanes idle).
SRC_MIN_WIDTH = 512


def _impl(d: int) -> str:
    """"src" (source-tiled, one token row per program; the default at d >= SRC_MIN_WIDTH)
    or "row" (token-tiled)."""
    impl = TUNE.get("impl")
    if impl is None:
        return "src" if d >= SRC_MIN_WIDTH else "row"
    return {0: "row", 1: "src"}[int(impl)]


def _src_tiles(d: int, S: int, backward: bool) -> Tuple[int, int, int]:
    """(BL sources per step, num_warps, pipeline stages) of the source-tiled kernels."""
    # defaults from the H200 sweeps with hand pipelining (S=9, sliced r=d/4, candidates timed
    # in interleaved rounds; benchmarks/results/kernels_prefetch_interleaved_2026-12-01.log):
    # one source per step in both passes, 4 warps. Forward 74.4% / 74.9% of copy bandwidth at
    # d=2048 / 4096 (2 sources per step without pipelining, the earlier default: 68.5% /
    # 72.7%); fwd+bwd at d=4096 66.0% (61.5%).
    pre = "src_bwd_" if backward else "src_"
    bl = TUNE.get(pre + "sources", 1)
    bl = max(1, min(pow2(bl), pow2(S)))
    bd = pow2(d)
    warps = TUNE.get(pre + "warps", max(4, min(16, bl * bd // 2048)))
    return bl, warps, TUNE.get(pre + "stages", 1)


def _alignment(values: Sequence[Tensor], keys: Sequence[Tensor], d: int, r: int,
               bd: int, key_offset: Optional[int] = None) -> Dict[str, int]:
    """Alignment facts for the source-tiled kernels' row pointers: PA = 16 when every
    table pointer (sources and their gradients) is 16-byte aligned and keys are sliced,
    else 1; SA / SK = the elements in 16 bytes when every value / key row stride and d / r
    (the gradients' strides) are multiples of it, else 1. With both the compiler moves rows
    in 16-byte vectors instead of element by element."""
    ts = list(values) + list(keys)
    pa = 16 if bd >= 16 and all(t.data_ptr() % 16 == 0 for t in ts) else 1
    if keys:
        # Projected keys run without the hints: on an H200 (d=2048, r=512, S=9) the hinted
        # projected forward took 1.65 ms (11.7% of copy bandwidth; its [BL, BR] key tile then
        # forces the value tile through shared memory, 16 KiB and 24 barriers per program in
        # the PTX) against 59.4% without them (benchmarks/results/depth_read_2026-12-01.csv
        # and depth_read_src_unaligned_2026-12-01.csv).
        pa = 1

    def common(group, width):
        if not group:
            return 1
        vec = 16 // group[0].element_size()
        ok = width % vec == 0 and all(t.stride(0) % vec == 0 for t in group)
        return vec if ok else 1
    sa = common(list(values), d)
    if key_offset is not None:
        # sliced keys read as rows of their own, key_offset elements into each value row:
        # whole vectors when the offset and r are multiples of the vector too
        return dict(PA=pa, SA=sa, SK=sa if key_offset % sa == 0 and r % sa == 0 else 1)
    return dict(PA=pa, SA=sa, SK=common(list(keys), r))


def _src_prefetch(backward: bool) -> int:
    """PF of the source-tiled kernels (TUNE keys ``src_prefetch`` / ``src_bwd_prefetch``):
    1 (the default) pipelines every source loop by hand
    (the next step's rows and the step after's table entries are loaded while a step
    reduces), 0 leaves it to Triton (``src_stages``). Loading two steps ahead (one more
    row of registers per program) was slower on an H200 in every case measured (forward
    82.8 -> 73.6% of copy bandwidth at d=2048 and 89.9 -> 60.1% at d=4096, fwd+bwd
    74.4 -> 69.6% and 76.6 -> 73.5%, GPU busy time, git e963348,
    benchmarks/results/kernels_prefetch_depth_2026-12-01.log) and is gone, as is an
    earlier unrolled variant (one compiled kernel per S, 10-25% slower than the runtime
    loop, benchmarks/results/kernels_src_unroll_sweep_2026-12-01.log)."""
    return int(bool(TUNE.get("src_bwd_prefetch" if backward else "src_prefetch", 1)))


def _src_fused_sums(backward: bool) -> int:
    """FS of the source-tiled kernels (TUNE keys ``src_fused_sums`` / ``src_bwd_fused_sums``):
    1 reduces every row sum of a sliced-key step (logit, key RMS and, in the backward,
    <g, v_i>) in one multi-operand reduction: one cross-warp exchange per step instead of two
    or three (sm_90a PTX: 3 instead of 6 barriers in the forward, 10 instead of 16 in the
    backward, registers unchanged; ``tools/kernel_ptx.py``). On an H200 (S=9, sliced
    r=d/4, GPU busy time) the forward went from 77.1% to 82.6% of copy bandwidth at d=2048
    and fwd+bwd from 69.1% to 76.2% at d=4096
    (benchmarks/results/kernels_maxnreg_sweep_table_2026-12-01.log)."""
    return int(bool(TUNE.get("src_bwd_fused_sums" if backward else "src_fused_sums", 1)))


# Register caps per thread of the source-tiled kernels by padded width (H200 sweep,
# benchmarks/results/kernels_maxnreg_sweep_table_2026-12-01.log, S=9, sliced r=d/4, GPU busy
# time). The kernels hold a whole token row several times over in fp32 registers, so the
# register count sets the programs per SM and with it the rows in flight: the backward at
# d=2048 (4 warps) needs 159 registers, 3 programs per SM; capped at 128 it runs 4 (32
# bytes spilled) and fwd+bwd went from 66.3% to 74.5% of copy bandwidth. The forward at
# d=4096 needs 149, 3 programs; capped, 4, and the forward went from 78.9% to 90.2%. The
# same cap on the d=4096 backward (254 registers, 812 bytes spilled) halved its speed, and
# 96 at d=2048 (200 bytes spilled) lost 10 points: other widths stay uncapped. With the
# sliced keys as rows of their own (the default, _src_key_chunk) the d=2048 backward
# compiles to 96 registers uncapped, yet the 128 cap still measured faster (77.4% against
# 74.5% uncapped, benchmarks/results/kernels_key_rows_sweep2_2026-12-01.log); AttnRes
# (r = d) keeps the 159-register kernel above.
SRC_MAXNREG = {False: {4096: 128}, True: {2048: 128}}


def _src_launch(d: int, warps: int, backward: bool) -> Dict[str, int]:
    """Extra launch options of the source-tiled kernels: ``maxnreg``, a register cap per
    thread (``SRC_MAXNREG`` at the default 4 warps; TUNE keys ``src_maxnreg`` /
    ``src_bwd_maxnreg`` override it, 0 = no cap; ``tools/kernel_ptx.py --maxnreg`` shows
    registers, spills and programs per SM). Left out under the interpreter."""
    key = "src_bwd_maxnreg" if backward else "src_maxnreg"
    default = SRC_MAXNREG[backward].get(pow2(d)) if warps == 4 else None
    cap = TUNE.get(key, default)
    return {} if not cap or _interpreting() else {"maxnreg": int(cap)}


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()).multi_processor_count


def _src_key_chunk(d: int, r: int) -> bool:
    """KC of the source-tiled backward (TUNE key ``src_bwd_key_chunk``, on by default, 0
    = off): sliced keys read as rows of their own, so that the query, its gradient and
    the correction accumulator are r wide instead of the padded row width (fewer
    registers, ``tools/kernel_ptx.py --key-chunk``: 4 warps, r = d/4, 159 -> 96 at
    d=2048, 254 -> 168 at d=4096). Only where r pads to less than the row (pow2(r) <
    pow2(d)); the key columns are then read twice per step (the second time from cache)
    and a step has two row reductions instead of one. H200, S=9, bf16, fwd+bwd by GPU
    busy time: 74.5 -> 77.2% of copy at d=2048, 76.5 -> 82.1% at d=4096
    (benchmarks/results/kernels_key_rows_sweep_2026-12-01.log)."""
    return bool(TUNE.get("src_bwd_key_chunk", 1)) and pow2(r) < pow2(d)


def _src_programs(T: int, dev: torch.device) -> int:
    """Persistent programs of the source-tiled backward (each writes one grad_q partial)."""
    if dev.type == "cuda":
        return max(1, min(T, _sm_count(dev.index) * TUNE.get("src_ctas_per_sm", 8)))
    return max(1, min(T, 3))


def _tables(*groups: Sequence[Tensor]) -> List[Tuple[Tensor, Tensor]]:
    """Device int64 tables of data pointers and row strides, one (pointers, strides) pair per
    group of tensors, all staged in one pinned buffer and copied in one transfer without a
    host sync (PyTorch's host allocator keeps the buffer until the copy is done). Each
    group starts on a 16-byte boundary, so a table's alignment (which Triton specialises
    on) does not depend on the sizes of the groups before it."""
    dev = next(t.device for g in groups for t in g)
    ptrs: List[int] = []
    strides: List[int] = []
    starts = []
    for g in groups:
        pad = len(ptrs) % 2
        ptrs += [0] * pad
        strides += [0] * pad
        starts.append(len(ptrs))
        ptrs += [t.data_ptr() for t in g]
        strides += [t.stride(0) for t in g]
    if dev.type == "cuda":
        tab = torch.tensor([ptrs, strides], dtype=torch.int64, pin_memory=True).to(
            dev, non_blocking=True)
    else:
        tab = torch.tensor([ptrs, strides], dtype=torch.int64)
    return [(tab[0, a:a + len(g)], tab[1, a:a + len(g)]) for a, g in zip(starts, groups)]


def _rows(t: Tensor, width: int) -> Tensor:
    """[T, width] view with unit column stride (copies only when that is impossible)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_envelope(values: Sequence[Tensor], query: Tensor,
                    keys: Optional[Sequence[Tensor]]) -> None:
    S, d, r = len(values), values[0].shape[-1], query.shape[-1]
    where = "lrattn_kernels.depth_read"
    if not 1 <= S <= MAX_SOURCES:
        raise ValueError(f"{where}: S={S} sources, supported 1..{MAX_SOURCES}")
    if not 1 <= d <= MAX_WIDTH:
        raise ValueError(f"{where}: d={d}, supported 1..{MAX_WIDTH}; use backend='torch'")
    if keys is None and not 1 <= r <= d:
        raise ValueError(f"{where}: sliced keys need 1 <= r <= d, got r={r}, d={d}")
    if keys is not None and not 1 <= r <= MAX_WIDTH:
        raise ValueError(f"{where}: projected r={r}, supported 1..{MAX_WIDTH}")
    for name, ts in (("values", values), ("keys", keys or [])):
        for t in ts:
            if t.dtype not in DTYPES:
                raise ValueError(f"{where}: {name} dtype {t.dtype}, supported {DTYPES}; "
                                 "use backend='torch' for float64")
    if not values[0].is_cuda and not _interpreting():
        raise ValueError(f"{where}: CPU tensors need TRITON_INTERPRET=1; use backend='torch'")


def _forward(vs: List[Tensor], ks: List[Tensor], query: Tensor, eps: float,
             scale: float) -> Tuple[Tensor, Tensor]:
    T, d = vs[0].shape
    r = query.shape[0]
    projected = len(ks) > 0
    out = _alloc((T, d), vs[0].dtype, vs[0].device)
    lse = _alloc((T,), torch.float32, vs[0].device)
    if T == 0:
        return out, lse
    bt, bd, br, warps = _tiles(d, r, projected, T)
    (v_tab, vs_tab), (k_tab, ks_tab) = _tables(vs, ks) if projected else _tables(vs) * 2
    kref = ks[0] if projected else vs[0]
    if _impl(d) == "src":
        bl, warps, stages = _src_tiles(d, len(vs), backward=False)
        _fwd_src_kernel[(T,)](
            v_tab, vs_tab, k_tab, ks_tab, vs[0], kref, query, out, lse,
            T, len(vs), d, r, eps, scale,
            PROJECTED=projected, BL=bl, BD=bd, BR=br, STAGES=stages, PF=_src_prefetch(False),
            FS=_src_fused_sums(False),
            **_alignment(vs, ks, d, r, bd), **_src_launch(d, warps, False), num_warps=warps)
        return out, lse
    _fwd_kernel[(triton.cdiv(T, bt),)](
        v_tab, vs_tab, k_tab, ks_tab, vs[0], kref, query, out, lse,
        T, len(vs), d, r, eps, scale,
        PROJECTED=projected, BT=bt, BD=bd, BR=br, PREFETCH=_prefetch(), num_warps=warps)
    return out, lse


def _backward(vs, ks, query, lse, out, grad_out, eps, scale):
    T, d = vs[0].shape
    r = query.shape[0]
    projected = len(ks) > 0
    dev = vs[0].device
    dvs = [_alloc((T, d), v.dtype, dev) for v in vs]
    dks = [_alloc((T, r), k.dtype, dev) for k in ks]
    if T == 0:
        return torch.zeros_like(query), [dv.zero_() for dv in dvs], [dk.zero_() for dk in dks]
    g = _rows(grad_out, d)
    bt, bd, br, warps = _tiles(d, r, projected, T)
    kc = not projected and _impl(d) == "src" and _src_key_chunk(d, r)
    if projected:
        (v_tab, vs_tab), (dv_tab, _), (k_tab, ks_tab), (dk_tab, _) = _tables(vs, dvs, ks, dks)
    else:
        # sliced keys: their columns are the last r of each value row (KC: read as rows of
        # their own, d - r elements into each row, through the value tables)
        if kc:
            br = pow2(r)
        (v_tab, vs_tab), (dv_tab, _) = _tables(vs, dvs)
        k_tab, ks_tab, dk_tab = v_tab, vs_tab, dv_tab
    kref = ks[0] if projected else vs[0]
    # projected keys need no output: delta is exact after one pass over the values (da: the
    # <g, v_i> scratch of projected keys; a placeholder otherwise)
    has_out = out is not None and not projected
    if _impl(d) == "src":
        bl, warps, stages = _src_tiles(d, len(vs), backward=True)
        nprog = _src_programs(T, dev)
        parts = _alloc((nprog, r), torch.float32, dev)
        da = _alloc((len(vs), T), torch.float32, dev) if projected else parts
        _bwd_src_kernel[(nprog,)](
            v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vs[0], kref,
            query, lse, g, g.stride(0), out if has_out else g, da, parts,
            T, len(vs), d, r, eps, scale,
            PROJECTED=projected, HAS_OUT=has_out, BL=bl, BD=bd, BR=br, STAGES=stages,
            PF=_src_prefetch(True), FS=_src_fused_sums(True), KC=kc,
            **_alignment(vs + dvs, ks + dks, d, r, bd, key_offset=d - r if kc else None),
            **_src_launch(d, warps, True), num_warps=warps)
        return parts.sum(0), dvs, dks
    n_blocks = triton.cdiv(T, bt)
    if dev.type == "cuda":
        nprog = min(n_blocks, _sm_count(dev.index) * TUNE.get("ctas_per_sm", 4))
    else:
        nprog = min(n_blocks, 2)
    parts = _alloc((nprog, r), torch.float32, dev)
    da = _alloc((len(vs), T), torch.float32, dev) if projected else parts
    _bwd_kernel[(nprog,)](
        v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vs[0], kref,
        query, lse, g, g.stride(0), out if has_out else g, da, parts,
        T, len(vs), d, r, eps, scale, n_blocks,
        PROJECTED=projected, HAS_OUT=has_out, BT=bt, BD=bd, BR=br, PREFETCH=_prefetch(),
        num_warps=warps)
    return parts.sum(0), dvs, dks


class _DepthReadTriton(torch.autograd.Function):
    """Fused depth read on flattened [T, d] sources; grads for query, values and keys."""

    @staticmethod
    def forward(ctx, query, eps, scale, save_output, nv, *tensors):
        vs, ks = list(tensors[:nv]), list(tensors[nv:])
        q = query.contiguous()
        out, lse = _forward(vs, ks, q, eps, scale)
        save_output = save_output and not ks
        saved = (q, lse, *tensors) + ((out,) if save_output else ())
        ctx.save_for_backward(*saved)
        ctx.eps, ctx.scale, ctx.nv, ctx.save_output = eps, scale, nv, save_output
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, lse, *rest = ctx.saved_tensors
        out = rest.pop() if ctx.save_output else None
        vs, ks = rest[:ctx.nv], rest[ctx.nv:]
        gq, dvs, dks = _backward(vs, ks, q, lse, out, grad_out, ctx.eps, ctx.scale)
        gq = gq.to(q.dtype) if ctx.needs_input_grad[0] else None
        return (gq, None, None, None, None, *dvs, *dks)


def depth_read_triton(
    values: Sequence[Tensor],
    query: Tensor,
    keys: Optional[Sequence[Tensor]] = None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    save_output: Optional[bool] = None,
) -> Tensor:
    """Fused depth read ``sum_i softmax_i(scale <q, RMS(k_i)>) values[i]``.

    Args:
        values: S tensors [..., d] of one shape, dtype (bf16, fp16 or fp32) and device,
            separately allocated; each must flatten to [T, d] rows (a row stride is fine).
        query: [r] routing query (fp32 recommended; math is fp32 regardless).
        keys: None for sliced keys (the last r columns of each value; r == d is AttnRes),
            or S tensors [..., r] of projected keys.
        eps: epsilon of the key RMS normalisation.
        scale: logit scale tau.
        save_output: keep a reference to the output for the backward (faster; default
            ``SAVE_OUTPUT``, env ``LRATTN_DEPTH_READ_SAVE_OUTPUT``) or re-read the sources.

    Returns:
        Tensor [..., d] in the dtype of ``values``.

    Raises:
        ValueError: outside the supported envelope (see the module docstring).
    """
    _check_envelope(values, query, keys)
    shape = values[0].shape
    d, r = shape[-1], query.shape[-1]
    vs = [_rows(v, d) for v in values]
    ks = [_rows(k, r) for k in keys] if keys is not None else []
    keep = SAVE_OUTPUT if save_output is None else save_output
    out = _DepthReadTriton.apply(query, eps, scale, keep, len(vs), *vs, *ks)
    return out.reshape(shape)
