"""The depth-read benchmark's harness on CPU (``--smoke`` under TRITON_INTERPRET=1): every
backend is checked against the reference before it is timed, the CSV gets one row per
backend and pass with the correctness verdict, the summary prints, and candidates are timed
in interleaved rounds. The GPU numbers themselves come from the box (docs/kernels.md); this
keeps the harness from breaking between those runs."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_depth_read.py"
GPU_SCRIPTS = sorted((ROOT / "tools" / "gpu_box").glob("kernels*.sh"))


@pytest.mark.slow
def test_smoke_run_writes_checked_rows(tmp_path):
    out = tmp_path / "rows.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--tokens", "3", "--widths", "512",
         "--sources", "2", "--no-compile", "--rounds", "2", "--csv", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    got = {(r["keys"], r["r"], r["backend"], r["pass"]) for r in rows}
    for keys, r in (("sliced", "128"), ("sliced", "512"), ("projected", "128")):
        for backend in ("triton", "triton_recompute", "torch_ref"):
            for p in ("fwd", "fwdbwd"):
                assert (keys, r, backend, p) in got, (keys, r, backend, p)
    assert all(r["check"].startswith("ok") for r in rows), [r["check"] for r in rows]
    # no GPU: the busy-time columns say so instead of inventing a number
    assert all(r["gpu_ms"] == "nan" for r in rows)
    assert "% of copy bandwidth, wall time per call" in proc.stdout


@pytest.mark.slow
def test_keys_filter_selects_rows(tmp_path):
    """--keys runs only the named key kinds (here AttnRes, r = d) and rejects others."""
    out = tmp_path / "rows.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(BENCH), "--smoke", "--tokens", "2", "--widths", "512",
           "--sources", "2", "--no-compile", "--rounds", "1", "--csv", str(out)]
    proc = subprocess.run(cmd + ["--keys", "attnres"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert rows and {(r["keys"], r["r"]) for r in rows} == {("sliced", "512")}
    bad = subprocess.run(cmd + ["--keys", "full"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "invalid choice: 'full'" in bad.stderr


def test_rounds_interleave_candidates(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_depth_read as bdr
    finally:
        sys.path.pop(0)
    order = []
    monkeypatch.setattr(bdr, "DEVICE", "cuda")
    monkeypatch.setattr(bdr, "ROUNDS", 3)
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 9.0])}

    def fake_bench(fn, rep):
        name = fn()
        order.append(name)
        return next(times[name])
    monkeypatch.setattr(bdr, "bench", fake_bench)
    ms = bdr.bench_rounds({"a": lambda: "a", "b": lambda: "b"}, rep=10)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert ms == {"a": 2.0, "b": 5.0}  # median of each candidate's rounds


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_kernel_box_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.slow
def test_block_smoke_rows_are_checked(tmp_path):
    """``--block --block-updates`` on CPU: per-site and two-phase rows of one depth block,
    then the block whose partial sums are formed from sub-layer outputs (adds then merges,
    or merges that form them; then with each read's RMSNorm, the last arm's merges applying
    it themselves), each checked against the per-site torch reference."""
    out = tmp_path / "block.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--block", "--tokens", "3", "--block-width",
         "64", "--block-sources", "2", "--block-sites", "3", "--block-updates", "--csv",
         str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    got = {(r["keys"], r["backend"]) for r in rows}
    for keys in ("sliced", "projected"):
        for arm in ("per_site", "two_phase"):
            assert (keys, f"block_K3_{arm}") in got, (keys, arm)
    for keys in ("sliced", "attnres"):
        for arm in ("per_site_adds", "two_phase_adds", "two_phase_fused_update",
                    "per_site_adds_norm", "two_phase_adds_norm", "two_phase_fused_update_norm",
                    "two_phase_fused_update_fused_norm"):
            assert (keys, f"block_K3_{arm}") in got, (keys, arm)
    assert all(r["check"].startswith("ok") for r in rows), [r["check"] for r in rows]
