"""Depth schedule: block ends and the sources every read site sees (docs/design.md)."""

import dataclasses
import math
from fractions import Fraction

import pytest

from megatron_lrattn.depth.schedule import DepthSchedule, SiteSources, depth_schedule


def expected_ends(num_layers: int, num_blocks: int) -> tuple:
    total = 2 * num_layers
    return tuple(math.ceil(Fraction(total * k, num_blocks)) for k in range(1, num_blocks + 1))


def simulate(num_layers: int, num_blocks: int):
    """Append sub-layer outputs one by one; return per-site (completed blocks, partial members)."""
    ends = set(expected_ends(num_layers, num_blocks))
    completed, partial, states = [], [], {}
    for j in range(1, 2 * num_layers + 1):
        partial.append(j)
        if j in ends:
            completed.append(partial)
            partial = []
        states[j] = ([list(b) for b in completed], list(partial))
    return states


ALL_SHAPES = [(L, N) for L in range(1, 14) for N in range(1, 2 * L + 1)] + [
    (24, 8), (24, 7), (24, 48), (32, 5), (40, 80), (61, 13),
]


class TestPaperExample:
    """L = 24, N = 8: blocks end every 6 sub-layers."""

    sched = depth_schedule(24, 8)

    def test_block_ends(self):
        assert self.sched.block_ends == (6, 12, 18, 24, 30, 36, 42, 48)
        assert self.sched.num_sublayers == self.sched.num_sites == 48

    def test_site_7(self):
        s = self.sched.site(7)
        assert s == SiteSources(site=7, num_completed=1, partial=(7, 7))
        assert s.labels() == ("v0", "B1", "P[7:7]")
        assert s.num_sources == 3

    def test_site_6(self):
        s = self.sched.site(6)
        assert s.num_completed == 1 and s.partial is None
        assert s.labels() == ("v0", "B1")
        assert s.num_sources == 2

    def test_site_48(self):
        s = self.sched.site(48)
        assert s.labels() == ("v0",) + tuple(f"B{k}" for k in range(1, 9))
        assert s.num_sources == 9 and s.partial is None

    def test_other_sites(self):
        assert self.sched.site(1).labels() == ("v0", "P[1:1]")
        assert self.sched.site(5).labels() == ("v0", "P[1:5]")
        assert self.sched.site(11).labels() == ("v0", "B1", "P[7:11]")
        assert self.sched.site(12).labels() == ("v0", "B1", "B2")
        assert self.sched.site(47).labels() == ("v0",) + tuple(f"B{k}" for k in range(1, 8)) + (
            "P[43:47]",
        )

    def test_blocks(self):
        for j in range(1, 49):
            assert self.sched.block_index(j) == (j - 1) // 6 + 1
            assert self.sched.closes_block(j) == (j % 6 == 0)
        assert [self.sched.block_start(k) for k in range(1, 9)] == [1, 7, 13, 19, 25, 31, 37, 43]

    def test_max_sources(self):
        assert max(self.sched.site(j).num_sources for j in range(1, 49)) == 9


@pytest.mark.parametrize("num_layers", [1, 2, 3, 12, 24])
def test_full_granularity(num_layers):
    total = 2 * num_layers
    sched = depth_schedule(num_layers, total)
    assert sched.block_ends == tuple(range(1, total + 1))
    for j in range(1, total + 1):
        s = sched.site(j)
        assert s.num_sources == j + 1
        assert s.partial is None and s.num_completed == j
        assert s.labels() == ("v0",) + tuple(f"B{k}" for k in range(1, j + 1))
        assert sched.block_index(j) == j and sched.block_start(j) == j
        assert sched.closes_block(j)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 12, 24])
def test_single_block(num_layers):
    total = 2 * num_layers
    sched = depth_schedule(num_layers, 1)
    assert sched.block_ends == (total,)
    for j in range(1, total):
        s = sched.site(j)
        assert s.labels() == ("v0", f"P[1:{j}]")
        assert (s.num_completed, s.partial, s.num_sources) == (0, (1, j), 2)
        assert not sched.closes_block(j) and sched.block_index(j) == 1
    last = sched.site(total)
    assert last.labels() == ("v0", "B1")
    assert (last.num_completed, last.partial) == (1, None)
    assert sched.closes_block(total) and sched.block_start(1) == 1


