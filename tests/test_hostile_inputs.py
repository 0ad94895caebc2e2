"""Hostile and broken inputs for every command: each case asserts the exit code (or the
error type), the one-line message, and that nothing was written or lost.

Fast in-process cases come first (flags, ``.idx`` files, index caches, preprocessing of
malformed text); the cases that run the CLIs in subprocesses are marked slow and share one
small trained checkpoint.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import cli_env, finish, tmpfs
from megatron_lrattn.data.errors import DataError
from megatron_lrattn.training.arg_types import ArgumentError


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _digest(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


BAD_FLAGS = {
    "split-no-valid": (["--split", "100,0,0"], "--split 100,0,0"),
    "split-garbage": (["--split", "abc"], "--split 'abc'"),
    "sequence-parallel-tp1": (["--sequence-parallel"], "--sequence-parallel"),
    "seed-negative": (["--seed", "-1"], "--seed -1"),
    "seed-huge": (["--seed", str(2**40)], "--seed"),
    "lr-nan": (["--lr", "nan"], "--lr nan"),
    "lr-inf": (["--lr", "inf", "--min-lr", "0"], "--lr inf"),
    "min-lr-nan": (["--min-lr", "nan"], "--min-lr nan"),
    "weight-decay-negative": (["--weight-decay", "-5"], "--weight-decay -5"),
    "adam-beta1": (["--adam-beta1", "1.5"], "--adam-beta1 1.5"),
    "adam-beta2-nan": (["--adam-beta2", "nan"], "--adam-beta2 nan"),
    "clip-grad-negative": (["--clip-grad", "-1"], "--clip-grad -1"),
    "init-std-zero": (["--init-method-std", "0"], "--init-method-std 0"),
    "key-norm-eps-nan": (["--key-norm-eps", "nan"], "--key-norm-eps nan"),
    "rotary-base-zero": (["--rotary-base", "0"], "--rotary-base 0"),
    "dropout-nan": (["--hidden-dropout", "nan"], "--hidden-dropout"),
    "batch-not-multiple": (["--global-batch-size", "5", "--micro-batch-size", "2"],
                           "--global-batch-size 5"),
    "learned-positions-too-short": (["--position-embedding-type", "learned_absolute",
                                     "--max-position-embeddings", "8", "--seq-length", "16"],
                                    "--max-position-embeddings 8"),
    "wsd-decay-too-long": (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "99",
                            "--train-iters", "10"], "--lr-wsd-decay-iters 99"),
    "cache-dir-is-a-file": (["--cache-dir", "{file}"], "--cache-dir"),
}


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_pretrain_flag_values_are_refused_before_megatron_sees_them(name, tmp_path):
    from megatron_lrattn.training.arguments import parse_args

    argv, needle = BAD_FLAGS[name]
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{file}", str(tmp_path / "file")) for a in argv]
    with pytest.raises(ArgumentError) as e:
        parse_args(["--train-iters", "10", "--lr-warmup-iters", "1", *argv])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_triton_backend_without_cuda_or_interpreter_is_refused(monkeypatch):
    import torch

    from megatron_lrattn.training.arguments import parse_args

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ArgumentError, match="--depth-backend triton needs"):
        parse_args(["--depth-backend", "triton"])


def test_fresh_run_into_a_folder_with_checkpoints_is_refused_unless_asked(tmp_path):
    from megatron_lrattn.training.arguments import parse_args

    save = tmp_path / "ckpt"
    (save / "iter_0000004").mkdir(parents=True)
    (save / "iter_0000004" / "lrattn.json").write_text("{}")
    (save / "latest").write_text("iter_0000004\n")
    with pytest.raises(ArgumentError) as e:
        parse_args(["--save", str(save)])
    assert str(e.value) == (
        f"--save {save} already holds checkpoints (latest, 1 complete checkpoint(s)); resume "
        f"with --load {save}, or choose another --save folder (--overwrite-checkpoints writes "
        "over them)")
    with pytest.raises(ArgumentError, match="already holds checkpoints"):
        parse_args(["--save", str(save), "--load", str(tmp_path)])
    parse_args(["--save", str(save), "--load", str(save)])
    parse_args(["--save", str(save), "--overwrite-checkpoints"])


def _write_idx(prefix, docs, dtype=np.uint16):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.mark.parametrize("damage, needle", [
    ("swap-pointers", "sequence 1 starts at byte 10"),
    ("negative-length", "sequence 1 has length -3"),
    ("documents-fall", "document boundaries must rise"),
])
def test_idx_with_bad_entries_in_the_middle_is_refused(tmp_path, damage, needle):
    """Before: only the header, the file size and the last entry were checked, so these
    passed and crashed inside megatron or trained on garbage."""
    from megatron_lrattn.data.datasets import check_indexed_dataset

    prefix = _write_idx(tmp_path / "d", [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]])
    idx = Path(prefix + ".idx")
    raw = bytearray(idx.read_bytes())
    n = 4
    lengths = np.frombuffer(raw, np.int32, n, 34).copy()
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n).copy()
    docs = np.frombuffer(raw, np.int64, n + 1, 34 + 12 * n).copy()
    if damage == "swap-pointers":
        pointers[1], pointers[2] = pointers[2], pointers[1]
    elif damage == "negative-length":
        lengths[1] = -3
    else:
        docs[2] = 0
    raw[34:34 + 4 * n] = lengths.tobytes()
    raw[34 + 4 * n:34 + 12 * n] = pointers.tobytes()
    raw[34 + 12 * n:34 + 12 * n + 8 * (n + 1)] = docs.tobytes()
    idx.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        check_indexed_dataset(prefix)
    assert needle in str(e.value) and str(e.value).startswith(str(idx)), str(e.value)


def test_index_cache_that_is_a_pickle_never_runs(tmp_path):
    from megatron_lrattn.data.datasets import check_index_caches

    cache = tmp_path / "cache"
    cache.mkdir()
    good = cache / "abc-CachedGPTDataset-train-document_index.npy"
    np.save(good, np.arange(10, dtype=np.int32))
    check_index_caches(str(cache))
    marker = tmp_path / "PWNED"
    bad = cache / "abc-CachedGPTDataset-train-sample_index.npy"
    bad.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(DataError, match=r"sample_index\.npy: not a plain index array"):
        check_index_caches(str(cache))
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="holds Python objects"):
        check_index_caches(str(cache))
    np.save(bad, np.arange(100, dtype=np.int64))
    bad.write_bytes(bad.read_bytes()[:-8])
    with pytest.raises(DataError, match="its header describes"):
        check_index_caches(str(cache))
    check_index_caches(str(cache), prefix="other")  # another dataset's files are not read
    assert not marker.exists()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from megatron_lrattn.data.tokenizer import train_bpe_tokenizer

    texts = [f"document {i}: the quick brown fox jumps over the lazy dog " * 5 for i in range(50)]
    return train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tok", 300)


def test_gpt_dataset_refuses_a_tampered_index_cache_before_megatron_loads_it(tmp_path, tok_dir):
    from megatron_lrattn.data.datasets import build_gpt_datasets
    from megatron_lrattn.data.preprocess import preprocess
    from megatron_lrattn.data.tokenizer import HFTokenizer

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(40)))
    prefix = str(tmp_path / "ds")
    preprocess(src, prefix, tok_dir)
    tok, cache = HFTokenizer(tok_dir), tmp_path / "idx"
    build_gpt_datasets(prefix, tok, 16, split="80,20,0", cache_dir=cache)
    target = sorted(cache.glob("*-train-shuffle_index.npy"))[0]
    marker = tmp_path / "PWNED"
    target.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(DataError, match="not a plain index array"):
        build_gpt_datasets(prefix, tok, 16, split="80,20,0", cache_dir=cache)
    assert not marker.exists()


def test_preprocess_survives_lone_surrogates_bad_bytes_and_a_cut_gz(tmp_path, tok_dir):
    """Before: a lone surrogate escape or a cut .gz aborted the whole run."""
    from megatron_lrattn.data.preprocess import preprocess

    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "fine"}\n{"text": "lone \\ud800 surrogate"}\n')
    stats = preprocess(jl, tmp_path / "a", tok_dir)
    assert stats.documents == 2 and stats.replaced_text == 1
    raw = tmp_path / "b.txt"
    raw.write_bytes(b"caf\xe9 latin-1 bytes\n")
    stats = preprocess(raw, tmp_path / "b", tok_dir)
    assert stats.documents == 1 and stats.replaced_text == 1
    data = b"".join(b'{"text": "doc %d of the corpus"}\n' % i for i in range(3000))
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(data)[:4000])
    stats = preprocess(gz, tmp_path / "c", tok_dir)
    assert stats.truncated_files == 1 and 0 < stats.documents < 3000
    assert Path(str(tmp_path / "c") + ".idx").is_file()


def test_preprocess_unwritable_output_is_one_line_and_writes_nothing(tmp_path, tok_dir):
    from megatron_lrattn.data.preprocess import preprocess

    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"--output-prefix: /sys is not writable"):
        preprocess(jl, "/sys/lrattn/x", tok_dir)


SMALL = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
    "--ffn-hidden-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--eval-interval", "1000", "--eval-iters", "1", "--lr-warmup-iters", "1", "--no-progress",
]


def _start(module, args, cache, cwd, fault=None, pretrain=True):
    env = cli_env(cache, OMP_NUM_THREADS="1")
    env.pop("LRATTN_FAULT", None)
    if fault:
        env["LRATTN_FAULT"] = fault
    argv = [*SMALL, *args, "--cache-dir", str(cache)] if pretrain else list(args)
    return subprocess.Popen([sys.executable, "-m", f"megatron_lrattn.cli.{module}", *argv],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _one_line(rc, out, err, code=2):
    assert rc == code, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert ": error: " in last, last
    return last


@pytest.fixture(scope="module")
def cache(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def base(tmp_path_factory, cache):
    """A finished 2-iteration run with checkpoints after iterations 1 and 2."""
    work = tmp_path_factory.mktemp("hostile")
    proc = _start("pretrain", ["--train-iters", "2", "--save", str(work / "ckpt"),
                               "--save-interval", "1", "--log-json", str(work / "m.jsonl")],
                  cache, work)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    return work


def _copy(base: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(base / "ckpt", dst)
    return dst


@pytest.fixture(scope="module")
def exported(base, cache, tmp_path_factory):
    """``base``'s last checkpoint converted by ``lrattn-convert-hf``; tests read copies."""
    hf = tmp_path_factory.mktemp("exported") / "hf"
    rc, _, err = finish(_start("convert_hf", [str(base / "ckpt"), str(hf)], cache, hf.parent,
                               pretrain=False))
    assert rc == 0, err[-3000:]
    return hf


