"""LRAttnResConfig: every field documented and defaulted, every bad value refused clearly."""

import ast
import dataclasses
import inspect
import math
import textwrap

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrattn.model.config import (
    DEPTH_BACKENDS,
    KEY_TYPES,
    RESIDUAL_MODES,
    ConfigError,
    LRAttnResConfig,
)
from megatron_lrattn.depth.schedule import depth_schedule, schedule_from_config

D = 64
SMALL = dict(num_layers=2, hidden_size=D, num_attention_heads=4, num_blocks=4)

OUR_FIELDS = {
    "residual": "lr_attnres",
    "key_type": "sliced",
    "key_rank": None,
    "num_blocks": 8,
    "key_norm_eps": 1e-6,
    "depth_scale": 1.0,
    "depth_backend": "auto",
    "depth_schedule": "auto",
    "fuse_depth_norm": True,
    "recompute_mlp_activation": True,
    "triton_cross_entropy": False,
}


def make(**overrides) -> LRAttnResConfig:
    return LRAttnResConfig(**{**SMALL, **overrides})


def expect_error(field: str, value, allowed: str, **overrides) -> None:
    """Building with ``overrides`` raises ConfigError naming field, value and what is allowed."""
    with pytest.raises(ConfigError) as info:
        make(**overrides)
    msg = str(info.value)
    assert f"{field}=" in msg, msg
    assert repr(value) in msg, msg
    assert allowed in msg, msg


def test_new_fields_are_exactly_the_documented_ones():
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    ours = {f.name: f for f in dataclasses.fields(LRAttnResConfig) if f.name not in base}
    assert set(ours) == set(OUR_FIELDS)
    for name, default in OUR_FIELDS.items():
        assert ours[name].default == default, name


def test_every_new_field_has_a_docstring():
    tree = ast.parse(textwrap.dedent(inspect.getsource(LRAttnResConfig)))
    body = tree.body[0].body
    documented = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            documented[stmt.target.id] = is_doc and isinstance(nxt.value.value, str)
    assert set(documented) == set(OUR_FIELDS)
    assert all(documented.values()), documented
    assert LRAttnResConfig.__doc__
    for prop in ("uses_depth_attention", "projected_keys"):
        assert getattr(LRAttnResConfig, prop).__doc__


def test_defaults_lr_attnres():
    cfg = LRAttnResConfig(num_layers=4, hidden_size=D, num_attention_heads=4)
    assert cfg.residual == "lr_attnres"
    assert cfg.key_type == "sliced"
    assert cfg.key_rank == D // 4
    assert cfg.num_blocks == 8
    assert cfg.key_norm_eps == 1e-6
    assert cfg.depth_scale == 1.0
    assert cfg.depth_backend == "auto"
    assert cfg.uses_depth_attention and not cfg.projected_keys
    assert isinstance(cfg, TransformerConfig)


def test_default_num_blocks_needs_enough_layers():
    # N defaults to the paper's 8, which needs 2L >= 8.
    with pytest.raises(ConfigError, match=r"num_blocks=8 .*2 \* num_layers \(4\)"):
        LRAttnResConfig(num_layers=2, hidden_size=D, num_attention_heads=4)


def test_default_rank_per_mode():
    assert make().key_rank == D // 4
    assert make(key_type="projected").key_rank == D // 4
    assert make(residual="attnres").key_rank == D
    assert make(residual="standard").key_rank is None


def test_default_rank_is_at_least_one():
    cfg = LRAttnResConfig(num_layers=2, hidden_size=2, num_attention_heads=1, num_blocks=2)
    assert cfg.key_rank == 1


def test_properties_per_mode():
    std = make(residual="standard")
    assert not std.uses_depth_attention and not std.projected_keys
    att = make(residual="attnres")
    assert att.uses_depth_attention and not att.projected_keys
    proj = make(key_type="projected", key_rank=8)
    assert proj.uses_depth_attention and proj.projected_keys


