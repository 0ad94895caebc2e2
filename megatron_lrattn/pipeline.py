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

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_lrattn.depth_state import DepthState
from megatron_lrattn.schedule import DepthSchedule


def packed_num_sources(schedule: DepthSchedule, sublayers_done: int) -> int:
    """Number of sources a boundary after ``sublayers_done`` sub-layers carries."""
    return schedule.state_after(sublayers_done).num_sources


def pack_state(state: DepthState) -> Tensor:
    """Concatenate the state's sources along dim 0 into one new tensor."""
    values, keys = state.sources()
    if keys is not None:
        values = [torch.cat([v, k.to(v.dtype)], dim=-1) for v, k in zip(values, keys)]
    return torch.cat(values, dim=0)


def unpack_state(packed: Tensor, schedule: DepthSchedule, sublayers_done: int, hidden_size: int,
                 projected: bool) -> DepthState:
    """Inverse of ``pack_state`` for the boundary after ``sublayers_done`` sub-layers."""
    site = schedule.state_after(sublayers_done)
    n_src = site.num_sources
    if packed.shape[0] % n_src:
        raise ValueError(
            f"packed depth state has {packed.shape[0]} rows, not a multiple of the "
            f"{n_src} sources expected after sub-layer {sublayers_done}"
        )
    parts = list(packed.chunk(n_src, dim=0))
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


def stage_sublayers(config, pp_rank: int) -> Tuple[int, int]:
    """Global sub-layer range of pipeline rank ``pp_rank`` as megatron-core splits layers.

    Args:
        config: the model's ``TransformerConfig`` (its pipeline size and uneven-split fields
            are honoured through megatron's ``get_transformer_layer_offset`` and
            ``get_num_layers_to_build``).
        pp_rank: pipeline rank, 0-based.

    Returns:
        (before, after): the stage receives the state after sub-layer ``before`` and sends
        the state after sub-layer ``after`` (``after - before`` = 2 x its layer count).
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return 2 * offset, 2 * (offset + count)


def boundary_width(config) -> int:
    """Last dimension w of the packed state: d, or d + r with projected keys."""
    return config.hidden_size + (config.rank if config.projected_keys else 0)


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
        The function, or None when no adjustment is needed (``residual='standard'`` or no
        pipeline parallelism).
    """
    if not getattr(config, "uses_depth_attention", False) or config.pipeline_model_parallel_size == 1:
        return None
    if pp_rank is None:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    from megatron_lrattn.schedule import schedule_from_config

    schedule = schedule_from_config(config)
    before, after = stage_sublayers(config, pp_rank)
    width = boundary_width(config)

    def adjust(recv_shapes: List[Shape], send_shapes: List[Shape]
               ) -> Tuple[List[Shape], List[Shape]]:
        recv = [boundary_shape(schedule, before, s, b, width) for s, b, _ in recv_shapes]
        send = [boundary_shape(schedule, after, s, b, width) for s, b, _ in send_shapes]
        return recv, send

    return adjust
