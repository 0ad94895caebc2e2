"""``lrattn-profile``: the tiny preset end to end on CPU (every arm, every field, JSON and
PNG), ratios of ``standard`` equal to 1, one-line errors on bad input, exact kernel-name
matching for the depth-read share."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_lrattn.cli.profile import main
from megatron_lrattn.profiling.arms import ARM_NAMES
from megatron_lrattn.profiling.report import RATIO_FIELDS
from megatron_lrattn.profiling.runner import depth_read_time_s

SMALL = [
    "--preset", "tiny", "--num-layers", "1", "--num-blocks", "2", "--hidden-size", "32",
    "--num-attention-heads", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
    "--micro-batch-size", "2", "--vocab-size", "256", "--projected-rank", "4",
    "--rounds", "2", "--steps-per-round", "1", "--warmup-steps", "0",
]

FIELDS = (
    "arm", "label", "params", "step_times_s", "median_step_time_s", "tokens_per_s_per_gpu",
    "model_flops_per_token", "depth_read_flops_per_token", "flops_per_token", "mfu",
    "peak_memory_bytes", "process_peak_memory_bytes", "depth_read_time_s",
    "profiled_step_time_s", "depth_read_share", "top_ops_profiled_step",
) + tuple(f + "_vs_standard" for f in RATIO_FIELDS)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", GIT_SHA="test")
    cmd = [sys.executable, "-m", "megatron_lrattn.cli.profile", *SMALL,
           "--json", str(out / "p.json"), "--plot", str(out / "p.png")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow
def test_every_arm_and_field_in_json(profiled):
    out, stdout = profiled
    report = json.loads((out / "p.json").read_text())
    assert [a["arm"] for a in report["arms"]] == list(ARM_NAMES)
    for key in ("git_sha", "torch", "megatron_core", "device", "date", "command"):
        assert report["provenance"][key], key
    assert report["settings"]["tokens_per_step"] == 2 * 2 * 16
    for arm in report["arms"]:
        for field in FIELDS:
            assert field in arm, (arm["arm"], field)
        assert len(arm["step_times_s"]) == 2
        assert arm["last_loss"] < arm["first_loss"], arm["arm"]  # the step trains
        assert arm["median_step_time_s"] > 0 and arm["mfu"] > 0
        assert arm["peak_memory_bytes"] is None  # CPU
        assert arm["label"] in stdout
        if arm["arm"] == "standard":
            assert arm["depth_read_share"] == 0.0 and arm["depth_read_flops_per_token"] == 0
        else:
            assert 0.0 < arm["depth_read_share"] < 1.0
            assert arm["depth_read_flops_per_token"] > 0
    std = report["arms"][0]
    for field in ("median_step_time_s", "tokens_per_s_per_gpu", "mfu"):
        assert std[field + "_vs_standard"] == 1.0
    assert std["peak_memory_bytes_vs_standard"] is None
    ranks = {a["arm"]: a["rank"] for a in report["arms"]}
    assert ranks == {"standard": None, "attnres": 32, "lr_attnres": 8, "lr_attnres_projected": 4}


@pytest.mark.slow
def test_plot_written(profiled):
    out, _ = profiled
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed")
    assert (out / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD = {
    "residual-flag": (["--residual", "attnres"], "--arms"),
    "rank-flag": (["--rank=8"], "--projected-rank"),
    "unknown-arm": (["--arms", "standard,foo"], "foo"),
    "repeated-arm": (["--arms", "standard,standard"], "distinct"),
    "projected-rank-above-d": (["--hidden-size", "64", "--projected-rank", "65"], "65"),
    "zero-rounds": (["--rounds", "0"], "--rounds"),
    "negative-peak": (["--peak-tflops", "-1"], "--peak-tflops"),
    "gbs-not-divisible": (["--micro-batch-size", "4", "--global-batch-size", "6"], "6"),
    "blocks-above-2L": (["--num-layers", "2", "--num-blocks", "5"], "--num-blocks 5"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_one_line_error(name, capsys):
    argv, needle = BAD[name]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own type errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lrattn-profile: error: "), last
    assert needle in last, last


def test_cuda_share_counts_exact_gpu_kernel_names_only():
    from torch.autograd import DeviceType

    def ev(name, us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("depth_read_source_tiled_fwd_kernel", 100.0),
              ev("depth_read_source_tiled_bwd_kernel", 300.0), ev("merge_fwd_kernel", 50.0),
              ev("void pytorch_flash::flash_fwd_kernel<...>(...)", 5000.0),
              ev("merge_fwd_kernel", 7000.0, DeviceType.CPU),
              # the two-phase schedule's phase-1 passes
              ev("phase1_logits_kernel", 20.0), ev("phase1_values_kernel", 40.0),
              ev("phase1_dots_kernel", 60.0), ev("phase1_coef_kernel", 1.0),
              ev("phase1_dvalues_kernel", 30.0),
              ev("void at::native::vectorized_elementwise_kernel<4, ...>", 900.0)]
    prof = SimpleNamespace(events=lambda: events)
    pytest.importorskip("triton")
    assert depth_read_time_s(prof, on_cuda=True) == pytest.approx(601e-6)


@pytest.mark.slow
def test_interleaved_pipeline_two_processes(tmp_path):
    """PP=2 with 2 virtual stages per rank under torchrun (gloo): every arm runs through the
    interleaved schedule and the report records the layout."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", GIT_SHA="test")
    small = [a for a in SMALL]
    small[small.index("--num-layers") + 1] = "4"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron_lrattn.cli.profile", *small, "--arms", "standard,lr_attnres",
           "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
           "--no-kernel-profile", "--json", str(tmp_path / "p.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "p.json").read_text())
    s = report["settings"]
    assert (s["pp"], s["virtual_stages"], s["num_microbatches"]) == (2, 2, 8)
    assert [a["arm"] for a in report["arms"]] == ["standard", "lr_attnres"]
    assert all(a["median_step_time_s"] > 0 for a in report["arms"])
