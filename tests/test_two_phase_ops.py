"""Two-phase block ops (``depth_read_multi``, ``depth_merge``), both backends, against
float64 naive formulas: every output and every gradient (each source, each query, each
projected key, the partial sum and its key, and the lse gradient path).

On CPU the Triton backend runs under ``TRITON_INTERPRET=1`` on small shapes; the large bf16
shapes run only where CUDA is present (the GPU box). One tolerance table, relative RMS.
"""

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import lrattn_kernels.depth_merge as kmg  # noqa: E402
import lrattn_kernels.depth_read as kdr  # noqa: E402
import lrattn_kernels.depth_read_multi as kmr  # noqa: E402
import lrattn_kernels.multi_chunked as kmc  # noqa: E402
from megatron_lrattn.ops import (  # noqa: E402
    depth_merge,
    depth_merge_update,
    depth_read,
    depth_read_multi,
    depth_read_multi_naive,
    depth_read_naive,
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    for mod, kernel in ((kdr, "_fwd_kernel"), (kmr, "_fwd_kernel"), (kmg, "_fwd_kernel"),
                        (kmc, "_values_kernel")):
        if not isinstance(getattr(mod, kernel), InterpretedFunction):
            importlib.reload(mod)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="large shapes need a CUDA GPU (GPU box)")
BACKENDS = ["torch", "triton"]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# A merged read is rounded twice (the phase-1 output is stored in the activation dtype, then
# merged), and the interpreter converts fp32 to bf16 by truncation (the GPU rounds to
# nearest): merged results get twice the table.
MERGED = 2.0


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-filled buffers (an unwritten element fails the comparison), each followed by NaN
    guard elements that must still be NaN after the test (no write past a buffer)."""
    monkeypatch.setattr(kdr, "POISON", True)
    kdr.GUARDED.clear()
    yield
    bad = kdr.guards_intact()
    assert not bad, f"kernels wrote past the end of buffers (size, guard indices): {bad}"


def rel_rms(x, ref, floor=1e-30):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(floor)).item()


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def make(T, d, r, S, K, dtype, projected, seed=0, lead=()):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (*lead, T)
    values = [(randn(gen, *shape, d, dtype=dtype) * (0.5 + i % 3)) for i in range(S)]
    keys = [randn(gen, *shape, r, dtype=dtype) for _ in range(S)] if projected else None
    qdtype = torch.float64 if dtype == torch.float64 else torch.float32
    queries = randn(gen, K, r, dtype=qdtype) * (2.0 / r**0.5)
    return gen, values, keys, queries


def up(ts):
    return None if ts is None else [t.detach().double().requires_grad_() for t in ts]


def assert_table(errs, dtype, factor=1.0):
    tol = TOL[dtype] * (1.0 if dtype in (torch.float32, torch.float64) else factor)
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"errors over {tol:.0e}: {bad}"


def grad_errors(errs, names, grads, ref_grads, leaves, floor):
    """Add each leaf's gradient error (relative RMS, ``floor`` for tiny references) to
    ``errs``; every gradient must have its leaf's dtype and shape."""
    for name, gr, rg, t in zip(names, grads, ref_grads, leaves):
        assert gr.dtype == t.dtype and gr.shape == t.shape, name
        errs[name] = rel_rms(gr, rg, floor=floor)
    return errs


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


