"""Per-microbatch cache of depth sources, owned by the transformer block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from megatron_lrattn.ops import depth_read


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """Stateless RMS normalisation over the last dimension, computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class DepthState:
    """The depth sources seen so far by one microbatch.

    Attributes:
        embedding: v_0, [s, b, d].
        blocks: completed block values B_1..B_n (raw sums of their members' outputs).
        partial: running sum of the current block's outputs, or None when it is empty.
        embedding_key, block_keys, partial_key: projected keys ([s, b, r]) matching the
            values; all None / empty for sliced keys.
        num_sublayers_done: global index of the last sub-layer whose output was added.
    """

    embedding: Tensor
    embedding_key: Optional[Tensor] = None
    blocks: List[Tensor] = field(default_factory=list)
    block_keys: List[Tensor] = field(default_factory=list)
    partial: Optional[Tensor] = None
    partial_key: Optional[Tensor] = None
    num_sublayers_done: int = 0

    @property
    def projected(self) -> bool:
        """True when the state carries projected keys."""
        return self.embedding_key is not None

    def add(self, output: Tensor, key: Optional[Tensor], closes_block: bool) -> None:
        """Add one sub-layer's output (and its normalised key) to the current block."""
        if (key is None) == self.projected:
            raise ValueError("DepthState.add: key must be given exactly when keys are projected")
        self.partial = output if self.partial is None else self.partial + output
        if key is not None:
            self.partial_key = key if self.partial_key is None else self.partial_key + key
        self.num_sublayers_done += 1
        if closes_block:
            self.blocks.append(self.partial)
            self.partial = None
            if key is not None:
                self.block_keys.append(self.partial_key)
                self.partial_key = None

    def sources(self) -> Tuple[List[Tensor], Optional[List[Tensor]]]:
        """Values [v_0, B_1.., P?] and matching keys (None for sliced keys)."""
        values = [self.embedding, *self.blocks]
        if self.partial is not None:
            values.append(self.partial)
        if not self.projected:
            return values, None
        keys = [self.embedding_key, *self.block_keys]
        if self.partial_key is not None:
            keys.append(self.partial_key)
        return values, keys

    def read(self, query: Tensor, config) -> Tensor:
        """Depth read of the current sources with ``query`` ([r], fp32).

        Runs inside ``torch.profiler.record_function("depth_read")`` so that profiles
        (``lrattn-profile``) can attribute the forward of every read site.
        """
        values, keys = self.sources()
        with torch.profiler.record_function("depth_read"):
            return depth_read(
                values,
                query,
                keys,
                eps=config.key_norm_eps,
                scale=config.depth_scale,
                backend=config.depth_backend,
            )
