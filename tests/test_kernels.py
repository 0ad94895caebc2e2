"""Fused Triton depth read against the reference: every output and every gradient.

On CPU the kernels run under ``TRITON_INTERPRET=1`` on small shapes; the large bf16 shapes
run only where CUDA is present (the GPU box). Errors are relative RMS against float64
``depth_read_naive`` on the same (upcast) random inputs, with one tolerance table.
"""

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import lrattn_kernels.depth_read as kdr  # noqa: E402
from megatron_lrattn.ops import depth_read  # noqa: E402
from megatron_lrattn.ops.reference import depth_read_naive, depth_read_torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kdr._fwd_kernel, InterpretedFunction):
        kdr = importlib.reload(kdr)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"  # triton's interpreter
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="large shapes need a CUDA GPU (GPU box)")

# relative RMS error vs the float64 formula, per input dtype
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-filled buffers (an unwritten element fails the comparison), each followed by NaN
    guard elements that must still be NaN after the test (no write past a buffer)."""
    monkeypatch.setattr(kdr, "POISON", True)
    kdr.GUARDED.clear()
    yield
    bad = kdr.guards_intact()
    assert not bad, f"kernels wrote past the end of buffers (size, guard indices): {bad}"


@pytest.fixture(autouse=True, params=[0, 1], ids=["row_tiled", "source_tiled"])
def impl(request, monkeypatch):
    """Every test runs on both kernel families: token-tiled (``TUNE["impl"] = 0``) and
    source-tiled (1: one token row per program, BL sources per step)."""
    monkeypatch.setitem(kdr.TUNE, "impl", request.param)
    return request.param


def rel_rms(x, ref, floor=1e-30):
    """RMS(x - ref) / RMS(ref); ``floor`` stands in for RMS(ref) when that is smaller
    (an identically zero reference, e.g. every key gradient of a single source)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(floor)).item()


def make_inputs(T, d, r, S, dtype, projected, lead=(), seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dt)

    shape = (*lead, T)
    values = [(randn(*shape, d) * (0.5 + i % 3)).requires_grad_() for i in range(S)]
    keys = [randn(*shape, r).requires_grad_() for _ in range(S)] if projected else None
    query = (randn(r, dt=torch.float32) * (2.0 / r**0.5)).requires_grad_()
    grad = randn(*shape, d)
    return values, query, keys, grad


def grads_of(fn, values, query, keys, grad, **kw):
    out = fn(values, query, keys, **kw)
    tensors = [query, *values, *(keys or [])]
    gs = torch.autograd.grad(out, tensors, grad)
    return out, list(gs)


