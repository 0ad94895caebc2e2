"""Shapes of the tensors a pipeline stage boundary carries.

A boundary after sub-layer j carries the packed depth state (``DepthState.pack``): the S
sources of read site j, [(S * s), b, w] with w = d, or d + r when keys are projected. S
differs per boundary, so the tensors megatron-core's 1F1B schedule sends and receives differ
per stage: ``stage_sublayers`` gives a stage's sub-layer range from megatron's own
layer-to-stage split and ``depth_tensor_shapes_fn`` turns it into the schedule's
``adjust_tensor_shapes_fn``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from megatron_lrattn.depth.schedule import DepthSchedule, schedule_from_config

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
    return (schedule.state_after(sublayers_done).num_sources * seq_rows, micro_batch_size,
            width)


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
    schedule = schedule_from_config(config)
    before, after = stage_sublayers(config, pp_rank)
    width = boundary_width(config)

    def adjust(recv_shapes: List[Shape], send_shapes: List[Shape]
               ) -> Tuple[List[Shape], List[Shape]]:
        recv = [boundary_shape(schedule, before, s, b, width) for s, b, _ in recv_shapes]
        send = [boundary_shape(schedule, after, s, b, width) for s, b, _ in send_shapes]
        return recv, send

    return adjust
