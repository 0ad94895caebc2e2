"""Launch scripts: valid bash, strict mode, and the model scripts agree with their presets
(r = d/4, N = 8, TP/PP as in the preset, an existing preset file)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_lrattn.training.presets import PRESETS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted([*EXAMPLES.glob("*.sh"), *EXAMPLES.glob("*.sbatch")])


def test_all_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {
        "pretrain_tiny.sh", "pretrain_0.5b.sh", "pretrain_1b.sh", "pretrain_4b.sh",
        "pretrain_multinode.sh", "pretrain_slurm.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_use_strict_mode(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("name", ["0.5b", "1b", "4b"])
def test_model_scripts_match_presets(name):
    text = (EXAMPLES / f"pretrain_{name}.sh").read_text()
    preset = PRESETS[name]
    assert f'--config "$HERE/presets/{name}.yaml"' in text
    assert re.search(rf"--rank {preset['hidden_size'] // 4}\b", text)
    assert "--num-blocks 8" in text
    assert f"--tensor-model-parallel-size {preset['tensor_model_parallel_size']}" in text
    assert f"--pipeline-model-parallel-size {preset['pipeline_model_parallel_size']}" in text


def test_scripts_refuse_missing_arguments():
    for script in ("pretrain_1b.sh", "pretrain_multinode.sh"):
        proc = subprocess.run(["bash", str(EXAMPLES / script)], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith("usage:"), proc.stderr
