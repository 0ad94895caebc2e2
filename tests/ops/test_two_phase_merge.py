"""Phase 2 of the two-phase block schedule (``depth_merge``, ``depth_merge_update``, each
optionally fused with the next sub-layer's RMSNorm), both backends, against float64 depth
reads over the sources and the partial sum: every output and every gradient (the partial
sum, its key, the update, the norm weight, each source, key and query).

On CPU the Triton backend runs under ``TRITON_INTERPRET=1`` on small shapes; the large bf16
shapes run only where CUDA is present (``gpu`` marker, the GPU box).
"""

import pytest
import torch

pytest.importorskip("triton")

from op_checks import (  # noqa: E402
    CUDA,
    DEVICE,
    TOL,
    assert_table,
    gpu,
    grad_errors,
    randn,
    rel_rms,
    shape_dtypes,
    up,
)
from two_phase_checks import BACKENDS, MERGED, check_merge, make  # noqa: E402

from megatron_lrattn.ops import (  # noqa: E402
    depth_merge,
    depth_merge_update,
    depth_read_multi,
    depth_read_naive,
)


MERGE = {
    "sliced": (13, 64, 16, 4, False),
    "projected": (13, 64, 24, 3, True),
    "attnres_r_eq_d": (7, 48, 48, 2, False),
    "one_source": (9, 32, 8, 1, False),
    "many_sources": (3, 16, 4, 33, False),
    "odd_d_1000": (3, 1000, 250, 2, True),
    "one_token": (1, 40, 10, 3, False),
}


# sliced and many_sources in the full suite only (their phase 1 takes most of the time; the
# fast tier reads many sources in test_two_phase_phase1.py and merges the other five shapes)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,dtype", shape_dtypes(
    MERGE, slow=("sliced", "many_sources"), fast_fp32=("one_source",)))
def test_merge_equals_read_over_sources_and_partial(name, dtype, backend):
    T, d, r, S, projected = MERGE[name]
    check_merge(T, d, r, S, dtype, projected, backend)


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
    grad_errors(errs, names, grads, ref_grads, leaves, floor)
    assert_table(errs, dtype, MERGED)


MERGE_UPDATE = {
    "sliced": (13, 64, 16, 3, False),
    "projected": (11, 48, 12, 2, True),
    "attnres_r_eq_d": (7, 40, 40, 2, False),
    "one_source": (5, 32, 8, 1, False),
    "odd_d_1000": (3, 1000, 250, 2, False),
    "one_token": (1, 24, 6, 3, True),
}


# sliced in the full suite only (as in the merge tests around it): one_source and
# test_merge_update_with_one_output_used update with sliced keys in the fast tier
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,dtype", shape_dtypes(
    MERGE_UPDATE, slow=("sliced",), fast_fp32=("one_source",)))
def test_merge_update_equals_read_over_updated_partial(name, dtype, backend):
    check_merge_update(*MERGE_UPDATE[name], dtype, backend)


# projected keys in the full suite only: which output the gradient reaches does not depend
# on them, and test_merge_update_equals_read_over_updated_partial merges with them in the
# fast tier
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", [("h",), ("P",)], ids=["h_only", "P_only"])
@pytest.mark.parametrize("projected", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_merge_update_with_one_output_used(projected, use, backend):
    T, d, r, S = (9, 48, 12, 2)
    check_merge_update(T, d, r, S, projected, torch.float32, backend, use=use)


@gpu
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


# One op of each of the two largest fast shapes in the full suite only: projected's
# merge_update (test_merge_update_equals_read_over_updated_partial updates with projected keys
# in the fast tier) and odd_d_1000's merge (its merge_update normalises the same width).
NORM_SLOW_OPS = {("projected", True), ("odd_d_1000", False)}


def _norm_cases():
    """``(name, dtype, update)`` of the fused-norm test, ids ``<name>-<dtype>-<op>``."""
    cases = []
    for case in shape_dtypes(MERGE_UPDATE, slow=("sliced",), fast_fp32=("one_source",)):
        name, dtype = case.values
        for update, op in ((False, "merge"), (True, "merge_update")):
            marks = list(case.marks) or (
                [pytest.mark.slow] if (name, update) in NORM_SLOW_OPS else [])
            cases.append(pytest.param(name, dtype, update, id=f"{case.id}-{op}", marks=marks))
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,dtype,update", _norm_cases())
def test_merge_with_fused_rmsnorm_equals_read_then_norm(name, dtype, update, backend):
    check_merge_norm(*MERGE_UPDATE[name], dtype, backend, update)


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


@pytest.mark.slow
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


@gpu
@pytest.mark.parametrize("update", [False, True], ids=["merge", "merge_update"])
@pytest.mark.parametrize("name", ["d2048_sliced", "d2048_attnres", "d4096_projected"])
def test_merge_with_fused_rmsnorm_parity_large_bf16(name, update):
    T, d, r, projected = {"d2048_sliced": (4096, 2048, 512, False),
                          "d2048_attnres": (4096, 2048, 2048, False),
                          "d4096_projected": (2048, 4096, 1024, True)}[name]
    check_merge_norm(T, d, r, 5, projected, torch.bfloat16, "triton", update)


@pytest.mark.parametrize("projected", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["sliced", "projected"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_merge_backward_prefetch_changes_no_bit(projected, norm):
    """The backward that loads the next token block ahead (``tuning.Merge.prefetch``) and
    the one that loads each block when it reaches it give the same gradients bit for bit,
    with more blocks than programs (the loop and its last, masked prefetch), 1 and 4 tokens
    per block."""
    from megatron_lrattn.ops import tuning

    T, d, r = 23, 64, 16
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    out, part, upd, g, g_p = (randn(gen, T, d, dtype=torch.bfloat16) for _ in range(5))
    lse = randn(gen, T)
    query = randn(gen, r)
    pkey = randn(gen, T, r, dtype=torch.bfloat16) if projected else None
    w = (1.0 + 0.5 * randn(gen, d)).to(torch.bfloat16) if norm else None
    leaves = [query, out, lse, part, upd, *([pkey] if projected else []),
              *([w] if norm else [])]
    for t in leaves:
        t.requires_grad_()

    def run(**settings):
        with tuning.override(merge=settings):
            h, P = depth_merge_update(out, lse, part, upd, query, pkey, backend="triton",
                                      norm_weight=w, norm_eps=1e-5 if norm else None)
            return [h, P, *torch.autograd.grad([h, P], leaves, [g, g_p])]

    for tokens in (1, 4):
        ref = run(tokens=tokens, prefetch=False)
        got = run(tokens=tokens, prefetch=True)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), (tokens, i)
