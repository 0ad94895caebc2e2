"""depth_read (torch backend) against the naive formula in float64: outputs and every gradient."""

import math

import pytest
import torch

from op_checks import rel_rms

from megatron_lrattn.ops import depth_read, depth_read_logits, depth_read_naive, depth_read_torch

# The reference backend's tolerance table for the relative-RMS error of outputs and gradients.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, what
    err = rel_rms(actual, expected, floor=1e-300)
    assert err <= TOL[dtype], f"{what}: relative RMS error {err:.3e} > {TOL[dtype]:.0e}"


def make_inputs(num_sources, lead, d, r, dtype, projected, seed=0):
    """Random sources with distinct scales/offsets, a non-trivial query, optional keys."""
    gen = torch.Generator().manual_seed(seed)
    values = [
        (torch.randn(*lead, d, generator=gen) * (0.5 + i % 3) + 0.1 * i).to(dtype)
        for i in range(num_sources)
    ]
    qdtype = torch.float64 if dtype == torch.float64 else torch.float32
    query = (torch.randn(r, generator=gen) * 2.0 / math.sqrt(r)).to(qdtype)
    keys = None
    if projected:
        keys = [
            (torch.randn(*lead, r, generator=gen) * (1 + i)).to(dtype) for i in range(num_sources)
        ]
    grad_out = torch.randn(*lead, d, generator=gen).to(dtype)
    return values, query, keys, grad_out


def run_op(values, query, keys, grad_out, **kw):
    """depth_read(backend='torch') forward + backward on fresh leaves."""
    vs = [v.clone().requires_grad_() for v in values]
    q = query.clone().requires_grad_()
    ks = [k.clone().requires_grad_() for k in keys] if keys is not None else None
    out = depth_read(vs, q, ks, backend="torch", **kw)
    out.backward(grad_out)
    return out, vs, q, ks


def run_naive64(values, query, keys, grad_out, **kw):
    """The naive formula under float64 autograd on the same input data."""
    vs = [v.detach().double().requires_grad_() for v in values]
    q = query.detach().double().requires_grad_()
    ks = [k.detach().double().requires_grad_() for k in keys] if keys is not None else None
    out = depth_read_naive(vs, q, ks, **kw)
    out.backward(grad_out.double())
    return out, vs, q, ks


