"""``--downstream-eval-interval``: lrattn-eval's local tasks scored inside the training loop."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from helpers import cli_env
from megatron_lrattn.training.arg_types import ArgumentError
from megatron_lrattn.training.downstream import (
    add_downstream_args, check_downstream_args, flatten,
)


def _args(*argv, tp=1, pp=1, mock=False, tokenizer=None):
    p = argparse.ArgumentParser()
    add_downstream_args(p)
    a = p.parse_args(list(argv))
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = tp, pp
    a.mock_data, a.tokenizer_model = mock, tokenizer
    return a


def test_off_by_default():
    check_downstream_args(_args(tp=2, pp=2, mock=True))


@pytest.mark.parametrize("argv,kw,needle", [
    (["--downstream-eval-interval", "0"], {}, "--downstream-eval-interval 0"),
    (["--downstream-eval-interval", "5", "--downstream-eval-limit", "0"], {},
     "--downstream-eval-limit 0"),
    (["--downstream-eval-interval", "5", "--downstream-eval-tasks", "cloze"], {},
     "heldout,last_word,next_line"),
    (["--downstream-eval-interval", "5", "--downstream-eval-tasks", ","], {}, "subset"),
    (["--downstream-eval-interval", "5"], {"tp": 2}, "--tensor-model-parallel-size,"),
    (["--downstream-eval-interval", "5"], {"pp": 2}, "(got 1, 2 and 1)"),
    (["--downstream-eval-interval", "5"], {"mock": True}, "--tokenizer-model"),
])
def test_refusals_are_one_line(argv, kw, needle):
    with pytest.raises(ArgumentError) as e:
        check_downstream_args(_args(*argv, **kw))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_flatten_keeps_numbers():
    assert flatten({"last_word": {"acc": 0.5, "n": 10, "ok": True, "name": "x"},
                    "seconds": 3.0}) == {"last_word_acc": 0.5, "last_word_n": 10}


@pytest.mark.slow
def test_scores_during_training_and_after_the_last_iteration(tmp_path, new_cache):
    metrics, cache = tmp_path / "m.jsonl", new_cache(tmp_path / "cache")
    r = subprocess.run(
        [sys.executable, "-m", "megatron_lrattn.cli.pretrain", "--preset", "tiny",
         "--seq-length", "64", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
         "--ffn-hidden-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "5", "--eval-interval", "5", "--eval-iters", "1",
         "--lr-warmup-iters", "1", "--no-progress", "--downstream-eval-interval", "2",
         "--downstream-eval-limit", "8", "--log-json", str(metrics),
         "--cache-dir", str(cache)],
        capture_output=True, text=True, env=cli_env(cache), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    down = [x for x in rows if x.get("type") == "downstream"]
    assert [x["iteration"] for x in down] == [2, 4, 5]
    for x in down:
        assert 0.0 <= x["last_word_acc"] <= 1.0 and 0.0 <= x["next_line_acc"] <= 1.0
        assert x["next_line_items"] == 8 and x["last_word_items"] <= 8
    assert "downstream at iteration 5:" in r.stderr
