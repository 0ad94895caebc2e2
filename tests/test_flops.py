"""FLOP and parameter accounting (``megatron_lrattn.analysis.flops``) and ``lrattn-flops``."""
from __future__ import annotations

import json
import warnings

import pytest

from megatron_lrattn.analysis.flops import (
    FlopsConfigError,
    ModelShape,
    depth_read_bytes_per_token,
    flops_report,
    forward_flops,
    model_flops_per_token,
    parameter_counts,
    sources_per_site,
)
from megatron_lrattn.cli.flops import main as flops_main

PAPER = dict(num_layers=24, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16)


def test_paper_sliced_r64_n8_is_0_0932_percent():
    fl = forward_flops(ModelShape(**PAPER, residual="lr_attnres", key="sliced", rank=64,
                                  num_blocks=8))
    assert f"{fl.added_percent:.4g}" == "0.09317"
    assert round(fl.added_percent, 4) == 0.0932
    assert fl.denominator == 24 * (8 * 1024**2 + 6 * 1024 * 2816)
    assert fl.depth_reads == 264 * (2 * 64 + 2 * 1024)
    assert fl.key_projections == 0


def test_sources_follow_the_design_example():
    s = sources_per_site(ModelShape(**PAPER, rank=64, num_blocks=8))
    assert len(s) == 48
    assert s[6] == 3  # site 7 reads [v0, B1, P]
    assert s[47] == 9  # site 48 reads [v0, B1..B8]
    full = sources_per_site(ModelShape(**PAPER, rank=64, num_blocks=48))
    assert full == tuple(range(2, 50))  # site j reads [v0, out_1..out_j]


def test_full_granularity_costs_more_than_blocks_and_attnres_more_than_sliced():
    def pct(**kw):
        return forward_flops(ModelShape(**PAPER, **kw)).added_percent

    assert pct(rank=64, num_blocks=48) > pct(rank=64, num_blocks=8) > pct(rank=64, num_blocks=1)
    assert pct(residual="attnres", num_blocks=8) > pct(rank=256, num_blocks=8) > pct(
        rank=64, num_blocks=8)
    assert pct(key="projected", rank=64, num_blocks=8) > pct(rank=64, num_blocks=8)


def test_projected_key_flops():
    L, d, h, r = 24, 1024, 2816, 32
    fl = forward_flops(ModelShape(**PAPER, key="projected", rank=r, num_blocks=8))
    assert fl.key_projections == L * 2 * r * (d + h) + 2 * d * r
    assert fl.depth_reads == 264 * (2 * r + 2 * d)


def test_standard_adds_nothing():
    rep = flops_report(ModelShape(**PAPER, residual="standard"))
    assert rep["added_flops_percent"] == 0.0
    assert rep["params_added"] == 0
    assert rep["depth_read_bytes_per_token_fwd"] == rep["depth_read_bytes_per_token_fwd_bwd"] == 0


def test_depth_read_bytes():
    shape = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                       rank=2, num_blocks=4)
    s = sources_per_site(shape)
    assert s == (2, 3, 4, 5)
    assert depth_read_bytes_per_token(shape) == (sum((x + 1) * 8 * 2 for x in s),
                                                 sum((3 * x + 2) * 8 * 2 for x in s))
    proj = ModelShape(**{**shape.__dict__, "key": "projected"})
    fwd, both = depth_read_bytes_per_token(proj, bytes_per_elem=4)
    assert fwd == sum((x + 1) * 8 * 4 + x * 2 * 4 for x in s)
    assert both == sum((3 * x + 2) * 8 * 4 + 3 * x * 2 * 4 for x in s)


def test_model_flops_per_token_formula():
    L, d, h, V, seq = 24, 1024, 2816, 50304, 2048
    shape = ModelShape(**PAPER, residual="standard", seq_length=seq, vocab_size=V)
    matmul = L * (4 * d * d + 3 * d * h) + V * d
    assert model_flops_per_token(shape) == 6 * matmul + 12 * L * d * seq


def test_added_parameter_formulas():
    L, d, h = 24, 1024, 2816
    base = parameter_counts(ModelShape(**PAPER, residual="standard"))
    assert parameter_counts(ModelShape(**PAPER, rank=64)).added == 2 * L * 64
    assert parameter_counts(ModelShape(**PAPER, residual="attnres")).added == 2 * L * d
    proj = parameter_counts(ModelShape(**PAPER, key="projected", rank=32))
    assert proj.added == 2 * L * 32 + d * 32 + L * (d * 32 + h * 32)
    assert proj.total == base.total + proj.added
    assert base.non_embedding == base.total - 2 * 50304 * d


