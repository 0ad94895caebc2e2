"""Launch scripts: valid bash, strict mode, the model scripts agree with their presets
(r = d/4, N = 8, TP/PP as in the preset, an existing preset file), and the multi-node
script's layout from lrattn-plan (``DRY_RUN=1``: the torchrun command is printed, its
lrattn-pretrain flags are parsed by the real parser)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan import _plan_json, assert_flags_realise

from megatron_lrattn.training.arguments import parse_args
from megatron_lrattn.training.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
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


def _dry_run(tmp_path, config, nodes, node_rank=0, flags=(), **env):
    """``pretrain_multinode.sh`` with ``DRY_RUN=1`` on data, tokenizer and save folders that
    lrattn-pretrain's checks accept; returns the finished process."""
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").touch()
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "save").mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if k not in ("LAYOUT", "PLAN_ARGS", "NPROC_PER_NODE", "MASTER_PORT")}
    base.update(DRY_RUN="1", NNODES=str(nodes), NODE_RANK=str(node_rank), MASTER_ADDR="node0",
                PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(EXAMPLES / "pretrain_multinode.sh"), config,
                           str(tmp_path / "corpus"), str(tmp_path / "tok"),
                           str(tmp_path / "save"), *flags],
                          capture_output=True, text=True, env=base, cwd=REPO)


def _pretrain_argv(stdout):
    """The lrattn-pretrain arguments of the printed torchrun command."""
    command = shlex.split(stdout)
    assert command[0] == "torchrun"
    i = command.index("megatron_lrattn.cli.pretrain")
    assert command[i - 1] == "-m"
    return command, command[i + 1:]


@pytest.mark.parametrize("nodes", [1, 4])
@pytest.mark.parametrize("name", ["1b", "4b"])
def test_multinode_takes_the_planned_layout(tmp_path, name, nodes):
    """LAYOUT=auto (the default): the flags are lrattn-plan's recommendation for the preset
    file on NNODES x 8 GPUs, lrattn-pretrain's parser accepts them and runs that layout;
    node 0 logs the layout and the flags, every other node gets the same command."""
    config = f"examples/presets/{name}.yaml"
    proc = _dry_run(tmp_path, config, nodes)
    assert proc.returncode == 0, proc.stderr
    command, argv = _pretrain_argv(proc.stdout)
    assert command[command.index("--nnodes") + 1] == str(nodes)
    assert command[command.index("--nproc-per-node") + 1] == "8"
    rec = _plan_json(["--config", config, "--nodes", str(nodes), "--gpus-per-node", "8"])[
        "recommended"]
    args = parse_args(argv)
    assert_flags_realise(args, rec, nodes * 8)
    assert args.num_layers == PRESETS[name]["num_layers"] and args.bf16
    assert f"layout auto: {rec['summary']}" in proc.stderr
    assert f"launch: flags {' '.join(rec['flags'])}" in proc.stderr
    other = _dry_run(tmp_path, config, nodes, node_rank=nodes - 1 or 1)
    assert other.returncode == 0 and other.stderr == ""
    assert _pretrain_argv(other.stdout)[1] == argv


def test_multinode_user_flags_win_and_plan_args_reach_the_planner(tmp_path):
    """Flags after SAVE_DIR come last and override the planned ones; PLAN_ARGS reach the
    planner (a model flag there is repeated in the recommended flags)."""
    proc = _dry_run(tmp_path, "examples/presets/1b.yaml", 1, flags=["--micro-batch-size", "1"],
                    PLAN_ARGS="--seq-length 4096 --gpu-memory-gib 80")
    assert proc.returncode == 0, proc.stderr
    args = parse_args(_pretrain_argv(proc.stdout)[1])
    assert args.micro_batch_size == 1 and args.seq_length == 4096


def test_multinode_manual_layout_uses_only_the_given_flags(tmp_path):
    proc = _dry_run(tmp_path, "examples/presets/4b.yaml", 2, LAYOUT="manual",
                    flags=["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size",
                           "1"])
    assert proc.returncode == 0, proc.stderr
    argv = _pretrain_argv(proc.stdout)[1]
    assert "--use-distributed-optimizer" not in argv and "--overlap-grad-reduce" not in argv
    args = parse_args(argv)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (4, 1)
    assert args.context_parallel_size == 1 and args.recompute_granularity is None
    assert "layout manual" in proc.stderr


def test_multinode_stops_with_the_planner_reason(tmp_path):
    """Nothing fits: the planner's one-line reason, exit 1, no command; a bad planner input
    or LAYOUT stops before anything runs too."""
    proc = _dry_run(tmp_path, "examples/presets/4b.yaml", 1, PLAN_ARGS="--gpu-memory-gib 2")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("lrattn-plan: no layout fits in memory: the smallest needs")
    assert proc.stderr.count("\n") == 1
    proc = _dry_run(tmp_path, "examples/presets/nope.yaml", 1)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("lrattn-plan: error: --config: examples/presets/nope.yaml")
    proc = _dry_run(tmp_path, "examples/presets/1b.yaml", 1, LAYOUT="planned")
    assert proc.returncode == 2 and "LAYOUT=planned: use auto or manual" in proc.stderr