def check_against_naive(values, query, keys, grad_out, dtype, query_dtype=None, **kw):
    out, vs, q, ks = run_op(values, query, keys, grad_out, **kw)
    ref, rvs, rq, rks = run_naive64(values, query, keys, grad_out, **kw)
    assert out.dtype == values[0].dtype and out.shape == values[0].shape
    assert_close(out, ref, dtype, "output")
    for i, (v, rv) in enumerate(zip(vs, rvs)):
        assert v.grad.dtype == v.dtype
        assert_close(v.grad, rv.grad, dtype, f"grad values[{i}]")
    assert q.grad.dtype == query.dtype
    assert_close(q.grad, rq.grad, query_dtype or dtype, "grad query")
    if keys is not None:
        for i, (k, rk) in enumerate(zip(ks, rks)):
            assert k.grad.dtype == k.dtype
            assert_close(k.grad, rk.grad, dtype, f"grad keys[{i}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
@pytest.mark.parametrize("lead", [(7, 3), (19,)], ids=["sbd", "td"])
@pytest.mark.parametrize("eps, scale", [(1e-6, 1.0), (1e-3, 0.7)], ids=["default", "eps_scale"])
def test_matches_naive(dtype, projected, lead, eps, scale):
    values, query, keys, g = make_inputs(5, lead, 64, 16, dtype, projected)
    check_against_naive(values, query, keys, g, dtype, eps=eps, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_rank_attnres(dtype):
    values, query, _, g = make_inputs(4, (6, 2), 32, 32, dtype, False, seed=1)
    check_against_naive(values, query, None, g, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_many_sources(dtype, projected):
    values, query, keys, g = make_inputs(40, (8,), 32, 8, dtype, projected, seed=2)
    check_against_naive(values, query, keys, g, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_odd_width(dtype, projected):
    values, query, keys, g = make_inputs(4, (3, 2), 1000, 250, dtype, projected, seed=3)
    check_against_naive(values, query, keys, g, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [8.0, 20.0])
def test_peaked_softmax(dtype, scale):
    """Large logits: the log-sum-exp path must stay finite and match. Near one-hot weights
    make the softmax backward ill-conditioned (error ~ eps / (1 - p_max)) for the tiny
    gradients of the dominant source, in any precision including the float64 reference, so
    value and key gradients are compared over all sources at once."""
    for seed in range(3):
        values, query, keys, g = make_inputs(6, (10,), 64, 16, dtype, True, seed=seed)
        out, vs, q, ks = run_op(values, query, keys, g, scale=scale)
        ref, rvs, rq, rks = run_naive64(values, query, keys, g, scale=scale)
        assert torch.isfinite(out).all()
        assert_close(out, ref, dtype, "output")
        assert_close(q.grad, rq.grad, dtype, "grad query")
        for name, ours, exact in (("values", vs, rvs), ("keys", ks, rks)):
            stacked = torch.stack([t.grad.double() for t in ours])
            assert_close(stacked, torch.stack([t.grad for t in exact]), dtype, f"grad {name}")


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_gradcheck(projected):
    values, query, keys, _ = make_inputs(3, (2, 2), 6, 3, torch.float64, projected, seed=5)
    leaves = [t.requires_grad_() for t in values + [query] + (keys or [])]
    nv = len(values)

    def fn(*ts):
        ks = list(ts[nv + 1 :]) if projected else None
        return depth_read(list(ts[:nv]), ts[nv], ks, backend="torch", scale=1.3)

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
@pytest.mark.parametrize("r", [8, 64])
def test_zero_query_is_mean(dtype, projected, r):
    values, _, keys, _ = make_inputs(5, (4, 3), 64, r, dtype, projected, seed=6)
    query = torch.zeros(r, requires_grad=True)
    out = depth_read(values, query, keys, backend="torch")
    mean = torch.stack([v.float() for v in values]).mean(0)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, mean, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, mean.to(dtype))


def test_sliced_full_rank_equals_attnres_formula():
    """r = d: softmax over <q, RMS(v_i)> with the full values as keys, written out directly."""
    values, query, _, _ = make_inputs(5, (9,), 48, 48, torch.float64, False, seed=7)
    eps, tau = 1e-6, 0.8
    logits = torch.stack(
        [tau * (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)) @ query for v in values]
    )
    weights = torch.softmax(logits, dim=0)
    expected = sum(w[:, None] * v for w, v in zip(weights, values))
    out = depth_read(values, query, eps=eps, scale=tau, backend="torch")
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out32 = depth_read([v.float() for v in values], query.float(), eps=eps, scale=tau)
    assert rel_rms(out32, expected) < TOL[torch.float32]


def test_sliced_keys_are_last_r_coordinates():
    values, query, _, g = make_inputs(4, (5,), 32, 8, torch.float64, False, seed=8)
    r, d = 8, 32
    sliced = run_op(values, query, None, g)
    keys = [v[:, d - r :].clone() for v in values]
    proj = run_op(values, query, keys, g)
    torch.testing.assert_close(sliced[0], proj[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sliced[2].grad, proj[2].grad, rtol=1e-12, atol=1e-12)
    for sv, pv, pk in zip(sliced[1], proj[1], proj[3]):
        # Sliced value grad = value grad of the projected op + key grad on the last r columns.
        expected = pv.grad.clone()
        expected[:, d - r :] += pk.grad
        torch.testing.assert_close(sv.grad, expected, rtol=1e-12, atol=1e-12)
    # The first d - r coordinates do not route: changing them keeps the weights.
    shifted = [v.clone() for v in values]
    for v in shifted:
        v[:, : d - r] = 0.0
    a = depth_read(values, query)[:, d - r :]
    b = depth_read(shifted, query)[:, d - r :]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_single_source(dtype, projected):
    values, query, keys, g = make_inputs(1, (4, 2), 32, 8, dtype, projected, seed=9)
    out, vs, q, ks = run_op(values, query, keys, g)
    assert torch.equal(out, values[0])
    assert torch.equal(vs[0].grad, g)
    assert torch.count_nonzero(q.grad) == 0
    if projected:
        assert torch.count_nonzero(ks[0].grad) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_sources(dtype):
    base, query, _, g = make_inputs(3, (2, 5), 32, 8, dtype, False, seed=10)
    values = [v.transpose(0, 1) for v in base]  # [5, 2, d], not contiguous
    assert not values[0].is_contiguous()
    check_against_naive(values, query, None, g.transpose(0, 1).contiguous(), dtype)


def test_grads_only_where_requested():
    values, query, keys, g = make_inputs(3, (6,), 16, 4, torch.float32, True, seed=11)
    vs = [v.clone().requires_grad_() for v in values]
    out = depth_read(vs, query, keys, backend="torch")
    out.backward(g)
    assert query.grad is None and all(k.grad is None for k in keys)
    ref = run_naive64(values, query, keys, g)
    for v, rv in zip(vs, ref[1]):
        assert_close(v.grad, rv.grad, torch.float32, "grad values")
    q = query.clone().requires_grad_()
    depth_read(values, q, keys, backend="torch").backward(g)
    assert_close(q.grad, ref[2].grad, torch.float32, "grad query")


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_fp32_query_with_fp64_sources(projected):
    # The model keeps queries fp32; float64 sources must still work (math in float64).
    values, query, keys, g = make_inputs(3, (6,), 16, 4, torch.float64, projected, seed=12)
    q32 = query.float()
    check_against_naive(values, q32, keys, g, torch.float64, query_dtype=torch.float32)


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
def test_deterministic_and_auto_backend(projected):
    values, query, keys, g = make_inputs(4, (8, 2), 64, 16, torch.bfloat16, projected, seed=13)
    first = run_op(values, query, keys, g)
    second = run_op(values, query, keys, g)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[2].grad, second[2].grad)
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a.grad, b.grad)
    auto = depth_read(values, query, keys, backend="auto")
    assert torch.equal(auto, first[0])
    assert torch.equal(depth_read_torch(values, query, keys), first[0])


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
@pytest.mark.parametrize("lead", [(16, 2), (32,)], ids=["sbd", "td"])
def test_saves_no_fp32_hidden_tensor(projected, lead):
    d, r, tokens = 64, 16, 32
    values, query, keys, g = make_inputs(4, lead, d, r, torch.bfloat16, projected, seed=14)
    vs = [v.clone().requires_grad_() for v in values]
    q = query.clone().requires_grad_()
    ks = [k.clone().requires_grad_() for k in keys] if projected else None
    inputs = vs + [q] + (ks or [])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = depth_read(vs, q, ks, backend="torch")
    out.backward(g)
    assert saved, "the op saved nothing: hooks did not see it"
    input_ptrs = {t.data_ptr() for t in inputs}
    for t in saved:
        is_input = t.data_ptr() in input_ptrs
        assert is_input or t.numel() <= tokens, (tuple(t.shape), t.dtype)
        assert not (t.dtype == torch.float32 and t.numel() >= tokens * d), tuple(t.shape)
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in input_ptrs)
    assert extra <= tokens * 4


