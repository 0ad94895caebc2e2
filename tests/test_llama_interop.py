"""Llama both ways: a tiny random ``LlamaForCausalLM`` made with ``transformers`` imports as a
standard Megatron checkpoint whose logits equal the Llama's, and exports back as a plain
Llama folder (no remote code) that stock ``transformers`` loads with the same weights and
logits; what Llama cannot express is refused in one line naming the feature."""
from __future__ import annotations

import json
import os

import pytest
import torch

ATOL = 1e-5
LLAMAS = {
    # name: LlamaConfig overrides
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_theta=50000.0),
    "bias-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                      attention_bias=True, mlp_bias=True, rope_theta=10000.0),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from megatron_lrattn.data.corpus import iter_stdlib_documents
    from megatron_lrattn.data.tokenizer import train_bpe_tokenizer

    texts = [t for _, t in iter_stdlib_documents(max_bytes=300_000)]
    return str(train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=320))


def _make_llama(path, tokenizer_dir, seed=0, **overrides):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                      num_hidden_layers=3, max_position_embeddings=64, rms_norm_eps=1e-5,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random norm gains and biases: every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def _tokens(vocab, seed=0, b=2, s=40):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _no_prompt(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("transformers asked whether to run custom code")

    monkeypatch.setattr("builtins.input", refuse)


@pytest.mark.parametrize("name", list(LLAMAS))
def test_llama_import_export_logits(name, tokenizer_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from megatron_lrattn.hf.export import hf_to_megatron_checkpoint, megatron_checkpoint_to_hf
    from megatron_lrattn.hf.megatron_io import load_megatron
    from megatron_lrattn.training.checkpoint_io import resolve_checkpoint
    from megatron_lrattn.training.runtime import single_process_model_parallel

    llama = _make_llama(tmp_path / "llama", tokenizer_dir, **LLAMAS[name])
    tokens = _tokens(llama.config.vocab_size)
    with torch.no_grad():
        want = llama(tokens).logits

    hf_to_megatron_checkpoint(str(tmp_path / "llama"), str(tmp_path / "ckpt"))
    with single_process_model_parallel():
        sd, meta, model = load_megatron(resolve_checkpoint(str(tmp_path / "ckpt")))
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            ours = model(tokens, pos, None)[..., : llama.config.vocab_size]
    assert meta["model_settings"]["residual"] == "standard"
    assert meta["model_settings"]["num_blocks"] == 6  # lrattn-pretrain's default at L = 3
    assert meta["contents"] == ["model"] and meta["iteration"] == 0
    err = (ours - want).abs().max().item()
    print(f"{name}: Llama -> Megatron max |logit diff| = {err:.3g}")
    assert err <= ATOL

    # The export is a plain Llama: no remote code, standard names, the same weights; the
    # converted checkpoint still finds its tokenizer copy after a move, from anywhere.
    os.rename(tmp_path / "ckpt", tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    export = tmp_path / "export"
    megatron_checkpoint_to_hf(str(tmp_path / "moved"), str(export))
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in cfg and not list(export.glob("*.py"))
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["num_key_value_heads"] == \
        LLAMAS[name]["num_key_value_heads"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    assert theta == LLAMAS[name]["rope_theta"]
    assert cfg["tie_word_embeddings"] == LLAMAS[name]["tie_word_embeddings"]
    _no_prompt(monkeypatch)
    back = LlamaForCausalLM.from_pretrained(export, trust_remote_code=False).eval()
    assert type(back) is LlamaForCausalLM
    assert back.state_dict().keys() == llama.state_dict().keys()
    for k, v in llama.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with torch.no_grad():
        got = back(tokens).logits
    err = (got - want).abs().max().item()
    print(f"{name}: exported Llama max |logit diff| = {err:.3g}")
    assert err <= ATOL
    tok = AutoTokenizer.from_pretrained(export)
    assert tok("def f():").input_ids == AutoTokenizer.from_pretrained(tokenizer_dir)(
        "def f():").input_ids


def _standard_lrattn_folder(path, tokenizer_dir, **overrides):
    """An exported-style standard ``LRAttnForCausalLM`` folder with ``overrides``."""
    from transformers import AutoTokenizer

    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.export import save_hf
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LRAttnConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                       residual="standard", eos_token_id=tok.eos_token_id, **overrides)
    torch.manual_seed(0)
    model = LRAttnForCausalLM(cfg)
    save_hf(model.state_dict(), cfg, str(path), tokenizer_dir)


def test_llama_export_refuses_what_llama_cannot_express(tokenizer_dir, tmp_path, capsys):
    from megatron_lrattn.cli.convert_hf import main as convert_hf
    from megatron_lrattn.hf.export import hf_to_megatron_checkpoint

    _standard_lrattn_folder(tmp_path / "ln", tokenizer_dir, normalization="LayerNorm",
                            qk_layernorm=True)
    hf_to_megatron_checkpoint(str(tmp_path / "ln"), str(tmp_path / "ckpt"))
    assert convert_hf([str(tmp_path / "ckpt"), str(tmp_path / "as_llama"),
                       "--format", "llama"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lrattn-convert-hf: error: cannot export as Llama: "
                           "normalization=LayerNorm"), last
    assert "qk_layernorm" in last and "--format lrattn" in last, last
    assert not (tmp_path / "as_llama").exists()
    # auto keeps our own type for it, tokenizer given explicitly from elsewhere
    assert convert_hf([str(tmp_path / "ckpt"), str(tmp_path / "auto"),
                       "--tokenizer", tokenizer_dir]) == 0
    cfg = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert cfg["model_type"] == "lrattn" and cfg["normalization"] == "LayerNorm"
    assert (tmp_path / "auto" / "tokenizer.json").is_file()


def test_llama_blockers_and_import_refusals():
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.llama import from_llama_config, llama_blockers

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    assert llama_blockers(LRAttnConfig(residual="standard", **base)) == []
    for kw, word in ((dict(normalization="LayerNorm"), "LayerNorm"),
                     (dict(qk_layernorm=True), "qk_layernorm"),
                     (dict(swiglu=False), "GELU"),
                     (dict(position_embedding_type="learned_absolute"), "learned_absolute")):
        found = llama_blockers(LRAttnConfig(residual="standard", **base, **kw))
        assert len(found) == 1 and word in found[0], (kw, found)
    assert "residual=attnres" in llama_blockers(LRAttnConfig(residual="attnres", num_blocks=2,
                                                           **base))[0]
    raw = dict(model_type="llama", hidden_size=32, num_attention_heads=4, rms_norm_eps=1e-5,
               intermediate_size=48, num_hidden_layers=2, vocab_size=300)
    assert from_llama_config(raw, 1e-5).residual == "standard"
    for extra, word in ((dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
                        (dict(rms_norm_eps=1e-6), "rms_norm_eps"),
                        (dict(attention_bias=True), "mlp_bias"),
                        (dict(head_dim=16), "head_dim"),
                        (dict(hidden_act="gelu"), "hidden_act")):
        with pytest.raises(ValueError, match=word):
            from_llama_config({**raw, **extra}, 1e-5)


def test_llama_import_refuses_a_vocabulary_other_than_the_tokenizers(tokenizer_dir, tmp_path,
                                                                     capsys):
    from megatron_lrattn.cli.convert_megatron import main as convert_megatron

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)) + 64,
                      hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, rms_norm_eps=1e-5, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / "llama")
    assert convert_megatron([str(tmp_path / "llama"), str(tmp_path / "out")]) == 2
    assert "the tokenizer has" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("num_blocks", [8, 3])
def test_attnres_with_zero_queries_reads_the_mean_so_equals_llama_only_without_norm_eps(
        num_blocks):
    """docs/hf.md: with a Llama's weights and zero depth queries, every read is the residual
    stream divided by its source count; RMSNorm removes that scale except through its
    epsilon, so the model equals the Llama at eps ~ 0 and differs at eps = 1e-5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    errs = {}
    for eps in (1e-12, 1e-5):
        shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        llama = LlamaForCausalLM(LlamaConfig(rms_norm_eps=eps, **shape)).eval()
        ours = LRAttnForCausalLM(LRAttnConfig(norm_eps=eps, residual="attnres",
                                              num_blocks=num_blocks, **shape)).eval()
        missing, unexpected = ours.load_state_dict(llama.state_dict(), strict=False)
        assert not unexpected and all("depth_queries" in k for k in missing)
        with torch.no_grad():
            for q in ours.model.depth_queries.values():
                q.weight.zero_()
            x = _tokens(300, s=32)
            errs[eps] = (ours(x).logits - llama(x).logits).abs().max().item()
    assert errs[1e-12] <= ATOL, errs
    assert errs[1e-5] > 1e-3, errs


MODEL = ["--preset", "tiny", "--residual", "standard", "--seq-length", "64", "--hidden-size",
         "64", "--num-layers", "2", "--num-blocks", "4", "--ffn-hidden-size", "128",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "2",
         "--lr-warmup-iters", "1", "--no-progress", "--seed", "5"]


def _cli(module, *argv, cache):
    import subprocess
    import sys

    from helpers import cli_env

    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                       env=cli_env(cache), timeout=900)
    assert r.returncode == 0, (module, r.stderr[-3000:])
    return r


def _valid(metrics):
    import json

    rows = [json.loads(line) for line in open(metrics)]
    return [(r["iteration"], r["loss"]) for r in rows if r.get("type") == "valid"]


@pytest.mark.slow
def test_llama_export_then_import_finetunes_from_the_same_loss(tmp_path, new_cache):
    """A trained standard checkpoint, exported as a Llama and imported back, trains 20 steps
    with --finetune starting from the loss the original had (fp32, CPU)."""
    import json

    cache = new_cache(tmp_path / "cache")
    _cli("megatron_lrattn.cli.pretrain", *MODEL, "--train-iters", "8", "--eval-interval", "4",
         "--save", str(tmp_path / "a"), "--log-json", str(tmp_path / "a.jsonl"), cache=cache)
    trained = _valid(tmp_path / "a.jsonl")[-1]
    assert trained[0] == 8
    _cli("megatron_lrattn.cli.convert_hf", str(tmp_path / "a"), str(tmp_path / "llama"),
         cache=cache)
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    _cli("megatron_lrattn.cli.convert_megatron", str(tmp_path / "llama"), str(tmp_path / "b"),
         cache=cache)
    _cli("megatron_lrattn.cli.pretrain", *MODEL, "--train-iters", "20", "--eval-interval", "10",
         "--load", str(tmp_path / "b"), "--finetune", "--save", str(tmp_path / "c"),
         "--log-json", str(tmp_path / "c.jsonl"), cache=cache)
    valid = _valid(tmp_path / "c.jsonl")
    assert valid[0][0] == 0
    assert valid[0][1] == pytest.approx(trained[1], rel=1e-5), (trained, valid)
    assert valid[-1][0] == 20 and valid[-1][1] < valid[0][1], valid
