"""``lrattn-eval``: local tasks built deterministically from the held-out corpus, a scorer
whose batched, windowed log-likelihoods equal a plain forward, and the CLI's JSON and table
on a Llama and on an lrattn export."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from megatron_lrattn.data.corpus import iter_stdlib_documents
    from megatron_lrattn.data.tokenizer import train_bpe_tokenizer

    texts = [t for _, t in iter_stdlib_documents(max_bytes=300_000)]
    return str(train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=320))


@pytest.fixture(scope="module")
def llama_dir(tokenizer_dir, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, rms_norm_eps=1e-5,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def heldout():
    from megatron_lrattn.eval.tasks import heldout_documents

    return heldout_documents()


def test_heldout_split_is_megatrons_test_split():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron_lrattn.data.default_corpus import RECOMMENDED_SPLIT
    from megatron_lrattn.eval.tasks import HELDOUT_SPLIT, split_range

    assert HELDOUT_SPLIT == RECOMMENDED_SPLIT
    for split in (HELDOUT_SPLIT, "969,30,1", "98,1,1"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in (1, 7, 21, 437, 1000):
            for which in range(3):
                beg, end = matrix[which]
                assert split_range(n, split, which) == range(int(round(beg * n)),
                                                             int(round(end * n)))


def test_items_are_deterministic_and_well_formed(heldout):
    from megatron_lrattn.eval.tasks import items_digest, last_word_items, next_line_items

    cloze = last_word_items(heldout, 50)
    assert len(cloze) == 50 and items_digest(cloze) == items_digest(last_word_items(heldout, 50))
    assert items_digest(cloze) != items_digest(last_word_items(heldout, 50, seed=1))
    for it in cloze:
        word = it.target.strip()
        assert word.isidentifier() and word in it.context and word not in ("None", "self")
        assert "\n" not in it.target
    choice = next_line_items(heldout, 50)
    assert len(choice) == 50
    answers = {it.answer for it in choice}
    assert len(answers) > 1
    for it in choice:
        true = it.choices[it.answer]
        assert len(set(it.choices)) == 4 and all(c.endswith("\n") for c in it.choices)
        indent = true[: len(true) - len(true.lstrip())]
        assert all(c.startswith(indent) and not c[len(indent)].isspace() for c in it.choices)


def test_scorer_matches_a_plain_forward(llama_dir, heldout):
    from megatron_lrattn.eval.harness import Request, Scorer, load_model, perplexity

    model, tok, kind = load_model(llama_dir)
    assert kind == "llama"
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, 300, (n,), generator=g).tolist(), k)
                for n, k in ((20, 5), (9, 8), (33, 1), (40, 39))]
    batched = Scorer(model, batch_size=3, max_length=64, progress=False).score(requests)
    for r, (lp, greedy) in zip(requests, batched):
        ids = torch.tensor([r.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[:, :-1]).logits.float(), -1)[0]
        tgt = ids[0, 1:]
        want = logp[-r.n_scored:].gather(-1, tgt[-r.n_scored:, None]).sum().item()
        assert abs(lp - want) < 1e-4, (lp, want)
        assert greedy == bool((logp[-r.n_scored:].argmax(-1) == tgt[-r.n_scored:]).all())
    # One short document in one window: the mean NLL is the model's own loss.
    text = heldout[0][:60]
    res = perplexity(Scorer(model, max_length=64, progress=False), tok, [text])
    ids = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids])
    assert ids.shape[1] <= 65
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert res["tokens"] == ids.shape[1] - 1
    assert abs(res["nll_per_token"] - loss) < 1e-5
    assert abs(res["bits_per_byte"] - loss * res["tokens"] / 0.6931471805599453
               / len(text.encode())) < 1e-6
    # A long document in sliding windows scores every token exactly once.
    long = perplexity(Scorer(model, max_length=16, progress=False), tok, [heldout[0][:2000]])
    n = len(tok(heldout[0][:2000], add_special_tokens=False).input_ids)
    assert long["tokens"] == n


def test_cli_writes_json_and_table(llama_dir, tokenizer_dir, tmp_path, capsys, monkeypatch):
    from megatron_lrattn.cli.eval import main
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.export import save_hf
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    def refuse(*a, **k):
        raise AssertionError("asked whether to run custom code")

    monkeypatch.setattr("builtins.input", refuse)
    out = tmp_path / "res.json"
    assert main([llama_dir, "--limit", "6", "--heldout-bytes", "3000", "--output", str(out),
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    for word in ("perplexity", "bits_per_byte", "last_word", "next_line", "acc_norm"):
        assert word in table
    res = json.loads(out.read_text())
    assert set(res["tasks"]) == {"heldout", "last_word", "next_line"}
    assert res["tasks"]["last_word"]["items"] == 6 and res["tasks"]["next_line"]["choices"] == 4
    assert 0 < res["tasks"]["heldout"]["bits_per_byte"] < 20
    # Our own export (an LR-AttnRes model) loads through the installed code, no prompt.
    tok_len = len(__import__("transformers").AutoTokenizer.from_pretrained(tokenizer_dir))
    cfg = LRAttnConfig(vocab_size=tok_len, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                       residual="lr_attnres", key_rank=8, num_blocks=2, eos_token_id=0)
    torch.manual_seed(0)
    save_hf(LRAttnForCausalLM(cfg).state_dict(), cfg, str(tmp_path / "ours"), tokenizer_dir)
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n")
    assert main([str(tmp_path / "ours"), "--tasks", "heldout", "--text", str(text),
                 "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main([llama_dir, "--tasks", "hellaswag"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "lrattn-eval: error: --tasks: unknown hellaswag")


@pytest.fixture(scope="module")
def dataset(tokenizer_dir, tmp_path_factory):
    """40 documents through lrattn-preprocess: (prefix, texts)."""
    from megatron_lrattn.cli.preprocess import main as preprocess

    root = tmp_path_factory.mktemp("ds")
    g = __import__("random").Random(0)
    words = ["river", "stone", "garden", "window", "number", "lantern", "market", "yellow"]
    texts = []
    for d in range(40):
        lines = [f"{d} " + " ".join(g.choice(words) for _ in range(8)) for _ in range(12)]
        texts.append("\n".join(lines) + "\n")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert preprocess(["--input", str(src), "--output-prefix", str(root / "d"), "--tokenizer",
                       tokenizer_dir, "--workers", "1", "--no-progress"]) == 0
    return str(root / "d_text_document"), texts


@pytest.mark.parametrize("split,part,want", [("98,2,0", "valid", range(39, 40)),
                                             ("80,10,10", "valid", range(32, 36)),
                                             ("80,10,10", "test", range(36, 40)),
                                             ("80,10,10", "train", range(0, 32))])
def test_dataset_documents_are_the_split_part_decoded(dataset, tokenizer_dir, split, part, want):
    from transformers import AutoTokenizer

    from megatron_lrattn.eval.tasks import dataset_documents

    prefix, texts = dataset
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = dataset_documents(prefix, split, part,
                             lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert docs == [texts[i] for i in want]


def test_dataset_documents_refuse_an_empty_part(dataset):
    from megatron_lrattn.eval.tasks import dataset_documents

    with pytest.raises(ValueError, match="test part .* holds no document"):
        dataset_documents(dataset[0], "98,2,0", "test", lambda ids: "")


def test_cli_scores_a_datasets_valid_part(llama_dir, dataset, tmp_path, capsys):
    from megatron_lrattn.cli.eval import main

    prefix, _ = dataset
    out = tmp_path / "res.json"
    assert main([llama_dir, "--data-path", prefix, "--split", "80,20,0", "--limit", "4",
                 "--output", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    for task in ("heldout", "last_word", "next_line"):
        assert res["tasks"][task]["source"].endswith("valid part of 80,20,0"), res["tasks"][task]
    assert res["tasks"]["last_word"]["items"] == 4 and res["settings"]["split"] == "80,20,0"
    capsys.readouterr()
    for argv, needle in (([ "--data-path", prefix + "_nope"], "no " + prefix + "_nope.bin"),
                         (["--data-path", prefix, "--split", "abc"], "--split 'abc'"),
                         (["--data-path", prefix, "--split", "98,2,0", "--split-part", "test"],
                          "holds no document"),
                         (["--data-path", prefix, "--split", "98,2,0", "--tasks", "next_line"],
                          "next_line: no item can be built")):
        assert main([llama_dir, *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and "Traceback" not in "\n".join(err), err


_FUZZ_VALUES = ["0", "1", "-1", "2", "7", "nan", "inf", "1e309", "1.5", "abc", "", "100,0,0",
                "0,0,0", "1,1,1", "/nonexistent/x", "/sys/lrattn", "/dev/null", "cpu", "cuda",
                "meta", "bogus", "heldout", "last_word,next_line", ",", "valid", "test",
                "float16", "--", "\u00e9\u4e2d"]


@pytest.mark.slow
def test_cli_fuzzed_flags_score_or_refuse_in_one_line(llama_dir, tmp_path, capsys,
                                                      monkeypatch):
    """Every flag with hostile values on a real (tiny) model: a result or a one-line
    error (exit 2), never a traceback."""
    monkeypatch.chdir(tmp_path)  # a fuzzed relative --output lands here
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from megatron_lrattn.cli.eval import build_parser, main

    # flag -> whether it takes a value (mostly given one, so that runs get past argparse)
    flags = {s: a.nargs != 0 for a in build_parser()._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"}
    pairs = st.lists(st.tuples(st.sampled_from(sorted(flags)), st.sampled_from(_FUZZ_VALUES),
                               st.integers(0, 5)), max_size=3)
    seen = {0: 0, 2: 0}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(pairs)
    def check(chosen):
        argv = [llama_dir, "--limit", "2", "--heldout-bytes", "1500", "--no-progress",
                "--output", str(tmp_path / "r.json")]
        for flag, value, odd in chosen:
            argv += [flag, value] if flags[flag] == bool(odd) else [flag]
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage and one line, exit 2
            rc = e.code
        err = capsys.readouterr().err
        assert rc in (0, 2), (argv, rc, err[-2000:])
        assert "Traceback" not in err, (argv, err[-2000:])
        if rc == 2:
            assert err.strip().splitlines()[-1].startswith(("lrattn-eval: error:",)), (argv, err)
        seen[rc] += 1

    check()
    assert seen[0] >= 10 and seen[2] >= 10, seen  # both outcomes were reached
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("device,needle", [
    ("bogus", "--device bogus: expected cpu, cuda or cuda:N"),
    ("meta", "--device meta: expected cpu, cuda or cuda:N"),
    ("cuda:99", "--device cuda:99: this machine has"),
])
def test_cli_device_is_checked_in_one_line(llama_dir, device, needle, capsys):
    from megatron_lrattn.cli.eval import main

    assert main([llama_dir, "--device", device, "--no-progress"]) == 2
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_output_to_a_device_writes_through_it(llama_dir, tmp_path, capsys):
    """``--output /dev/null`` discards the results; it must not replace the device by a
    file (a rename over it would, as root)."""
    from megatron_lrattn.cli.eval import main

    assert main([llama_dir, "--tasks", "heldout", "--heldout-bytes", "1500", "--no-progress",
                 "--output", "/dev/null"]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    assert main([llama_dir, "--tasks", "heldout", "--heldout-bytes", "1500", "--no-progress",
                 "--output", str(link)]) == 0
    assert link.is_symlink() and "perplexity" in (tmp_path / "target.json").read_text()
