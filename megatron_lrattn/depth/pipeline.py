"""Packing of the depth state into the one tensor a pipeline stage boundary carries.

A stage boundary after sub-layer j carries [v_0, B_1..B_n, P?] (the sources of read site
j, from the depth schedule) concatenated along the sequence dimension into one view-free
tensor [(S * s), b, w] with w = d, or d + r when keys are projected (each source then
travels as [value | key]).

The number of sources differs per boundary, so the tensors megatron-core's 1F1B schedule
sends and receives differ per stage: ``stage_sublayers`` gives a stage's sub-layer range
from megatron's own layer-to-stage split and ``depth_tensor_shapes_fn`` turns it into the
schedule's ``adjust_tensor_shapes_fn``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_lrattn.depth.state import DepthState
from megatron_lrattn.depth.schedule import DepthSchedule

logger = logging.getLogger(__name__)


def packed_num_sources(schedule: DepthSchedule, sublayers_done: int) -> int:
    """Number of sources a boundary after ``sublayers_done`` sub-layers carries."""
    return schedule.state_after(sublayers_done).num_sources


def pack_state(state: DepthState) -> Tensor:
    """Concatenate the state's sources along dim 0 into one new tensor."""
    return torch.cat(state_sources(state), dim=0)


def unpack_state(packed: Tensor, schedule: DepthSchedule, sublayers_done: int, hidden_size: int,
                 projected: bool) -> DepthState:
    """Inverse of ``pack_state`` for the boundary after ``sublayers_done`` sub-layers."""
    n_src = schedule.state_after(sublayers_done).num_sources
    return state_from_sources(_split_packed(packed, n_src, sublayers_done), schedule,
                              sublayers_done, hidden_size, projected)


def _split_packed(packed: Tensor, n_src: int, sublayers_done: int) -> List[Tensor]:
    if packed.shape[0] % n_src:
        raise ValueError(
            f"packed depth state has {packed.shape[0]} rows, not a multiple of the "
            f"{n_src} sources expected after sub-layer {sublayers_done}"
        )
    return list(packed.chunk(n_src, dim=0))


def state_sources(state: DepthState) -> List[Tensor]:
    """The state's sources in label order, each [s, b, w] ([value | key] when projected)."""
    values, keys = state.sources()
    if keys is not None:
        values = [torch.cat([v, k.to(v.dtype)], dim=-1) for v, k in zip(values, keys)]
    return values


def state_from_sources(parts: List[Tensor], schedule: DepthSchedule, sublayers_done: int,
                       hidden_size: int, projected: bool) -> DepthState:
    """``DepthState`` after ``sublayers_done`` from its sources in label order."""
    site = schedule.state_after(sublayers_done)
    parts = list(parts)
    keys = None
    if projected:
        keys = [p[..., hidden_size:] for p in parts]
        parts = [p[..., :hidden_size] for p in parts]
    n = site.num_completed
    state = DepthState(
        embedding=parts[0],
        embedding_key=keys[0] if keys else None,
        blocks=parts[1 : 1 + n],
        block_keys=keys[1 : 1 + n] if keys else [],
        partial=parts[1 + n] if site.partial is not None else None,
        partial_key=keys[1 + n] if keys and site.partial is not None else None,
        num_sublayers_done=sublayers_done,
    )
    return state


Shape = Tuple[int, int, int]


def stage_sublayers(config, pp_rank: int, vp_stage: Optional[int] = None) -> Tuple[int, int]:
    """Global sub-layer range of pipeline rank ``pp_rank`` as megatron-core splits layers.

    Args:
        config: the model's ``TransformerConfig`` (its pipeline size, virtual pipeline size
            and uneven-split fields are honoured through megatron's
            ``get_transformer_layer_offset`` and ``get_num_layers_to_build``).
        pp_rank: pipeline rank, 0-based.
        vp_stage: virtual stage (model chunk) of that rank, with interleaving.

    Returns:
        (before, after): the stage receives the state after sub-layer ``before`` and sends
        the state after sub-layer ``after`` (``after - before`` = 2 x its layer count).
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return 2 * offset, 2 * (offset + count)


def chunk_ends_from_config(config) -> List[int]:
    """Sub-layer after which each model chunk ends, in pipeline order.

    Chunk c = v * P + p is virtual stage v of pipeline rank p (megatron's interleaving);
    without virtual stages chunk c is rank c. The last entry is 2L.
    """
    pp = config.pipeline_model_parallel_size
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    ends = []
    for v in range(vp or 1):
        for p in range(pp):
            ends.append(stage_sublayers(config, p, v if vp else None)[1])
    return ends


def boundary_width(config) -> int:
    """Last dimension w of the packed state: d, or d + r with projected keys."""
    return config.hidden_size + (config.key_rank if config.projected_keys else 0)


def boundary_shape(schedule: DepthSchedule, sublayers_done: int, seq_rows: int,
                   micro_batch_size: int, width: int) -> Shape:
    """Shape [S * s, b, w] of the packed state after ``sublayers_done`` sub-layers.

    Args:
        schedule: the depth schedule.
        sublayers_done: boundary position (0..2L).
        seq_rows: rows one source has on this rank (the sequence length divided by the
            context- and, under sequence parallelism, tensor-parallel sizes).
        micro_batch_size: b.
        width: w from ``boundary_width``.
    """
    return (packed_num_sources(schedule, sublayers_done) * seq_rows, micro_batch_size, width)


def depth_tensor_shapes_fn(config, pp_rank: Optional[int] = None
                           ) -> Optional[Callable[[List[Shape], List[Shape]],
                                                  Tuple[List[Shape], List[Shape]]]]:
    """``adjust_tensor_shapes_fn`` for megatron-core's non-interleaved 1F1B schedule.

    The schedule computes one default shape [s, b, d] (already divided for sequence and
    context parallelism); the returned function scales its rows by the number of sources
    crossing this rank's input and output boundaries and widens it for projected keys.

    Args:
        config: ``LRAttnResConfig``.
        pp_rank: pipeline rank; default the current one from ``parallel_state``.

    Returns:
        The function, or None when no adjustment is needed (``residual='standard'``, no
        pipeline parallelism, or interleaved stages, which use ``variable_seq_lengths``).
    """
    if not getattr(config, "uses_depth_attention", False) or config.pipeline_model_parallel_size == 1:
        return None
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        # The interleaved schedule takes no adjust_tensor_shapes_fn: with
        # variable_seq_lengths its p2p sends each tensor's shape first.
        return None
    if pp_rank is None:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    from megatron_lrattn.depth.schedule import schedule_from_config

    schedule = schedule_from_config(config)
    before, after = stage_sublayers(config, pp_rank)
    width = boundary_width(config)

    def adjust(recv_shapes: List[Shape], send_shapes: List[Shape]
               ) -> Tuple[List[Shape], List[Shape]]:
        recv = [boundary_shape(schedule, before, s, b, width) for s, b, _ in recv_shapes]
        send = [boundary_shape(schedule, after, s, b, width) for s, b, _ in send_shapes]
        return recv, send

    return adjust


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
    from megatron_lrattn.depth.schedule import schedule_from_config

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
