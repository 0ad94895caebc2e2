"""``lrattn-pretrain`` end to end as a subprocess: one-line errors on bad input, a short real
run with metrics and a checkpoint, resume, and refusal of a checkpoint with other settings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, finish

# every test runs lrattn-pretrain in a subprocess
pytestmark = pytest.mark.slow

SMALL = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
    "--ffn-hidden-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--eval-interval", "3", "--eval-iters", "2", "--lr-warmup-iters", "1", "--no-progress",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("lrattn_cache"))


def _start(args, cache_dir, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_lrattn.cli.pretrain", *args, "--cache-dir",
         str(cache_dir)],
        cwd=cwd, env=cli_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _run(args, cache_dir, cwd):
    return finish(_start(args, cache_dir, cwd))


def _assert_one_line_error(rc, out, err, *needles):
    assert rc == 2, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("lrattn-pretrain: error: "), last
    for needle in needles:
        assert needle in last, last


BAD_INPUTS = {
    "missing-data-path": (["--data-path", "{tmp}/nowhere/corpus"],
                          ["--data-path", "nowhere/corpus"]),
    "unknown-preset": (["--preset", "no-such-preset"], ["--preset", "no-such-preset"]),
    "rank-above-d": (["--hidden-size", "64", "--rank", "65"], ["--rank 65", "64"]),
    "blocks-above-2L": (["--num-layers", "2", "--num-blocks", "5"], ["--num-blocks 5", "(4)"]),
    "heads-do-not-divide-d": (["--hidden-size", "66", "--num-attention-heads", "4"],
                              ["--hidden-size 66", "--num-attention-heads 4"]),
}


def test_bad_inputs_end_with_one_line_error_and_write_nothing(tmp_path, cache_dir):
    procs = {}
    for name, (args, _) in BAD_INPUTS.items():
        out_dir = tmp_path / name / "out"
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        full = ["--train-iters", "2", "--lr-warmup-iters", "1", *args, "--save",
                str(out_dir / "ckpt"), "--log-json", str(out_dir / "m.jsonl")]
        (tmp_path / name).mkdir()
        procs[name] = _start(full, cache_dir, tmp_path / name)
    for name, proc in procs.items():
        rc, out, err = finish(proc)
        _assert_one_line_error(rc, out, err, *BAD_INPUTS[name][1])
        assert not (tmp_path / name / "out").exists(), name
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [], name


def _records(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("pretrain")
    ckpt, log = work / "ckpt", work / "metrics.jsonl"
    rc, out, err = _run([*SMALL, "--train-iters", "6", "--save", str(ckpt), "--log-json",
                         str(log)], cache_dir, work)
    assert rc == 0, err[-4000:]
    assert "Traceback" not in out + err
    return work, ckpt, log, out


def test_short_run_writes_metrics_and_checkpoint(trained):
    work, ckpt, log, out = trained
    assert "validation loss at start (iteration 0): " in out
    assert "final validation loss (iteration 6): " in out
    recs = _records(log)
    runs = [r for r in recs if r["type"] == "run"]
    train = [r for r in recs if r["type"] == "train"]
    valid = [r for r in recs if r["type"] == "valid"]
    assert len(runs) == 1 and recs[0]["type"] == "run"
    assert runs[0]["residual"] == "lr_attnres" and runs[0]["num_blocks"] == 4
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        for field in ("loss", "grad_norm", "lr", "tokens_per_s"):
            assert isinstance(r[field], float) and r[field] == r[field], (field, r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        # MFU at the default 989 TFLOP/s peak; one process, so TFLOP/s per GPU is the step's
        assert r["tflops_per_gpu"] > 0
        assert abs(r["mfu"] - r["tflops_per_gpu"] / 989.0) < 1e-12
    # the FLOPs per token behind TFLOP/s are one number for the whole run
    per_token = [r["tflops_per_gpu"] * 1e12 / r["tokens_per_s"] for r in train]
    assert max(per_token) - min(per_token) < 1e-6 * max(per_token)
    assert [r["iteration"] for r in valid] == [0, 3, 6]
    assert (ckpt / "latest").read_text().strip() == "iter_0000006"
    meta = json.loads((ckpt / "iter_0000006" / "lrattn.json").read_text())
    assert meta["iteration"] == 6 and meta["consumed_samples"] == 24
    assert meta["model_settings"]["residual"] == "lr_attnres"
    assert not list(ckpt.glob("*.tmp"))


@pytest.fixture(scope="module")
def resumed(trained, cache_dir):
    work, ckpt, log, _ = trained
    before = _records(log)
    # A longer run than the saved schedule: this run's schedule from the saved step on.
    rc, out, err = _run([*SMALL, "--train-iters", "8", "--load", str(ckpt), "--save", str(ckpt),
                         "--override-opt_param-scheduler", "--log-json", str(log)], cache_dir,
                        work)
    assert rc == 0, err[-4000:]
    assert "Traceback" not in out + err
    return before, _records(log)[len(before):]


def test_resume_continues_from_the_checkpoint(trained, resumed):
    _, ckpt, _, _ = trained
    before, after = resumed
    assert after[0]["type"] == "run"
    train = [r for r in after if r["type"] == "train"]
    assert [r["iteration"] for r in train] == [7, 8]
    valid = [r for r in after if r["type"] == "valid"]
    assert valid[0]["iteration"] == 6
    # The restored model evaluates exactly as the saved one did.
    saved_valid6 = [r for r in before if r["type"] == "valid" and r["iteration"] == 6][0]
    assert valid[0]["loss"] == pytest.approx(saved_valid6["loss"], rel=1e-6)
    assert (ckpt / "latest").read_text().strip() == "iter_0000008"


def test_load_with_other_depth_settings_fails_with_one_line_error(trained, resumed, cache_dir):
    work, ckpt, _, _ = trained
    cases = {"residual": ["--residual", "attnres"], "num_blocks": ["--num-blocks", "2"]}
    procs = {}
    for field, extra in cases.items():
        log = work / f"refused_{field}.jsonl"
        procs[field] = (log, _start([*SMALL, *extra, "--train-iters", "10", "--load", str(ckpt),
                                     "--log-json", str(log)], cache_dir, work))
    for field, (log, proc) in procs.items():
        rc, out, err = finish(proc)
        _assert_one_line_error(rc, out, err, field, "other model settings")
        assert not log.exists()
    assert (ckpt / "latest").read_text().strip() == "iter_0000008"


def test_bf16_run_saves_and_resumes(tmp_path, cache_dir):
    # bf16 parameters with fp32 main copies in megatron's optimizer, depth queries included:
    # the optimizer's sharded state must cover every parameter, or saving fails.
    ckpt, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    base = [*SMALL, "--bf16", "--save", str(ckpt), "--log-json", str(log)]
    rc, out, err = _run([*base, "--train-iters", "3"], cache_dir, tmp_path)
    assert rc == 0, err[-4000:]
    rc, out, err = _run([*base, "--train-iters", "4", "--load", str(ckpt),
                         "--override-opt-param-scheduler"], cache_dir, tmp_path)
    assert rc == 0, err[-4000:]
    assert "Traceback" not in out + err
    train = [r for r in _records(log) if r["type"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"


def test_help_is_fast_imports_no_megatron_and_shows_every_default(tmp_path):
    import time

    code = ("import sys, time; t = time.perf_counter(); sys.argv = ['lrattn-pretrain', "
            "'--help']\nfrom megatron_lrattn.cli.pretrain import main\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint('SECONDS', time.perf_counter() - t)\n"
            "print('MODULES', any(m.startswith(('megatron.core', 'torch')) for m in sys.modules))")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert "MODULES False" in proc.stdout
    inside = float(proc.stdout.split("SECONDS")[1].split()[0])
    assert inside < 1.0 and wall < 5.0, (inside, wall)

    from megatron_lrattn.training.arguments import build_parser

    for preset in (None, "1b"):
        for action in build_parser(preset)._actions:
            if action.dest == "help":
                continue
            assert action.help and "default" in action.help, action.option_strings
    helps = {a.dest: a.help for a in build_parser("1b")._actions}
    assert "(default: 16, from --preset 1b)" in helps["num_layers"]
    helps = {a.dest: a.help for a in build_parser()._actions}
    assert "tiny 4" in helps["num_layers"] or "from --preset tiny" in helps["num_layers"]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["pretrain", "preprocess", "convert_hf", "convert_megatron",
                                    "analyze", "eval", "flops", "plan", "profile"])
def test_every_cli_help_imports_neither_torch_nor_megatron(module):
    code = ("import contextlib, io, runpy, sys\n"
            f"sys.argv = ['lrattn', '--help']\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n"
            f"        runpy.run_module('megatron_lrattn.cli.{module}', run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        code = e.code\n"
            "heavy = sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules)\n"
            "print('RESULT', code, 'usage:' in out.getvalue(), heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("RESULT", 1)[-1].strip() == "0 True []", (proc.stdout, proc.stderr)


def test_parser_choices_equal_the_config_module():
    from megatron_lrattn.model import config
    from megatron_lrattn.training import arguments

    for name in ("RESIDUAL_MODES", "KEY_TYPES", "DEPTH_BACKENDS", "DEPTH_SCHEDULES"):
        assert getattr(arguments, name) == getattr(config, name), name


def test_pretrain_runs_where_triton_is_not_installed(tmp_path):
    """torch's CPU wheel brings no Triton, and the README's main job installs only the
    package: the fused kernels' modules load where they are used, so a CPU run trains
    without it (the optimizer step falls back to megatron's, saying why)."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"   # every import of triton fails, as when absent
        "from megatron_lrattn.cli.pretrain import main\n"
        "sys.argv = ['lrattn-pretrain', '--preset', 'tiny', '--mock-data', '--train-iters', '2',"
        " '--lr-warmup-iters', '1', '--eval-iters', '1', '--no-progress', '--log-interval', '1']\n"
        "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=cli_env(tmp_path / "cache"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final validation loss (iteration 2)" in proc.stdout + proc.stderr
