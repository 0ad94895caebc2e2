"""Starting from weights and changing the schedule on resume (Megatron-LM's flags):
argument resolution (fast), and end to end on CPU with subprocesses (slow): a checkpoint
written by ``lrattn-convert-megatron`` trains with ``--finetune``, a plain ``--load`` of it
ends in one line, ``--pretrained-checkpoint`` starts once and then resumes, and a resume with
a larger ``--train-iters`` uses the new schedule with ``--override-opt_param-scheduler``."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from helpers import cli_env, finish

SMALL = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
    "--ffn-hidden-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--eval-interval", "3", "--eval-iters", "2", "--lr-warmup-iters", "1", "--no-progress",
]


def _parse(*argv):
    from megatron_lrattn.training.arguments import parse_args

    return parse_args(list(argv))


def test_sample_based_schedule_resolves_to_iterations():
    a = _parse("--train-samples", "1600", "--lr-decay-samples", "1200",
               "--lr-warmup-samples", "100")
    assert (a.train_iters, a.lr_decay_iters, a.lr_warmup_iters) == (100, 75, 7)
    a = _parse("--train-iters", "100", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50")
    assert (a.lr_decay_iters, a.lr_warmup_iters) == (50, 5)
    a = _parse("--train-iters", "40")  # the decay spans the run by default
    assert a.lr_decay_iters == 40


@pytest.mark.parametrize("argv, needle", [
    (["--train-samples", "1600", "--train-iters", "10"], "not both"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "one warm-up"),
    (["--lr-warmup-fraction", "1.5"], "[0, 1)"),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"], "choose one"),
    (["--pretrained-checkpoint", "/nonexistent/x"], "--pretrained-checkpoint"),
])
def test_schedule_and_start_flags_refuse_bad_combinations(argv, needle):
    from megatron_lrattn.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _parse(*argv)
    assert needle in str(e.value)


def test_start_point_follows_megatron(tmp_path):
    from megatron_lrattn.training.resume import start_point

    held = tmp_path / "held"
    held.mkdir()
    (held / "latest").write_text("iter_0000004\n")
    empty = tmp_path / "empty"

    def sp(**kw):
        base = dict(load=None, finetune=False, no_load_optim=False, pretrained_checkpoint=None,
                    seed=1)
        return start_point(Namespace(**{**base, **kw}))

    assert sp().path is None
    p = sp(load=str(held))
    assert (p.path, p.weights_only, p.keep_progress) == (str(held), False, True)
    p = sp(load=str(held), finetune=True)
    assert (p.weights_only, p.keep_progress) == (True, False)
    p = sp(load=str(held), no_load_optim=True)
    assert (p.weights_only, p.keep_progress) == (True, True)
    # --pretrained-checkpoint while --load holds nothing; --load once it does
    p = sp(load=str(empty), pretrained_checkpoint="W")
    assert (p.path, p.weights_only, p.keep_progress) == ("W", True, False)
    assert sp(load=str(held), pretrained_checkpoint="W").path == str(held)


def test_schedule_differences_name_the_flags():
    from megatron_lrattn.training.schedule import schedule_differences

    class Sched:
        def state_dict(self):
            return {"max_lr": 3e-3, "min_lr": 3e-4, "lr_warmup_steps": 1, "lr_decay_steps": 8,
                    "lr_decay_style": "cosine", "start_wd": 0.1, "wd_incr_steps": 8}

    saved = dict(Sched().state_dict(), lr_decay_steps=4, max_lr=1e-3)
    diffs = schedule_differences(saved, Sched())
    assert any(d.startswith("--lr:") for d in diffs)
    assert any("--lr-decay-iters" in d and "checkpoint 4, run 8" in d for d in diffs)


def test_final_lines_never_repeat_an_old_loss_as_final():
    from megatron_lrattn.cli.pretrain import final_lines
    from megatron_lrattn.training.loop import TrainResult

    done = TrainResult(5.0, 4.0, 8, "ck/iter_0000008", first_valid_iteration=0,
                       final_valid_iteration=8)
    assert final_lines(done)[:2] == ["validation loss at start (iteration 0): 5.0000",
                                     "final validation loss (iteration 8): 4.0000"]
    stopped = TrainResult(5.0, 4.5, 5, "ck/iter_0000005", first_valid_iteration=0,
                          final_valid_iteration=3, stop_reason="exit signal")
    line = final_lines(stopped)[1]
    assert line.startswith("final validation loss: none (stopped at iteration 5 (exit signal)")
    assert "iteration 3" in line


def _run(args, cache_dir, cwd, module="megatron_lrattn.cli.pretrain"):
    extra = ["--cache-dir", str(cache_dir)] if module.endswith("pretrain") else []
    proc = subprocess.Popen([sys.executable, "-m", module, *args, *extra], cwd=cwd,
                            env=cli_env(cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return finish(proc, timeout=600)


def _records(path: Path, kind: str):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


def _cosine(step: int, warmup: int, decay: int, lr=3e-3, min_lr=3e-4) -> float:
    if step <= warmup:
        return lr * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * ratio))


@pytest.fixture(scope="module")
def cache(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("lrattn_cache"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """A folder with a 4-iteration run: checkpoint ``A``, metrics ``a.jsonl`` (relative
    paths, so a copy of the folder works alike); tests work on their own copies."""
    work = tmp_path_factory.mktemp("trained")
    rc, out, err = _run([*SMALL, "--train-iters", "4", "--save", "A", "--log-json", "a.jsonl"],
                        cache, work)
    assert rc == 0, err[-3000:]
    return work


def _copy(trained: Path, work: Path) -> Path:
    shutil.copytree(trained, work, dirs_exist_ok=True)
    return work


@pytest.mark.slow
def test_weights_only_checkpoint_trains_with_finetune(tmp_path_factory, cache, trained):
    work = _copy(trained, tmp_path_factory.mktemp("finetune"))
    source_final = _records(work / "a.jsonl", "valid")[-1]["loss"]
    for module, argv in (("megatron_lrattn.cli.convert_hf", ["A", "hf"]),
                         ("megatron_lrattn.cli.convert_megatron", ["hf", "W"])):
        rc, out, err = _run(argv, cache, work, module)
        assert rc == 0, err[-3000:]

    # A plain --load of weights only: one line saying what to use instead.
    rc, out, err = _run([*SMALL, "--train-iters", "3", "--load", "W"], cache, work)
    assert rc == 2 and "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("lrattn-pretrain: error: ") and "--finetune" in last, last

    rc, out, err = _run([*SMALL, "--train-iters", "3", "--load", "W", "--finetune", "--save",
                         "F", "--log-json", "f.jsonl"], cache, work)
    assert rc == 0, err[-3000:]
    valid = _records(work / "f.jsonl", "valid")
    train = _records(work / "f.jsonl", "train")
    # iteration 0 with the source's weights: its last validation loss (same data), and a
    # fresh schedule (warm-up from step 1) over 3 iterations
    assert valid[0]["iteration"] == 0
    assert valid[0]["loss"] == pytest.approx(source_final, rel=1e-5)
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert [r["lr"] for r in train] == pytest.approx([_cosine(i, 1, 3) for i in (1, 2, 3)])
    assert "final validation loss (iteration 3):" in out
    assert (work / "F" / "latest").read_text().strip() == "iter_0000003"

    # --pretrained-checkpoint: the first run starts from W's weights, the same command again
    # resumes from --load (= --save).
    cont = [*SMALL, "--pretrained-checkpoint", "W", "--load", "P", "--save", "P",
            "--log-json", "p.jsonl"]
    cont += ["--train-iters", "3", "--exit-interval", "2"]
    rc, out, err = _run(cont, cache, work)
    assert rc == 0, err[-3000:]
    assert _records(work / "p.jsonl", "valid")[0]["loss"] == pytest.approx(source_final,
                                                                             rel=1e-5)
    assert "final validation loss: none (stopped at iteration 2 (--exit-interval 2)" in out
    rc, out, err = _run(cont, cache, work)
    assert rc == 0, err[-3000:]
    assert _records(work / "p.jsonl", "run")[-1]["resumed_from"] == 2
    assert [r["iteration"] for r in _records(work / "p.jsonl", "train")] == [1, 2, 3]


@pytest.mark.slow
def test_resume_with_more_iterations_and_override_uses_the_new_schedule(tmp_path_factory, cache,
                                                                        trained):
    work = _copy(trained, tmp_path_factory.mktemp("override"))
    base = [*SMALL, "--save", "A", "--log-json", "a.jsonl"]
    # Megatron's default: a schedule that differs from the checkpoint's is refused.
    rc, out, err = _run([*base, "--train-iters", "8", "--load", "A"], cache, work)
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "--override-opt_param-scheduler" in last and "checkpoint 4, run 8" in last, last
    rc, out, err = _run([*base, "--train-iters", "8", "--load", "A",
                         "--override-opt_param-scheduler"], cache, work)
    assert rc == 0, err[-3000:]
    train = _records(work / "a.jsonl", "train")
    assert [r["iteration"] for r in train] == list(range(1, 9))
    lrs = [r["lr"] for r in train]
    assert lrs[:4] == pytest.approx([_cosine(i, 1, 4) for i in range(1, 5)])
    # from the saved step 4 on: cosine over 8 iterations, not --min-lr
    assert lrs[4:] == pytest.approx([_cosine(i, 1, 8) for i in range(5, 9)])
    assert lrs[4] > 4 * 3e-4


@pytest.mark.slow
def test_no_load_optim_keeps_weights_and_progress_with_a_fresh_optimizer(tmp_path_factory,
                                                                         cache):
    """``--no-load-optim``: iteration and data position continue and the first resumed loss
    (the forward on the loaded weights) equals a full resume's; the Adam state and the LR
    schedule start afresh (Megatron saves the schedule with the optimizer), so the next
    step differs from the full resume's."""
    work = tmp_path_factory.mktemp("no_load_optim")
    rc, out, err = _run([*SMALL, "--train-iters", "4", "--save", "A", "--save-interval", "2",
                         "--exit-interval", "2"], cache, work)
    assert rc == 0, err[-3000:]
    runs = {}
    for name, extra in (("full", []), ("fresh", ["--no-load-optim"])):
        rc, out, err = _run([*SMALL, "--train-iters", "4", "--load", "A", *extra,
                             "--override-opt_param-scheduler", "--log-json",
                             f"{name}.jsonl"], cache, work)
        assert rc == 0, err[-3000:]
        runs[name] = _records(work / f"{name}.jsonl", "train")
    full, fresh = runs["full"], runs["fresh"]
    assert [r["iteration"] for r in fresh] == [r["iteration"] for r in full] == [3, 4]
    assert fresh[0]["loss"] == full[0]["loss"]
    assert fresh[1]["loss"] != full[1]["loss"]
    # the restarted schedule warms up again from its first step
    assert fresh[0]["lr"] == pytest.approx(_cosine(1, 1, 4))
    assert full[0]["lr"] == pytest.approx(_cosine(3, 1, 4))


@pytest.mark.slow
def test_sample_based_schedule_trains_the_resolved_iterations(tmp_path_factory, cache):
    """``--train-samples 16 --lr-warmup-samples 4 --lr-decay-samples 12`` at global batch 4
    trains 4 iterations with 1 warm-up iteration and a cosine decay over 3."""
    work = tmp_path_factory.mktemp("samples")
    argv = SMALL[:SMALL.index("--lr-warmup-iters")] + ["--no-progress"]
    rc, out, err = _run([*argv, "--train-samples", "16", "--lr-warmup-samples", "4",
                         "--lr-decay-samples", "12", "--log-json", "s.jsonl"], cache, work)
    assert rc == 0, err[-3000:]
    train = _records(work / "s.jsonl", "train")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    assert [r["lr"] for r in train] == pytest.approx([_cosine(i, 1, 3) for i in (1, 2, 3)]
                                                      + [3e-4])
