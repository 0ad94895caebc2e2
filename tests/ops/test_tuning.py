"""The launch-settings table: the measured defaults per kernel, and the override that
benchmarks and tests use."""

import dataclasses
import functools

import pytest
import torch

from megatron_lrattn.ops import tuning


def test_kernel_family_defaults():
    """d >= SOURCE_TILED_MIN_WIDTH takes the source-tiled kernels, narrower rows the
    token-tiled ones; the override forces either."""
    wide = tuning.SOURCE_TILED_MIN_WIDTH
    assert tuning.read_family(wide) == "source" and tuning.read_family(4096) == "source"
    assert tuning.read_family(wide - 1) == "token"
    with tuning.override(family="source"):
        assert tuning.read_family(64) == "source"
    with tuning.override(family="token"):
        assert tuning.read_family(4096) == "token"
    assert tuning.read_family(4096) == "source"  # restored


def test_register_caps():
    """The register caps apply where they were measured (4 warps: the backward at padded
    width 2048, the forward at 4096, d=3072 included); other widths and warps stay uncapped,
    and the override sets or removes a cap."""
    cap = lambda d, bwd: tuning.source_tiled(d, 9, bwd).maxnreg  # noqa: E731
    assert cap(2048, True) == 128 and cap(2048, False) is None
    assert cap(3072, False) == 128 and cap(4096, True) is None and cap(8192, False) is None
    with tuning.override(source_tiled_bwd={"warps": 8}):
        assert cap(2048, True) is None
    with tuning.override(source_tiled_bwd={"maxnreg": None}, source_tiled_fwd={"maxnreg": 96}):
        assert cap(2048, True) is None and cap(1000, False) == 96


def test_defaults_are_the_measured_winners():
    """The values the GPU path runs at (bf16, T=16384): token-tiled 2048-element tiles, 4
    warps, 4 backward programs per SM; source-tiled one source per step, 4 warps, 8 backward
    programs per SM; phase-1 logits 128 tokens x 32 columns, values 512 columns / 2 warps,
    dots 256 columns (d/8 above 2048), key-column gradients 256 / 1 warp, groups of 8;
    merges 1024-element tiles, 4 warps, 8 backward programs per SM that prefetch with 16
    elements of a row per thread up to 2048-element tiles."""
    T, bf16 = 16384, torch.bfloat16
    assert tuning.token_tiled(256, T) == tuning.TokenTiled(tokens=8, warps=4, programs_per_sm=4)
    for d in (512, 2048, 4096, 8192):
        for bwd in (False, True):
            cfg = tuning.source_tiled(d, 9, bwd)
            assert (cfg.sources, cfg.warps, cfg.programs_per_sm) == (1, 4, 8)
    p = tuning.phase1(2048, 512, T, bf16)
    assert (p.logit_tokens, p.logit_chunk, p.logit_warps, p.logit_precision) == (
        128, 32, 4, "tf32x3")
    assert (p.value_chunk, p.value_warps, p.dots_chunk, p.dots_warps) == (512, 2, 256, 1)
    assert (p.grad_chunk, p.grad_warps, p.key_warps, p.programs_per_sm, p.group) == (
        256, 1, 4, 8, 8)
    assert tuning.phase1(4096, 1024, T, bf16).dots_chunk == 512
    assert tuning.phase1(2048, 512, T, torch.float32).logit_precision == "ieee"
    merge = functools.partial(tuning.Merge, warps=4, programs_per_sm=8)
    assert tuning.merge(256, T) == merge(tokens=4, bwd_warps=2, prefetch=True)
    assert tuning.merge(1024, T) == merge(tokens=1, bwd_warps=2, prefetch=True)
    assert tuning.merge(2048, T) == merge(tokens=1, bwd_warps=4, prefetch=True)
    assert tuning.merge(3072, T) == merge(tokens=1, bwd_warps=4, prefetch=False)


def test_tiles_never_outgrow_the_tokens_or_the_row():
    assert tuning.token_tiled(64, 3).tokens == 4
    assert tuning.source_tiled(64, 3, False).sources == 1
    with tuning.override(source_tiled_fwd={"sources": 8}):
        assert tuning.source_tiled(64, 3, False).sources == 4
    p = tuning.phase1(64, 8, 5, torch.bfloat16)
    assert (p.logit_tokens, p.logit_chunk, p.value_chunk, p.dots_chunk) == (16, 16, 64, 64)


def test_override_refuses_unknown_names_and_restores():
    with pytest.raises(ValueError, match="unknown kernel 'phase2'"):
        with tuning.override(phase2={"tokens": 1}):
            pass
    with pytest.raises(ValueError, match=r"merge has no field \['tile'\]"):
        with tuning.override(merge={"tile": 4096}):
            pass
    with pytest.raises(ValueError, match="family='row'"):
        with tuning.override(family="row"):
            pass
    with tuning.override(merge={"tokens": 2}):
        with tuning.override(merge={"warps": 16}):
            assert tuning.merge(2048, 64) == tuning.Merge(
                tokens=2, warps=16, programs_per_sm=8, bwd_warps=16, prefetch=False)
        assert tuning.merge(2048, 64) == tuning.Merge(
            tokens=2, warps=4, programs_per_sm=8, bwd_warps=4, prefetch=False)
    assert tuning.merge(2048, 64).tokens == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.merge(2048, 64).tokens = 2
