"""The GPU-box driver on CPU: its scripts parse, an unknown suite or a missing TE piece is
refused before anything runs, and its metrics tables read ``lrattn-pretrain --log-json``
files. The suites themselves run on the box (tools/gpu_box/README.md)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOX = ROOT / "tools" / "gpu_box"
SCRIPTS = sorted(BOX.glob("*.sh"))


def _run(*args, cwd=ROOT, out=None):
    env = dict(os.environ, NO_WHEEL="1", OUT=str(out), GIT_SHA="test")
    return subprocess.run(["bash", str(BOX / "run.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_driver_and_te_scripts_are_there():
    assert {p.name for p in SCRIPTS} == {"run.sh", "te_build.sh", "te_fetch.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_use_strict_mode(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "set -" in script.read_text() and "pipefail" in script.read_text()


def test_unknown_suite_is_refused_before_the_header(tmp_path):
    proc = _run("bogus", out=tmp_path)
    assert proc.returncode == 2
    assert "unknown suite 'bogus'" in proc.stderr
    assert not (tmp_path / "log").exists()


def _tree_with_a_refused_te_piece(tmp_path) -> Path:
    """A checkout whose TE piece 00 does not match its manifest (``te carry 00`` exits 1)."""
    work = tmp_path / "tree"
    (work / ".whl" / "te_chunks").mkdir(parents=True)
    (work / ".whl" / "te_chunks" / "00").write_bytes(b"piece")
    digest = hashlib.sha256(b"other").hexdigest()
    (work / ".whl" / "te_chunks" / "SHA256SUMS").write_text(f"{digest}  chunks/00\n")
    return work


def test_te_carry_checks_the_piece_and_writes_the_header(tmp_path):
    """A piece that is not in the manifest is refused; the log starts with the provenance
    header (GPU, versions, git SHA, date, suite)."""
    work = _tree_with_a_refused_te_piece(tmp_path)
    proc = _run("te", "carry", "00", cwd=work, out=tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    log = (tmp_path / "out" / "log").read_text().splitlines()
    assert "torch" in log[1] and "megatron-core" in log[1]
    assert log[2].startswith("git test date ") and "suite te carry 00" in log[2]
    assert "sha256" in log[3] and "manifest" in log[3]


def test_pack_returns_the_log_and_a_whole_archive_with_the_suites_exit_code(tmp_path):
    """``PACK=1``: the suite runs in a scratch folder; ``$OUT/log`` and a whole
    ``$OUT/results.tgz`` come back (no cut ``.part``), and the driver exits with the suite's
    exit code."""
    import tarfile

    work = _tree_with_a_refused_te_piece(tmp_path)
    env = dict(os.environ, NO_WHEEL="1", OUT=str(tmp_path / "out"), GIT_SHA="test", PACK="1",
               PACK_EVERY="1")
    proc = subprocess.run(["bash", str(BOX / "run.sh"), "te", "carry", "00"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the refused piece's exit code
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["log", "results.tgz"]
    assert "suite te carry 00" in (out / "log").read_text()
    with tarfile.open(out / "results.tgz") as tar:
        assert "./log" in tar.getnames()
    line = [x for x in proc.stdout.splitlines() if x.startswith("pack: te exited 1;")]
    assert len(line) == 1 and "snapshots while it ran" in line[0], proc.stdout


@pytest.mark.parametrize("every", ["0", "x", "1.5", "-2", "05"])
def test_pack_every_must_be_whole_seconds(tmp_path, every):
    env = dict(os.environ, NO_WHEEL="1", OUT=str(tmp_path / "out"), GIT_SHA="test", PACK="1",
               PACK_EVERY=every)
    proc = subprocess.run(["bash", str(BOX / "run.sh"), "tests"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"PACK_EVERY={every}: a whole number of seconds > 0"], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_pack_snapshots_while_the_suite_runs(tmp_path):
    """A suite of about 10 s (pytest collecting the whole tree for a name that matches
    nothing) with ``PACK_EVERY=1``: several archives are written while it runs."""
    env = dict(os.environ, NO_WHEEL="1", OUT=str(tmp_path / "out"), GIT_SHA="test", PACK="1",
               PACK_EVERY="1")
    proc = subprocess.run(["bash", str(BOX / "run.sh"), "tests", "-k", "no_such_test_name"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("pack: tests exited")]
    assert len(line) == 1, proc.stdout + proc.stderr
    assert int(line[0].split("(")[-1].split()[0]) >= 3, line[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["log", "results.tgz"]


def _metrics(path: Path, steps, losses, valid=None):
    rows = [{"type": "run"}]
    rows += [{"type": "train", "iteration": i + 1, "loss": loss, "step_time_s": t,
              "tokens_per_s": 1000 / t, "peak_memory_gib": 2.0}
             for i, (t, loss) in enumerate(zip(steps, losses))]
    if valid is not None:
        rows.append({"type": "valid", "iteration": len(steps), "loss": valid})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_metrics_table_and_compare(tmp_path):
    a = _metrics(tmp_path / "a.jsonl", [9.0, 0.1, 0.1, 0.1], [3.0, 2.5, 2.0, 1.5], valid=1.4)
    b = _metrics(tmp_path / "b.jsonl", [9.0, 0.2, 0.2, 0.2], [3.0, 2.5, 2.0, 1.2])
    tool = [sys.executable, str(BOX / "metrics.py")]
    out = subprocess.run([*tool, "table", a, b, "--skip", "1", "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [r["run"] for r in rows] == ["a", "b"]
    assert rows[0]["median_step_ms"] == pytest.approx(100.0)
    assert rows[1]["median_step_ms"] == pytest.approx(200.0)
    assert rows[0]["valid_loss"] == 1.4 and rows[1]["valid_loss"] is None
    assert " 2.000 " in out.splitlines()[2]  # b's step time relative to a's
    out = subprocess.run([*tool, "compare", a, a, b], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].endswith("bitwise equal")
    assert "max |dloss|/loss 2.00e-01" in out[1] and "bitwise" not in out[1]


@pytest.mark.slow
def test_steps_run_the_drivers_own_functions(tmp_path):
    """``step`` runs its command under ``timeout``, which cannot start a shell function:
    the ``tests`` suite's ``pytest_`` steps must reach pytest (here: the one GPU test of
    the selection, skipped on a machine without CUDA, or run where there is one)."""
    proc = _run("tests", "-k", "test_zero2_and_zero3_follow_plain_pytorch", out=tmp_path)
    log = (tmp_path / "log").read_text()
    assert "failed to run command" not in log + proc.stderr, log[-2000:]
    assert "1 skipped" in log or "1 passed" in log or "1 failed" in log, log[-2000:]
