"""Depth schedule: which sources every read site sees, computed from the config alone.

Sub-layers are numbered 1..2L (attention, MLP, attention, ...). Source v_0 is the token
embedding. Read site j (1..2L) produces the input of sub-layer j + 1; site 2L is the read
before the final norm. A depth block is a run of consecutive sub-layers; its value is the
raw sum of its members' outputs. Site j reads [v_0, B_1, ..., B_n] plus the running
partial sum P of the current block when it is non-empty. Every other part of the code
(layers, kernels, pipeline packing, FLOP accounting) asks this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple


@dataclass(frozen=True)
class SiteSources:
    """The sources one read site sees.

    Attributes:
        site: read-site index j (1..2L).
        num_completed: number n of completed blocks read (B_1..B_n).
        partial: (first, last) sub-layer range of the running partial sum, or None when
            the current block is empty at this site.
    """

    site: int
    num_completed: int
    partial: Optional[Tuple[int, int]]

    @property
    def num_sources(self) -> int:
        """S = 1 (embedding) + completed blocks + (1 if a partial sum is read)."""
        return 1 + self.num_completed + (self.partial is not None)

    def labels(self) -> Tuple[str, ...]:
        """Readable names of the sources, e.g. ('v0', 'B1', 'P[7:7]')."""
        out = ["v0"] + [f"B{k}" for k in range(1, self.num_completed + 1)]
        if self.partial is not None:
            out.append(f"P[{self.partial[0]}:{self.partial[1]}]")
        return tuple(out)


@dataclass(frozen=True)
class DepthSchedule:
    """Block structure of the depth sources for L layers and N blocks.

    Attributes:
        num_layers: L.
        num_blocks: N (1 <= N <= 2L).
        block_ends: sorted sub-layer indices that close a block; the last is 2L.
    """

    num_layers: int
    num_blocks: int
    block_ends: Tuple[int, ...]

    @property
    def num_sublayers(self) -> int:
        """2L."""
        return 2 * self.num_layers

    @property
    def num_sites(self) -> int:
        """Number of read sites (and of depth queries): 2L."""
        return 2 * self.num_layers

    def block_index(self, sublayer: int) -> int:
        """1-based index of the block that sub-layer ``sublayer`` (1..2L) belongs to."""
        self._check_sublayer(sublayer)
        return next(k for k, end in enumerate(self.block_ends, start=1) if sublayer <= end)

    def block_start(self, block: int) -> int:
        """First sub-layer of 1-based block ``block`` (1..N)."""
        if not 1 <= block <= self.num_blocks:
            raise ValueError(f"block={block} is outside 1..{self.num_blocks}")
        return 1 if block == 1 else self.block_ends[block - 2] + 1

    def closes_block(self, sublayer: int) -> bool:
        """True when sub-layer ``sublayer`` is the last member of its block."""
        self._check_sublayer(sublayer)
        return sublayer in self.block_ends

    def site(self, j: int) -> SiteSources:
        """Sources of read site j (1..2L)."""
        self._check_sublayer(j, name="site")
        n = sum(1 for end in self.block_ends if end <= j)
        start = 1 if n == 0 else self.block_ends[n - 1] + 1
        return SiteSources(site=j, num_completed=n, partial=(start, j) if start <= j else None)

    def block_sites(self, num_completed: int) -> Tuple[int, ...]:
        """Read sites whose completed sources are exactly [v_0, B_1..B_n], n = ``num_completed``.

        These are the sites of block n + 1 (its first site reads no partial sum; site 0, the
        embedding itself, is not a read), or site 2L alone for n = N. Phase 1 of the
        two-phase schedule serves all of them with one pass over those sources.
        """
        if not 0 <= num_completed <= self.num_blocks:
            raise ValueError(f"num_completed={num_completed} is outside 0..{self.num_blocks}")
        lo = self.block_ends[num_completed - 1] if num_completed else 1
        hi = (self.block_ends[num_completed] - 1 if num_completed < self.num_blocks
              else self.num_sites)
        return tuple(range(lo, hi + 1))

    def state_after(self, sublayer: int) -> SiteSources:
        """Depth state held after sub-layer ``sublayer`` (0..2L): what a pipeline stage
        boundary placed there must carry. ``sublayer`` = 0 is the embedding alone."""
        if sublayer == 0:
            return SiteSources(site=0, num_completed=0, partial=None)
        return self.site(sublayer)

    def _check_sublayer(self, j: int, name: str = "sublayer") -> None:
        if not 1 <= j <= self.num_sublayers:
            raise ValueError(f"{name}={j} is outside 1..{self.num_sublayers}")


@lru_cache(maxsize=None)
def depth_schedule(num_layers: int, num_blocks: int) -> DepthSchedule:
    """Compute the depth schedule.

    Block ends are E = { ceil(2L * k / N) : k = 1..N } in sub-layer units.

    Args:
        num_layers: number of transformer layers L (>= 1).
        num_blocks: number of depth blocks N, 1 <= N <= 2L.

    Returns:
        The ``DepthSchedule``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if not 1 <= num_blocks <= 2 * num_layers:
        raise ValueError(f"num_blocks={num_blocks} must be in 1..{2 * num_layers}")
    total = 2 * num_layers
    # Integer ceil(total * k / N), exact for all sizes.
    ends = tuple(-((-total * k) // num_blocks) for k in range(1, num_blocks + 1))
    assert len(set(ends)) == num_blocks and ends[-1] == total
    return DepthSchedule(num_layers=num_layers, num_blocks=num_blocks, block_ends=ends)


def schedule_from_config(config) -> DepthSchedule:
    """``depth_schedule`` for a config with ``num_layers`` and ``num_blocks``."""
    return depth_schedule(config.num_layers, config.num_blocks)
