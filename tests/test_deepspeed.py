"""The exported HF model under DeepSpeed ZeRO-2 and ZeRO-3 (``examples/hf_deepspeed.py``):
the same steps' losses as plain PyTorch within bf16 noise (on the CPU and on the GPU box,
wherever DeepSpeed is installed), and the script's one-line errors on bad input."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_deepspeed.py"


def _run(*argv, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("argv,needle", [
    (["--model", "/nonexistent-folder"], "no config.json"),
    (["--model", ".", "--steps", "0"], "--steps 0"),
    (["--model", ".", "--device", "tpu"], "invalid choice"),
])
def test_bad_input_is_one_line(argv, needle):
    r = _run(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_asked_without_a_gpu_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = _run("--model", str(tmp_path), "--device", "cuda")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--device cuda: no CUDA device here" in r.stderr.strip().splitlines()[-1]


def _export_tiny(out: Path) -> Path:
    """A random tiny LR-AttnRes model with non-zero depth queries, as lrattn-convert-hf
    writes it (config with auto_map, safetensors, the model code)."""
    from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
    from megatron_lrattn.hf.export import AUTO_MAP, CODE_FILES, HERE
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    torch.manual_seed(0)
    config = LRAttnConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                          num_hidden_layers=4, num_attention_heads=4, residual="lr_attnres",
                          num_blocks=4)
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["LRAttnForCausalLM"]
    model = LRAttnForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "query" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    for name in CODE_FILES:
        shutil.copy2(os.path.join(HERE, name), out / name)
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed (pip install deepspeed)")
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
def test_zero2_and_zero3_follow_plain_pytorch(tmp_path, device):
    """ZeRO-2 and ZeRO-3 (bf16 weights, fp32 master copies) take the plain fp32 run's
    steps: an LR-AttnRes export, whose depth queries are fp32 in every other mode."""
    model = _export_tiny(tmp_path / "export")
    losses = {}
    for zero in ("none", "2", "3"):
        out = tmp_path / f"{zero}.json"
        r = _run("--model", str(model), "--zero", zero, "--steps", "12", "--device", device,
                 "--json", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        losses[zero] = json.loads(out.read_text())["losses"]
        print(zero, [round(x, 4) for x in losses[zero]])
    for zero in ("2", "3"):
        assert len(losses[zero]) == 12
        # bf16 weights (DeepSpeed) against fp32 weights under bf16 autocast (plain)
        gaps = [abs(a - b) / abs(b) for a, b in zip(losses[zero], losses["none"])]
        assert max(gaps) < 2e-2, (zero, gaps)
    for zero in ("none", "2", "3"):  # Zipf-distributed tokens: the loss can fall
        assert losses[zero][-1] < losses[zero][0] - 0.1, (zero, losses[zero])
