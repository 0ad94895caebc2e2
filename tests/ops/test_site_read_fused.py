"""Fused Triton depth read against the reference: every output and every gradient.

On CPU the kernels run under ``TRITON_INTERPRET=1`` on small shapes; the large bf16 shapes
run only where CUDA is present (``gpu`` marker, the GPU box). Errors are relative RMS against
float64 ``depth_read_naive`` on the same (upcast) random inputs, with one tolerance table.
"""

import pytest
import torch

pytest.importorskip("triton")

from op_checks import (DEVICE, TOL, assert_table, gpu, grad_errors, rel_rms,  # noqa: E402
                       shape_dtypes, up)

from megatron_lrattn.ops import depth_read, depth_read_naive, depth_read_torch, tuning  # noqa: E402
from megatron_lrattn.ops import triton_utils as tu  # noqa: E402
from megatron_lrattn.ops.site_read import fused  # noqa: E402


@pytest.fixture(autouse=True, params=["token", "source"], ids=lambda family: f"{family}_tiled")
def family(request):
    """Every test runs on both kernel families: token-tiled (one program = tokens x the
    padded width) and source-tiled (one token row per program, BL sources per step)."""
    with tuning.override(family=request.param):
        yield request.param


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
    out, gs = grads_of(fused.depth_read_triton, values, query, keys, grad,
                       save_output=save_output)
    ref, rgs = grads_of(depth_read_naive, up(values), up([query])[0], up(keys), grad.double())
    assert out.shape == ref.shape and out.dtype == dtype
    names = ["query"] + [f"values[{i}]" for i in range(S)] + [
        f"keys[{i}]" for i in range(S if keys else 0)]
    errs = {"out": rel_rms(out, ref)}
    floor = 1e-1 * grad.double().pow(2).mean().sqrt().item()
    grad_errors(errs, names, gs, rgs, [query, *values, *(keys or [])], floor)
    assert_table(errs, dtype)
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
    "odd_d_1000_keys_in_rows": (3, 1000, 600, 3, False),  # pow2(r) == pow2(d): no key rows
    "one_token": (1, 40, 10, 3, False),
    "three_tokens": (3, 24, 6, 4, True),
}


# The larger stress shapes and the recompute mode run in the full suite only: interpreted,
# each takes seconds in the source-tiled family; so do odd_d_1000 there (the token-tiled
# family reads it in the fast tier) and projected_two_sources (three_tokens and
# one_source_projected read projected keys source-tiled in the fast tier).
SLOW_STRESS = ("sliced", "projected", "many_sources", "many_sources_projected",
               "odd_d_1000_keys_in_rows")
SLOW_SOURCE_TILED = ("odd_d_1000", "projected_two_sources")


def _parity_cases():
    """``(family, name, dtype)`` of test_parity, ids ``<family>_tiled-<name>-<dtype>``."""
    cases = []
    for family in ("token", "source"):
        for case in shape_dtypes(STRESS, slow=SLOW_STRESS, fast_fp32=("one_source",)):
            name, dtype = case.values
            marks = list(case.marks)
            if family == "source" and name in SLOW_SOURCE_TILED and not marks:
                marks.append(pytest.mark.slow)
            cases.append(pytest.param(family, name, dtype, id=f"{family}_tiled-{case.id}",
                                      marks=marks))
    return cases


@pytest.mark.parametrize("save_output", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["saved_out", "recompute"])
@pytest.mark.parametrize("family,name,dtype", _parity_cases(), indirect=["family"])
def test_parity(family, name, dtype, save_output):
    T, d, r, S, projected = STRESS[name]
    check(T, d, r, S, dtype, projected, save_output)


# fp16 and leading dimensions: the source-tiled family in the full suite only (seconds
# interpreted), the token-tiled family in the fast tier too
@pytest.mark.parametrize("family", ["token", pytest.param("source", marks=pytest.mark.slow)],
                         ids=["token_tiled", "source_tiled"], indirect=True)
def test_fp16_and_leading_dims(family):
    check(5, 40, 12, 3, torch.float16, lead=(2,))
    check(4, 32, 32, 3, torch.float32, projected=True, lead=(2, 3))


def test_reference_backend_meets_the_same_table():
    values, query, keys, grad = make_inputs(9, 48, 12, 4, torch.bfloat16, False)
    out, gs = grads_of(depth_read_torch, values, query, keys, grad)
    ref, rgs = grads_of(depth_read_naive, up(values), up([query])[0], None, grad.double())
    assert max(rel_rms(a, b) for a, b in zip([out, *gs], [ref, *rgs])) <= TOL[torch.bfloat16]


def test_strided_sources_use_their_row_stride():
    T, d, r, S = 6, 32, 8, 3
    values, query, keys, grad = make_inputs(T, d + 5, r, S, torch.float32, True)
    wide = [v.detach() for v in values]
    narrow = [w[:, 2:2 + d].requires_grad_() for w in wide]
    kwide = [torch.randn(T, r + 3, device=DEVICE) for _ in range(S)]
    knarrow = [k[:, :r].requires_grad_() for k in kwide]
    g = grad[:, :d]
    out, gs = grads_of(fused.depth_read_triton, narrow, query, knarrow, g)
    ref, rgs = grads_of(depth_read_torch, narrow, query, knarrow, g)
    for a, b in zip([out, *gs], [ref, *rgs]):
        assert rel_rms(a, b) <= TOL[torch.float32]