@pytest.mark.slow
def test_cli_refusals_of_a_trained_folder(base, exported, cache, tmp_path):
    """Fresh run over checkpoints, a pickle payload under --load, other data, a conversion
    into the training folder: each one line, exit 2, the folder unchanged, no code run."""
    marker = tmp_path / "PWNED"
    fresh, hostile, other, conv = (_copy(base, tmp_path, n) for n in
                                   ("fresh", "hostile", "other", "conv"))
    md = hostile / "iter_0000002" / ".metadata"
    md.write_bytes(pickle.dumps(_Payload(marker)) + md.read_bytes())
    before = {p: _digest(p) for p in (fresh, hostile, other, conv)}
    hf = shutil.copytree(exported, tmp_path / "hf")
    procs = {
        "fresh": _start("pretrain", ["--train-iters", "2", "--save", str(fresh)], cache, tmp_path),
        "pretrain-payload": _start("pretrain", ["--train-iters", "2", "--load", str(hostile)],
                                   cache, tmp_path),
        "hf-payload": _start("convert_hf", [str(hostile), str(tmp_path / "hf2")], cache,
                             tmp_path, pretrain=False),
        "analyze-payload": _start("analyze", [str(hostile), "--out", str(tmp_path / "an"),
                                              "--no-plots"], cache, tmp_path, pretrain=False),
        "other-split": _start("pretrain", ["--train-iters", "2", "--load", str(other),
                                           "--split", "90,9,1"], cache, tmp_path),
        "other-ffn": _start("pretrain", ["--train-iters", "2", "--load", str(other),
                                         "--ffn-hidden-size", "96"], cache, tmp_path),
        "convert-into-training": _start("convert_megatron", [str(hf), str(conv)], cache,
                                        tmp_path, pretrain=False),
        "analyze-readonly-out": _start("analyze", [str(base / "ckpt"), "--out", "/sys/lrattn"],
                                       cache, tmp_path, pretrain=False),
    }
    res = {k: finish(p) for k, p in procs.items()}
    assert "already holds checkpoints" in _one_line(*res["fresh"])
    for name in ("pretrain-payload", "hf-payload", "analyze-payload"):
        assert "not a torch checkpoint metadata file" in _one_line(*res[name]), name
    assert "trained on other data (split: saved" in _one_line(*res["other-split"])
    assert "ffn_hidden_size: saved 128, requested 96" in _one_line(*res["other-ffn"])
    assert "holds training checkpoints" in _one_line(*res["convert-into-training"])
    assert "--out: /sys is not writable" in _one_line(*res["analyze-readonly-out"])
    assert not marker.exists()
    assert {p: _digest(p) for p in before} == before
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "an").exists()


