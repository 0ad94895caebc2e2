"""Hugging Face export/import: logits parity with Megatron, bitwise round trip, KV-cache
generation, loading without megatron, and one-line errors.

One short ``lrattn-pretrain`` run per residual mode and key type, each under torchrun at
TP2 x PP2, all started together; every later check reuses them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import cli_env, torchrun

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--eval-interval", "2", "--eval-iters", "1", "--lr-warmup-iters", "1", "--no-progress",
]
MODES = {
    # name: (flags, tensor x pipeline parallel)
    "standard": (["--residual", "standard", "--no-disable-bias-linear"], (2, 2)),
    "attnres": (["--residual", "attnres", "--num-blocks", "3",
                 "--no-untie-embeddings-and-output-weights"], (2, 2)),
    "sliced": (["--residual", "lr_attnres", "--key", "sliced", "--rank", "16", "--num-blocks", "8",
                "--qk-layernorm"], (2, 2)),
    "projected": (["--residual", "lr_attnres", "--key", "projected", "--rank", "16",
                   "--num-blocks", "3"], (2, 2)),
}
ATOL = 1e-4


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("hf_cache"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("hf_train")
    procs = {}
    for name, (flags, (tp, pp)) in MODES.items():
        launcher = [sys.executable, "-m", "megatron_lrattn.cli.pretrain"]
        if tp * pp > 1:
            launcher = torchrun(tp * pp) + ["-m", "megatron_lrattn.cli.pretrain"]
        cmd = launcher + BASE + flags + [
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--save", str(work / name), "--cache-dir", str(cache_dir)]
        procs[name] = subprocess.Popen(cmd, cwd=work, env=cli_env(cache_dir, OMP_NUM_THREADS="1"),
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-4000:])
    return {name: work / name for name in MODES}


@pytest.fixture(scope="module")
def megatron_models(checkpoints):
    """{mode: (TP1PP1 Megatron model loaded from the checkpoint, its state dict)}."""
    from megatron_lrattn.hf.megatron_io import load_megatron
    from megatron_lrattn.training.checkpoint_io import resolve_checkpoint
    from megatron_lrattn.training.runtime import single_process_model_parallel

    with single_process_model_parallel():
        out = {}
        for name, path in checkpoints.items():
            sd, meta, model = load_megatron(resolve_checkpoint(str(path)))
            assert meta["args"]["tensor_model_parallel_size"] == MODES[name][1][0]
            out[name] = (model, sd)
        yield out


@pytest.fixture(scope="module")
def exported(checkpoints, megatron_models, tmp_path_factory):
    from megatron_lrattn.hf.export import megatron_checkpoint_to_hf

    root = tmp_path_factory.mktemp("hf_export")
    return {name: Path(megatron_checkpoint_to_hf(str(path), str(root / name),
                                                 max_shard_size="200KB"))
            for name, path in checkpoints.items()}


def _load_hf(path, **kw):
    """The exported model: a plain ``LlamaForCausalLM`` (the standard arm's default export)
    or our ``LRAttnForCausalLM``."""
    from transformers import LlamaForCausalLM

    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    llama = json.loads((Path(path) / "config.json").read_text())["model_type"] == "llama"
    return (LlamaForCausalLM if llama else LRAttnForCausalLM).from_pretrained(path, **kw).eval()


def _tokens(seed=0, b=2, s=24, vocab=4000):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)


def _megatron_logits(model, tokens):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None)


def _randomize_queries(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in getattr(model.decoder, "depth_queries", {}).values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g) * 2.0)


def _hf_from_megatron(model, config):
    from megatron_lrattn.hf.convert import megatron_to_hf
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    hf = LRAttnForCausalLM(config).eval()
    sd = megatron_to_hf(model.state_dict(), config)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_exported_logits_match_megatron(mode, megatron_models, exported):
    from transformers import AutoConfig

    model, _ = megatron_models[mode]
    hf = _load_hf(exported[mode])
    # The standard arm (biases, GQA, RMSNorm, SwiGLU, RoPE) is a plain Llama by default.
    assert (type(hf).__name__ == "LlamaForCausalLM") == (mode == "standard")
    assert hf.config.vocab_size <= model.vocab_size
    tokens = _tokens()
    want = _megatron_logits(model, tokens)[..., : hf.config.vocab_size]
    with torch.no_grad():
        got = hf(tokens).logits
    err = (got - want).abs().max().item()
    print(f"{mode}: trained queries, max |HF - Megatron| = {err:.3g}")
    assert err <= ATOL
    # Random queries route for real: the read differs from the mean of the sources.
    if mode != "standard":
        saved = {k: q.weight.detach().clone() for k, q in model.decoder.depth_queries.items()}
        try:
            _randomize_queries(model, seed=3)
            want = _megatron_logits(model, tokens)[..., : hf.config.vocab_size]
            hf2 = _hf_from_megatron(model, AutoConfig.from_pretrained(exported[mode],
                                                                      trust_remote_code=True))
            with torch.no_grad():
                got = hf2(tokens).logits
            err = (got - want).abs().max().item()
            print(f"{mode}: random queries, max |HF - Megatron| = {err:.3g}")
            assert err <= ATOL
        finally:
            with torch.no_grad():
                for k, q in model.decoder.depth_queries.items():
                    q.weight.copy_(saved[k])


@pytest.mark.slow
def test_standard_exports_as_lrattn_on_request(checkpoints, megatron_models, tmp_path):
    from megatron_lrattn.hf.export import megatron_checkpoint_to_hf
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    out = megatron_checkpoint_to_hf(str(checkpoints["standard"]), str(tmp_path / "ours"),
                                    hf_format="lrattn")
    assert json.loads((Path(out) / "config.json").read_text())["model_type"] == "lrattn"
    model, _ = megatron_models["standard"]
    hf = LRAttnForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    want = _megatron_logits(model, tokens)[..., : hf.config.vocab_size]
    with torch.no_grad():
        assert (hf(tokens).logits - want).abs().max().item() <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_megatron_hf_megatron_is_bit_identical(mode, megatron_models, exported, tmp_path):
    from megatron_lrattn.hf.export import hf_to_megatron_checkpoint
    from megatron_lrattn.hf.megatron_io import load_megatron
    from megatron_lrattn.training.checkpoint_io import resolve_checkpoint
    from megatron_lrattn.training.runtime import single_process_model_parallel

    model, sd = megatron_models[mode]
    tp, pp = MODES[mode][1]
    hf_to_megatron_checkpoint(str(exported[mode]), str(tmp_path / "back"), tp, pp)
    with single_process_model_parallel():
        back, meta, _ = load_megatron(resolve_checkpoint(str(tmp_path / "back")))
    assert meta["args"]["tensor_model_parallel_size"] == tp
    vocab = json.loads((exported[mode] / "config.json").read_text())["vocab_size"]
    assert back.keys() == sd.keys()
    for k, want in sd.items():
        got = back[k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(got[:vocab], want[:vocab]), k
            assert torch.count_nonzero(got[vocab:]) == 0, k
        else:
            assert torch.equal(got, want), k


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_with_kv_cache_equals_without(mode, exported):
    hf = _load_hf(exported[mode])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for q in getattr(hf.model, "depth_queries", {}).values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g) * 2.0)
    prompt = _tokens(seed=1, b=2, s=5)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = hf.generate(prompt, use_cache=True, **kw)
    plain = hf.generate(prompt, use_cache=False, **kw)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, plain)
    # Incremental logits equal the full forward.
    with torch.no_grad():
        full = hf(cached).logits
        out = hf(cached[:, :9], use_cache=True)
        step = hf(cached[:, 9:], cache=out.cache if hasattr(out, "cache") else
                  out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 9:], rtol=0, atol=1e-5)
    # bf16: queries stay fp32 and generation runs.
    bf = _load_hf(exported[mode], dtype=torch.bfloat16)
    assert bf.model.embed_tokens.weight.dtype == torch.bfloat16
    for q in getattr(bf.model, "depth_queries", {}).values():
        assert q.weight.dtype == torch.float32
    assert bf.generate(prompt, **kw).shape == (2, 17)


NO_MEGATRON = r"""
import sys
for name in ("megatron", "megatron.core", "megatron_lrattn"):
    sys.modules[name] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import json, os
from transformers import PreTrainedTokenizerFast
for path in sys.argv[1:]:
    llama = json.load(open(os.path.join(path, "config.json")))["model_type"] == "llama"
    # A Llama export needs no remote code, for the model nor its tokenizer.
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=not llama).eval()
    tok = (AutoTokenizer.from_pretrained(path) if llama
           else PreTrainedTokenizerFast.from_pretrained(path))
    ids = tok("def main():", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 6
    print(path, repr(tok.decode(out[0])))
print("megatron loaded:", [m for m in sys.modules if m.startswith("megatron") and sys.modules[m]])
"""


@pytest.mark.slow
def test_loads_and_generates_without_megatron(exported, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_MODULES_CACHE=str(tmp_path / "mods"))
    proc = subprocess.run([sys.executable, "-c", NO_MEGATRON, *map(str, exported.values())],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "custom code" not in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert "megatron loaded: []" in proc.stdout
    # The small shard size made some exports sharded.
    assert any((p / "model.safetensors.index.json").is_file() for p in exported.values())


def _cli(module, *args, cwd):
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=cwd,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_broken_inputs_end_with_one_line_error(checkpoints, exported, tmp_path):
    src = checkpoints["sliced"]
    iter_dir = src / (src / "latest").read_text().strip()
    no_meta = tmp_path / "no_meta"
    shutil.copytree(iter_dir, no_meta / iter_dir.name)
    (no_meta / "latest").write_text(iter_dir.name + "\n")
    (no_meta / iter_dir.name / "lrattn.json").unlink()
    torn = tmp_path / "torn"
    shutil.copytree(iter_dir, torn / iter_dir.name)
    (torn / "latest").write_text(iter_dir.name + "\n")
    for shard in (torn / iter_dir.name).glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    corrupt = tmp_path / "corrupt_hf"
    shutil.copytree(exported["standard"], corrupt)
    for f in corrupt.glob("*.safetensors"):
        f.write_bytes(b"\x00garbage" * 10)
    mismatched = tmp_path / "mismatched_hf"
    shutil.copytree(exported["standard"], mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (mismatched / "config.json").write_text(json.dumps(cfg))
    missing_key = tmp_path / "missing_key_hf"
    shutil.copytree(exported["sliced"], missing_key)
    cfg = json.loads((missing_key / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    cfg["num_blocks"] = 8
    (missing_key / "config.json").write_text(json.dumps(cfg))

    to_hf, to_meg = "megatron_lrattn.cli.convert_hf", "megatron_lrattn.cli.convert_megatron"
    cases = {
        "no-lrattn.json": (to_hf, [no_meta, tmp_path / "o1"], ["lrattn.json missing"]),
        "torn-shards": (to_hf, [torn, tmp_path / "o2"], ["torn"]),
        "nowhere": (to_hf, [tmp_path / "nowhere", tmp_path / "o3"], ["not a directory"]),
        "corrupt-safetensors": (to_meg, [corrupt, tmp_path / "o4"], ["model", "unreadable"]),
        "shape-mismatch": (to_meg, [mismatched, tmp_path / "o5"],
                           ["mlp.", "the config implies"]),
        "missing-keys": (to_meg, [missing_key, tmp_path / "o6"], ["missing", "key(s)"]),
    }
    procs = {k: _cli(m, *a, cwd=tmp_path) for k, (m, a, _) in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        prog = "lrattn-convert-hf" if cases[name][0] == to_hf else "lrattn-convert-megatron"
        assert proc.returncode == 2, (name, err[-3000:])
        assert "Traceback" not in out + err, (name, err[-3000:])
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"{prog}: error: "), (name, last)
        for needle in cases[name][2]:
            assert needle in last, (name, last)


def test_key_map_pads_vocab_splits_layouts_and_names_bad_keys():
    """Synthetic state dict: vocabulary padding dropped and re-added as zeros, GQA QKV and
    SwiGLU layouts split per Megatron's definition, and bad keys/shapes named."""
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.convert import (ConversionError, expanded_rules, hf_to_megatron,
                                            megatron_to_hf)

    cfg = LRAttnConfig(vocab_size=200, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, add_bias_linear=True,
                       residual="lr_attnres", key_type="projected", key_rank=4, num_blocks=2)
    shapes = {"embedding.word_embeddings.weight": (256, 16), "output_layer.weight": (256, 16),
              "decoder.embedding_key_proj.weight": (4, 16)}
    g = torch.Generator().manual_seed(0)
    msd = {}
    for r in expanded_rules(cfg):
        k = r.megatron
        if k in shapes:
            shape = shapes[k]
        elif "linear_qkv" in k:
            shape = (2 * (2 + 2) * 4, 16)[: 1 if k.endswith("bias") else 2]
        elif "linear_fc1" in k:
            shape = (48, 16)[: 1 if k.endswith("bias") else 2]
        elif "linear_fc2" in k:
            shape = (20, 24)[: 1 if k.endswith("bias") else 2]
        elif "linear_proj" in k:
            shape = (20, 16)[: 1 if k.endswith("bias") else 2]
        elif "depth_queries" in k:
            shape = (4,)
        else:
            shape = (16,)
        msd[k] = torch.randn(shape, generator=g)
    hsd = megatron_to_hf(msd, cfg)
    assert hsd["model.embed_tokens.weight"].shape == (200, 16)
    w = msd["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 4, 4, 16)
    # group 1 = rows [q2 q3 k1 v1]: query heads 2, 3 and kv head 1
    assert torch.equal(hsd["model.layers.0.self_attn.q_proj.weight"].view(4, 4, 16)[2], w[1, 0])
    assert torch.equal(hsd["model.layers.0.self_attn.k_proj.weight"].view(2, 4, 16)[1], w[1, 2])
    assert torch.equal(hsd["model.layers.0.self_attn.v_proj.weight"].view(2, 4, 16)[1], w[1, 3])
    assert torch.equal(hsd["model.layers.1.mlp.gate_proj.weight"],
                       msd["decoder.layers.1.mlp.linear_fc1.weight"][:24])
    back = hf_to_megatron(hsd, cfg, padded_vocab=256)
    for k, v in msd.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(back[k][:200], v[:200]) and not back[k][200:].any()
        else:
            assert torch.equal(back[k], v), k
    with pytest.raises(ConversionError, match="unknown 1 key.*decoder.extra.weight"):
        megatron_to_hf({**msd, "decoder.extra.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ConversionError, match="missing 1 key.*depth_queries.3.weight"):
        megatron_to_hf({k: v for k, v in msd.items() if "depth_queries.3." not in k}, cfg)
    bad = dict(hsd)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(16, 24)
    with pytest.raises(ConversionError, match=r"down_proj.weight has shape \(16, 24\).*\(20, 24\)"):
        hf_to_megatron(bad, cfg)


@pytest.mark.parametrize("residual,key", [("attnres", "sliced"), ("lr_attnres", "sliced"),
                                          ("lr_attnres", "projected")])
def test_fp32_model_under_autocast_reads_sources_of_one_dtype(residual, key, monkeypatch):
    """An fp32 HF model under bf16 autocast (plain PyTorch fine-tuning, DeepSpeed's
    baseline): the embedding is fp32 while the sub-layers return bf16; every depth read
    must still get sources (and keys) of one dtype, which the fused CUDA op requires."""
    from megatron_lrattn.hf import modeling_lrattn
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig

    seen = []
    reference = modeling_lrattn.depth_read_reference

    def spy(values, query, keys, eps, scale):
        seen.append(({v.dtype for v in values}, None if keys is None else {k.dtype for k in keys}))
        return reference(values, query, keys, eps=eps, scale=scale)

    monkeypatch.setattr(modeling_lrattn, "depth_read", spy)
    torch.manual_seed(0)
    config = LRAttnConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, residual=residual,
                          key=key, rank=16, num_blocks=2)
    model = modeling_lrattn.LRAttnForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "query" in name:
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        fp32 = model(input_ids=tokens).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(input_ids=tokens).logits
    assert seen and all(len(v) == 1 and (k is None or len(k) == 1) for v, k in seen), seen
    assert (mixed.float() - fp32).abs().max() < 0.1 * fp32.abs().max()
