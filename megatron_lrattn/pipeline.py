"""Packing of the depth state into the one tensor a pipeline stage boundary carries.

A stage boundary after sub-layer j carries [v_0, B_1..B_n, P?] (the sources of read site
j, from the depth schedule) concatenated along the sequence dimension into one view-free
tensor [(S * s), b, w] with w = d, or d + r when keys are projected (each source then
travels as [value | key]).
"""

from __future__ import annotations

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
