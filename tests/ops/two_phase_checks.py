"""Checks shared by the two-phase op tests: inputs, phase 1 against float64 naive formulas,
a merge against the depth read over the sources and the partial sum, and a depth block as
``DepthState`` runs it."""

import torch
from op_checks import DEVICE, assert_table, grad_errors, randn, rel_rms, up

from megatron_lrattn.ops import (
    depth_merge,
    depth_read_multi,
    depth_read_multi_naive,
    depth_read_naive,
)

BACKENDS = ["torch", "triton"]
# A merged read is rounded twice (the phase-1 output is stored in the activation dtype, then
# merged), and the interpreter converts fp32 to bf16 by truncation (the GPU rounds to
# nearest): merged results get twice the table.
MERGED = 2.0


def make(T, d, r, S, K, dtype, projected, seed=0, lead=()):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (*lead, T)
    values = [(randn(gen, *shape, d, dtype=dtype) * (0.5 + i % 3)) for i in range(S)]
    keys = [randn(gen, *shape, r, dtype=dtype) for _ in range(S)] if projected else None
    qdtype = torch.float64 if dtype == torch.float64 else torch.float32
    queries = randn(gen, K, r, dtype=qdtype) * (2.0 / r**0.5)
    return gen, values, keys, queries


def check_multi(T, d, r, S, K, dtype, projected, backend, split=False, lead=()):
    gen, values, keys, queries = make(T, d, r, S, K, dtype, projected, lead=lead)
    leaves = [queries, *values, *(keys or [])]
    for t in leaves:
        t.requires_grad_()
    out, lse = depth_read_multi(values, queries, keys, backend=backend, split=split)
    if split:
        assert len(out) == K
        out = torch.stack(out)
    g_out = randn(gen, *out.shape, dtype=dtype)
    g_lse = randn(gen, *lse.shape)
    grads = torch.autograd.grad([out, lse], leaves, [g_out, g_lse])
    ref_leaves = up(leaves)
    ref_out, ref_lse = depth_read_multi_naive(ref_leaves[1:S + 1], ref_leaves[0],
                                              ref_leaves[S + 1:] if projected else None)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_leaves, [g_out.double(),
                                                                    g_lse.double()])
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64
                                                else torch.float32)
    assert out.shape == (K, *lead, T, d) and lse.shape == (K, *lead, T)
    names = ["queries"] + [f"values[{i}]" for i in range(S)] + [
        f"keys[{i}]" for i in range(S if projected else 0)]
    errs = {"out": rel_rms(out, ref_out), "lse": rel_rms(lse, ref_lse)}
    floor = 1e-1 * g_out.double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype)


def check_merge(T, d, r, S, dtype, projected, backend):
    """depth_merge(phase 1 over S sources, P) == depth_read over [sources..., P]."""
    gen, values, keys, queries = make(T, d, r, S, 1, dtype, projected, seed=1)
    partial = randn(gen, T, d, dtype=dtype) * 1.5
    pkey = randn(gen, T, r, dtype=dtype) if projected else None
    query = queries[0]
    leaves = [query, partial, *values, *(keys or []), *([pkey] if projected else [])]
    for t in leaves:
        t.requires_grad_()
    out, lse = depth_read_multi(values, query[None], keys, backend=backend)
    h = depth_merge(out[0], lse[0], partial, query, pkey, backend=backend)
    g = randn(gen, T, d, dtype=dtype)
    grads = torch.autograd.grad(h, leaves, g)
    rl = up(leaves)
    rq, rp, rv = rl[0], rl[1], rl[2:2 + S]
    rk = [*rl[2 + S:2 + 2 * S], rl[-1]] if projected else None
    ref = depth_read_naive([*rv, rp], rq, rk)
    ref_grads = torch.autograd.grad(ref, rl, g.double())
    assert h.dtype == dtype and h.shape == (T, d)
    names = ["query", "partial"] + [f"values[{i}]" for i in range(S)] + (
        [f"keys[{i}]" for i in range(S)] + ["partial_key"] if projected else [])
    errs = {"out": rel_rms(h, ref)}
    floor = 1e-1 * g.double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype, MERGED)


def check_block(T, d, r, S, K, projected, backend, qdtype=torch.bfloat16, dtype=torch.bfloat16,
                seed=3):
    """One depth block as ``DepthState`` runs it in a bf16 model: K queries stacked from
    separate (bf16) parameters, phase 1 with ``split=True``; site 0 returns its phase-1
    output, sites k >= 1 merge their own partial sum P_k. Every output and every gradient
    (queries, sources, keys, partial sums and their keys) against float64 per-site reads."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    values = [randn(gen, T, d, dtype=dtype) * (0.5 + i % 3) for i in range(S)]
    keys = [randn(gen, T, r, dtype=dtype) for _ in range(S)] if projected else None
    qs = [(randn(gen, r) * (2.0 / r**0.5)).to(qdtype) for _ in range(K)]
    parts = [randn(gen, T, d, dtype=dtype) * 1.5 for _ in range(K - 1)]
    pkeys = [randn(gen, T, r, dtype=dtype) for _ in range(K - 1)] if projected else []
    leaves = [*qs, *values, *(keys or []), *parts, *pkeys]
    for t in leaves:
        t.requires_grad_()
    outs, lse = depth_read_multi(values, torch.stack(qs), keys, backend=backend, split=True)
    hs = [outs[0]] + [depth_merge(outs[k], lse[k], parts[k - 1], qs[k],
                                  pkeys[k - 1] if projected else None, backend=backend)
                      for k in range(1, K)]
    gs = [randn(gen, T, d, dtype=dtype) for _ in range(K)]
    grads = torch.autograd.grad(hs, leaves, gs)
    rl = up(leaves)
    rq, rv = rl[:K], rl[K:K + S]
    rk = rl[K + S:K + 2 * S] if projected else None
    rp = rl[K + (2 if projected else 1) * S:][:K - 1]
    rpk = rl[K + 2 * S + K - 1:] if projected else []
    refs = [depth_read_naive(rv, rq[0], rk)] + [
        depth_read_naive([*rv, rp[k - 1]], rq[k], [*rk, rpk[k - 1]] if projected else None)
        for k in range(1, K)]
    ref_grads = torch.autograd.grad(refs, rl, [g.double() for g in gs])
    names = ([f"q{k}" for k in range(K)] + [f"values[{i}]" for i in range(S)]
             + [f"keys[{i}]" for i in range(S if projected else 0)]
             + [f"P{k}" for k in range(1, K)]
             + [f"Pkey{k}" for k in range(1, K if projected else 1)])
    errs = {f"h{k}": rel_rms(h, ref) for k, (h, ref) in enumerate(zip(hs, refs))}
    floor = 1e-1 * gs[0].double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype, MERGED)