@pytest.mark.slow
def test_async_save_is_finalized_on_a_nonfinite_stop_and_resume_drops_replayed_records(
        base, cache, tmp_path):
    """Before: exit 3 left only iter_0000002.tmp (no latest). And a resumed run appended
    after the killed run's records of the iterations it replays."""
    ckpt = tmp_path / "async"
    rc, out, err = finish(_start("pretrain", ["--train-iters", "5", "--save", str(ckpt),
                                              "--save-interval", "1", "--async-save"], cache,
                                 tmp_path, fault="inf_grad@3"))
    assert "non-finite values at iteration 3" in _one_line(rc, out, err, code=3)
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert not list(ckpt.glob("*.tmp")) and (ckpt / "iter_0000002" / "lrattn.json").is_file()

    resume, log = _copy(base, tmp_path, "resume"), tmp_path / "m.jsonl"
    shutil.copy(base / "m.jsonl", log)
    (resume / "latest").write_text("iter_0000001\n")  # as if killed after iteration 2
    rc, _, err = finish(_start("pretrain", ["--train-iters", "2", "--load", str(resume),
                                            "--save", str(resume), "--log-json", str(log)],
                               cache, tmp_path))
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r["iteration"] for r in recs if r["type"] == "train"]
    assert train == [1, 2], train  # the killed run's iteration 2 dropped, the replay kept
    runs = [r for r in recs if r["type"] == "run"]
    assert runs[-1].get("dropped_records", 0) >= 1 and runs[-1]["resumed_from"] == 1


