"""Phase 1 of the two-phase block schedule (``depth_read_multi``), both backends, against
float64 naive formulas: every output and every gradient (each source, each query, each
projected key, and the lse gradient path), and depth blocks as the model runs them.

On CPU the Triton backend runs under ``TRITON_INTERPRET=1`` on small shapes; the large bf16
shapes run only where CUDA is present (``gpu`` marker, the GPU box).
"""

import pytest
import torch

pytest.importorskip("triton")

from op_checks import DEVICE, gpu, randn  # noqa: E402
from op_checks import shape_dtypes  # noqa: E402
from two_phase_checks import BACKENDS, check_block, check_merge, check_multi, make  # noqa: E402

from megatron_lrattn.ops import depth_merge, depth_read, depth_read_multi, tuning  # noqa: E402


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


# many_sources in the full suite only: many_sources_projected reads more than 32 sources in
# the fast tier
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,dtype", shape_dtypes(
    STRESS, slow=("many_sources",), fast_fp32=("one_source_one_query",)))
def test_multi_parity(name, dtype, backend):
    T, d, r, S, K, projected = STRESS[name]
    check_multi(T, d, r, S, K, dtype, projected, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_split_fp16_and_leading_dims(backend):
    check_multi(5, 40, 12, 3, 3, torch.float16, False, backend, split=True, lead=(2,))
    check_multi(4, 32, 8, 2, 2, torch.float32, True, backend, split=True, lead=(2,))


@pytest.mark.parametrize("projected", [False, True])
def test_torch_reference_in_float64(projected):
    check_multi(7, 24, 8, 3, 4, torch.float64, projected, "torch")
    check_merge(7, 24, 8, 3, torch.float64, projected, "torch")


def test_multi_rows_equal_single_site_reads_and_query_groups():
    """Row k is depth_read with query k; more queries than one kernel group holds."""
    _, values, _, queries = make(6, 32, 8, 3, 5, torch.float32, False)
    with tuning.override(phase1={"group": 2}):
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


@pytest.mark.slow
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


@gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_multi_parity_large_bf16(name):
    T, d, r, S, K, projected = GPU_SHAPES[name]
    check_multi(T, d, r, S, K, torch.bfloat16, projected, "triton")


@gpu
@pytest.mark.parametrize("name", ["d2048_S5_K6_sliced", "d2048_S9_K6_projected",
                                  "d4096_S9_K6_sliced", "d8192_S3_K3_sliced"])
def test_merge_parity_large_bf16(name):
    T, d, r, S, _, projected = GPU_SHAPES[name]
    check_merge(T, d, r, S, torch.bfloat16, projected, "triton")


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_attnres", "tiny_sliced", "study25m_projected"])
def test_model_block_pattern_bf16_small(name):
    """CPU-sized version of the model blocks (interpreter): more than one phase-1 program of
    many tokens, bf16 sources and bf16 queries, split outputs, merges."""
    _, d, r, projected, blocks = MODEL_BLOCKS[name]
    d, r = min(d, 128), min(r, 32) if projected else min(r, d)
    T = 160 if d == 128 else 96
    for S, K in blocks[:2] + blocks[-1:]:
        check_block(T, d, r, S, K, projected, "triton")


@gpu
@pytest.mark.parametrize("name", list(MODEL_BLOCKS))
def test_model_block_pattern_bf16_gpu(name):
    T, d, r, projected, blocks = MODEL_BLOCKS[name]
    for S, K in blocks:
        check_block(T, d, r, S, K, projected, "triton")


CHUNKED_TILES = {
    "narrow_chunks": dict(value_chunk=16, dots_chunk=16, grad_chunk=16, logit_chunk=16),
    "mixed_chunks": dict(value_chunk=32, dots_chunk=16, grad_chunk=32, logit_tokens=16,
                         programs_per_sm=1),
    # the dot pass's value gradients ending inside one of its chunks
    "wide_dots_narrow_grads": dict(dots_chunk=64, grad_chunk=16),
}


# narrow_chunks and mixed_chunks in the full suite only: at the default tiles the fast tier's
# wide_d4096 and odd_d_1000 (test_multi_parity) split every pass into several column chunks
# per row, odd_d_1000's logit chunks do not divide r
@pytest.mark.parametrize("tiles", [t if t == "wide_dots_narrow_grads" else
                                   pytest.param(t, marks=pytest.mark.slow)
                                   for t in CHUNKED_TILES])
@pytest.mark.parametrize("name", ["sliced"] + [  # the other shapes in the full suite only
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("projected", "attnres_r_eq_d", "r_one", "many_sources")])
def test_multi_chunked_tiles_match(name, tiles):
    """The width-chunked phase 1 at other tiles: several column chunks per row in every pass
    (key columns starting inside a chunk, dot partials over several chunks), logit chunks
    that do not divide r, a logit tile of few tokens and few persistent programs."""
    T, d, r, S, K, projected = STRESS[name]
    with tuning.override(phase1=CHUNKED_TILES[tiles]):
        check_multi(T, d, r, S, K, torch.float32, projected, "triton")
