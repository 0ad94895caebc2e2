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


# --- tools/study_pool.py -------------------------------------------------------------------

def _steps_csv(path, rows):
    """rows: (arm, lr, seed, iteration, validation loss)"""
    lines = ["arm,lr,seed,type,iteration,loss,grad_norm,step_time_s"]
    lines += [f"{a},{lr},{s},valid,{i},{v},," for a, lr, s, i, v in rows]
    lines.append("standard,2e-3,1,train,3,9.9,1.0,0.1")  # training rows are not pooled
    path.write_text("\n".join(lines) + "\n")
    return path


def test_study_pool_pools_runs_across_files_with_welch_and_paired_t(tmp_path):
    a = _steps_csv(tmp_path / "a.csv", [
        ("standard", "2e-3", 1, 0, 9.0), ("standard", "2e-3", 1, 4, 3.0),
        ("standard", "2e-3", 2, 4, 3.2), ("standard", "1e-3", 1, 4, 1.0),  # other LR: out
        ("lr_sliced", "2e-3", 1, 4, 2.8), ("lr_sliced", "2e-3", 2, 4, 2.9),
        ("lr_sliced", "2e-3", 3, 2, 2.0)])  # did not reach iteration 4: out
    b = _steps_csv(tmp_path / "b.csv", [("standard", "0.002", 3, 4, 3.1),
                                        ("lr_sliced", "2e-3", 3, 4, 3.0)])
    proc = _run("tools/study_pool.py", a, b, "--pick", "lr_sliced=2e-3", "standard=2e-3",
                "--iteration", "4", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "out" / "pooled.json").read_text())
    assert list(got["arms"]) == ["standard", "lr_sliced"]
    assert got["arms"]["standard"]["n"] == 3
    assert got["arms"]["standard"]["mean"] == pytest.approx(3.1)
    assert got["arms"]["lr_sliced"]["mean"] == pytest.approx(2.9)
    (c,) = got["comparisons"]
    assert (c["a"], c["b"], c["pairs"]) == ("lr_sliced", "standard", 3)
    assert c["diff"] == pytest.approx(-0.2)
    # per seed: -0.2, -0.3, -0.1 -> mean -0.2, sd 0.1, t = -0.2 / (0.1 / sqrt 3)
    assert c["paired_t"] == pytest.approx(-0.2 / (0.1 / 3 ** 0.5))
    assert c["welch_t"] == pytest.approx(-0.2 / (0.01 / 3 + 0.01 / 3) ** 0.5)
    assert "| LR-AttnRes sliced (r=d/4, N=8) - standard residual | -0.2000 |" in proc.stdout


def test_study_pool_does_not_pair_a_repeated_seed(tmp_path):
    rows = [("standard", "2e-3", 1, 4, 3.0), ("attnres", "1e-3", 1, 4, 2.9),
            ("attnres", "1e-3", 2, 4, 2.8)]
    a, b = _steps_csv(tmp_path / "a.csv", rows), _steps_csv(tmp_path / "b.csv", rows[1:])
    assert _run("tools/study_pool.py", a, b, "--pick", "standard=2e-3", "attnres=1e-3",
                "--iteration", "4", "--out", tmp_path).returncode == 0
    (c,) = json.loads((tmp_path / "pooled.json").read_text())["comparisons"]
    assert c["n_a"] == 4 and c["pairs"] == 0 and c["paired_t"] is None


@pytest.mark.parametrize("args,needle", [
    (["--pick", "bogus=1e-3"], "is not arm=LR"),
    (["--pick", "standard"], "is not arm=LR"),
    (["--pick", "standard=fast"], "the LR must be a number > 0"),
    (["--pick", "standard=-1"], "the LR must be a number > 0"),
    (["--pick", "standard=1e-3", "standard=2e-3"], "names an arm twice"),
    (["--pick", "standard=2e-3", "--iteration", "0"], "--iteration 0"),
    (["--pick", "standard=2e-3", "--out", "{good}"], "is not a folder"),
    (["--pick", "standard=5e-3"], "no run of standard at LR 5e-3 reached iteration 916"),
    (["{tmp}/none.csv", "--pick", "standard=2e-3"], "none.csv"),
    (["{tmp}/junk.csv", "--pick", "standard=2e-3"], "not a study steps CSV (no column"),
    (["{tmp}/badnum.csv", "--pick", "standard=2e-3"], "line 2: seed, iteration and loss"),
])
def test_study_pool_refuses_bad_flags_and_files(tmp_path, args, needle):
    good = _steps_csv(tmp_path / "good.csv", [("standard", "2e-3", 1, 916, 3.0)])
    (tmp_path / "junk.csv").write_text("a,b\n1,2\n")
    (tmp_path / "badnum.csv").write_text("arm,lr,seed,type,iteration,loss\n"
                                         "standard,2e-3,one,valid,916,3.0\n")
    args = [a.format(tmp=tmp_path, good=good) for a in args]
    if not args[0].endswith(".csv"):
        args = [good] + args
    _refused(_run("tools/study_pool.py", *args), needle)


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
