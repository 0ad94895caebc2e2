"""Pipeline packing: the depth state crosses a stage boundary as one view-free tensor."""
from __future__ import annotations

import pytest
import torch

from megatron_lrattn.depth.state import DepthState
from megatron_lrattn.depth.schedule import depth_schedule

S_LEN, B, D, R = 3, 2, 8, 3

CASES = [(L, N) for L, N in [(1, 1), (1, 2), (2, 1), (2, 3), (2, 4), (3, 2), (3, 4), (4, 8)]]


def _build_state(L, N, boundary, projected, seed):
    """A DepthState after ``boundary`` sub-layers, built from leaf tensors; returns the
    state, the leaves, and for every source the leaf indices summed into it."""
    g = torch.Generator().manual_seed(seed)
    sched = depth_schedule(L, N)

    def leaf(width):
        return torch.randn(S_LEN, B, width, generator=g).requires_grad_()

    emb = leaf(D)
    emb_key = leaf(R) if projected else None
    state = DepthState(embedding=emb, embedding_key=emb_key)
    outs, keys = [], []
    for j in range(1, boundary + 1):
        outs.append(leaf(D))
        keys.append(leaf(R) if projected else None)
        state.add(outs[-1], keys[-1], sched.closes_block(j))
    return sched, state, emb, emb_key, outs, keys


def _members(sched, boundary):
    """Sub-layer indices (1-based) of each source after ``boundary``; [] is v_0."""
    site = sched.state_after(boundary)
    groups, start = [[]], 1
    for k in range(site.num_completed):
        end = sched.block_ends[k]
        groups.append(list(range(start, end + 1)))
        start = end + 1
    if site.partial is not None:
        groups.append(list(range(site.partial[0], site.partial[1] + 1)))
    return groups


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
@pytest.mark.parametrize("L,N", CASES)
def test_round_trip_every_boundary(L, N, projected):
    seen_partial = set()
    for boundary in range(0, 2 * L + 1):
        sched, state, emb, emb_key, outs, keys = _build_state(L, N, boundary, projected,
                                                              seed=boundary)
        site = sched.state_after(boundary)
        seen_partial.add(site.partial is not None)
        n_src = sched.state_after(boundary).num_sources
        assert n_src == site.num_sources

        packed = state.pack()
        w = D + R if projected else D
        assert packed.shape == (n_src * S_LEN, B, w)
        assert packed.is_contiguous()
        assert packed._base is None, "packed state must not be a view"
        values, ks = state.sources()
        for v in values:
            assert packed.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()

        back = DepthState.unpack(packed, sched, boundary, D, projected)
        assert back.num_sublayers_done == boundary
        assert back.projected == projected
        assert len(back.blocks) == site.num_completed
        assert (back.partial is None) == (site.partial is None)
        got_values, got_keys = back.sources()
        assert len(got_values) == len(values)
        for a, b in zip(got_values, values):
            assert torch.equal(a, b)
        if projected:
            assert len(got_keys) == len(ks)
            for a, b in zip(got_keys, ks):
                assert torch.equal(a, b)
        else:
            assert got_keys is None

        # Expected sources computed directly from the leaves.
        groups = _members(sched, boundary)
        for src, members in zip(got_values, groups):
            want = emb if not members else sum(outs[m - 1] for m in members)
            torch.testing.assert_close(src, want, rtol=0, atol=1e-6)
    if 2 * L > N:
        assert seen_partial == {True, False}


@pytest.mark.parametrize("projected", [False, True], ids=["sliced", "projected"])
@pytest.mark.parametrize("L,N,boundary", [(2, 1, 1), (2, 2, 2), (2, 2, 3), (3, 4, 4),
                                          (3, 6, 5), (4, 8, 8), (4, 3, 5)])
def test_gradients_flow_to_every_source(L, N, boundary, projected):
    sched, state, emb, emb_key, outs, keys = _build_state(L, N, boundary, projected, seed=7)
    back = DepthState.unpack(state.pack(), sched, boundary, D, projected)
    values, ks = back.sources()
    g = torch.Generator().manual_seed(99)
    wv = [torch.randn(v.shape, generator=g) for v in values]
    loss = sum((w * v).sum() for w, v in zip(wv, values))
    if projected:
        wk = [torch.randn(k.shape, generator=g) for k in ks]
        loss = loss + sum((w * k).sum() for w, k in zip(wk, ks))
    loss.backward()

    groups = _members(sched, boundary)
    assert torch.equal(emb.grad, wv[0])
    if projected:
        assert torch.equal(emb_key.grad, wk[0])
    for i, members in enumerate(groups[1:], start=1):
        for m in members:
            assert torch.equal(outs[m - 1].grad, wv[i]), f"output of sub-layer {m}"
            if projected:
                assert torch.equal(keys[m - 1].grad, wk[i]), f"key of sub-layer {m}"
    assert all(o.grad is not None for o in outs)


def test_unpack_refuses_a_wrong_row_count():
    sched = depth_schedule(2, 2)
    packed = torch.zeros(5, B, D)  # after sub-layer 3: 3 sources
    with pytest.raises(ValueError, match="3 sources"):
        DepthState.unpack(packed, sched, 3, D, False)


def test_paper_example_boundary_sizes():
    sched = depth_schedule(24, 8)
    assert sched.state_after(0).num_sources == 1
    assert sched.state_after(6).num_sources == 2  # [v0, B1]
    assert sched.state_after(7).num_sources == 3  # [v0, B1, P]
    assert sched.state_after(48).num_sources == 9
