"""Same seed, same model in every parallel layout (``megatron_lrattn.model.init``).

Fast tier: the global-name initialisation in one process (a layer's weights do not depend on
the stage that builds it or on the random state before the build; tensor-parallel shards are
cut as megatron cuts its master weight; megatron's init distributions are kept). Slow tier: a
fresh ``lrattn-pretrain`` run under torchrun in each layout gives the one-process first
validation loss (bitwise where the arithmetic is the same: pipeline and data parallelism;
to 1e-6 relative under TP, whose all-reduces sum in another order) and training losses
within 1e-6 relative over 4 steps.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, pretrain_rows, tiny_config

SEED = 7
LOSS_RTOL = 1e-6


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("residual,key", [("standard", "sliced"), ("lr_attnres", "sliced"),
                                          ("lr_attnres", "projected"), ("attnres", "sliced")])
def test_layer_weights_depend_on_global_layer_not_on_stage(residual, key):
    """Layers 3-4 of a 4-layer model equal the same layers built as "stage 1" (local
    indices 0-1, global layer numbers 3-4, another random state before the build); the
    embedding, output layer and embedding key projection equal across builds too."""
    from megatron_lrattn.model.init import init_by_global_name

    depth = {} if residual == "standard" else dict(key_type=key, num_blocks=3)
    with model_parallel_1x1():
        config = tiny_config(residual, num_layers=4, **depth)
        full = build_gpt(config, seed=0)
        redrawn = init_by_global_name(full, config, SEED)
        ref = _params(full)
        stage = build_gpt(config, seed=123)
        stage.decoder.layers = stage.decoder.layers[2:]
        assert [layer.layer_number for layer in stage.decoder.layers] == [3, 4]
        init_by_global_name(stage, config, SEED)
        got = _params(stage)
    assert "decoder.layers.3.mlp.linear_fc2.weight" in redrawn
    if key == "projected":
        assert "decoder.embedding_key_proj.weight" in redrawn
    for name, value in got.items():
        want = name
        if name.startswith("decoder.layers."):
            _, _, local, rest = name.split(".", 3)
            want = f"decoder.layers.{int(local) + 2}.{rest}"
        assert torch.equal(value, ref[want]), name


def test_seed_changes_the_weights_and_generators_are_untouched():
    from megatron_lrattn.model.init import init_by_global_name

    with model_parallel_1x1():
        config = tiny_config(num_layers=2, num_blocks=2)
        model = build_gpt(config)
        state = torch.get_rng_state()
        init_by_global_name(model, config, SEED)
        assert torch.equal(torch.get_rng_state(), state)
        a = _params(model)
        init_by_global_name(model, config, SEED + 1)
        b = _params(model)
    w = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(a[w], b[w])
    # queries stay zero, norm gains one
    assert torch.equal(a["decoder.depth_queries.1.weight"], b["decoder.depth_queries.1.weight"])
    assert bool((a["decoder.final_layernorm.weight"] == 1).all())


def test_init_keeps_megatrons_distributions():
    """Each redrawn weight has the std of megatron's own initialisation of it (init_method
    0.02, output projections 0.02 / sqrt(2L), embeddings embedding_init_method)."""
    from megatron_lrattn.model.init import init_by_global_name

    with model_parallel_1x1():
        config = tiny_config("lr_attnres", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                             key_type="projected", num_blocks=3)
        model = build_gpt(config)
        before = _params(model)
        redrawn = init_by_global_name(model, config, SEED)
        after = _params(model)
    assert len(redrawn) == 4 * 4 + 3  # per layer qkv, proj, fc1, fc2; embedding, key, head
    for name in redrawn:
        ratio = after[name].std() / before[name].std()
        assert 0.9 < ratio < 1.1, (name, float(ratio))
        assert abs(float(after[name].mean())) < 0.1 * float(after[name].std())
    proj = after["decoder.layers.0.self_attention.linear_proj.weight"].std()
    assert abs(float(proj) - 0.02 / (2 * 4) ** 0.5) < 0.1 * 0.02 / (2 * 4) ** 0.5


@pytest.mark.parametrize("stride,dim", [(1, 0), (2, 0), (1, 1)])
def test_tp_slice_is_megatrons_cpu_split(stride, dim):
    """``tp_slice`` of the full tensor is the shard megatron's CPU initialisation copies
    into each TP rank from the same master weight (stride 2: gated MLP's fc1)."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from megatron_lrattn.model.init import tp_slice

    tp, out, inp = 2, 16, 8
    full = torch.randn(out, inp)
    for rank in range(tp):
        shard = [out // tp, inp] if dim == 0 else [out, inp // tp]
        param = torch.nn.Parameter(torch.empty(shard))
        _initialize_affine_weight_cpu(param, out, inp, shard[dim], dim, lambda w: w.copy_(full),
                                      stride=stride, rank=rank, world_size=tp)
        assert param.partition_stride == stride
        assert torch.equal(tp_slice(full, param, rank, tp), param.data)


def test_a_parameter_without_rule_is_an_error():
    from megatron_lrattn.model.init import init_by_global_name

    with model_parallel_1x1():
        config = tiny_config(num_layers=2, num_blocks=2)
        model = build_gpt(config)
        model.decoder.extra_scale = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="decoder.extra_scale.weight .* no layout-independent"):
            init_by_global_name(model, config, SEED)



def test_a_fused_norm_and_linear_is_a_projection_not_a_norm():
    """TE's LayerNormLinear (the QKV projection of the TE spec) holds a norm gain and a
    projection weight: the weight gets the projection's rule, the gain stays constant."""
    from megatron_lrattn.model.init import init_rule

    class LayerNormLinear(torch.nn.Module):  # the name TE's fused module carries
        pass

    class RMSNorm(torch.nn.Module):
        pass

    config = tiny_config(num_layers=2, num_blocks=2)
    path = "decoder.layers.0.self_attention.linear_qkv"
    assert init_rule(path, LayerNormLinear(), "weight", config) is config.init_method
    assert init_rule(path, LayerNormLinear(), "layer_norm_weight", config) is None
    assert init_rule("decoder.final_layernorm", RMSNorm(), "weight", config) is None

CLI = ["--preset", "tiny", "--train-iters", "4", "--lr-warmup-iters", "1",
       "--eval-interval", "1000", "--seed", str(SEED), "--no-progress",
       # 4 micro-batches per step: the interleaved schedule needs at least 2P on CPU
       "--micro-batch-size", "4"]
MODES = {
    "lr_sliced": [],
    "attnres": ["--residual", "attnres"],
    "standard": ["--residual", "standard"],
    "lr_projected": ["--key", "projected"],
}
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
VPP2 = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
L8 = ["--num-layers", "8"]
TIED_LEARNED = ["--no-untie-embeddings-and-output-weights", "--position-embedding-type",
                "learned_absolute"]
LAYOUTS = {
    # name: (model flags, processes, layout flags, first validation loss: exact (True),
    # up to the order of the DP sum ("sum_order") or within LOSS_RTOL (False))
    "pp2": (MODES["lr_sliced"], 2, PP2, True),
    "pp2_vpp2": (MODES["lr_sliced"], 2, VPP2, True),
    "tp2_pp2": (MODES["lr_sliced"], 4, TP2 + PP2, False),
    "pp4_l8": (L8, 4, ["--pipeline-model-parallel-size", "4"], True),
    # DP=2: each rank takes the fp32 mean of its half of the micro-batches' losses and the
    # two means are averaged (reduce_loss), where one process takes one fp32 mean of all
    # of them: the same losses, rounded differently in the last bit (measured on a
    # 2-core machine without AVX-512: 5.7e-9 relative; equal on others)
    "pp2_dp2_distopt": (MODES["lr_sliced"], 4, PP2 + ["--use-distributed-optimizer"],
                        "sum_order"),
    "tp2_dp2_distopt": (MODES["lr_sliced"], 4, TP2 + ["--use-distributed-optimizer"], False),
    "attnres_pp2_vpp2": (MODES["attnres"], 2, VPP2, True),
    "standard_tp2_pp2": (MODES["standard"], 4, TP2 + PP2, False),
    "projected_tp2_sp_pp2": (MODES["lr_projected"], 4, TP2 + PP2 + ["--sequence-parallel"],
                             False),
    # the last stage's copy of the tied word embedding; learned position embeddings
    "tied_learned_pp2": (TIED_LEARNED, 2, PP2, True),
}


def _split(rows) -> dict:
    return {"valid": [r["loss"] for r in rows if r["type"] == "valid"],
            "train": [(r["iteration"], r["loss"]) for r in rows if r["type"] == "train"]}


def _pretrain(nproc: int, extra, log: Path, cache_dir: Path) -> dict:
    return _split(pretrain_rows(nproc, CLI + extra, log, cache_dir))


@pytest.fixture(scope="module")
def one_process(pretrain_once):
    """One-process runs, computed once per model and shared by the layouts (and with
    test_context_parallel, which runs the same command)."""
    return lambda model: _split(pretrain_once(1, CLI + list(model)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fresh_run_matches_one_process(layout, one_process, tmp_path, data_cache):
    """A fresh run (no checkpoint) in ``layout`` starts from the one-process model: the
    first validation loss (iteration 0, before any update) and 4 training losses agree."""
    model, nproc, flags, exact = LAYOUTS[layout]
    ref = one_process(model)
    got = _pretrain(nproc, model + flags, tmp_path / "run.jsonl", data_cache)
    assert [i for i, _ in got["train"]] == [i for i, _ in ref["train"]] == [1, 2, 3, 4]
    first, want = got["valid"][0], ref["valid"][0]
    if exact == "sum_order":  # a few fp32 ulps; a wrong initialisation is off by >= 1e-3
        assert abs(first - want) <= 4 * 2.0 ** -23 * abs(want), (first, want)
    elif exact:
        assert first == want, (first, want)
    else:
        assert abs(first - want) <= LOSS_RTOL * abs(want), (first, want)
    for (_, a), (_, b) in zip(got["train"], ref["train"]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (got["train"], ref["train"])