# (T, d, r, S, K, projected)
STRESS = {
    "sliced": (13, 64, 16, 4, 3, False),
    "projected": (13, 64, 24, 3, 6, True),
    "attnres_r_eq_d": (7, 48, 48, 3, 2, False),
    "one_source_one_query": (9, 32, 8, 1, 1, False),
    "one_source_projected": (5, 32, 8, 1, 2, True),
    "many_sources": (3, 16, 4, 33, 6, False),
    "many_sources_projected": (2, 16, 5, 34, 7, True),
    "odd_d_1000": (3, 1000, 250, 3, 6, False),
    "one_token": (1, 40, 10, 3, 6, False),
    "r_one": (5, 24, 1, 3, 2, False),
    "wide_d4096": (2, 4096, 1024, 3, 2, False),  # phase-1 dot chunks wider than 256
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(STRESS))
def test_multi_parity(name, dtype, backend):
    T, d, r, S, K, projected = STRESS[name]
    check_multi(T, d, r, S, K, dtype, projected, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_split_fp16_and_leading_dims(backend):
    check_multi(5, 40, 12, 3, 3, torch.float16, False, backend, split=True, lead=(2,))
    check_multi(4, 32, 8, 2, 2, torch.float32, True, backend, split=True, lead=(2,))


MERGE = {
    "sliced": (13, 64, 16, 4, False),
    "projected": (13, 64, 24, 3, True),
    "attnres_r_eq_d": (7, 48, 48, 2, False),
    "one_source": (9, 32, 8, 1, False),
    "many_sources": (3, 16, 4, 33, False),
    "odd_d_1000": (3, 1000, 250, 2, True),
    "one_token": (1, 40, 10, 3, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MERGE))
def test_merge_equals_read_over_sources_and_partial(name, dtype, backend):
    T, d, r, S, projected = MERGE[name]
    check_merge(T, d, r, S, dtype, projected, backend)


@pytest.mark.parametrize("projected", [False, True])
def test_torch_reference_in_float64(projected):
    check_multi(7, 24, 8, 3, 4, torch.float64, projected, "torch")
    check_merge(7, 24, 8, 3, torch.float64, projected, "torch")


def test_multi_rows_equal_single_site_reads_and_query_groups(monkeypatch):
    """Row k is depth_read with query k; more queries than one kernel group holds."""
    monkeypatch.setattr(kmr, "MAX_TILE", 64)  # d=32 -> groups of 2 queries
    _, values, _, queries = make(6, 32, 8, 3, 5, torch.float32, False)
    out, lse = depth_read_multi(values, queries, backend="triton")
    assert out.shape == (5, 6, 32) and lse.shape == (5, 6)
    for k in range(5):
        torch.testing.assert_close(out[k], depth_read(values, queries[k], backend="triton"),
                                   rtol=1e-6, atol=1e-6)


def test_zero_queries_give_the_mean_and_log_s():
    _, values, _, queries = make(5, 24, 6, 4, 3, torch.float32, False)
    out, lse = depth_read_multi(values, torch.zeros_like(queries), backend="triton")
    torch.testing.assert_close(out, torch.stack(values).mean(0).expand(3, -1, -1))
    torch.testing.assert_close(lse, torch.full_like(lse, float(torch.log(torch.tensor(4.0)))))


def test_backward_is_deterministic():
    for projected in (False, True):
        gen, values, keys, queries = make(37, 64, 16, 4, 6, torch.bfloat16, projected)
        leaves = [queries, *values, *(keys or [])]
        for t in leaves:
            t.requires_grad_()
        g = randn(gen, 6, 37, 64, dtype=torch.bfloat16)
        runs = []
        for _ in range(2):
            out, lse = depth_read_multi(values, queries, keys, backend="triton")
            h = depth_merge(out[1], lse[1], values[0] * 2, queries[1],
                            keys[0] * 2 if projected else None, backend="triton")
            runs.append(torch.autograd.grad([out, h], leaves, [g, g[0]]))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


def test_zero_tokens():
    _, values, keys, queries = make(0, 16, 4, 3, 2, torch.float32, True)
    leaves = [queries, *values, *keys]
    for t in leaves:
        t.requires_grad_()
    out, lse = depth_read_multi(values, queries, keys, backend="triton")
    h = depth_merge(out[0], lse[0], values[1], queries[0], keys[1], backend="triton")
    assert out.shape == (2, 0, 16) and lse.shape == (2, 0) and h.shape == (0, 16)
    grads = torch.autograd.grad([out, h], leaves, [torch.ones_like(out), torch.ones_like(h)])
    assert all(g.abs().sum() == 0 for g in grads)


def test_argument_errors():
    v = [torch.randn(3, 16, device=DEVICE)]
    with pytest.raises(ValueError, match=r"\[K, r\]"):
        depth_read_multi(v, torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="lse"):
        depth_merge(v[0], torch.zeros(4, device=DEVICE), v[0], torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        depth_merge(v[0], torch.zeros(3, device=DEVICE), v[0], torch.randn(4, device=DEVICE),
                    backend="cuda")
    with pytest.raises(ValueError, match="d=8193"):
        depth_read_multi([torch.randn(1, 8193, device=DEVICE)], torch.randn(2, 4, device=DEVICE),
                         backend="triton")


# (T, d, r, S, K, projected): block reads of the L=24, N=8 schedule and wider models
GPU_SHAPES = {
    "d2048_S5_K6_sliced": (4096, 2048, 512, 5, 6, False),
    "d2048_S9_K6_attnres": (4096, 2048, 2048, 9, 6, False),
    "d4096_S9_K6_sliced": (2048, 4096, 1024, 9, 6, False),
    "d2048_S9_K6_projected": (3001, 2048, 512, 9, 6, True),
    "d1000_S40_K8_sliced": (777, 1000, 250, 40, 8, False),
    "d8192_S3_K3_sliced": (512, 8192, 2048, 3, 3, False),
}


@needs_cuda
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_multi_parity_large_bf16(name):
    T, d, r, S, K, projected = GPU_SHAPES[name]
    check_multi(T, d, r, S, K, torch.bfloat16, projected, "triton")


@needs_cuda
@pytest.mark.parametrize("name", ["d2048_S5_K6_sliced", "d2048_S9_K6_projected",
                                  "d4096_S9_K6_sliced", "d8192_S3_K3_sliced"])
def test_merge_parity_large_bf16(name):
    T, d, r, S, _, projected = GPU_SHAPES[name]
    check_merge(T, d, r, S, torch.bfloat16, projected, "triton")


@pytest.mark.parametrize("projected", [False, True])
def test_prefetch_does_not_change_results(projected, monkeypatch):
    gen, values, keys, queries = make(9, 48, 12, 4, 3, torch.bfloat16, projected)
    values = values[:2] if projected else values  # S=2 < depth 3 on the projected run
    keys = keys[:2] if projected else keys
    leaves = [queries, *values, *(keys or [])]
    for t in leaves:
        t.requires_grad_()
    g = randn(gen, 3, 9, 48, dtype=torch.bfloat16)
    runs = []
    for pf in (0, 1, 2, 3):
        monkeypatch.setitem(kdr.TUNE, "multi_prefetch", pf)
        monkeypatch.setitem(kdr.TUNE, "multi_bwd_prefetch", pf)
        out, lse = depth_read_multi(values, queries, keys, backend="triton")
        runs.append([out, lse, *torch.autograd.grad([out, lse], leaves, [g, lse])])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


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
             + [f"P{k}" for k in range(1, K)] + [f"Pkey{k}" for k in range(1, K if projected else 1)])
    errs = {f"h{k}": rel_rms(h, ref) for k, (h, ref) in enumerate(zip(hs, refs))}
    floor = 1e-1 * gs[0].double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype, MERGED)


