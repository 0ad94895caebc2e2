"""Bad data ends with one line naming the file and the problem: truncated .bin, an .idx of
another dataset, a garbage .idx, token ids beyond the tokenizer's vocabulary (checked on
the files directly, then once through ``lrattn-pretrain``: exit 2, no traceback)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_lrattn.data.datasets import check_indexed_dataset
from megatron_lrattn.data.errors import DataError


def _write(prefix, docs, dtype=np.uint16):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, n) for n in (40, 7, 63, 20)]
    docs[2][5] = 499
    return _write(tmp_path / "good", docs)


def test_a_good_dataset_passes_and_counts_its_tokens(good):
    assert check_indexed_dataset(good, vocab_size=500) == 130


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(good + ".bin") - 2)
    with pytest.raises(DataError, match=r"good\.bin: 258 bytes but .* describes 260 \(truncated"):
        check_indexed_dataset(good)


def test_idx_of_another_dataset(good, tmp_path):
    other = _write(tmp_path / "other", [[1, 2, 3], [4, 5]])
    shutil.copy(other + ".idx", good + ".idx")
    with pytest.raises(DataError, match=r"longer than its index; or the \.idx belongs to another"):
        check_indexed_dataset(good)


def test_garbage_and_cut_idx(good):
    data = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(data[:-5])
    with pytest.raises(DataError, match=r"good\.idx: corrupt index"):
        check_indexed_dataset(good)
    open(good + ".idx", "wb").write(b"not an index at all, just text" * 3)
    with pytest.raises(DataError, match=r"good\.idx: not a Megatron indexed-dataset index"):
        check_indexed_dataset(good)


def test_token_ids_beyond_the_vocabulary(good):
    with pytest.raises(DataError, match=r"token id 499 >= the tokenizer's vocabulary size 300"):
        check_indexed_dataset(good, vocab_size=300)


def test_large_files_are_checked_in_windows(tmp_path, monkeypatch):
    import megatron_lrattn.data.datasets as ds

    monkeypatch.setattr(ds, "_FULL_SCAN_TOKENS", 100)
    monkeypatch.setattr(ds, "_WINDOW_TOKENS", 10)
    tokens = np.zeros(1000, dtype=np.int64)
    tokens[-1] = 7000  # the last window always ends at the last token
    prefix = _write(tmp_path / "big", [tokens[:500], tokens[500:]], dtype=np.int32)
    with pytest.raises(DataError, match="token id 7000"):
        check_indexed_dataset(prefix, vocab_size=4096)


@pytest.mark.slow
def test_cli_vocabulary_mismatch_is_one_line_exit_2(tmp_path, new_cache):
    from megatron_lrattn.data.default_corpus import ensure_default_data

    default = ensure_default_data(cache_dir=new_cache(tmp_path / "cache"))
    prefix = _write(tmp_path / "wide", [[5000, 1, 2, 3] * 40] * 8)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lrattn.cli.pretrain", "--data-path", prefix,
         "--tokenizer-model", default.tokenizer_dir, "--split", "1,1,1", "--train-iters", "2",
         "--lr-warmup-iters", "1", "--no-progress", "--save", str(tmp_path / "ckpt")],
        cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
        text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lrattn-pretrain: error: ") and "token id 5000 >=" in last, last
    assert not (tmp_path / "ckpt").exists()