def test_zero_query_is_the_mean():
    values, query, _, _ = make_inputs(7, 24, 6, 5, torch.float32, False)
    out = fused.depth_read_triton(values, torch.zeros_like(query))
    torch.testing.assert_close(out, torch.stack(values).mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_backward_is_deterministic():
    for projected in (False, True):
        values, query, keys, grad = make_inputs(37, 64, 16, 5, torch.bfloat16, projected)
        _, first = grads_of(fused.depth_read_triton, values, query, keys, grad)
        _, second = grads_of(fused.depth_read_triton, values, query, keys, grad)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


def test_dispatch_through_the_public_op():
    values, query, _, _ = make_inputs(5, 32, 8, 3, torch.float32, False)
    a = depth_read(values, query, backend="triton")
    assert torch.equal(a, fused.depth_read_triton(values, query))


def test_zero_tokens():
    values, query, keys, grad = make_inputs(0, 16, 4, 3, torch.float32, True)
    out, gs = grads_of(fused.depth_read_triton, values, query, keys, grad)
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
        fused.depth_read_triton(v, q, keys)


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


@gpu
@pytest.mark.parametrize("save_output", [True, False], ids=["saved_out", "recompute"])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_parity_large_bf16(name, save_output):
    T, d, r, S, projected = GPU_SHAPES[name]
    check(T, d, r, S, torch.bfloat16, projected, save_output)


@pytest.mark.slow
@pytest.mark.parametrize("projected", [False, True])
def test_source_tiles(projected, family):
    """Source-tiled kernels at other tiles (BL = 1, 2, 4, 8 sources per step, few
    persistent backward programs) meet the same table; the tiles alternate between fp32
    and bf16 so that each dtype meets several tiles (each tile in both dtypes took 3 of
    the suite's minutes in the interpreter)."""
    if family != "source":
        pytest.skip("source-tiled kernels only")
    T, d, r, S, _ = STRESS["projected" if projected else "sliced"]
    dtypes = (torch.float32, torch.bfloat16)
    for i, (bl, ctas) in enumerate(((1, 1), (2, 2), (8, 8), (4, 4), (4, 3))):
        tiles = dict(sources=bl)
        with tuning.override(family="source", source_tiled_fwd=tiles,
                             source_tiled_bwd=dict(tiles, programs_per_sm=ctas)):
            check(T, d, r, S + 5, dtypes[(i + projected) % 2], projected)


@pytest.mark.slow
@pytest.mark.parametrize("r", [16, 64], ids=["key_rows", "keys_in_rows"])
def test_query_gradient_with_near_identical_sources(r, family):
    """bf16 sources that differ by 1%: the saved bf16 output's rounding is then of the
    order of <g, v_i> - delta itself, and the query gradient (a sum over tokens) is exact
    only through the backward's correction term (removing it fails this test), with the
    source-tiled backward reading the sliced keys as rows of their own (r < d) or inside
    the value rows (r = d)."""
    T, d, S = 64, 64, 6
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    base = torch.randn(T, d, generator=gen, device=DEVICE)
    values = [(base + 0.01 * torch.randn(T, d, generator=gen, device=DEVICE)).to(
        torch.bfloat16).requires_grad_() for _ in range(S)]
    query = (torch.randn(r, generator=gen, device=DEVICE) * 0.5).requires_grad_()
    grad = torch.randn(T, d, generator=gen, device=DEVICE).to(torch.bfloat16)
    _, gs = grads_of(fused.depth_read_triton, values, query, None, grad, save_output=True)
    _, rgs = grads_of(depth_read_naive, up(values), up([query])[0], None, grad.double())
    assert rel_rms(gs[0], rgs[0]) <= TOL[torch.bfloat16]


def test_key_rows_where_r_pads_narrower():
    """The source-tiled backward reads sliced keys as rows of their own exactly where r pads
    to less than the row."""
    assert fused.key_rows(2048, 512) and fused.key_rows(1000, 250)
    assert not fused.key_rows(1000, 600) and not fused.key_rows(48, 48)


def test_alignment_facts():
    """16-byte vectors are declared only when every pointer is 16-byte aligned and every row
    stride (and d / r) is a multiple of 16 bytes' worth of elements, and not for projected
    keys (measured slower with them)."""
    base = torch.zeros(4, 80, dtype=torch.bfloat16)
    al = fused.alignment([base, base.clone()], [], 80, 80, 128)
    assert al == {"PA": 16, "SA": 8, "SK": 1}
    odd_stride = torch.zeros(4, 90, dtype=torch.bfloat16)[:, :80]  # row stride 90
    assert fused.alignment([base, odd_stride], [], 80, 80, 128)["SA"] == 1
    shifted = torch.zeros(4 * 80 + 1, dtype=torch.bfloat16)[1:].view(4, 80)  # 2-byte offset
    assert fused.alignment([base, shifted], [], 80, 80, 128)["PA"] == 1
    assert fused.alignment([base], [], 84, 84, 128)["SA"] == 1  # d not a multiple of 8
    keys = [torch.zeros(4, 24, dtype=torch.float32)]
    assert fused.alignment([base], keys, 80, 24, 128) == {"PA": 1, "SA": 8, "SK": 4}


def test_pointer_tables_share_one_buffer():
    """The pointer tables of one call are staged in one buffer, one (pointers, strides) pair
    per group, each group starting on a 16-byte boundary."""
    a = [torch.zeros(3, 8), torch.zeros(5, 8)[:, :4]]
    b = [torch.zeros(2, 6)]
    c = [torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2)]
    (pa, sa), (pb, sb), (pc, sc) = tu.tables(a, b, c)
    assert pa.tolist() == [t.data_ptr() for t in a] and sa.tolist() == [8, 8]
    assert pb.tolist() == [b[0].data_ptr()] and sb.tolist() == [6]
    assert pc.tolist() == [t.data_ptr() for t in c] and sc.tolist() == [2, 2, 2]
    for p in (pa, pb, pc):
        assert p.data_ptr() % 16 == 0
    assert pa.untyped_storage().data_ptr() == pc.untyped_storage().data_ptr()
