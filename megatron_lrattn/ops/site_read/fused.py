"""Fused Triton depth read: host launchers, the autograd Function and ``depth_read_triton``.

    s_i = scale * <q, RMS(k_i)>,   a = softmax_i(s) (fp32),   out = sum_i a_i v_i

Sources are never stacked: the host passes a pointer table (int64 ``data_ptr`` of every
source, cast back to a typed pointer inside the kernel) and a row-stride table. Two kernel
families with the same math and saved tensors, chosen by ``tuning.read_family``: token-tiled
(``token_tiled.py``) and source-tiled (``source_tiled.py``). The forward streams the sources
once with an online softmax, the backward once more (twice when ``save_output=False``). Only
the fp32 log-sum-exp per token is written besides the output. Envelope:
``validation.check_envelope``; derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
from torch import Tensor

from megatron_lrattn.ops import triton_utils as tu
from megatron_lrattn.ops import tuning
from megatron_lrattn.ops.site_read.source_tiled import (
    depth_read_source_tiled_bwd_kernel,
    depth_read_source_tiled_fwd_kernel,
)
from megatron_lrattn.ops.site_read.token_tiled import (
    depth_read_token_tiled_bwd_kernel,
    depth_read_token_tiled_fwd_kernel,
)
from megatron_lrattn.ops.validation import check_envelope, interpreting

# Memory/recompute knob: keep a reference to the output for the backward (one read of it
# instead of a second pass over the sources to form delta = <grad_out, out>). The output
# usually stays alive anyway (the next sub-layer's norm saves it); set False when it
# would not, and the backward re-reads every source once more instead.
SAVE_OUTPUT = os.environ.get("LRATTN_DEPTH_READ_SAVE_OUTPUT", "1") == "1"

KERNELS = (depth_read_token_tiled_fwd_kernel, depth_read_token_tiled_bwd_kernel,
           depth_read_source_tiled_fwd_kernel, depth_read_source_tiled_bwd_kernel)


def alignment(values: Sequence[Tensor], keys: Sequence[Tensor], d: int, r: int, bd: int,
              key_offset: Optional[int] = None) -> Dict[str, int]:
    """Alignment facts for the source-tiled kernels' row pointers: PA = 16 when every
    table pointer (sources and their gradients) is 16-byte aligned and keys are sliced,
    else 1; SA / SK = the elements in 16 bytes when every value / key row stride and d / r
    (the gradients' strides) are multiples of it, else 1. With both the compiler moves rows
    in 16-byte vectors instead of element by element."""
    ts = list(values) + list(keys)
    pa = 16 if bd >= 16 and all(t.data_ptr() % 16 == 0 for t in ts) else 1
    if keys:
        # Projected keys run without the hints: on an H200 (d=2048, r=512, S=9) the hinted
        # projected forward reached 11.7% of copy bandwidth (its [BL, BR] key tile forces the
        # value tile through shared memory) against 59.4% without them
        # (benchmarks/results/depth_read_src_unaligned_2026-12-01.csv).
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


def launch_options(cfg: tuning.SourceTiled) -> Dict[str, int]:
    """Extra launch options of a source-tiled kernel: its register cap (none under the
    interpreter)."""
    return {} if not cfg.maxnreg or interpreting() else {"maxnreg": int(cfg.maxnreg)}


def key_rows(d: int, r: int) -> bool:
    """Whether the source-tiled backward reads sliced keys as rows of their own (KC): where
    r pads to less than the row, so the query, its gradient and the correction are r wide
    (4 warps, r = d/4: 159 -> 96 registers at d=2048; fwd+bwd 74.5 -> 77.2% of copy at
    d=2048, 76.5 -> 82.1% at d=4096, H200, kernels_key_rows_sweep_2026-12-01.log)."""
    return tu.pow2(r) < tu.pow2(d)


def _forward(vs: List[Tensor], ks: List[Tensor], query: Tensor, eps: float,
             scale: float) -> Tuple[Tensor, Tensor]:
    T, d = vs[0].shape
    r = query.shape[0]
    projected = len(ks) > 0
    out = tu.empty((T, d), vs[0].dtype, vs[0].device)
    lse = tu.empty((T,), torch.float32, vs[0].device)
    if T == 0:
        return out, lse
    bd = tu.pow2(d)
    (v_tab, vs_tab), (k_tab, ks_tab) = tu.tables(vs, ks) if projected else tu.tables(vs) * 2
    kref = ks[0] if projected else vs[0]
    if tuning.read_family(d) == "source":
        cfg = tuning.source_tiled(d, len(vs), backward=False)
        depth_read_source_tiled_fwd_kernel[(T,)](
            v_tab, vs_tab, k_tab, ks_tab, vs[0], kref, query, out, lse,
            T, len(vs), d, r, eps, scale, PROJECTED=projected, BL=cfg.sources, BD=bd,
            BR=tu.key_tile(r, cfg.warps) if projected else 1,
            **alignment(vs, ks, d, r, bd), **launch_options(cfg), num_warps=cfg.warps)
        return out, lse
    cfg = tuning.token_tiled(d, T)
    depth_read_token_tiled_fwd_kernel[(triton.cdiv(T, cfg.tokens),)](
        v_tab, vs_tab, k_tab, ks_tab, vs[0], kref, query, out, lse,
        T, len(vs), d, r, eps, scale, PROJECTED=projected, BT=cfg.tokens, BD=bd,
        BR=tu.key_tile(r, cfg.warps) if projected else 1, num_warps=cfg.warps)
    return out, lse


def _backward(vs, ks, query, lse, out, grad_out, eps, scale):
    T, d = vs[0].shape
    r = query.shape[0]
    projected = len(ks) > 0
    dev = vs[0].device
    dvs = [tu.empty((T, d), v.dtype, dev) for v in vs]
    dks = [tu.empty((T, r), k.dtype, dev) for k in ks]
    if T == 0:
        return torch.zeros_like(query), [dv.zero_() for dv in dvs], [dk.zero_() for dk in dks]
    g = tu.rows(grad_out, d)
    bd = tu.pow2(d)
    source = tuning.read_family(d) == "source"
    cfg = tuning.source_tiled(d, len(vs), backward=True) if source else tuning.token_tiled(d, T)
    br = tu.key_tile(r, cfg.warps) if projected else 1
    kc = not projected and source and key_rows(d, r)
    if projected:
        (v_tab, vs_tab), (dv_tab, _), (k_tab, ks_tab), (dk_tab, _) = \
            tu.tables(vs, dvs, ks, dks)
    else:
        # sliced keys: their columns are the last r of each value row (KC: read as rows of
        # their own, d - r elements into each row, through the value tables)
        if kc:
            br = tu.pow2(r)
        (v_tab, vs_tab), (dv_tab, _) = tu.tables(vs, dvs)
        k_tab, ks_tab, dk_tab = v_tab, vs_tab, dv_tab
    kref = ks[0] if projected else vs[0]
    # projected keys need no output: delta is exact after one pass over the values (da: the
    # <g, v_i> scratch of projected keys; a placeholder otherwise)
    has_out = out is not None and not projected
    if source:
        nprog = tu.programs(T, dev, cfg.programs_per_sm, cpu=3)
        parts = tu.empty((nprog, r), torch.float32, dev)
        da = tu.empty((len(vs), T), torch.float32, dev) if projected else parts
        depth_read_source_tiled_bwd_kernel[(nprog,)](
            v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vs[0], kref,
            query, lse, g, g.stride(0), out if has_out else g, da, parts,
            T, len(vs), d, r, eps, scale, PROJECTED=projected, HAS_OUT=has_out,
            BL=cfg.sources, BD=bd, BR=br, KC=kc,
            **alignment(vs + dvs, ks + dks, d, r, bd, key_offset=d - r if kc else None),
            **launch_options(cfg), num_warps=cfg.warps)
        return parts.sum(0), dvs, dks
    n_blocks = triton.cdiv(T, cfg.tokens)
    nprog = tu.programs(n_blocks, dev, cfg.programs_per_sm)
    parts = tu.empty((nprog, r), torch.float32, dev)
    da = tu.empty((len(vs), T), torch.float32, dev) if projected else parts
    depth_read_token_tiled_bwd_kernel[(nprog,)](
        v_tab, vs_tab, k_tab, ks_tab, dv_tab, dk_tab, vs[0], kref,
        query, lse, g, g.stride(0), out if has_out else g, da, parts,
        T, len(vs), d, r, eps, scale, n_blocks, PROJECTED=projected, HAS_OUT=has_out,
        BT=cfg.tokens, BD=bd, BR=br, num_warps=cfg.warps)
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
        ValueError: outside the supported envelope (``validation.check_envelope``).
    """
    check_envelope(values, query, keys)
    shape = values[0].shape
    d, r = shape[-1], query.shape[-1]
    vs = [tu.rows(v, d) for v in values]
    ks = [tu.rows(k, r) for k in keys] if keys is not None else []
    keep = SAVE_OUTPUT if save_output is None else save_output
    out = _DepthReadTriton.apply(query, eps, scale, keep, len(vs), *vs, *ks)
    return out.reshape(shape)