def test_non_divisible_3_layers_4_blocks():
    sched = depth_schedule(3, 4)
    assert sched.block_ends == (2, 3, 5, 6)
    assert [sched.block_index(j) for j in range(1, 7)] == [1, 1, 2, 3, 3, 4]
    assert [sched.block_start(k) for k in range(1, 5)] == [1, 3, 4, 6]
    assert [sched.closes_block(j) for j in range(1, 7)] == [False, True, True, False, True, True]
    labels = [sched.site(j).labels() for j in range(1, 7)]
    assert labels == [
        ("v0", "P[1:1]"),
        ("v0", "B1"),
        ("v0", "B1", "B2"),
        ("v0", "B1", "B2", "P[4:4]"),
        ("v0", "B1", "B2", "B3"),
        ("v0", "B1", "B2", "B3", "B4"),
    ]


@pytest.mark.parametrize(
    "num_layers, num_blocks, ends",
    [
        (24, 7, (7, 14, 21, 28, 35, 42, 48)),
        (2, 3, (2, 3, 4)),
        (5, 4, (3, 5, 8, 10)),
        (1, 2, (1, 2)),
    ],
)
def test_non_divisible_ends(num_layers, num_blocks, ends):
    assert depth_schedule(num_layers, num_blocks).block_ends == ends


@pytest.mark.parametrize("num_layers, num_blocks", ALL_SHAPES)
def test_matches_simulation(num_layers, num_blocks):
    sched = depth_schedule(num_layers, num_blocks)
    total = 2 * num_layers
    assert isinstance(sched, DepthSchedule)
    assert (sched.num_layers, sched.num_blocks) == (num_layers, num_blocks)
    assert sched.block_ends == expected_ends(num_layers, num_blocks)
    assert len(sched.block_ends) == num_blocks and sched.block_ends[-1] == total
    assert all(type(e) is int for e in sched.block_ends)
    sizes = [b - a for a, b in zip((0,) + sched.block_ends, sched.block_ends)]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1

    states = simulate(num_layers, num_blocks)
    for j in range(1, total + 1):
        completed, partial = states[j]
        s = sched.site(j)
        assert s.site == j
        assert s.num_completed == len(completed)
        assert s.partial == ((partial[0], partial[-1]) if partial else None)
        assert s.num_sources == 1 + len(completed) + bool(partial)
        assert s.num_sources <= num_blocks + 1
        assert len(s.labels()) == s.num_sources
        assert sched.state_after(j) == s
        # Block bookkeeping agrees with the simulated membership.
        k = sched.block_index(j)
        assert sched.block_start(k) <= j <= sched.block_ends[k - 1]
        assert sched.closes_block(j) == (not partial)
        if partial:
            assert partial == list(range(sched.block_start(k), j + 1))
        else:
            assert completed[-1] == list(range(sched.block_start(k), j + 1))
    for k, members in enumerate(states[total][0], start=1):
        assert members == list(range(sched.block_start(k), sched.block_ends[k - 1] + 1))
        assert all(sched.block_index(m) == k for m in members)


def test_state_after_embedding():
    sched = depth_schedule(3, 4)
    s0 = sched.state_after(0)
    assert (s0.num_completed, s0.partial, s0.num_sources) == (0, None, 1)
    assert s0.labels() == ("v0",)


def test_cached_and_frozen():
    sched = depth_schedule(24, 8)
    assert depth_schedule(24, 8) is sched
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.num_blocks = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.site(3).num_completed = 0


@pytest.mark.parametrize(
    "num_layers, num_blocks", [(0, 1), (-1, 1), (2, 0), (2, -1), (2, 5), (24, 49)]
)
def test_bad_shapes(num_layers, num_blocks):
    with pytest.raises(ValueError, match="num_layers|num_blocks"):
        depth_schedule(num_layers, num_blocks)


def test_bad_num_blocks_message():
    with pytest.raises(ValueError, match=r"num_blocks=49 must be in 1\.\.48"):
        depth_schedule(24, 49)


@pytest.mark.parametrize("bad", [0, -1, 7])
def test_bad_indices(bad):
    sched = depth_schedule(3, 4)
    with pytest.raises(ValueError, match=f"site={bad} is outside 1..6"):
        sched.site(bad)
    with pytest.raises(ValueError, match=f"sublayer={bad} is outside 1..6"):
        sched.block_index(bad)
    with pytest.raises(ValueError, match=f"sublayer={bad} is outside 1..6"):
        sched.closes_block(bad)


@pytest.mark.parametrize("bad", [-1, 7])
def test_bad_state_after(bad):
    with pytest.raises(ValueError, match="outside 1..6"):
        depth_schedule(3, 4).state_after(bad)


@pytest.mark.parametrize("bad", [0, -1, 5])
def test_bad_block_start(bad):
    with pytest.raises(ValueError, match=f"block={bad} is outside 1..4"):
        depth_schedule(3, 4).block_start(bad)