# The depth blocks of the models whose two-phase training went wrong on an H200 (tiny
# preset: d=128, N=4 of 8 sub-layers; study-25m: d=512, N=8 of 16), with the model's token
# count per micro-batch; the large shapes above (T*d big enough that a phase-1 program holds
# 1-2 tokens) were the only ones the GPU had run. Here phase-1 programs hold 16-128 tokens
# and 1-2 queries. (T, d, r, projected, [(S, K), ...])
MODEL_BLOCKS = {
    "tiny_attnres": (1024, 128, 128, False, [(1, 1), (2, 2), (3, 2), (5, 1)]),
    "tiny_sliced": (1024, 128, 32, False, [(1, 1), (2, 2), (4, 2), (5, 1)]),
    "study25m_sliced": (4096, 512, 128, False, [(1, 1), (2, 2), (5, 2), (9, 1)]),
    "study25m_projected": (4096, 512, 32, True, [(1, 1), (3, 2), (9, 1)]),
    "1b_sliced_control": (1024, 2048, 512, False, [(1, 3), (5, 4), (9, 1)]),
}


@pytest.mark.parametrize("name", ["tiny_attnres", "tiny_sliced", "study25m_projected"])
def test_model_block_pattern_bf16_small(name):
    """CPU-sized version of the model blocks (interpreter): more than one phase-1 program of
    many tokens, bf16 sources and bf16 queries, split outputs, merges."""
    _, d, r, projected, blocks = MODEL_BLOCKS[name]
    d, r = min(d, 128), min(r, 32) if projected else min(r, d)
    T = 160 if d == 128 else 96
    for S, K in blocks[:2] + blocks[-1:]:
        check_block(T, d, r, S, K, projected, "triton")