@pytest.mark.parametrize("rank", [1, 7, D // 4, D - 1, D])
def test_valid_ranks(rank):
    assert make(key_rank=rank).key_rank == rank
    assert make(key_rank=rank, key_type="projected").key_rank == rank


def test_attnres_explicit_full_rank():
    assert make(residual="attnres", key_rank=D).key_rank == D


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_valid_num_blocks(n):
    cfg = make(num_blocks=n)
    assert cfg.num_blocks == n
    sched = schedule_from_config(cfg)
    assert sched is depth_schedule(2, n)
    assert sched.num_blocks == n and sched.num_layers == 2


def test_valid_eps_scale_backend():
    cfg = make(key_norm_eps=1e-12, depth_scale=3.5, depth_backend="torch")
    assert (cfg.key_norm_eps, cfg.depth_scale, cfg.depth_backend) == (1e-12, 3.5, "torch")
    for backend in DEPTH_BACKENDS:
        assert make(depth_backend=backend).depth_backend == backend


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("rank", [0, -1, -D])
def test_rank_below_one(rank):
    expect_error("key_rank", rank, f"1 <= key_rank <= hidden_size ({D})", key_rank=rank)


@pytest.mark.parametrize("rank", [D + 1, 4 * D])
def test_rank_above_hidden(rank):
    expect_error("key_rank", rank, f"1 <= key_rank <= hidden_size ({D})", key_rank=rank)
    expect_error("key_rank", rank, f"1 <= key_rank <= hidden_size ({D})", key_rank=rank, key_type="projected")


@pytest.mark.parametrize("rank", [16.0, 16.5, "16", True])
def test_rank_not_an_int(rank):
    expect_error("key_rank", rank, "an integer", key_rank=rank)


@pytest.mark.parametrize("rank", [1, D // 4, D - 1, D + 1])
def test_attnres_needs_full_rank(rank):
    expect_error("key_rank", rank, f"r = hidden_size = {D}", residual="attnres", key_rank=rank)
    expect_error("key_rank", rank, "use lr_attnres", residual="attnres", key_rank=rank)


def test_attnres_refuses_projected_keys():
    expect_error("key_type", "projected", "use lr_attnres", residual="attnres", key_type="projected")


@pytest.mark.parametrize("rank", [1, D // 4, D])
def test_standard_refuses_rank(rank):
    allowed = "only to residual attnres/lr_attnres"
    expect_error("key_rank", rank, allowed, residual="standard", key_rank=rank)


def test_standard_refuses_projected_keys():
    allowed = "only to residual lr_attnres"
    expect_error("key_type", "projected", allowed, residual="standard", key_type="projected")


@pytest.mark.parametrize("n", [0, -1])
def test_num_blocks_below_one(n):
    expect_error("num_blocks", n, "1 <= num_blocks <= 2 * num_layers (4)", num_blocks=n)


@pytest.mark.parametrize("n", [5, 8, 100])
def test_num_blocks_above_two_layers(n):
    expect_error("num_blocks", n, "1 <= num_blocks <= 2 * num_layers (4)", num_blocks=n)
    expect_error("num_blocks", n, "2 * num_layers (4)", num_blocks=n, residual="attnres")


@pytest.mark.parametrize("n", [2.0, "2", True])
def test_num_blocks_not_an_int(n):
    expect_error("num_blocks", n, "an integer", num_blocks=n)


@pytest.mark.parametrize("name", ["Standard", "attn_res", "lr-attnres", "", "none"])
def test_unknown_residual(name):
    expect_error("residual", name, "one of " + ", ".join(RESIDUAL_MODES), residual=name)


@pytest.mark.parametrize("name", ["slice", "Projected", "full", ""])
def test_unknown_key(name):
    expect_error("key_type", name, "one of " + ", ".join(KEY_TYPES), key_type=name)
    expect_error("key_type", name, "one of " + ", ".join(KEY_TYPES), key_type=name, residual="standard")


@pytest.mark.parametrize("name", ["cuda", "Triton", "te", ""])
def test_unknown_backend(name):
    allowed = "one of " + ", ".join(DEPTH_BACKENDS)
    expect_error("depth_backend", name, allowed, depth_backend=name)
    expect_error("depth_backend", name, allowed, depth_backend=name, residual="standard")


@pytest.mark.parametrize("value", [1, "yes", None])
def test_fuse_depth_norm_is_a_bool(value):
    expect_error("fuse_depth_norm", value, "True or False", fuse_depth_norm=value)


@pytest.mark.parametrize("residual", ["lr_attnres", "attnres"])
@pytest.mark.parametrize("eps", [0.0, -1e-6, math.nan, math.inf])
def test_bad_key_norm_eps(residual, eps):
    expect_error("key_norm_eps", eps, "a finite number > 0", key_norm_eps=eps, residual=residual)


@pytest.mark.parametrize("residual", ["lr_attnres", "attnres"])
@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_bad_depth_scale(residual, scale):
    expect_error("depth_scale", scale, "a finite number > 0", depth_scale=scale, residual=residual)

