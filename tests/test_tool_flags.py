"""The developer tools' command lines (``tools/``, ``benchmarks/bench_data.py``): bad flags,
missing or broken input files and a cut metrics file end in one ``error:`` line with exit
code 2, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, *args, cwd=ROOT):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


def _refused(proc, needle):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert ": error: " in last and needle in last, proc.stderr


def _train_rows(n=3, loss=3.0):
    return [{"type": "train", "iteration": i, "loss": loss + i / 10, "step_time_s": 0.1,
             "tokens_per_s": 100.0, "consumed_samples": 8 * i} for i in range(1, n + 1)]


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


# --- tools/gpu_box/metrics.py --------------------------------------------------------------

def test_metrics_refuses_a_missing_reference_and_bad_outputs(tmp_path):
    good = _write(tmp_path / "a.jsonl", _train_rows())
    _refused(_run("tools/gpu_box/metrics.py", "compare", tmp_path / "none.jsonl", good),
             "is not a file")
    _refused(_run("tools/gpu_box/metrics.py", "table", good, "--skip", "-1"), ">= 0")
    _refused(_run("tools/gpu_box/metrics.py", "table", good, "--json", tmp_path), "--json")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    _refused(_run("tools/gpu_box/metrics.py", "compare", junk, good), "junk.jsonl")


def test_metrics_reports_broken_files_among_good_ones(tmp_path):
    good = _write(tmp_path / "a.jsonl", _train_rows())
    junk = tmp_path / "junk.jsonl"
    junk.write_text("[1, 2]\n")
    proc = _run("tools/gpu_box/metrics.py", "table", good, junk, tmp_path / "gone.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert "junk.jsonl: unreadable" in proc.stdout and "gone.jsonl: missing" in proc.stdout
    assert "\na " in proc.stdout  # the good file's row
    proc = _run("tools/gpu_box/metrics.py", "compare", good, junk, good)
    assert proc.returncode == 0 and "junk.jsonl: unreadable" in proc.stdout
    assert "bitwise equal" in proc.stdout


# --- tools/study_report.py -----------------------------------------------------------------

def test_study_report_refuses_bad_folders_and_files(tmp_path):
    _refused(_run("tools/study_report.py", tmp_path / "none"), "is not a folder")
    _write(tmp_path / "standard_seed1.jsonl", _train_rows())
    _refused(_run("tools/study_report.py", tmp_path, "--out", tmp_path / "standard_seed1.jsonl"),
             "is not a folder")
    (tmp_path / "attnres_seed1.jsonl").write_text("junk\n" + json.dumps(_train_rows()[0]) + "\n")
    _refused(_run("tools/study_report.py", tmp_path), "line 1 is not JSON")
    _write(tmp_path / "attnres_seed1.jsonl", _train_rows())
    (tmp_path / "attnres_seed1_eval.json").write_text("{}")
    _refused(_run("tools/study_report.py", tmp_path), "not an lrattn-eval result")


def test_study_report_leaves_out_a_cut_last_line(tmp_path):
    """A run stopped while writing its metrics: the complete records count, with a note."""
    _write(tmp_path / "standard_seed1.jsonl",
           _train_rows() + [{"type": "valid", "iteration": 3, "loss": 2.5}], tail='{"type": "tr')
    proc = _run("tools/study_report.py", tmp_path, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "a cut last line left out" in proc.stderr
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    assert summary["arms"]["standard"]["mean"] == pytest.approx(2.5)


# --- benchmarks/bench_data.py, tools/kernel_ptx.py, tools/two_phase_cpu_check.py ------------

@pytest.mark.parametrize("script,args,needle", [
    pytest.param("benchmarks/bench_data.py", ["--data-path", "x", "--tokenizer-model",
                                              "{tmp}/none"], "tokenizer folder not found",
                 marks=pytest.mark.slow),
    ("benchmarks/bench_data.py", ["--data-path", "x", "--tokenizer-model", "x", "--steps", "0"],
     "--steps"),
    pytest.param("benchmarks/bench_data.py", ["--data-path", "x", "--tokenizer-model", "x",
                                              "--step-seconds", "nan"], "--step-seconds",
                 marks=pytest.mark.slow),
    pytest.param("tools/kernel_ptx.py", ["--maxnreg", "-3"], "--maxnreg", marks=pytest.mark.slow),
    pytest.param("tools/kernel_ptx.py", ["--warps", "3"], "--warps", marks=pytest.mark.slow),
    pytest.param("tools/two_phase_cpu_check.py", ["--top", "-1"], "--top",
                 marks=pytest.mark.slow),
    pytest.param("tools/two_phase_cpu_check.py", ["--seq", "0"], "--seq", marks=pytest.mark.slow),
], ids=["data-tokenizer", "data-steps", "data-step-seconds", "ptx-maxnreg", "ptx-warps",
        "two-phase-top", "two-phase-seq"])
def test_tool_refuses_bad_flags_in_one_line(script, args, needle, tmp_path):
    _refused(_run(script, *[a.replace("{tmp}", str(tmp_path)) for a in args]), needle)
