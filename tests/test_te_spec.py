"""Transformer Engine layer spec: what can be checked without TE runs here for real (error
messages, flags and their plumbing into the config, FP8 shape checks, the local <-> TE
checkpoint key map on real local-spec models, the HF converter on both namings); tests that
build TE modules skip with a reason unless TE and CUDA are present (the GPU box, after
tools/gpu_box/run.sh te build)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, rel_rms, tiny_batch, tiny_config
from megatron_lrattn.compat import te as te_compat
from megatron_lrattn.model.spec import SPEC_BACKENDS, get_lr_attnres_layer_spec

MODES = [("standard", {}), ("attnres", {"num_blocks": 4}),
         ("lr_attnres", {"num_blocks": 4}),
         ("lr_attnres", {"key_type": "projected", "key_rank": 16, "num_blocks": 4})]
MODE_IDS = ["standard", "attnres", "sliced", "projected"]
HAVE_TE = te_compat.te_available()
no_te = pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here: the "
                                           "missing-TE error cannot be shown")


@pytest.fixture(scope="module", autouse=True)
def mp():
    with model_parallel_1x1():
        yield


def _config(mode, depth, **changes):
    cfg = tiny_config(mode, bias=True, **depth)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _te_named_keys(model):
    return te_compat.local_to_te_keys(model.state_dict())


@no_te
@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_te_backend_without_te_is_one_clear_error(mode, depth):
    cfg = _config(mode, depth)
    with pytest.raises(te_compat.TEUnavailableError) as err:
        get_lr_attnres_layer_spec(cfg, backend="te")
    msg = str(err.value)
    assert "Transformer Engine is not installed" in msg
    assert "pip install --no-build-isolation 'transformer_engine[pytorch]==" in msg
    assert "run.sh te build" in msg and "--transformer-impl local" in msg
    assert isinstance(err.value, ImportError)
    assert not te_compat.te_available()


def test_local_backend_is_untouched_and_unknown_backends_refused():
    assert SPEC_BACKENDS == ("local", "te")
    cfg = _config("lr_attnres", {"num_blocks": 4})
    spec = get_lr_attnres_layer_spec(cfg)
    assert spec.module.__name__ == "LRAttnResLayer"
    assert spec.submodules.input_layernorm.__name__ == "SequenceParallelTorchNorm"
    with pytest.raises(ValueError, match="backend='apex' is not available"):
        get_lr_attnres_layer_spec(cfg, backend="apex")
    with pytest.raises(ValueError, match="core_attention='sdpa' applies to backend='local'"):
        get_lr_attnres_layer_spec(cfg, backend="te", core_attention="sdpa")


def test_fp8_needs_te_and_shapes_and_recipes_it_accepts():
    """FP8 settings are refused before any TE import: with the local spec, with recipes
    other than delayed/tensorwise, with fp8_param, and with GEMM widths TE's FP8 kernels
    refuse (projected keys add r rows to the output projections); so are TE's
    communication-overlap buffers with projected keys."""
    ok = _config("lr_attnres", {"key_type": "projected", "key_rank": 16, "num_blocks": 4}, fp8="hybrid")
    with pytest.raises(ValueError, match="fp8='hybrid' needs backend='te'"):
        get_lr_attnres_layer_spec(ok)
    te_compat.check_fp8_config(ok)
    odd = dataclasses.replace(ok, key_rank=4)
    with pytest.raises(ValueError, match=r"linear_proj: 32 -> 36 per TP rank; "
                                         r"linear_fc2: 64 -> 36 per TP rank"):
        get_lr_attnres_layer_spec(odd, backend="te")
    # d + r = 40: TE's own input checks and the forward accept it, its backward GEMM does not
    with pytest.raises(ValueError, match=r"linear_proj: 32 -> 40 per TP rank"):
        te_compat.check_fp8_config(dataclasses.replace(ok, key_rank=8))
    with pytest.raises(ValueError, match="fp8_recipe='mxfp8' is not supported"):
        te_compat.check_fp8_config(dataclasses.replace(ok, fp8_recipe="mxfp8"))
    with pytest.raises(ValueError, match="fp8_param"):
        te_compat.check_fp8_config(dataclasses.replace(ok, fp8_param=True))
    te_compat.check_fp8_config(dataclasses.replace(ok, fp8=None, key_rank=4))
    with pytest.raises(ValueError, match="tp_comm_overlap with projected keys"):
        get_lr_attnres_layer_spec(dataclasses.replace(ok, fp8=None, tp_comm_overlap=True),
                                  backend="te")


def test_fp8_shape_problems_of_the_presets():
    # 1b: d=2048, SwiGLU 5632, 16 heads; projected keys r = d/4; TP 1 and 8
    for tp in (1, 8):
        assert te_compat.fp8_shape_problems(
            hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
            num_query_groups=16, kv_channels=128, tensor_parallel=tp, key_rows=512) == []
    bad = te_compat.fp8_shape_problems(hidden_size=2048, ffn_hidden_size=5632,
                                       num_attention_heads=16, num_query_groups=16,
                                       kv_channels=128, key_rows=12)
    assert bad == ["linear_proj: 2048 -> 2060 per TP rank", "linear_fc2: 5632 -> 2060 per TP rank"]
    bad = te_compat.fp8_shape_problems(hidden_size=1000, ffn_hidden_size=2816,
                                       num_attention_heads=8, num_query_groups=8, kv_channels=125)
    assert [b.split(":")[0] for b in bad] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_flags_default_local_and_fp8_needs_transformer_engine():
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    args = parse_args(["--preset", "tiny"])
    assert (args.transformer_impl, args.fp8_format, args.fp8_recipe) == ("local", None, "delayed")
    with pytest.raises(ArgumentError, match="--fp8-format hybrid needs --transformer-impl "
                                            "transformer_engine"):
        parse_args(["--preset", "tiny", "--fp8-format", "hybrid"])
    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny", "--fp8-recipe", "mxfp8"])


def test_fp8_flags_refuse_shapes_before_needing_te():
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    base = ["--preset", "tiny", "--transformer-impl", "transformer_engine", "--fp8-format",
            "e4m3", "--residual", "lr_attnres", "--key", "projected"]
    with pytest.raises(ArgumentError, match=r"linear_proj: 128 -> 132 per TP rank"):
        parse_args(base + ["--rank", "4"])
    with pytest.raises(ArgumentError, match=r"24 tokens per micro-batch and rank \(not a "
                                            r"multiple of 16\)"):
        parse_args(base + ["--rank", "16", "--seq-length", "24", "--micro-batch-size", "1"])


@no_te
def test_transformer_engine_flag_without_te_is_an_argument_error(tmp_path):
    from megatron_lrattn.cli.pretrain import main
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine: "
                                            "Transformer Engine is not installed"):
        parse_args(["--preset", "tiny", "--transformer-impl", "transformer_engine"])
    cfg = tmp_path / "te.yaml"
    cfg.write_text("preset: tiny\ntransformer_impl: transformer_engine\n")
    with pytest.raises(ArgumentError, match="Transformer Engine is not installed"):
        parse_args(["--config", str(cfg)])
    assert main(["--preset", "tiny", "--transformer-impl", "transformer_engine"]) == 2


def test_builder_plumbs_fp8_flags_into_the_config_and_backend():
    """Flags -> ``LRAttnResConfig`` (megatron's fp8 fields) and the spec backend, without
    ``validate_args`` (which needs TE for --transformer-impl transformer_engine)."""
    from megatron.core.enums import Fp8Recipe

    from megatron_lrattn.training.arguments import build_parser, validate_args
    from megatron_lrattn.training.builder import SPEC_BACKENDS as IMPL_TO_BACKEND, build_config
    from megatron_lrattn.training.presets import PRESETS

    p = build_parser()
    p.set_defaults(**PRESETS["tiny"])
    args = p.parse_args(["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
                         "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16",
                         "--fp8-amax-compute-algo", "max"])
    args.transformer_impl = "local"
    args.fp8_format = None
    validate_args(args)  # fill derived defaults
    args.transformer_impl, args.fp8_format = "transformer_engine", "hybrid"
    cfg = build_config(args, bf16=False)
    assert cfg.fp8 == "hybrid" and cfg.fp8_recipe in ("tensorwise", Fp8Recipe.tensorwise)
    assert (cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (16, "max")
    assert IMPL_TO_BACKEND == {"local": "local", "transformer_engine": "te"}
    old = dict(vars(args))
    for k in ("transformer_impl", "fp8_format", "fp8_recipe", "fp8_amax_history_len",
              "fp8_amax_compute_algo"):
        old.pop(k)
    assert build_config(type(args)(**old), bf16=False).fp8 is None  # args of older checkpoints


@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_key_map_renames_only_the_fused_norms_both_ways(mode, depth, norm):
    cfg = _config(mode, depth, normalization=norm, qk_layernorm=True)
    model = build_gpt(cfg, spec=get_lr_attnres_layer_spec(cfg, qk_layernorm=True,
                                                          core_attention="local"))
    sd = model.state_dict()
    te = te_compat.local_to_te_keys(sd)
    renamed = sorted(set(te) - set(sd))
    per_layer = ["mlp.linear_fc1.layer_norm_weight", "self_attention.linear_qkv.layer_norm_weight"]
    if norm == "LayerNorm":
        per_layer = sorted(per_layer + [k.replace("weight", "bias") for k in per_layer])
    assert renamed == [f"decoder.layers.{i}.{k}" for i in range(cfg.num_layers) for k in per_layer]
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)
    for k, v in sd.items():
        assert te[next(iter(te_compat.local_to_te_keys({k: None})))] is v, k
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in te
    assert te_compat.spec_naming(sd) == "local" and te_compat.spec_naming(te) == "te"
    back = te_compat.te_to_local_keys(
        {**te, "decoder.layers.0.self_attention.core_attention._extra_state": None})
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)
    with pytest.raises(ValueError, match="mixes local-spec"):
        te_compat.spec_naming({**sd, **te})
    wrapped = te_compat.local_to_te_keys({"module.module." + k: v for k, v in sd.items()})
    assert "module.module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in wrapped


@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_distributed_checkpoint_keys_are_the_te_names(mode, depth):
    """megatron's local spec writes its norms under TE's names, so a distributed checkpoint
    of the local spec has exactly the keys of the TE-named state dict (layer index moved into
    the sharding offsets; the output layer's empty extra state is not saved)."""
    model = build_gpt(_config(mode, depth))
    sharded = {v.key for v in model.sharded_state_dict().values()}
    te = {re.sub(r"layers\.\d+\.", "layers.", k) for k in _te_named_keys(model)}
    assert sharded == te - {"output_layer._extra_state"}


@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_te_named_state_dict_loads_into_a_local_model(mode, depth):
    cfg = _config(mode, depth)
    src, dst = build_gpt(cfg, seed=1), build_gpt(cfg, seed=2)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    te_sd = {**_te_named_keys(src),
             "decoder.layers.0.self_attention.core_attention._extra_state": None}
    te_compat.load_state_dict_across_specs(dst, te_sd)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    # where CUDA exists megatron's RoPE puts its table on the CUDA device: run there
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, pos, _ = (t.to(dev) for t in tiny_batch())
    src, dst = src.to(dev).eval(), dst.to(dev).eval()
    with torch.no_grad():
        assert torch.equal(src(tokens, pos, None), dst(tokens, pos, None))
    broken = dict(te_sd)
    broken.pop("decoder.layers.1.mlp.linear_fc1.layer_norm_weight")
    with pytest.raises(RuntimeError, match=r"missing \['decoder.layers.1.pre_mlp_layernorm"):
        te_compat.load_state_dict_across_specs(dst, broken)


@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_hf_converter_reads_and_writes_both_namings(mode, depth):
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.convert import ConversionError, hf_to_megatron, megatron_to_hf

    cfg = _config(mode, depth)
    model = build_gpt(cfg)
    hcfg = LRAttnConfig(
        vocab_size=128, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, max_position_embeddings=16,
        add_bias_linear=True, residual=mode, key_type=cfg.key_type,
        key_rank=cfg.key_rank if mode != "standard" else None, num_blocks=cfg.num_blocks,
        tie_word_embeddings=False)
    local = model.state_dict()
    hf = megatron_to_hf(local, hcfg)
    hf_te = megatron_to_hf(_te_named_keys(model), hcfg)
    assert hf.keys() == hf_te.keys() and all(torch.equal(hf[k], hf_te[k]) for k in hf)
    back_te = hf_to_megatron(hf, hcfg, naming="te")
    expect = {k: v for k, v in _te_named_keys(model).items() if not k.endswith("_extra_state")}
    assert back_te.keys() == expect.keys()
    assert all(torch.equal(back_te[k], expect[k]) for k in expect)
    assert te_compat.spec_naming(hf_to_megatron(hf, hcfg)) == "local"
    with pytest.raises(ConversionError, match="mixes local-spec"):
        megatron_to_hf({**local, **_te_named_keys(model)}, hcfg)
    with pytest.raises(ValueError, match="naming='apex'"):
        hf_to_megatron(hf, hcfg, naming="apex")


# Below: Transformer Engine and CUDA needed (the GPU box after tools/gpu_box/run.sh te build).

def _need_te_cuda():
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not "
                        "installed (tools/gpu_box/run.sh te build)")
    if not torch.cuda.is_available():
        pytest.skip("TE modules need CUDA")


def _build_cuda(cfg, backend, seed=1234):
    from megatron_lrattn.model.gpt import LRAttnResGPTModel
    from megatron_lrattn.model.spec import get_lr_attnres_block_spec
    from helpers import seed_all

    cfg = dataclasses.replace(cfg, use_cpu_initialization=False, bf16=True,
                              params_dtype=torch.bfloat16)
    seed_all(seed)
    spec = get_lr_attnres_layer_spec(cfg, backend=backend)
    model = LRAttnResGPTModel(cfg, get_lr_attnres_block_spec(cfg, spec), vocab_size=128,
                              max_sequence_length=16, position_embedding_type="rope",
                              share_embeddings_and_output_weights=False)
    return model.cuda().to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_te_model_matches_local_model_with_the_same_weights(mode, depth):
    """Both specs save the same distributed-checkpoint keys, a local state dict loads into
    the TE model, and the bf16 logits agree (different kernels: a tolerance, not equality)."""
    _need_te_cuda()
    cfg = _config(mode, depth)
    local, te = _build_cuda(cfg, "local"), _build_cuda(cfg, "te", seed=7)
    layer = te.decoder.layers[0]
    assert type(layer).__name__ == ("TransformerLayer" if mode == "standard"
                                    else "TELRAttnResLayer")
    assert type(layer.input_layernorm).__name__ == "IdentityOp"
    assert type(layer.self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear"
    assert type(layer.mlp.linear_fc1).__name__ == "TELayerNormColumnParallelLinear"
    extra = cfg.key_rank if cfg.projected_keys else 0
    assert layer.mlp.linear_fc2.weight.shape[0] == cfg.hidden_size + extra
    assert layer.self_attention.linear_proj.weight.shape[0] == cfg.hidden_size + extra
    assert ({v.key for v in local.sharded_state_dict().values()}
            == {v.key for v in te.sharded_state_dict().values()})
    te_compat.load_state_dict_across_specs(te, local.state_dict())
    tokens, pos, _ = (t.cuda() for t in tiny_batch())
    local.eval(), te.eval()
    with torch.no_grad():
        a, b = local(tokens, pos, None).float(), te(tokens, pos, None).float()
    assert rel_rms(b, a) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode,depth", MODES, ids=MODE_IDS)
def test_te_rope_fusion_matches_the_unfused_rotary_embedding(mode, depth):
    """TE's fused RoPE (and its one QKV-to-rotated-heads node where megatron-core takes it),
    as ``fusions.te_rope_fusion`` turns them on, against megatron-core's unfused rotary
    embedding: same weights, same loss and gradients up to bf16 rounding."""
    _need_te_cuda()
    from megatron.core.transformer import attention

    single = bool(getattr(attention, "HAVE_FUSED_QKV_ROPE", False))
    unfused = _build_cuda(_config(mode, depth), "te")
    fused = _build_cuda(_config(mode, depth, apply_rope_fusion=True,
                                fused_single_qkv_rope=single), "te", seed=7)
    fused.load_state_dict(unfused.state_dict())
    tokens, pos, labels = (t.cuda() for t in tiny_batch())
    losses, grads = [], []
    for model in (unfused, fused):
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    assert rel_rms(losses[1], losses[0]) < 1e-2
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert rel_rms(grads[1][n], grads[0][n]) < 5e-2, n


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("mode,depth", MODES[1:], ids=MODE_IDS[1:])
def test_te_fp8_forward_backward_runs_and_gives_every_parameter_a_gradient(mode, depth, recipe):
    _need_te_cuda()
    cfg = _config(mode, depth, fp8="hybrid", fp8_recipe=recipe)
    model = _build_cuda(cfg, "te")
    tokens, pos, labels = (t.cuda() for t in tiny_batch())
    loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_te_import_is_shown_torchs_cudnn(monkeypatch, tmp_path):
    """Before TE's import, every cuDNN library of the folder torch loaded its cuDNN from is
    loaded (sub-libraries first, a failing one retried after the others, a folder of
    libraries that never load ends the loop) and TE is pointed at that folder, unless the
    user set CUDNN_HOME or CUDNN_PATH; the environment is restored afterwards."""
    import ctypes
    import os
    import sys

    names = ["libcudnn.so.9", "libcudnn_ops.so.9", "libcudnn_heuristic.so.9",
             "libcudnn_graph.so.9", "libcudnn_adv.so.9"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    calls, failed = [], set()

    def fake_cdll(path, mode=0):
        name = os.path.basename(path)
        calls.append(name)
        if name == "libcudnn_heuristic.so.9" and name not in failed:
            failed.add(name)
            raise OSError("undefined symbol (first try)")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", fake_cdll)
    te_compat._preload_cudnn(str(tmp_path))
    assert calls[0] == "libcudnn_graph.so.9" and calls[-1] == "libcudnn_heuristic.so.9"
    assert calls.index("libcudnn.so.9") > calls.index("libcudnn_adv.so.9")
    assert sorted(set(calls)) == sorted(names) and len(calls) == len(names) + 1

    def never(path, mode=0):
        raise OSError("not a library")

    monkeypatch.setattr(ctypes, "CDLL", never)
    te_compat._preload_cudnn(str(tmp_path))  # returns: nothing loads

    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: object())
    monkeypatch.setattr(te_compat, "_loaded_cudnn_dir", lambda: str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    with te_compat._torch_cudnn_for_te():
        assert os.environ.get("CUDNN_HOME") == str(tmp_path)
    assert "CUDNN_HOME" not in os.environ
    monkeypatch.setenv("CUDNN_PATH", "/opt/cudnn")
    with te_compat._torch_cudnn_for_te():
        assert "CUDNN_HOME" not in os.environ  # the user's choice stands