@pytest.mark.slow
def test_second_writer_refused_and_ctrl_c_saves_and_finalizes_the_async_saves(cache, tmp_path):
    ckpt = tmp_path / "live"
    first = _start("pretrain", ["--train-iters", "100000", "--save", str(ckpt),
                                "--save-interval", "1", "--async-save"], cache, tmp_path)
    deadline = time.time() + 240
    while not (ckpt / "latest").exists():
        assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
        time.sleep(0.2)
    second = _start("pretrain", ["--train-iters", "100000", "--load", str(ckpt), "--save",
                                 str(ckpt)], cache, tmp_path)
    last = _one_line(*finish(second))
    assert f"another run writes this folder (pid {first.pid} on " in last, last
    # Ctrl-C as a terminal sends it: to the whole process group, the writers included.
    os.killpg(first.pid, signal.SIGINT)
    rc, out, err = finish(first)
    assert rc == 130 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    from megatron_lrattn.training.checkpoint_io import latest_checkpoint, read_meta

    # A first Ctrl-C saves at the end of the iteration: that save is the latest.
    assert "interrupt: saving a checkpoint at the end of this iteration" in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("checkpoint: ") and last.endswith(
        os.path.basename(latest_checkpoint(str(ckpt)))), out[-3000:]
    meta = read_meta(latest_checkpoint(str(ckpt)))
    # Every save before the interrupt is complete: only a save cut inside its synchronous
    # part may be left as .tmp (ignored), never one whose background write was pending.
    assert len(list(ckpt.glob("*.tmp"))) <= 1
    assert not (ckpt / ".lrattn-writer.lock").exists()
    assert meta["iteration"] >= 1


