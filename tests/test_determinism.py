"""``--deterministic``: what it switches, and Transformer Engine's own switch."""

import os

import pytest
import torch

from megatron_lrattn.training import determinism
from megatron_lrattn.training.arguments import ArgumentError, parse_args


@pytest.fixture
def restore_torch():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
              torch.backends.cudnn.allow_tf32)
    yield
    torch.use_deterministic_algorithms(before[0])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = before[1:]


def test_sets_torch_cublas_and_te_switches(monkeypatch, restore_torch):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    determinism.enable_deterministic()
    # megatron-core refuses deterministic mode with TE's attention unless this is 0
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cuda.matmul.allow_tf32


def test_a_te_switch_that_allows_nondeterminism_is_refused(monkeypatch, restore_torch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    with pytest.raises(ArgumentError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO=1"):
        parse_args(["--preset", "tiny", "--deterministic"])
    with pytest.raises(ArgumentError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO=1"):
        determinism.enable_deterministic()
    assert parse_args(["--preset", "tiny"]).deterministic is False  # only with the flag
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert parse_args(["--preset", "tiny", "--deterministic"]).deterministic


@pytest.mark.slow  # a CLI run in a subprocess; the refusal itself is checked in-process above
def test_lrattn_profile_reports_the_te_switch_in_one_line():
    import subprocess
    import sys

    env = dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="1")
    proc = subprocess.run([sys.executable, "-m", "megatron_lrattn.cli.profile", "--preset",
                           "tiny", "--deterministic", "--steps", "1"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1" in proc.stderr.rstrip().splitlines()[-1]