def check(T, d, r, S, dtype, projected=False, save_output=True, lead=()):
    values, query, keys, grad = make_inputs(T, d, r, S, dtype, projected, lead)
    out, gs = grads_of(kdr.depth_read_triton, values, query, keys, grad, save_output=save_output)
    up = [v.detach().double().requires_grad_() for v in values]
    kup = [k.detach().double().requires_grad_() for k in keys] if keys else None
    qup = query.detach().double().requires_grad_()
    ref, rgs = grads_of(depth_read_naive, up, qup, kup, grad.double())
    assert out.shape == ref.shape and out.dtype == dtype
    names = ["query"] + [f"values[{i}]" for i in range(S)] + [f"keys[{i}]" for i in range(S if keys else 0)]
    errs = {"out": rel_rms(out, ref)}
    for name, g, rg, t in zip(names, gs, rgs, [query, *values, *(keys or [])]):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        errs[name] = rel_rms(g, rg, floor=1e-1 * grad.double().pow(2).mean().sqrt().item())
    bad = {k: e for k, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"errors over {TOL[dtype]:.0e}: {bad}"
    return errs


STRESS = {
    "sliced": (37, 64, 16, 4, False),
    "projected": (37, 64, 24, 3, True),
    "projected_two_sources": (8, 32, 8, 2, True),
    "attnres_r_eq_d": (9, 48, 48, 5, False),
    "r_one": (9, 32, 1, 3, False),
    "one_source": (9, 32, 8, 1, False),
    "one_source_projected": (9, 32, 8, 1, True),
    "many_sources": (5, 16, 4, 40, False),
    "many_sources_projected": (3, 16, 5, 33, True),
    "odd_d_1000": (3, 1000, 250, 3, False),
    "one_token": (1, 40, 10, 3, False),
    "three_tokens": (3, 24, 6, 4, True),
}


@pytest.mark.parametrize("save_output", [True, False], ids=["saved_out", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(STRESS))
def test_parity(name, dtype, save_output):
    T, d, r, S, projected = STRESS[name]
    check(T, d, r, S, dtype, projected, save_output)


def test_fp16_and_leading_dims():
    check(5, 40, 12, 3, torch.float16, lead=(2,))
    check(4, 32, 32, 3, torch.float32, projected=True, lead=(2, 3))


def test_reference_backend_meets_the_same_table():
    values, query, keys, grad = make_inputs(9, 48, 12, 4, torch.bfloat16, False)
    out, gs = grads_of(depth_read_torch, values, query, keys, grad)
    up = [v.detach().double().requires_grad_() for v in values]
    qup = query.detach().double().requires_grad_()
    ref, rgs = grads_of(depth_read_naive, up, qup, None, grad.double())
    assert max(rel_rms(a, b) for a, b in zip([out, *gs], [ref, *rgs])) <= TOL[torch.bfloat16]


def test_strided_sources_use_their_row_stride():
    T, d, r, S = 6, 32, 8, 3
    values, query, keys, grad = make_inputs(T, d + 5, r, S, torch.float32, True)
    wide = [v.detach() for v in values]
    narrow = [w[:, 2:2 + d].requires_grad_() for w in wide]
    kwide = [torch.randn(T, r + 3, device=DEVICE) for _ in range(S)]
    knarrow = [k[:, :r].requires_grad_() for k in kwide]
    g = grad[:, :d]
    out, gs = grads_of(kdr.depth_read_triton, narrow, query, knarrow, g)
    ref, rgs = grads_of(depth_read_torch, narrow, query, knarrow, g)
    for a, b in zip([out, *gs], [ref, *rgs]):
        assert rel_rms(a, b) <= TOL[torch.float32]


def test_zero_query_is_the_mean():
    values, query, _, _ = make_inputs(7, 24, 6, 5, torch.float32, False)
    out = kdr.depth_read_triton(values, torch.zeros_like(query))
    torch.testing.assert_close(out, torch.stack(values).mean(0), rtol=1e-6, atol=1e-6)


def test_backward_is_deterministic():
    for projected in (False, True):
        values, query, keys, grad = make_inputs(37, 64, 16, 5, torch.bfloat16, projected)
        _, first = grads_of(kdr.depth_read_triton, values, query, keys, grad)
        _, second = grads_of(kdr.depth_read_triton, values, query, keys, grad)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


@pytest.mark.parametrize("projected", [False, True])
def test_prefetch_does_not_change_results(projected, monkeypatch):
    values, query, keys, grad = make_inputs(9, 48, 12, 4, torch.bfloat16, projected)
    monkeypatch.setitem(kdr.TUNE, "prefetch", 1)
    out_a, grads_a = grads_of(kdr.depth_read_triton, values, query, keys, grad)
    monkeypatch.setitem(kdr.TUNE, "prefetch", 0)
    out_b, grads_b = grads_of(kdr.depth_read_triton, values, query, keys, grad)
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_dispatch_through_the_public_op():
    values, query, _, _ = make_inputs(5, 32, 8, 3, torch.float32, False)
    a = depth_read(values, query, backend="triton")
    assert torch.equal(a, kdr.depth_read_triton(values, query))


def test_zero_tokens():
    values, query, keys, grad = make_inputs(0, 16, 4, 3, torch.float32, True)
    out, gs = grads_of(kdr.depth_read_triton, values, query, keys, grad)
    assert out.shape == (0, 16) and all(g.abs().sum() == 0 for g in gs)


@pytest.mark.parametrize(
    "case, match",
    [
        ("wide", "d=8193"),
        ("many", "S=257"),
        ("fp64", "float64"),
        ("sliced_r_over_d", "1 <= r <= d"),
        ("projected_r_too_wide", "projected r=8193"),
    ],
)
def test_envelope_errors(case, match):
    v = [torch.randn(1, 16, device=DEVICE)]
    q = torch.randn(4, device=DEVICE)
    keys = None
    if case == "wide":
        v = [torch.randn(1, 8193, device=DEVICE)]
    elif case == "many":
        v = v * 257
    elif case == "fp64":
        v = [v[0].double()]
    elif case == "sliced_r_over_d":
        q = torch.randn(17, device=DEVICE)
    else:
        q = torch.randn(8193, device=DEVICE)
        keys = [torch.randn(1, 8193, device=DEVICE)]
    with pytest.raises(ValueError, match=match):
        kdr.depth_read_triton(v, q, keys)


GPU_SHAPES = {
    "d2048_S9_sliced": (4096, 2048, 512, 9, False),
    "d4096_S9_attnres": (4096, 4096, 4096, 9, False),
    "d4096_S17_projected": (2048, 4096, 1024, 17, True),
    "d2560_S9_sliced": (3001, 2560, 640, 9, False),
    "d3072_S9_attnres": (2048, 3072, 3072, 9, False),
    "d8192_S9_sliced": (1024, 8192, 2048, 9, False),
    "d1000_S64_sliced": (777, 1000, 250, 64, False),
    "d1024_S64_projected": (1024, 1024, 256, 64, True),
}


@needs_cuda
@pytest.mark.parametrize("save_output", [True, False], ids=["saved_out", "recompute"])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_parity_large_bf16(name, save_output):
    T, d, r, S, projected = GPU_SHAPES[name]
    check(T, d, r, S, torch.bfloat16, projected, save_output)


@needs_cuda
@pytest.mark.parametrize("save_output", [True, False], ids=["saved_out", "recompute"])
@pytest.mark.parametrize("name", ["d2048_S9_sliced", "d2560_S9_sliced", "d8192_S9_sliced",
                                  "d1000_S64_sliced"])
def test_key_chunk_off_large_bf16(name, save_output, monkeypatch):
    """The backward with the sliced keys read inside the value rows (src_bwd_key_chunk=0;
    the default reads them as rows of their own), at the large shapes."""
    monkeypatch.setitem(kdr.TUNE, "src_bwd_key_chunk", 0)
    T, d, r, S, projected = GPU_SHAPES[name]
    check(T, d, r, S, torch.bfloat16, projected, save_output)


@pytest.mark.parametrize("projected", [False, True])
def test_source_tiles_and_stages(projected, impl, monkeypatch):
    """Source-tiled kernels at other tiles (BL = 1, 2, 4, 8 sources per step, 1-3 pipeline
    stages, few persistent backward programs, hand pipelining on or off, row sums fused or
    separate) meet the same table."""
    if impl != 1:
        pytest.skip("source-tiled kernels only")
    T, d, r, S, _ = STRESS["projected" if projected else "sliced"]
    for bl, stages, ctas, pf, fs in ((1, 1, 1, 1, 0), (2, 3, 2, 0, 1), (8, 2, 8, 1, 1),
                                     (4, 2, 4, 0, 0), (4, 1, 3, 1, 1)):
        for pre in ("src_", "src_bwd_"):
            monkeypatch.setitem(kdr.TUNE, pre + "sources", bl)
            monkeypatch.setitem(kdr.TUNE, pre + "stages", stages)
            monkeypatch.setitem(kdr.TUNE, pre + "prefetch", pf)
            monkeypatch.setitem(kdr.TUNE, pre + "fused_sums", fs)
        monkeypatch.setitem(kdr.TUNE, "src_ctas_per_sm", ctas)
        for dtype in (torch.float32, torch.bfloat16):
            check(T, d, r, S + 5, dtype, projected)


@pytest.mark.parametrize("key_chunk", [1, 0], ids=["key_rows", "keys_in_rows"])
@pytest.mark.parametrize("name", ["sliced", "r_one", "one_source", "many_sources",
                                  "odd_d_1000", "one_token"])
def test_key_chunk_backward(name, key_chunk, impl, monkeypatch):
    """The source-tiled backward with the sliced keys read as rows of their own (the
    default, src_bwd_key_chunk=1; r-wide query gradient and correction, dv stored in two
    parts) or inside the value rows (0) meets the same table: fp32 and bf16, saved output
    or not, hand pipelining on and off, key offsets d - r that are whole 16-byte vectors
    and ones that are not (d=1000)."""
    if impl != 1:
        pytest.skip("source-tiled kernels only")
    monkeypatch.delitem(kdr.TUNE, "src_bwd_key_chunk", raising=False)
    T, d, r, S, projected = STRESS[name]
    assert kdr._src_key_chunk(d, r)  # the default where r pads to less than the row
    monkeypatch.setitem(kdr.TUNE, "src_bwd_key_chunk", key_chunk)
    assert kdr._src_key_chunk(d, r) == bool(key_chunk)
    for dtype in (torch.float32, torch.bfloat16):
        for save_output in (True, False):
            check(T, d, r, S, dtype, projected, save_output)
    monkeypatch.setitem(kdr.TUNE, "src_bwd_prefetch", 0)
    check(T, d, r, S, torch.bfloat16, projected, True)


@pytest.mark.parametrize("key_chunk", [0, 1])
def test_query_gradient_with_near_identical_sources(key_chunk, impl, monkeypatch):
    """bf16 sources that differ by 1%: the saved bf16 output's rounding is then of the
    order of <g, v_i> - delta itself, and the query gradient (a sum over tokens) is exact
    only through the backward's correction term (the source-tiled backward with the
    correction removed fails this test), with the keys read inside the rows or as rows of
    their own (source-tiled kernels; the token-tiled ones have no such mode)."""
    if impl != 1 and key_chunk:
        pytest.skip("key rows of their own: source-tiled kernels only")
    monkeypatch.setitem(kdr.TUNE, "src_bwd_key_chunk", key_chunk)
    T, d, r, S = 64, 64, 16, 6
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    base = torch.randn(T, d, generator=gen, device=DEVICE)
    values = [(base + 0.01 * torch.randn(T, d, generator=gen, device=DEVICE)).to(
        torch.bfloat16).requires_grad_() for _ in range(S)]
    query = (torch.randn(r, generator=gen, device=DEVICE) * 0.5).requires_grad_()
    grad = torch.randn(T, d, generator=gen, device=DEVICE).to(torch.bfloat16)
    _, gs = grads_of(kdr.depth_read_triton, values, query, None, grad, save_output=True)
    up = [v.detach().double().requires_grad_() for v in values]
    qup = query.detach().double().requires_grad_()
    _, rgs = grads_of(depth_read_naive, up, qup, None, grad.double())
    assert rel_rms(gs[0], rgs[0]) <= TOL[torch.bfloat16]


def test_kernel_family_defaults(monkeypatch):
    """d >= SRC_MIN_WIDTH takes the source-tiled kernels, narrower rows the token-tiled
    ones; TUNE["impl"] overrides either way."""
    monkeypatch.delitem(kdr.TUNE, "impl", raising=False)
    assert kdr._impl(kdr.SRC_MIN_WIDTH) == "src"
    assert kdr._impl(4096) == "src"
    assert kdr._impl(kdr.SRC_MIN_WIDTH - 1) == "row"
    monkeypatch.setitem(kdr.TUNE, "impl", 1)
    assert kdr._impl(64) == "src"
    monkeypatch.setitem(kdr.TUNE, "impl", 0)
    assert kdr._impl(4096) == "row"


def test_register_caps(monkeypatch):
    """The register caps apply where they were measured (4 warps: the backward at padded
    width 2048, the forward at 4096, d=3072 included), TUNE overrides them (0 = none), other
    warps and widths stay uncapped, and the interpreter gets no cap."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for key in ("src_maxnreg", "src_bwd_maxnreg"):
        monkeypatch.delitem(kdr.TUNE, key, raising=False)
    assert kdr._src_launch(2048, 4, True) == {"maxnreg": 128}
    assert kdr._src_launch(2048, 4, False) == {}
    assert kdr._src_launch(3072, 4, False) == {"maxnreg": 128}
    assert kdr._src_launch(4096, 4, True) == {}
    assert kdr._src_launch(2048, 8, True) == {}
    assert kdr._src_launch(8192, 4, False) == {}
    monkeypatch.setitem(kdr.TUNE, "src_bwd_maxnreg", 0)
    assert kdr._src_launch(2048, 4, True) == {}
    monkeypatch.setitem(kdr.TUNE, "src_maxnreg", 96)
    assert kdr._src_launch(1000, 8, False) == {"maxnreg": 96}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kdr._src_launch(1000, 8, False) == {}


def test_alignment_facts():
    """16-byte vectors are declared only when every pointer is 16-byte aligned and every row
    stride (and d / r) is a multiple of 16 bytes' worth of elements, and not for projected
    keys (measured slower with them)."""
    base = torch.zeros(4, 80, dtype=torch.bfloat16)
    al = kdr._alignment([base, base.clone()], [], 80, 80, 128)
    assert al == {"PA": 16, "SA": 8, "SK": 1}
    odd_stride = torch.zeros(4, 90, dtype=torch.bfloat16)[:, :80]  # row stride 90
    assert kdr._alignment([base, odd_stride], [], 80, 80, 128)["SA"] == 1
    shifted = torch.zeros(4 * 80 + 1, dtype=torch.bfloat16)[1:].view(4, 80)  # 2-byte offset
    assert kdr._alignment([base, shifted], [], 80, 80, 128)["PA"] == 1
    assert kdr._alignment([base], [], 84, 84, 128)["SA"] == 1  # d not a multiple of 8
    keys = [torch.zeros(4, 24, dtype=torch.float32)]
    assert kdr._alignment([base], keys, 80, 24, 128) == {"PA": 1, "SA": 8, "SK": 4}  # no hints


def test_pointer_tables_share_one_buffer():
    """The pointer tables of one call are staged in one buffer, one (pointers, strides) pair
    per group, each group starting on a 16-byte boundary."""
    a = [torch.zeros(3, 8), torch.zeros(5, 8)[:, :4]]
    b = [torch.zeros(2, 6)]
    c = [torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2)]
    (pa, sa), (pb, sb), (pc, sc) = kdr._tables(a, b, c)
    assert pa.tolist() == [t.data_ptr() for t in a] and sa.tolist() == [8, 8]
    assert pb.tolist() == [b[0].data_ptr()] and sb.tolist() == [6]
    assert pc.tolist() == [t.data_ptr() for t in c] and sc.tolist() == [2, 2, 2]
    for p in (pa, pb, pc):
        assert p.data_ptr() % 16 == 0
    assert pa.untyped_storage().data_ptr() == pc.untyped_storage().data_ptr()