@pytest.mark.slow
def test_converters_on_a_full_disk_leave_nothing(base, exported, cache, tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        hf = shutil.copytree(exported, tmp_path / "hf")
        procs = {"hf": _start("convert_hf", [str(base / "ckpt"), str(disk / "hf")], cache,
                              tmp_path, pretrain=False),
                 "megatron": _start("convert_megatron", [str(hf), str(disk / "meg")], cache,
                                    tmp_path, pretrain=False)}
        for name, p in procs.items():
            last = _one_line(*finish(p))
            assert "writing the output failed (" in last, (name, last)
        assert os.listdir(disk) == []


@pytest.mark.slow
def test_a_read_only_checkpoint_loads_and_converts_and_refuses_writes(base, cache, tmp_path):
    """The checkpoint on a file system mounted read-only (a shared dataset volume, a
    snapshot): loading, converting and analysing read it and leave it as it was; saving,
    logging or converting into it is one line, before any training."""
    with tmpfs(tmp_path / "ro", "64m") as ro:
        shutil.copytree(base / "ckpt", ro / "ckpt")
        assert subprocess.run(["mount", "-o", "remount,ro", str(ro)]).returncode == 0
        before = _digest(ro)
        ck = str(ro / "ckpt")
        more = ["--train-iters", "3", "--use-checkpoint-opt_param-scheduler"]
        procs = {
            "resume-elsewhere": _start("pretrain", [*more, "--load", ck, "--save",
                                                    str(tmp_path / "out")], cache, tmp_path),
            "save-into": _start("pretrain", [*more, "--load", ck, "--save", ck],
                                cache, tmp_path),
            "log-into": _start("pretrain", [*more, "--load", ck, "--log-json",
                                            str(ro / "m.jsonl")], cache, tmp_path),
            "convert-from": _start("convert_hf", [ck, str(tmp_path / "hf")], cache, tmp_path,
                                   pretrain=False),
            "convert-into": _start("convert_hf", [ck, str(ro / "hf")], cache, tmp_path,
                                   pretrain=False),
            "analyze-from": _start("analyze", [ck, "--out", str(tmp_path / "an"), "--no-plots",
                                               "--num-batches", "1"], cache, tmp_path,
                                   pretrain=False),
        }
        res = {k: finish(p) for k, p in procs.items()}
        for name in ("resume-elsewhere", "convert-from", "analyze-from"):
            rc, _, err = res[name]
            assert rc == 0 and "Traceback" not in err, (name, err[-3000:])
        assert (tmp_path / "out" / "latest").read_text().strip() == "iter_0000003"
        for name in ("save-into", "log-into", "convert-into"):
            last = _one_line(*res[name])
            assert "not writable" in last and "Read-only file system" in last, (name, last)
        assert "--log-json:" in _one_line(*res["log-into"])
        assert _digest(ro) == before
