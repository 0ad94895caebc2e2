"""Data pipeline: corpus, tokenizer, preprocessing, GPT datasets, default-data cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lrattn.data.corpus import (
    iter_stdlib_documents,
    list_stdlib_sources,
    write_stdlib_corpus,
)
from megatron_lrattn.data.errors import DataError
from megatron_lrattn.data.preprocess import output_dtype, preprocess
from megatron_lrattn.data.tokenizer import EOD_TOKEN, HFTokenizer, train_bpe_tokenizer

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

CAP = 300_000
VOCAB = 512
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def docs():
    return [text for _, text in iter_stdlib_documents(CAP)]


@pytest.fixture(scope="module")
def corpus(workdir):
    return write_stdlib_corpus(workdir / "corpus.jsonl", max_bytes=CAP)


@pytest.fixture(scope="module")
def tok_dir(workdir, docs):
    return train_bpe_tokenizer(docs, workdir / "tok", VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer(tok_dir)


@pytest.fixture(scope="module")
def prefix(workdir, corpus, tok_dir):
    out = workdir / "ds" / "stdlib"
    preprocess(corpus.path, out, tok_dir)
    return str(out)


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return ds, [ds[i] for i in range(len(ds))]


def test_corpus_is_deterministic_and_capped(workdir, corpus):
    again = write_stdlib_corpus(workdir / "again.jsonl", max_bytes=CAP)
    assert Path(corpus.path).read_bytes() == Path(again.path).read_bytes()
    assert 0 < corpus.num_bytes <= CAP and corpus.documents > 5
    lines = Path(corpus.path).read_text(encoding="utf-8").splitlines()
    assert len(lines) == corpus.documents and all(json.loads(l)["text"] for l in lines)
    parts = {part for rel in list_stdlib_sources() for part in rel.split("/")[:-1]}
    assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings"}


def test_tokenizer_round_trip(tok_dir, tok, docs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    text = "def f(x):\n\treturn  x ** 2  # ünïcödé ✓ 🐍\r\n\n" + docs[0][:2000]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    assert tok.tokenize(text) == hf.encode(text, add_special_tokens=False)
    assert tok.vocab_size == len(hf) == VOCAB
    assert tok.eod == hf.convert_tokens_to_ids(EOD_TOKEN) == 0
    assert tok.tokenize(EOD_TOKEN) == [tok.eod]
    assert tok.tokenize_batch([text, "a"]) == [tok.tokenize(text), tok.tokenize("a")]


def test_preprocess_round_trip(prefix, tok, docs):
    ds, arrays = _read_docs(prefix)
    assert ds.index.dtype == np.uint16 == output_dtype(tok.vocab_size)
    assert output_dtype(70_000) == np.int32
    assert len(arrays) == len(docs)
    for ids, text in zip(arrays, docs):
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1]) == text


@pytest.mark.slow  # a pool of spawned processes; the fast tier preprocesses in this process
def test_preprocess_text_inputs_and_workers(workdir, tok_dir, tok):
    src = workdir / "txt"
    src.mkdir()
    (src / "a.txt").write_text("first line\n\nsecond line\n", encoding="utf-8")
    (src / "b.md").write_text("third\n", encoding="utf-8")
    per_file = preprocess(src, workdir / "txt_doc", tok_dir, append_eod=False)
    per_line = preprocess(
        src, workdir / "txt_line", tok_dir, split_lines=True, workers=2, chunk_size=1
    )
    assert (per_file.documents, per_line.documents) == (2, 3)
    _, arrays = _read_docs(str(workdir / "txt_doc"))
    assert [tok.detokenize(a) for a in arrays] == ["first line\n\nsecond line\n", "third\n"]
    _, arrays = _read_docs(str(workdir / "txt_line"))
    assert [tok.detokenize(a[:-1]) for a in arrays] == ["first line", "second line", "third"]


def test_preprocess_failure_mid_file_leaves_nothing(workdir, tok_dir):
    bad = workdir / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n', encoding="utf-8")
    out = workdir / "bad_out"
    out.mkdir()
    with pytest.raises(DataError, match=r"bad.jsonl:3: no key 'text'"):
        preprocess(bad, out / "x", tok_dir, chunk_size=1)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_input", "input file not found"),
        ("bad_key", "no key 'body'"),
        ("missing_tokenizer", "tokenizer folder not found"),
        ("device_input", "input /dev/null: not a regular file or folder"),
        ("log_level", "argument --log-level: invalid choice: 'BOGUS'"),
    ],
)
def test_cli_bad_input(workdir, corpus, tok_dir, case, expect):
    out = workdir / f"cli_{case}"
    out.mkdir()
    args = {"--input": corpus.path, "--tokenizer": str(tok_dir), "--json-keys": "text"}
    if case == "missing_input":
        args["--input"] = str(workdir / "nope.jsonl")
    elif case == "bad_key":
        args["--json-keys"] = "body"
    elif case == "device_input":
        args["--input"] = "/dev/null"
    elif case == "log_level":
        args["--log-level"] = "bogus"
    else:
        args["--tokenizer"] = str(workdir / "no_tokenizer")
    argv = [a for kv in args.items() for a in kv] + ["--output-prefix", str(out / "x")]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lrattn.cli.preprocess", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # one line of ours, or argparse's usage and its one line
    assert expect in lines[-1] and (len(lines) == 1 or lines[0].startswith("usage:")), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(out.iterdir()) == []


def _samples(ds, n=8):
    return torch.stack([ds[i]["tokens"] for i in range(n)])


def test_gpt_datasets_shapes_and_seeds(workdir, prefix, tok):
    from megatron_lrattn.data.datasets import build_gpt_datasets, get_batch

    kw = dict(split="80,10,10", num_samples=(40, 4, 4))
    a = build_gpt_datasets(prefix, tok, 64, seed=1, cache_dir=workdir / "c1", **kw)
    b = build_gpt_datasets(prefix, tok, 64, seed=1, cache_dir=workdir / "c2", **kw)
    c = build_gpt_datasets(prefix, tok, 64, seed=2, cache_dir=workdir / "c1", **kw)
    assert all(len(ds) >= n for ds, n in zip(a, kw["num_samples"]))
    sample = a[0][0]
    assert sample["tokens"].shape == sample["labels"].shape == (64,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert torch.equal(_samples(a[0]), _samples(b[0]))
    assert torch.equal(_samples(a[1], 4), _samples(b[1], 4))
    assert not torch.equal(_samples(a[0]), _samples(c[0]))
    loader = torch.utils.data.DataLoader(a[0], batch_size=4)
    tokens, labels, loss_mask, position_ids = get_batch(next(iter(loader)))
    assert tokens.shape == labels.shape == loss_mask.shape == position_ids.shape == (4, 64)
    assert tokens.dtype == torch.int64 and loss_mask.dtype == torch.float32
    assert torch.equal(position_ids[0], torch.arange(64))
    assert torch.equal(get_batch([a[0][i] for i in range(4)])[0], tokens)


def test_gpt_datasets_blend(workdir, prefix, tok, tok_dir, docs):
    from megatron_lrattn.data.datasets import build_gpt_datasets

    other = workdir / "other.jsonl"
    other.write_text("".join(json.dumps({"text": t[::-1]}) + "\n" for t in docs), encoding="utf-8")
    preprocess(other, workdir / "ds" / "other", tok_dir)
    blend = ["0.7", prefix, "0.3", str(workdir / "ds" / "other")]
    train, valid, test = build_gpt_datasets(
        blend, tok, 64, split="80,10,10", seed=3, num_samples=(200, 20, 20),
        cache_dir=workdir / "cb",
    )
    assert (len(train), len(valid), len(test)) == (200, 20, 20)
    share = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert abs(share[0] - 0.7) < 0.02
    assert train[0]["tokens"].shape == (64,)


def test_gpt_datasets_errors(workdir, prefix, tok):
    from megatron_lrattn.data.datasets import build_gpt_datasets, parse_blend

    assert parse_blend("0.5 a 0.5 b") == (["a", "b"], [0.5, 0.5])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    with pytest.raises(DataError, match="not found"):
        build_gpt_datasets(str(workdir / "missing"), tok, 64, cache_dir=workdir / "ce")
    with pytest.raises(DataError, match="valid split .* is empty"):
        build_gpt_datasets(prefix, tok, 64, split="998,1,1", cache_dir=workdir / "ce")


def _dist_worker(rank, world, store, prefix, tok_dir, cache, out):
    import torch.distributed as dist

    from megatron_lrattn.data.datasets import build_gpt_datasets

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tok = HFTokenizer(tok_dir)
    train, _, _ = build_gpt_datasets(
        prefix, tok, 64, split="80,10,10", seed=5, num_samples=(16, 2, 2), cache_dir=cache
    )
    torch.save(_samples(train), f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_gpt_datasets_distributed_gloo(workdir, prefix, tok_dir, tok):
    from megatron_lrattn.data.datasets import build_gpt_datasets

    out = workdir / "dist_samples"
    args = (2, str(workdir / "store"), prefix, str(tok_dir), str(workdir / "cd"), str(out))
    # fork: the children reuse the parent's imports (spawn re-imports megatron-core: ~10 s).
    torch.multiprocessing.start_processes(_dist_worker, args=args, nprocs=2, start_method="fork")
    train, _, _ = build_gpt_datasets(
        prefix, tok, 64, split="80,10,10", seed=5, num_samples=(16, 2, 2), cache_dir=workdir / "cd"
    )
    expected = _samples(train)
    for rank in range(2):
        assert torch.equal(torch.load(f"{out}.{rank}"), expected)


def test_default_data_is_cached(workdir):
    from megatron_lrattn.data.default_corpus import ensure_default_data

    first = ensure_default_data(workdir / "cache", vocab_size=300, max_bytes=100_000)
    assert first.built
    bin_path = Path(first.data_prefix + ".bin")
    mtime = bin_path.stat().st_mtime_ns
    second = ensure_default_data(workdir / "cache", vocab_size=300, max_bytes=100_000)
    assert not second.built and second.data_prefix == first.data_prefix
    assert bin_path.stat().st_mtime_ns == mtime
    assert HFTokenizer(second.tokenizer_dir).vocab_size == 300
    leftovers = (workdir / "cache" / "default_data").glob(".tmp*")
    assert not list(leftovers)
    other = ensure_default_data(workdir / "cache", vocab_size=320, max_bytes=100_000)
    assert other.built and other.root != first.root


def test_default_data_killed_build_leaves_no_cache(workdir, monkeypatch):
    from megatron_lrattn.data import default_corpus

    def boom(tmp, *args):
        (tmp / "partial.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_corpus, "_build", boom)
    with pytest.raises(KeyboardInterrupt):
        default_corpus.ensure_default_data(workdir / "killed", vocab_size=300, max_bytes=1000)
    assert list((workdir / "killed" / "default_data").iterdir()) == []


def test_cli_success(workdir, corpus, tok_dir, capsys):
    from megatron_lrattn.cli.preprocess import main

    out = workdir / "cli_ok" / "x"
    rc = main(["--input", corpus.path, "--output-prefix", str(out), "--tokenizer", str(tok_dir),
               "--no-progress"])
    assert rc == 0
    assert f"{corpus.documents} documents" in capsys.readouterr().out
    # Megatron's naming: PREFIX_KEY_document
    assert Path(f"{out}_text_document.bin").is_file() and Path(f"{out}_text_document.idx").is_file()
