"""Checkpoints move between parallel layouts: a TP2 x PP2 checkpoint loaded at TP1 x PP1
evaluates to the same validation loss, and a TP1 x PP1 checkpoint loaded at TP2 x PP2 too.

The validation loss is computed right after loading (before any training step), on the
same held-out batches the saving run evaluated last.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, torchrun

# every test runs lrattn-pretrain in subprocesses (torchrun for TP2 x PP2)
pytestmark = pytest.mark.slow

SMALL = [
    "--residual", "lr_attnres", "--key", "projected", "--rank", "8", "--num-blocks", "3",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "96", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--eval-interval", "2", "--eval-iters", "2",
    "--lr-warmup-iters", "1", "--train-iters", "2", "--no-progress",
]


def _run(args, tp, pp, cache, cwd):
    launcher = [sys.executable, "-m", "megatron_lrattn.cli.pretrain"]
    if tp * pp > 1:
        launcher = torchrun(tp * pp) + ["-m", "megatron_lrattn.cli.pretrain"]
    proc = subprocess.run(
        launcher + SMALL + ["--tensor-model-parallel-size", str(tp),
                            "--pipeline-model-parallel-size", str(pp), "--cache-dir", str(cache),
                            *args],
        cwd=cwd, env=cli_env(cache, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _valid(path: Path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "valid"]


@pytest.mark.parametrize("save_layout, load_layout", [((2, 2), (1, 1)), ((1, 1), (2, 2))])
def test_checkpoint_loads_in_another_layout(tmp_path, new_cache, save_layout, load_layout):
    cache = new_cache(tmp_path / "cache")
    ckpt = tmp_path / "ckpt"
    _run(["--save", str(ckpt), "--log-json", str(tmp_path / "save.jsonl")], *save_layout,
         cache, tmp_path)
    _run(["--load", str(ckpt), "--log-json", str(tmp_path / "load.jsonl")], *load_layout,
         cache, tmp_path)
    saved = _valid(tmp_path / "save.jsonl")[-1]
    loaded = _valid(tmp_path / "load.jsonl")[0]
    assert saved["iteration"] == loaded["iteration"] == 2
    # Different layouts reduce in different orders: equal up to fp32 rounding.
    assert loaded["loss"] == pytest.approx(saved["loss"], rel=1e-5, abs=0)