def test_validation_errors():
    v = [torch.randn(4, 8) for _ in range(3)]
    q = torch.zeros(2)
    with pytest.raises(ValueError, match="non-empty sequence"):
        depth_read([], q)
    with pytest.raises(ValueError, match="non-empty sequence"):
        depth_read(torch.stack(v), q)
    with pytest.raises(ValueError, match=r"values\[1\] is \(4, 9\)"):
        depth_read([v[0], torch.randn(4, 9), v[2]], q)
    with pytest.raises(ValueError, match=r"values\[2\] is \(5, 8\)"):
        depth_read([v[0], v[1], torch.randn(5, 8)], q)
    with pytest.raises(ValueError, match=r"values\[1\] .*bfloat16"):
        depth_read([v[0], v[1].bfloat16()], q)
    with pytest.raises(ValueError, match="query must be 1-D"):
        depth_read(v, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="query must be 1-D"):
        depth_read(v, torch.tensor(0.0))
    with pytest.raises(ValueError, match="r=9, d=8"):
        depth_read(v, torch.zeros(9))
    with pytest.raises(ValueError, match="r=0, d=8"):
        depth_read(v, torch.zeros(0))
    with pytest.raises(ValueError, match="backend='cuda'"):
        depth_read(v, q, backend="cuda")
    keys = [torch.randn(4, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="sequence of 3 tensors"):
        depth_read(v, q, keys[:2])
    with pytest.raises(ValueError, match="sequence of 3 tensors"):
        depth_read(v, q, torch.stack(keys))
    with pytest.raises(ValueError, match=r"keys\[1\] is \(4, 3\)"):
        depth_read(v, q, [keys[0], torch.randn(4, 3), keys[2]])
    with pytest.raises(ValueError, match=r"keys\[0\] is \(5, 2\)"):
        depth_read(v, q, [torch.randn(5, 2), keys[1], keys[2]])


def test_logits_are_the_scaled_query_dot_of_normalised_keys():
    """``depth_read_logits`` (the routing scores before the softmax, used by the routing
    analysis) is ``scale <q, RMS(k_i)>`` for every source, [S, T]."""
    values, query, keys, _ = make_inputs(3, (7,), 16, 4, torch.float64, True, seed=15)
    got = depth_read_logits(keys, query, 1e-6, 0.9)
    want = torch.stack([0.9 * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)) @ query
                        for k in keys])
    assert got.shape == (3, 7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