@needs_cuda
@pytest.mark.parametrize("name", list(MODEL_BLOCKS))
def test_model_block_pattern_bf16_gpu(name):
    T, d, r, projected, blocks = MODEL_BLOCKS[name]
    for S, K in blocks:
        check_block(T, d, r, S, K, projected, "triton")


@pytest.mark.parametrize("projected", [False, True])
def test_multi_2d_variant_matches(projected, monkeypatch):
    """The 2-D phase-1 kernels (``TUNE["multi_impl"] = 2``): the stress shapes' checks and the
    model block pattern (bf16 sources and queries, several programs of many tokens)."""
    monkeypatch.setitem(kdr.TUNE, "multi_impl", 2)
    name = "projected" if projected else "sliced"
    T, d, r, S, K, _ = STRESS[name]
    for dtype in (torch.float32, torch.bfloat16):
        check_multi(T, d, r, S, K, dtype, projected, "triton")
    check_multi(*STRESS["many_sources"][:5], torch.float32, False, "triton")
    monkeypatch.setitem(kdr.TUNE, "multi2d_tile", 1024)  # d=64: 16 tokens per program
    check_block(40, 64, 16, 3, 2, projected, "triton")
    check_block(40, 64, 16 if projected else 64, 1, 1, projected, "triton")


@pytest.mark.parametrize("projected", [False, True])
def test_multi_many_token_programs_match(projected, monkeypatch):
    """Phase-1 programs of several tokens (``TUNE["multi_tile"]``; the default is one token
    per program because the compiled kernels got BT > 1 wrong on an H200, see
    ``_tiles``): under the interpreter the 3-D tiles [BT > 1, BK, BD] stay exact."""
    monkeypatch.setitem(kdr.TUNE, "multi_tile", 16384)
    name = "projected" if projected else "sliced"
    T, d, r, S, K, _ = STRESS[name]
    for dtype in (torch.float32, torch.bfloat16):
        check_multi(T, d, r, S, K, dtype, projected, "triton")
    check_block(40, 64, 16, 3, 2, projected, "triton")


CHUNKED_TILES = {
    "keys_prefetch_3": dict(mc_keys_prefetch=3),
    "prefetch_2": dict(mc_prefetch=2, mc_dots_prefetch=2, mc_keys_prefetch=2),
    "prefetch_3": dict(mc_prefetch=3, mc_dots_prefetch=3),
    "narrow_chunks": dict(mc_chunk=16, mc_dots_chunk=16, mc_bwd_chunk=16, mc_logit_chunk=16),
    "mixed_chunks": dict(mc_chunk=32, mc_dots_chunk=16, mc_bwd_chunk=32, mc_logit_tokens=16,
                         mc_ctas_per_sm=1),
    # the dot pass's value gradients ending inside one of its chunks
    "wide_dots_narrow_grads": dict(mc_dots_chunk=64, mc_bwd_chunk=16),
    # every source's logits in one program (online lse)
    "logits_unsplit": dict(mc_logit_split=0, mc_logit_tokens=64),
}