@pytest.mark.parametrize("bad", [
    dict(rank=2048), dict(num_blocks=49), dict(num_blocks=0), dict(residual="nope"),
    dict(residual="attnres", key="projected"), dict(residual="standard", rank=8),
    dict(residual="attnres", rank=64),
])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(FlopsConfigError):
        ModelShape(**{**PAPER, **bad})


def test_mode_names_match_the_config():
    from megatron_lrattn.model import config
    from megatron_lrattn.analysis import flops

    assert flops.RESIDUAL_MODES == config.RESIDUAL_MODES
    assert flops.KEY_TYPES == config.KEY_TYPES


from megatron_lrattn.training.runtime import single_process_model_parallel as _model_parallel_1x1  # noqa: E402,E501


BUILT = [
    dict(residual="standard"),
    dict(residual="attnres", num_blocks=3),
    dict(residual="lr_attnres", rank=5, num_blocks=8),
    dict(residual="lr_attnres", key="projected", rank=3, num_blocks=2),
    dict(residual="lr_attnres", key="projected", rank=4, num_blocks=4, add_bias_linear=True,
         num_query_groups=2, qk_layernorm=True),
    dict(residual="lr_attnres", rank=8, swiglu=False, untied=False, add_bias_linear=True),
]


def test_parameter_counts_match_built_models():
    import torch
    import torch.nn.functional as F

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed.*")
    from megatron_lrattn.model.config import LRAttnResConfig
    from megatron_lrattn.model.gpt import LRAttnResGPTModel
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    with _model_parallel_1x1():
        for kw in BUILT:
            shape = ModelShape(num_layers=4, hidden_size=32, ffn_hidden_size=48,
                               num_attention_heads=4, seq_length=16, vocab_size=96, **kw)
            depth = {} if shape.residual == "standard" else dict(
                key_type=shape.key, key_rank=shape.rank, num_blocks=shape.num_blocks)
            cfg = LRAttnResConfig(
                num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                ffn_hidden_size=shape.ffn_hidden_size,
                num_attention_heads=shape.num_attention_heads,
                num_query_groups=shape.num_query_groups, normalization="RMSNorm",
                gated_linear_unit=shape.swiglu, activation_func=F.silu if shape.swiglu else F.gelu,
                add_bias_linear=shape.add_bias_linear, qk_layernorm=shape.qk_layernorm,
                hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                residual=shape.residual, **depth)
            spec = get_lr_attnres_layer_spec(cfg, qk_layernorm=shape.qk_layernorm,
                                             core_attention="local")
            torch.manual_seed(0)
            model = LRAttnResGPTModel(cfg, spec, vocab_size=shape.vocab_size,
                                      max_sequence_length=shape.seq_length,
                                      position_embedding_type="rope",
                                      share_embeddings_and_output_weights=not shape.untied)
            built = sum(p.numel() for p in model.parameters())
            assert built == parameter_counts(shape).total, kw


def _run_cli(capsys, *argv):
    code = flops_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_reproduces_the_paper(capsys):
    code, out, err = _run_cli(capsys, "--preset", "0.5b", "--rank", "64", "--json")
    assert code == 0 and err == ""
    rep = json.loads(out)
    for key in ("added_flops_percent", "params_total", "params_non_embedding", "params_added",
                "depth_read_bytes_per_token_fwd", "depth_read_bytes_per_token_fwd_bwd",
                "model_flops_per_token"):
        assert key in rep
    assert round(rep["added_flops_percent"], 4) == 0.0932
    assert rep["params_added"] == 2 * 24 * 64


def test_cli_table_and_flags(capsys):
    code, out, _ = _run_cli(capsys, "--num-layers", "6", "--hidden-size", "64",
                            "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                            "--num-blocks", "12", "--no-swiglu")
    assert code == 0 and "added FLOPs" in out and "N=12" in out and "gelu" in out


@pytest.mark.parametrize("argv", [
    ["--rank", "999"], ["--num-blocks", "9"], ["--num-blocks", "0"], ["--residual", "foo"],
    ["--num-layers", "x"], ["--residual", "standard", "--rank", "4"],
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv):
    code, out, err = _run_cli(capsys, *argv, "--json")
    assert code == 2 and out == ""
    assert err.startswith("lrattn-flops: error: ") and err.count("\n") == 1
