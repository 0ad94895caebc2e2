"""What the pipeline hops of one micro-batch carry: sources and bytes per hop, naive and with
the rank-local cache of interleaved stages (``stage_cache``), as a table logged at start, and
warnings for stage boundaries that carry a partial sum they could avoid."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from megatron_lrattn.depth.pipeline import boundary_width, chunk_ends_from_config
from megatron_lrattn.depth.schedule import DepthSchedule, schedule_from_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HopPayload:
    """What one pipeline hop (chunk c to chunk c + 1) carries per micro-batch, forward.

    The backward hop carries the gradients of the same sources (the same bytes).

    Attributes:
        hop: c (0-based).
        src_rank, dst_rank: pipeline ranks of chunks c and c + 1 (c % P, (c + 1) % P).
        after_sublayer: the boundary position j (the state after sub-layer j).
        sources: labels of every source of the state after j (what a naive hop sends).
        new_sources: the sources the receiving rank has neither produced nor received
            earlier for this micro-batch (what a hop with a rank-local cache sends).
        bytes_per_source: rows x micro-batch x width x element size.
    """

    hop: int
    src_rank: int
    dst_rank: int
    after_sublayer: int
    sources: Tuple[str, ...]
    new_sources: Tuple[str, ...]
    bytes_per_source: int

    @property
    def naive_bytes(self) -> int:
        """Bytes when every hop carries all sources so far."""
        return len(self.sources) * self.bytes_per_source

    @property
    def cached_bytes(self) -> int:
        """Bytes when the receiving rank keeps the sources it has seen (Kimi's cross-stage
        caching)."""
        return len(self.new_sources) * self.bytes_per_source


def hop_payloads(schedule: DepthSchedule, chunk_ends: Sequence[int], pp_size: int, *,
                 seq_rows: int, micro_batch_size: int, width: int,
                 bytes_per_element: int) -> List[HopPayload]:
    """Sources and bytes of every pipeline hop of one micro-batch.

    Chunk c runs on rank c % P and ends after sub-layer ``chunk_ends[c]``; hop c goes from
    chunk c to chunk c + 1. A naive hop sends the whole state after its boundary,
    ``[v_0, B_1..B_n, P?]``. With a rank-local cache, the receiving rank already holds
    every source it produced or received in its earlier chunks (the embedding and completed
    blocks never change), so only the others cross the wire; a partial sum is never reused
    (it changes at every sub-layer). With one chunk per rank both counts are equal.

    Args:
        schedule: the depth schedule.
        chunk_ends: sub-layer after which each chunk ends, in pipeline order (from
            ``chunk_ends_from_config``); strictly increasing, the last equals 2L.
        pp_size: P.
        seq_rows: rows of one source on a rank (sequence length / CP size, / TP size under
            sequence parallelism).
        micro_batch_size: b.
        width: last dimension from ``boundary_width`` (d, or d + r with projected keys).
        bytes_per_element: 2 for bf16.

    Returns:
        One ``HopPayload`` per hop (``len(chunk_ends) - 1``).
    """
    ends = list(chunk_ends)
    if not ends or ends[-1] != schedule.num_sublayers or any(
            b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"chunk_ends={ends} must increase strictly and end at "
                         f"{schedule.num_sublayers}")
    per_source = seq_rows * micro_batch_size * width * bytes_per_element
    seen = {p: set() for p in range(pp_size)}
    hops = []
    for c, end in enumerate(ends[:-1]):
        seen[c % pp_size].update(schedule.state_after(end).labels())
        dst = (c + 1) % pp_size
        labels = schedule.state_after(end).labels()
        hops.append(HopPayload(hop=c, src_rank=c % pp_size, dst_rank=dst, after_sublayer=end,
                               sources=labels,
                               new_sources=tuple(x for x in labels if x not in seen[dst]),
                               bytes_per_source=per_source))
        seen[dst].update(labels)
    return hops


def stage_boundary_warnings(schedule: DepthSchedule, chunk_ends: Sequence[int]) -> List[str]:
    """Boundaries whose payload would shrink if they moved one layer earlier.

    A boundary j whose last layer only opened a new block (the block before it closed at
    sub-layer j - 1 or j - 2) carries that block's one- or two-member partial sum as an
    extra source: the boundary at j - 2 carries one source fewer. Stage boundaries at block
    ends carry no partial sum, and completed blocks can be cached on later hops.

    Returns:
        One readable message per such boundary (empty when the split is fine).
    """
    out = []
    for end in list(chunk_ends)[:-1]:
        here = schedule.state_after(end)
        if end < 2 or here.partial is None:
            continue
        earlier = schedule.state_after(end - 2)
        if earlier.num_sources < here.num_sources:
            out.append(
                f"pipeline boundary after sub-layer {end} (layer {end // 2}) carries "
                f"{here.num_sources} sources {list(here.labels())}: block {here.num_completed} "
                f"closed at sub-layer {here.partial[0] - 1}, so one layer earlier it would carry "
                f"{earlier.num_sources}; consider moving it to a block end (block ends: "
                f"{list(schedule.block_ends)})"
            )
    return out


def format_payload_table(hops: Sequence[HopPayload]) -> str:
    """A plain-text table of ``hop_payloads`` (bytes per micro-batch, forward, in MiB, or
    KiB / B for small models; the backward hop carries gradients of the same size)."""
    total = sum(h.naive_bytes for h in hops)
    unit, mib = next((u, float(f)) for u, f in (("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
                     if total >= f or f == 1)
    rows = [("hop", "ranks", "after", "naive sources", f"naive {unit}", "cached sources",
             f"cached {unit}")]
    for h in hops:
        rows.append((str(h.hop), f"{h.src_rank}->{h.dst_rank}", str(h.after_sublayer),
                     " ".join(h.sources), f"{h.naive_bytes / mib:.1f}",
                     " ".join(h.new_sources) or "-", f"{h.cached_bytes / mib:.1f}"))
    rows.append(("total", "", "", str(sum(len(h.sources) for h in hops)),
                 f"{sum(h.naive_bytes for h in hops) / mib:.1f}",
                 str(sum(len(h.new_sources) for h in hops)),
                 f"{sum(h.cached_bytes for h in hops) / mib:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
                     for r in rows)


def log_pipeline_payloads(config, seq_length: int, micro_batch_size: int) -> List[HopPayload]:
    """Log the per-hop payload table at INFO and stage-boundary warnings; return the hops.

    Args:
        config: ``LRAttnResConfig`` (pipeline, virtual pipeline, sequence and context
            parallel sizes, pipeline dtype).
        seq_length: full sequence length s.
        micro_batch_size: b.

    Returns:
        The hops ([] without depth attention or pipeline parallelism).
    """
    if not getattr(config, "uses_depth_attention", False) or config.pipeline_model_parallel_size == 1:
        return []
    schedule = schedule_from_config(config)
    ends = chunk_ends_from_config(config)
    rows = seq_length // getattr(config, "context_parallel_size", 1)
    if config.sequence_parallel:
        rows //= config.tensor_model_parallel_size
    dtype = config.pipeline_dtype or config.params_dtype
    hops = hop_payloads(schedule, ends, config.pipeline_model_parallel_size, seq_rows=rows,
                        micro_batch_size=micro_batch_size, width=boundary_width(config),
                        bytes_per_element=torch.empty((), dtype=dtype).element_size())
    logger.info("pipeline payload per micro-batch (P=%d, chunks end after sub-layers %s):\n%s",
                config.pipeline_model_parallel_size, ends, format_payload_table(hops))
    for msg in stage_boundary_warnings(schedule, ends):
        logger.warning(msg)
    return hops