@pytest.mark.parametrize("tiles", list(CHUNKED_TILES))
@pytest.mark.parametrize("name", ["sliced", "projected", "attnres_r_eq_d", "r_one",
                                  "many_sources"])
def test_multi_chunked_tiles_match(name, tiles, monkeypatch):
    """The width-chunked phase 1 at other tiles: several column chunks per row in every pass
    (key columns starting inside a chunk, dot partials over several chunks), logit chunks
    that do not divide r, and one to three sources in flight in every value pass."""
    for key, value in CHUNKED_TILES[tiles].items():
        monkeypatch.setitem(kdr.TUNE, key, value)
    T, d, r, S, K, projected = STRESS[name]
    check_multi(T, d, r, S, K, torch.float32, projected, "triton")



def check_merge_update(T, d, r, S, projected, dtype, backend, use=("h", "P")):
    """depth_merge_update(phase 1 over S sources, P_prev, y): h == depth_read over
    [sources..., P_prev + y] and P == P_prev + y (bit for bit), every gradient (the upstream
    gradient reaches h, P or both)."""
    gen, values, keys, queries = make(T, d, r, S, 1, dtype, projected, seed=2)
    prev = randn(gen, T, d, dtype=dtype) * 1.5
    y = randn(gen, T, d, dtype=dtype)
    pkey = randn(gen, T, r, dtype=dtype) if projected else None
    query = queries[0]
    leaves = [query, prev, y, *values, *(keys or []), *([pkey] if projected else [])]
    for t in leaves:
        t.requires_grad_()
    out, lse = depth_read_multi(values, query[None], keys, backend=backend)
    h, P = depth_merge_update(out[0], lse[0], prev, y, query, pkey, backend=backend)
    if dtype == torch.float32 or CUDA or backend == "torch":
        assert torch.equal(P.detach(), (prev + y).detach())
    else:  # the interpreter rounds fp32 -> bf16 by truncation (the GPU to nearest, as torch)
        assert rel_rms(P.detach(), (prev + y).detach()) <= TOL[dtype]
    g_h, g_p = randn(gen, T, d, dtype=dtype), randn(gen, T, d, dtype=dtype)
    outs, ups = zip(*[(t, g) for name, t, g in (("h", h, g_h), ("P", P, g_p)) if name in use])
    grads = torch.autograd.grad(outs, leaves, ups, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    rl = up(leaves)
    rq, rprev, ry, rv = rl[0], rl[1], rl[2], rl[3:3 + S]
    rk = [*rl[3 + S:3 + 2 * S], rl[-1]] if projected else None
    rP = rprev + ry
    ref_h = depth_read_naive([*rv, rP], rq, rk)
    ref = dict(h=ref_h, P=rP)
    ref_grads = torch.autograd.grad([ref[n] for n in use], rl,
                                    [dict(h=g_h, P=g_p)[n].double() for n in use],
                                    allow_unused=True)
    names = ["query", "partial", "update"] + [f"values[{i}]" for i in range(S)] + (
        [f"keys[{i}]" for i in range(S)] + ["partial_key"] if projected else [])
    errs = {"h": rel_rms(h, ref_h)}
    floor = 1e-1 * g_h.double().pow(2).mean().sqrt().item()
    for name, gr, rg, t in zip(names, grads, ref_grads, leaves):
        assert gr.dtype == t.dtype and gr.shape == t.shape, name
        errs[name] = rel_rms(gr, torch.zeros_like(gr, dtype=torch.float64) if rg is None
                             else rg, floor=floor)
    assert_table(errs, dtype, MERGED)


MERGE_UPDATE = {
    "sliced": (13, 64, 16, 3, False),
    "projected": (11, 48, 12, 2, True),
    "attnres_r_eq_d": (7, 40, 40, 2, False),
    "one_source": (5, 32, 8, 1, False),
    "odd_d_1000": (3, 1000, 250, 2, False),
    "one_token": (1, 24, 6, 3, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MERGE_UPDATE))
def test_merge_update_equals_read_over_updated_partial(name, dtype, backend):
    check_merge_update(*MERGE_UPDATE[name], dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", [("h",), ("P",)], ids=["h_only", "P_only"])
@pytest.mark.parametrize("projected", [False, True])
def test_merge_update_with_one_output_used(projected, use, backend):
    T, d, r, S = (9, 48, 12, 2)
    check_merge_update(T, d, r, S, projected, torch.float32, backend, use=use)


@needs_cuda
@pytest.mark.parametrize("name", ["d2048_sliced", "d2048_attnres", "d4096_projected"])
def test_merge_update_parity_large_bf16(name):
    T, d, r, projected = {"d2048_sliced": (4096, 2048, 512, False),
                          "d2048_attnres": (4096, 2048, 2048, False),
                          "d4096_projected": (2048, 4096, 1024, True)}[name]
    check_merge_update(T, d, r, 5, projected, torch.bfloat16, "triton")


def _rms_norm64(h, w, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def check_merge_norm(T, d, r, S, projected, dtype, backend, update, norm_eps=1e-5):
    """The merge followed by the next sub-layer's RMSNorm (``norm_weight``): the result
    equals rms_norm(depth_read over [sources..., P]) in float64 (P = P_prev + y with
    ``update``), every gradient including the norm weight's; P's own gradient reaches it
    too when ``update``."""
    gen, values, keys, queries = make(T, d, r, S, 1, dtype, projected, seed=3)
    prev = randn(gen, T, d, dtype=dtype) * 1.5
    y = randn(gen, T, d, dtype=dtype)
    pkey = randn(gen, T, r, dtype=dtype) if projected else None
    w = (1.0 + 0.5 * randn(gen, d)).to(dtype)
    query = queries[0]
    leaves = [query, w, prev, *([y] if update else []), *values, *(keys or []),
              *([pkey] if projected else [])]
    for t in leaves:
        t.requires_grad_()
    out, lse = depth_read_multi(values, query[None], keys, backend=backend)
    g = randn(gen, T, d, dtype=dtype)
    g_p = randn(gen, T, d, dtype=dtype)
    if update:
        x, P = depth_merge_update(out[0], lse[0], prev, y, query, pkey, backend=backend,
                                  norm_weight=w, norm_eps=norm_eps)
        grads = torch.autograd.grad([x, P], leaves, [g, g_p])
    else:
        x = depth_merge(out[0], lse[0], prev, query, pkey, backend=backend, norm_weight=w,
                        norm_eps=norm_eps)
        grads = torch.autograd.grad(x, leaves, g)
    rl = up(leaves)
    n = 3 + int(update)
    rq, rw, rP, rv = rl[0], rl[1], rl[2], rl[n:n + S]
    if update:
        rP = rP + rl[3]
    rk = [*rl[n + S:n + 2 * S], rl[-1]] if projected else None
    ref = _rms_norm64(depth_read_naive([*rv, rP], rq, rk), rw, norm_eps)
    ref_grads = torch.autograd.grad([ref, rP] if update else ref, rl,
                                    [g.double(), g_p.double()] if update else g.double())
    assert x.dtype == dtype and x.shape == (T, d)
    names = ["query", "norm_weight", "partial", *(["update"] if update else []),
             *[f"values[{i}]" for i in range(S)],
             *([f"keys[{i}]" for i in range(S)] + ["partial_key"] if projected else [])]
    errs = {"out": rel_rms(x, ref)}
    floor = 1e-1 * g.double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype, MERGED)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("update", [False, True], ids=["merge", "merge_update"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MERGE_UPDATE))
def test_merge_with_fused_rmsnorm_equals_read_then_norm(name, dtype, update, backend):
    check_merge_norm(*MERGE_UPDATE[name], dtype, backend, update)


@pytest.mark.parametrize("update", [False, True], ids=["merge", "merge_update"])
@pytest.mark.parametrize("name", ["sliced", "projected", "odd_d_1000"])
def test_fused_rmsnorm_two_round_backward_matches(name, update, monkeypatch):
    """The fused-norm backward with the norm's row sums taken before the merge's
    (``merge_norm_mode`` 0) instead of expanded into one round."""
    monkeypatch.setitem(kdr.TUNE, "merge_norm_mode", 0)
    for dtype in (torch.float32, torch.bfloat16):
        check_merge_norm(*MERGE_UPDATE[name], dtype, "triton", update)


def test_fused_rmsnorm_matches_the_torch_module():
    """What the layer fuses: torch.nn.RMSNorm applied to the unfused merge's output."""
    gen, values, _, queries = make(9, 48, 12, 3, 1, torch.float32, False, seed=4)
    prev = randn(gen, 9, 48) * 1.5
    norm = torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * randn(gen, 48))
    out, lse = depth_read_multi(values, queries, backend="triton")
    fused = depth_merge(out[0], lse[0], prev, queries[0], backend="triton",
                        norm_weight=norm.weight, norm_eps=norm.eps)
    plain = norm(depth_merge(out[0], lse[0], prev, queries[0], backend="triton"))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_fused_rmsnorm_backward_is_deterministic():
    gen, values, _, queries = make(37, 64, 16, 3, 1, torch.bfloat16, False, seed=5)
    prev, y = randn(gen, 37, 64, dtype=torch.bfloat16), randn(gen, 37, 64, dtype=torch.bfloat16)
    w = (1.0 + randn(gen, 64)).to(torch.bfloat16)
    leaves = [queries, w, prev, y, *values]
    for t in leaves:
        t.requires_grad_()
    g = randn(gen, 37, 64, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        out, lse = depth_read_multi(values, queries, backend="triton")
        x, P = depth_merge_update(out[0], lse[0], prev, y, queries[0], backend="triton",
                                  norm_weight=w, norm_eps=1e-5)
        runs.append(torch.autograd.grad([x, P], leaves, [g, g]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_fused_rmsnorm_argument_errors():
    v = torch.randn(3, 16, device=DEVICE)
    lse, q = torch.zeros(3, device=DEVICE), torch.randn(4, device=DEVICE)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"norm_weight must be \[d\] = \[16\]"):
            depth_merge(v, lse, v, q, backend=backend, norm_weight=torch.ones(8, device=DEVICE),
                        norm_eps=1e-5)
        with pytest.raises(ValueError, match="norm_eps must be a finite number > 0"):
            depth_merge_update(v, lse, v, v, q, backend=backend,
                               norm_weight=torch.ones(16, device=DEVICE))
        with pytest.raises(ValueError, match="without norm_weight"):
            depth_merge(v, lse, v, q, backend=backend, norm_eps=1e-5)


def test_unknown_fused_norm_mode_is_refused(monkeypatch):
    monkeypatch.setitem(kdr.TUNE, "merge_norm_mode", 1)
    gen, values, _, queries = make(5, 32, 8, 2, 1, torch.float32, False, seed=6)
    prev = randn(gen, 5, 32).requires_grad_()
    out, lse = depth_read_multi(values, queries, backend="triton")
    x = depth_merge(out[0], lse[0], prev, queries[0], backend="triton",
                    norm_weight=torch.ones(32, device=DEVICE), norm_eps=1e-5)
    with pytest.raises(ValueError, match="merge_norm_mode=1, allowed: 0"):
        x.sum().backward()


@needs_cuda
@pytest.mark.parametrize("update", [False, True], ids=["merge", "merge_update"])
@pytest.mark.parametrize("name", ["d2048_sliced", "d2048_attnres", "d4096_projected"])
def test_merge_with_fused_rmsnorm_parity_large_bf16(name, update):
    T, d, r, projected = {"d2048_sliced": (4096, 2048, 512, False),
                          "d2048_attnres": (4096, 2048, 2048, False),
                          "d4096_projected": (2048, 4096, 1024, True)}[name]
    check_merge_norm(T, d, r, 5, projected, torch.bfloat16, "triton", update)
