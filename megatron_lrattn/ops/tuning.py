"""Launch settings of the fused kernels: one frozen dataclass per kernel, chosen by the width d,
the source count S, the dtype and (where a tile cannot outgrow them) the token count.

The defaults are the winners of the H200 measurements cited beside them (``docs/kernels.md``
has the current numbers). ``override`` replaces fields for benchmarks and tests only; fields
derived from an overridden one (the warps of a wider tile) follow it unless overridden too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import torch

from megatron_lrattn.ops.triton_utils import pow2

SOURCE_TILED_MIN_WIDTH = 512
"""Widths from which the depth read runs the source-tiled kernels (narrower rows keep the
token-tiled ones: one row per program would leave most lanes idle)."""

# Register caps per thread of the source-tiled kernels at 4 warps, by backward and padded
# width (H200, S=9, sliced r=d/4, GPU busy time; kernels_maxnreg_sweep_table_2026-12-01.log,
# kernels_key_rows_sweep2_2026-12-01.log): the backward at 2048 ran 4 programs per SM
# instead of 3 (fwd+bwd 74.5 -> 77.4% of copy), the forward at 4096 likewise (78.9 -> 90.2%);
# other widths lost with a cap (spills).
SOURCE_TILED_MAXNREG = {False: {4096: 128}, True: {2048: 128}}


@dataclass(frozen=True)
class TokenTiled:
    """Token-tiled depth read (d < ``SOURCE_TILED_MIN_WIDTH``): a program owns ``tokens``
    rows times the padded width. 2048-element tiles with 4 warps beat 4096 / 8 warps by 5-12
    points of copy bandwidth (H200, ``depth_read.csv`` run of 1b1fc73)."""

    tokens: int
    warps: int
    programs_per_sm: int  # persistent backward programs per SM


@dataclass(frozen=True)
class SourceTiled:
    """Source-tiled depth read (d >= ``SOURCE_TILED_MIN_WIDTH``): one token row per program,
    ``sources`` rows per step (one, 4 warps: H200, kernels_prefetch_interleaved_2026-12-01.log)."""

    sources: int
    warps: int
    maxnreg: Optional[int]  # register cap per thread (None: none)
    programs_per_sm: int  # persistent programs of the backward


@dataclass(frozen=True)
class Phase1:
    """Phase 1 of the two-phase block in width-chunked passes (one H200, block S=9, K=6,
    d=2048, 2026-12-02: phase1_logit_tiles / phase1_final logs)."""

    logit_tokens: int  # tokens per logit program (128)
    logit_chunk: int  # key columns per product (32)
    logit_warps: int
    logit_precision: str  # tl.dot precision: exact for bf16/fp16 keys in tf32x3
    value_chunk: int  # columns per program of the value pass (512, 2 warps)
    value_warps: int
    dots_chunk: int  # columns of the dot pass (256; d/8 above 2048: at most 8 partials)
    dots_warps: int
    grad_chunk: int  # columns of the key-column gradient pass (256)
    grad_warps: int
    key_warps: int  # warps of the projected-key gradient pass
    programs_per_sm: int  # persistent gradient programs per SM
    group: int  # queries per kernel call (K chunk accumulators per program)


@dataclass(frozen=True)
class Merge:
    """Phase-2 merge (and its fused update / RMSNorm): 1024-element tiles (one token from
    d = 1024 on), 4 warps forward. The backward's persistent programs (8 per SM) load the
    next token block while they compute the current one (``prefetch``) where a thread holds
    at most 16 elements of a row with it: 2 warps up to 1024-element tiles, 4 at 2048; the
    4096-element tile (d = 3072) keeps 4 warps without it (its rows held twice spill).
    H100, the update + norm merge, sliced keys r = d/4, backward device time at
    16384 x 1024 / 16384 x 2048 / 4096 x 3072: 94 / 165 / 104 us, against 108 / 194 / 105
    without the prefetch at 4 warps and 130 / 218 / 106 with the key read as a second load
    (``benchmarks/results/merge_prefetch_h100_2026-12-07.log``)."""

    tokens: int
    warps: int
    programs_per_sm: int
    bwd_warps: int
    prefetch: bool


_TABLES = {"token_tiled": TokenTiled, "source_tiled_fwd": SourceTiled,
           "source_tiled_bwd": SourceTiled, "phase1": Phase1, "merge": Merge}
_FAMILIES = ("token", "source")
_OVERRIDES: Dict[str, object] = {}


@contextlib.contextmanager
def override(**settings) -> Iterator[None]:
    """Replace launch settings inside a ``with`` block (benchmarks and tests only).

    Args:
        family: ``"token"`` or ``"source"``: the depth read's kernel family at every width.
        token_tiled, source_tiled_fwd, source_tiled_bwd, phase1, merge: dicts of fields of
            that kernel's dataclass, e.g. ``source_tiled_bwd={"sources": 4}`` (inside
            another override of the same kernel, its fields are added to the outer ones).

    Raises:
        ValueError: an unknown kernel, field or family.
    """
    for name, value in settings.items():
        if name == "family":
            if value not in _FAMILIES:
                raise ValueError(f"override: family={value!r}, allowed: {', '.join(_FAMILIES)}")
            continue
        if name not in _TABLES:
            raise ValueError(f"override: unknown kernel {name!r}, known: family, "
                             f"{', '.join(_TABLES)}")
        fields = {f.name for f in dataclasses.fields(_TABLES[name])}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"override: {name} has no field {unknown}, fields: "
                             f"{', '.join(sorted(fields))}")
    saved = dict(_OVERRIDES)
    for name, value in settings.items():  # nested overrides of one kernel add up
        _OVERRIDES[name] = value if name == "family" else {**_given(name), **value}
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def _given(name: str) -> dict:
    return _OVERRIDES.get(name, {})  # type: ignore[return-value]


def read_family(d: int) -> str:
    """``"source"`` (source-tiled kernels) from ``SOURCE_TILED_MIN_WIDTH`` on, else
    ``"token"``."""
    family = _OVERRIDES.get("family")
    if family is not None:
        return str(family)
    return "source" if d >= SOURCE_TILED_MIN_WIDTH else "token"


def token_tiled(d: int, T: int) -> TokenTiled:
    """Settings of the token-tiled depth read at width d over T tokens."""
    ov = _given("token_tiled")
    bt = max(1, min(ov.get("tokens", 2048 // pow2(d)), pow2(max(T, 1))))
    return TokenTiled(tokens=bt, warps=ov.get("warps", max(4, min(16, bt * pow2(d) // 1024))),
                      programs_per_sm=ov.get("programs_per_sm", 4))


def source_tiled(d: int, S: int, backward: bool) -> SourceTiled:
    """Settings of the source-tiled depth read (forward or backward) at width d, S sources."""
    ov = _given("source_tiled_bwd" if backward else "source_tiled_fwd")
    bl = max(1, min(pow2(ov.get("sources", 1)), pow2(S)))
    warps = ov.get("warps", max(4, min(16, bl * pow2(d) // 2048)))
    cap = SOURCE_TILED_MAXNREG[backward].get(pow2(d)) if warps == 4 else None
    return SourceTiled(sources=bl, warps=warps, maxnreg=ov.get("maxnreg", cap),
                       programs_per_sm=ov.get("programs_per_sm", 8))


def _chunk(width: int, value: int) -> int:
    """A column chunk: a power of two, at least 16, at most the padded width."""
    return max(16, min(pow2(value), pow2(width)))


def _chunk_warps(chunk: int) -> int:
    # 8 chunk columns per thread (16-byte bf16 vectors), at most 8 warps
    return max(1, min(8, chunk // 256))


def phase1(d: int, r: int, T: int, dtype: torch.dtype) -> Phase1:
    """Settings of the phase-1 passes at width d, key rank r, T tokens, source dtype."""
    ov = _given("phase1")
    bc = _chunk(d, ov.get("value_chunk", 512))
    bc1 = _chunk(d, ov.get("dots_chunk", max(256, pow2(d) // 8)))
    bcg = _chunk(d, ov.get("grad_chunk", 256))
    return Phase1(
        logit_tokens=max(16, min(ov.get("logit_tokens", 128), pow2(T))),
        logit_chunk=_chunk(r, ov.get("logit_chunk", 32)),
        logit_warps=ov.get("logit_warps", 4),
        logit_precision=ov.get("logit_precision",
                               "ieee" if dtype == torch.float32 else "tf32x3"),
        value_chunk=bc, value_warps=ov.get("value_warps", _chunk_warps(bc)),
        dots_chunk=bc1, dots_warps=ov.get("dots_warps", _chunk_warps(bc1)),
        grad_chunk=bcg, grad_warps=ov.get("grad_warps", _chunk_warps(bcg)),
        key_warps=ov.get("key_warps", 4), programs_per_sm=ov.get("programs_per_sm", 8),
        group=ov.get("group", 8))


def merge(d: int, T: int) -> Merge:
    """Settings of the merge kernels at width d over T tokens."""
    ov = _given("merge")
    bt = max(1, min(ov.get("tokens", 1024 // pow2(d)), pow2(max(T, 1))))
    tile = bt * pow2(d)
    warps = ov.get("warps", max(4, min(16, tile // 1024)))
    prefetch = ov.get("prefetch", tile <= 2048)
    return Merge(tokens=bt, warps=warps, programs_per_sm=ov.get("programs_per_sm", 8),
                 bwd_warps=ov.get("bwd_warps", max(2, tile // 512) if prefetch else warps),
                 prefetch=prefetch)
