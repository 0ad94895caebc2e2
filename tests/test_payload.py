"""Per-hop pipeline payload accounting (naive vs rank-local cache), checked by hand."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_lrattn.depth.payload import (
    format_payload_table,
    hop_payloads,
    log_pipeline_payloads,
    stage_boundary_warnings,
)
from megatron_lrattn.depth.pipeline import chunk_ends_from_config
from megatron_lrattn.depth.schedule import depth_schedule

MIB = 1024 * 1024


def _summary(hops):
    return [(h.src_rank, h.dst_rank, h.after_sublayer, h.sources, h.new_sources) for h in hops]


def test_block_aligned_interleaved_hops_by_hand():
    """L=4, N=4 (block ends 2, 4, 6, 8), P=2, V=2: one layer per chunk, chunks end after
    sub-layers 2, 4, 6, 8 on ranks 0, 1, 0, 1. Rank 0 produced v0, B1 in chunk 0, so hop 1
    only sends B2; rank 1 received v0, B1 and produced B2 in chunk 1, so hop 2 sends B3."""
    hops = hop_payloads(depth_schedule(4, 4), [2, 4, 6, 8], 2, seq_rows=8, micro_batch_size=2,
                        width=16, bytes_per_element=2)
    assert _summary(hops) == [
        (0, 1, 2, ("v0", "B1"), ("v0", "B1")),
        (1, 0, 4, ("v0", "B1", "B2"), ("B2",)),
        (0, 1, 6, ("v0", "B1", "B2", "B3"), ("B3",)),
    ]
    per_source = 8 * 2 * 16 * 2
    assert [h.naive_bytes for h in hops] == [2 * per_source, 3 * per_source, 4 * per_source]
    assert [h.cached_bytes for h in hops] == [2 * per_source, per_source, per_source]


def test_partial_sums_are_never_cached():
    """L=4, N=3 (block ends 3, 6, 8), P=2, V=2: hop 0 sends the partial P[1:2]; hop 1 sends
    B1 (which contains it, but is a new tensor) and the partial P[4:4]; hop 2 only B2."""
    hops = hop_payloads(depth_schedule(4, 3), [2, 4, 6, 8], 2, seq_rows=4, micro_batch_size=1,
                        width=8, bytes_per_element=4)
    assert _summary(hops) == [
        (0, 1, 2, ("v0", "P[1:2]"), ("v0", "P[1:2]")),
        (1, 0, 4, ("v0", "B1", "P[4:4]"), ("B1", "P[4:4]")),
        (0, 1, 6, ("v0", "B1", "B2"), ("B2",)),
    ]
    assert [h.cached_bytes for h in hops] == [2 * 128, 2 * 128, 128]


def test_without_virtual_stages_cache_changes_nothing():
    hops = hop_payloads(depth_schedule(8, 4), [4, 8, 12, 16], 4, seq_rows=2, micro_batch_size=1,
                        width=4, bytes_per_element=2)
    assert all(h.new_sources == h.sources for h in hops)
    assert [len(h.sources) for h in hops] == [2, 3, 4]


@pytest.mark.parametrize("pp,vp,naive,cached", [(2, 2, [3, 5, 7], [3, 2, 2]),
                                                (4, 2, [2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 3, 3, 3, 3])])
def test_documented_1b_table(pp, vp, naive, cached):
    """docs/parallelism.md: 1b preset shape (L=16, d=2048, seq 2048, micro-batch 1, bf16,
    N=8): every source is 2048 x 1 x 2048 x 2 bytes = 8 MiB; the number of sources per hop
    is 1 + completed blocks (naive) and the blocks completed since the receiving rank last
    ran (cached)."""
    chunks = pp * vp
    ends = [32 * (c + 1) // chunks for c in range(chunks)]
    hops = hop_payloads(depth_schedule(16, 8), ends, pp, seq_rows=2048, micro_batch_size=1,
                        width=2048, bytes_per_element=2)
    assert [len(h.sources) for h in hops] == naive
    assert [len(h.new_sources) for h in hops] == cached
    assert all(h.bytes_per_source == 8 * MIB for h in hops)
    assert sum(h.naive_bytes for h in hops) == 8 * MIB * sum(naive)
    assert sum(h.cached_bytes for h in hops) == 8 * MIB * sum(cached)
    assert stage_boundary_warnings(depth_schedule(16, 8), ends) == []
    table = format_payload_table(hops)
    assert table.splitlines()[-1].split() == ["total", str(sum(naive)), f"{8.0 * sum(naive):.1f}",
                                              str(sum(cached)), f"{8.0 * sum(cached):.1f}"]


def test_bad_chunk_ends_are_refused():
    with pytest.raises(ValueError, match="increase strictly"):
        hop_payloads(depth_schedule(4, 3), [4, 4, 8], 2, seq_rows=1, micro_batch_size=1,
                     width=1, bytes_per_element=2)
    with pytest.raises(ValueError, match="end at 8"):
        hop_payloads(depth_schedule(4, 3), [2, 6], 2, seq_rows=1, micro_batch_size=1,
                     width=1, bytes_per_element=2)


def test_boundary_just_after_a_block_closes_warns():
    """N=3 on L=4 closes block 1 at sub-layer 3: a boundary after sub-layer 4 carries v0,
    B1 and the one-member partial P[4:4]; one layer earlier (after 2) only v0, P[1:2]."""
    schedule = depth_schedule(4, 3)
    (msg,) = stage_boundary_warnings(schedule, [4, 8])
    assert "after sub-layer 4" in msg and "3 sources" in msg and "would carry 2" in msg
    # A boundary just before a block closes carries no extra source: no warning.
    assert stage_boundary_warnings(depth_schedule(4, 4), [2, 4, 6, 8]) == []
    assert stage_boundary_warnings(schedule, [6, 8]) == []


def _config(**kw):
    from megatron_lrattn.model.config import LRAttnResConfig

    return LRAttnResConfig(num_layers=16, hidden_size=64, num_attention_heads=4,
                           pipeline_dtype=torch.bfloat16, num_blocks=8, **kw)


def test_chunk_ends_follow_megatron_interleaving():
    """Chunk c = v * P + p; megatron gives virtual stage v of rank p layers
    [(v * P + p) * 16 / (P * V), ...)."""
    cfg = _config(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert chunk_ends_from_config(cfg) == [4, 8, 12, 16, 20, 24, 28, 32]
    cfg = _config(pipeline_model_parallel_size=2)
    assert chunk_ends_from_config(cfg) == [16, 32]


def test_log_pipeline_payloads(caplog):
    cfg = _config(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with caplog.at_level(logging.INFO, logger="megatron_lrattn.depth.payload"):
        hops = log_pipeline_payloads(cfg, seq_length=32, micro_batch_size=1)
    assert [len(h.new_sources) for h in hops] == [3, 2, 2]
    assert hops[0].bytes_per_source == 32 * 1 * 64 * 2
    assert "naive sources" in caplog.text and "B5 B6" in caplog.text
    assert log_pipeline_payloads(_config(), seq_length=32, micro_batch_size=1) == []


def test_chunk_plans_and_cache_gradients():
    """L=4, N=3, P=2, V=2: chunk 2 (rank 0) receives B1, P[4:4] and takes v0 from chunk 0's
    cache. Gradients reach the cached source through the producing chunk's pack in the
    order megatron runs backward (later chunk first), and the cache is emptied."""
    from megatron_lrattn.depth.stage_cache import StageCache, assemble_input, chunk_plan, pack_output

    schedule, ends = depth_schedule(4, 3), [2, 4, 6, 8]
    plans = [chunk_plan(schedule, ends, 2, c) for c in range(4)]
    assert plans[0].sent == ("v0", "P[1:2]") and plans[0].cache_for_next
    assert plans[2].in_labels == ("v0", "B1", "P[4:4]") and plans[2].received == ("B1", "P[4:4]")
    assert plans[2].cache_from == 0 and not plans[2].cache_for_next
    assert plans[3].received == ("B2",) and plans[3].out_labels == ()

    g = torch.Generator().manual_seed(0)
    v0, p12 = (torch.randn(3, 1, 4, generator=g, requires_grad=True) for _ in range(2))
    b1, p44 = (torch.randn(3, 1, 4, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(3, 1, 4, generator=g)
    cache = StageCache()
    packed = pack_output(plans[0], [v0 * 2, p12 * 3], cache)   # chunk 0's output
    assert packed.shape == (6, 1, 4) and len(cache) == 1
    ins = assemble_input(plans[2], [b1, p44], cache)          # chunk 2's input
    assert len(cache) == 0 and ins[1] is b1 and ins[0].grad_fn is None
    (ins[0] * ins[1] * w).sum().backward()                    # chunk 2's backward first
    packed.backward(torch.ones_like(packed))                  # then chunk 0's
    want_v0 = 2 * (1 + b1.detach() * w)
    assert torch.allclose(v0.grad, want_v0) and torch.allclose(p12.grad, torch.full_like(p12, 3.0))
