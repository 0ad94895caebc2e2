"""Failure modes of ``lrattn-pretrain``, provoked on purpose (single-process CPU runs).

Faults are injected through ``LRATTN_FAULT`` (``megatron_lrattn/training/faults.py``): a
SIGKILL between a complete ``iter_N.tmp`` and its rename, a disk that fills up during a
save, a reported free space too small for a checkpoint, inf/nan in the loss or a gradient.
The runs of one wave start together (they are short: most time is importing megatron-core).
"""
from __future__ import annotations

import argparse

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SMALL = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
    "--ffn-hidden-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--eval-interval", "100", "--eval-iters", "1", "--lr-warmup-iters", "1", "--no-progress",
]


def _start(args, cache_dir, cwd, fault=None):
    """Start a run in its own process group, output to files (a SIGKILLed run can leave
    megatron's spawned checkpoint-writer helpers behind, holding inherited pipes)."""
    env = dict(os.environ, LRATTN_CACHE=str(cache_dir), PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    env.pop("LRATTN_FAULT", None)
    if fault:
        env["LRATTN_FAULT"] = fault
    n = len(list(Path(cwd).glob("*.out")))
    out, err = open(Path(cwd) / f"{n}.out", "w+"), open(Path(cwd) / f"{n}.err", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_lrattn.cli.pretrain", *SMALL, *args, "--cache-dir",
         str(cache_dir)],
        cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
    proc.files = (out, err)
    return proc


def _finish(proc, timeout=300):
    try:
        proc.wait(timeout=timeout)
    finally:
        # What a scheduler does after a crash: nothing of the job's process group survives.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    texts = []
    for f in proc.files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return proc.returncode, texts[0], texts[1]


def _train(path: Path):
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r for r in recs if r["type"] == "train"}


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def _tree_digest(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _dcp_tensors(ckpt: Path, out: Path):
    """Every tensor of a torch_dist checkpoint (model and optimizer), read without megatron."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("lrattn_cache"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """Wave 1: a run SIGKILLed inside its final save, an identical clean run, a save that
    hits ENOSPC, non-finite stop and skip, one and two Ctrl-Cs in iteration 2, a run past
    --exit-duration-in-mins. Wave 2: resume of the killed and of the once-interrupted run, a
    start refused for lack of space on top of an existing checkpoint, an unwritable --save."""
    w = tmp_path_factory.mktemp("reliability")
    det = ["--deterministic", "--train-iters", "4"]
    wave1 = {
        "kill": _start([*det, "--save", str(w / "kill"), "--save-interval", "2",
                        "--log-json", str(w / "kill.jsonl")], cache_dir, w,
                       fault="kill_before_rename@4"),
        "clean": _start([*det, "--log-json", str(w / "clean.jsonl")], cache_dir, w),
        "enospc": _start(["--train-iters", "3", "--save", str(w / "enospc"), "--save-interval",
                          "1", "--log-json", str(w / "enospc.jsonl")], cache_dir, w,
                         fault="enospc_during_save@2"),
        "stop": _start(["--train-iters", "3", "--save", str(w / "stop"), "--save-interval", "1",
                        "--log-json", str(w / "stop.jsonl")], cache_dir, w, fault="inf_grad@2"),
        "skip": _start(["--train-iters", "3", "--on-nonfinite", "skip", "--save", str(w / "skip"),
                        "--save-interval", "1", "--log-json", str(w / "skip.jsonl")], cache_dir,
                       w, fault="nan_loss@2"),
        "ctrlc": _start([*det, "--save", str(w / "ctrlc"), "--log-json", str(w / "ctrlc.jsonl")],
                        cache_dir, w, fault="interrupt@2"),
        "late": _start(["--train-iters", "100", "--exit-duration-in-mins", "0.0001", "--save",
                        str(w / "late"), "--log-json", str(w / "late.jsonl")], cache_dir, w),
        "ctrlc2": _start([*det, "--save", str(w / "ctrlc2"), "--save-interval", "1",
                          "--log-json", str(w / "ctrlc2.jsonl")], cache_dir, w,
                         fault="interrupt_twice@2"),
    }
    res = {k: _finish(p) for k, p in wave1.items()}
    res["kill_latest"] = (w / "kill" / "latest").read_text().strip()
    res["kill_left"] = sorted(p.name for p in (w / "kill").iterdir())
    res["kill_tmp_meta"] = (w / "kill" / "iter_0000004.tmp" / "lrattn.json").is_file()
    res["enospc_tree"] = _tree_digest(w / "enospc")
    wave2 = {
        "ctrlc_resume": _start([*det, "--load", str(w / "ctrlc"), "--save", str(w / "ctrlc"),
                                "--log-json", str(w / "ctrlc_resume.jsonl")], cache_dir, w),
        "resume": _start(["--deterministic", "--train-iters", "4", "--load", str(w / "kill"),
                          "--save", str(w / "kill"), "--log-json", str(w / "resume.jsonl")],
                         cache_dir, w),
        "nospace": _start(["--train-iters", "3", "--load", str(w / "enospc"), "--save",
                           str(w / "enospc"), "--log-json", str(w / "nospace.jsonl")],
                          cache_dir, w, fault="disk_free=1000"),
        "unwritable": _start(["--train-iters", "2", "--save", "/sys/lrattn_ckpt"], cache_dir, w),
    }
    res.update({k: _finish(p) for k, p in wave2.items()})
    res["work"] = w
    return res


@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint_and_resumes(runs):
    w = runs["work"]
    rc, _, err = runs["kill"]
    assert rc == -9, err[-3000:]
    rc, _, err = runs["resume"]
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err
    killed, resumed = _train(w / "kill.jsonl"), _train(w / "resume.jsonl")
    assert sorted(killed) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert [resumed[i]["loss"] for i in (3, 4)] == [killed[i]["loss"] for i in (3, 4)]
    assert (w / "kill" / "latest").read_text().strip() == "iter_0000004"
    assert not list((w / "kill").glob("*.tmp"))


@pytest.mark.slow
def test_sigkill_leaves_latest_on_the_previous_complete_checkpoint(runs):
    # Killed after iter_0000004.tmp was complete, before its rename (recorded before the
    # resume touched anything): `latest` names the previous checkpoint.
    assert runs["kill"][0] == -9
    assert runs["kill_tmp_meta"]
    assert runs["kill_latest"] == "iter_0000002"
    # The writer lock of the killed run stays behind; the resume takes it over (stale).
    assert runs["kill_left"] == [".lrattn-writer.lock", "iter_0000002", "iter_0000004.tmp",
                                 "latest"]


@pytest.mark.slow
def test_disk_full_during_save_is_one_line_and_keeps_the_last_checkpoint(runs):
    w = runs["work"]
    rc, _, err = runs["enospc"]
    assert rc == 2, err[-3000:]
    last = _last_line(err)
    assert last.startswith("lrattn-pretrain: error: ") and "iter_0000002.tmp" in last, last
    assert "No space left on device" in last and "iter_0000001 is still the latest" in last
    assert (w / "enospc" / "latest").read_text().strip() == "iter_0000001"
    assert sorted(p.name for p in (w / "enospc").iterdir()
                  if p.name.startswith("iter_")) == ["iter_0000001"]


@pytest.mark.slow
def test_too_little_space_is_refused_before_training_and_touches_nothing(runs):
    w = runs["work"]
    rc, _, err = runs["nospace"]
    assert rc == 2, err[-3000:]
    last = _last_line(err)
    assert "GiB free on its file system, one checkpoint needs about" in last, last
    assert not (w / "nospace.jsonl").exists()
    assert _tree_digest(w / "enospc") == runs["enospc_tree"]


@pytest.mark.slow
def test_unwritable_save_dir_is_refused_at_startup(runs):
    rc, _, err = runs["unwritable"]
    assert rc == 2, err[-3000:]
    last = _last_line(err)
    assert last.startswith("lrattn-pretrain: error: --save: /sys is not writable"), last


@pytest.mark.slow
def test_nonfinite_gradient_stops_naming_iteration_and_tensor(runs):
    w = runs["work"]
    rc, _, err = runs["stop"]
    assert rc == 3, err[-3000:]
    last = _last_line(err)
    assert last.startswith("lrattn-pretrain: error: non-finite values at iteration 2"), last
    assert "first non-finite gradient: embedding.word_embeddings.weight" in last
    assert sorted(_train(w / "stop.jsonl")) == [1]
    assert (w / "stop" / "latest").read_text().strip() == "iter_0000001"
    assert not (w / "stop" / "iter_0000002").exists()


@pytest.mark.slow
def test_nonfinite_loss_skip_leaves_optimizer_and_weights_untouched(runs, tmp_path):
    w = runs["work"]
    rc, _, err = runs["skip"]
    assert rc == 0, err[-3000:]
    train = _train(w / "skip.jsonl")
    assert train[2]["skipped"] and "loss is nan" in train[2]["nonfinite"]
    assert train[2]["loss"] is None  # strict JSON: the non-finite loss is written as null
    assert not train[1]["skipped"] and not train[3]["skipped"]
    assert np.isfinite(train[3]["loss"])
    # The checkpoints before and after the skipped step are equal tensor for tensor
    # (weights, Adam moments), with the same step count and LR-schedule position.
    before = _dcp_tensors(w / "skip" / "iter_0000001", tmp_path / "1.pt")
    after = _dcp_tensors(w / "skip" / "iter_0000002", tmp_path / "2.pt")
    later = _dcp_tensors(w / "skip" / "iter_0000003", tmp_path / "3.pt")
    assert any(k.startswith("optimizer.state.exp_avg") for k in before)
    assert before.keys() == after.keys()
    assert all((before[k] == after[k]).all() for k in before)
    assert any(not (before[k] == later[k]).all() for k in before)
    import torch

    common = [torch.load(w / "skip" / f"iter_000000{i}" / "common.pt", weights_only=False)
              for i in (1, 2)]
    assert common[0]["optimizer"]["state"] == common[1]["optimizer"]["state"]
    meta = [json.loads((w / "skip" / f"iter_000000{i}" / "lrattn.json").read_text())
            for i in (1, 2)]
    assert meta[0]["scheduler"] == meta[1]["scheduler"]


@pytest.mark.slow
def test_first_ctrl_c_saves_at_the_end_of_the_iteration_and_the_run_resumes_exactly(runs):
    w = runs["work"]
    rc, out, err = runs["ctrlc"]
    assert rc == 130, err[-3000:]
    assert _last_line(err) == "lrattn-pretrain: interrupted"
    assert err.count("interrupt: saving a checkpoint at the end of this iteration") == 1, err
    assert "checkpoint: " in out and out.strip().endswith("iter_0000002"), out
    assert "(stopped at iteration 2 (interrupt)" in out, out
    assert sorted(_train(w / "ctrlc.jsonl")) == [1, 2]
    # The resumed run takes the uninterrupted run's steps, bit for bit.
    rc, _, err = runs["ctrlc_resume"]
    assert rc == 0, err[-3000:]
    clean, resumed = _train(w / "clean.jsonl"), _train(w / "ctrlc_resume.jsonl")
    assert sorted(resumed) == [3, 4]
    assert [resumed[i]["loss"] for i in (3, 4)] == [clean[i]["loss"] for i in (3, 4)]


@pytest.mark.slow
def test_exit_duration_saves_and_exits_0_after_the_iteration_that_passes_it(runs):
    w = runs["work"]
    rc, out, err = runs["late"]
    assert rc == 0, err[-3000:]
    assert "--exit-duration-in-mins 0.0001 reached: saving and exiting at iteration 1" in err
    assert "(stopped at iteration 1 (--exit-duration-in-mins 0.0001)" in out, out
    assert sorted(_train(w / "late.jsonl")) == [1]
    assert (w / "late" / "latest").read_text().strip() == "iter_0000001"


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once_without_saving(runs):
    w = runs["work"]
    rc, out, err = runs["ctrlc2"]
    assert rc == 130, err[-3000:]
    assert _last_line(err) == "lrattn-pretrain: interrupted"
    assert "checkpoint: " not in out, out
    # Interrupted inside iteration 2, before its optimizer step: iteration 1's save stays
    # the latest, nothing of iteration 2 was written, the writer lock is released.
    assert sorted(_train(w / "ctrlc2.jsonl")) == [1]
    assert (w / "ctrlc2" / "latest").read_text().strip() == "iter_0000001"
    assert sorted(p.name for p in (w / "ctrlc2").iterdir()) == ["iter_0000001", "latest"]


@pytest.mark.slow
def test_deterministic_runs_give_bit_identical_losses(runs):
    w = runs["work"]
    assert runs["clean"][0] == 0, runs["clean"][2][-3000:]
    a, b = _train(w / "kill.jsonl"), _train(w / "clean.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for i in a:
        assert (a[i]["loss"], a[i]["grad_norm"]) == (b[i]["loss"], b[i]["grad_norm"]), i


def _write_idx(prefix, docs, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_empty_dataset_and_float_tokens_are_one_line_errors(tmp_path):
    from megatron_lrattn.data.datasets import check_indexed_dataset
    from megatron_lrattn.data.errors import DataError

    empty = _write_idx(tmp_path / "empty", [], np.uint16)
    with pytest.raises(DataError, match=r"empty\.bin: empty dataset"):
        check_indexed_dataset(empty)
    floats = _write_idx(tmp_path / "floats", [[1.0, 2.0, 3.0]] * 4, np.float32)
    with pytest.raises(DataError, match=r"floats\.idx: token dtype float32 is not an integer"):
        check_indexed_dataset(floats)


def test_save_space_estimate_and_refusal(tmp_path, monkeypatch):
    import shutil

    from megatron_lrattn.training.checkpoint import (CheckpointError, check_save_space,
                                                     checkpoint_bytes)

    assert checkpoint_bytes(10, bf16=False) == 120
    assert checkpoint_bytes(10, bf16=True) == 140
    target = tmp_path / "not" / "yet" / "there"
    assert check_save_space(str(target), 1000, bf16=False) == 12000
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=11999))
    with pytest.raises(CheckpointError, match="one checkpoint needs about"):
        check_save_space(str(target), 1000, bf16=False)
    assert not (tmp_path / "not").exists()


def test_save_path_that_is_a_file_is_refused(tmp_path):
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ArgumentError, match="exists and is not a directory"):
        parse_args(["--save", str(blocker)])
    with pytest.raises(ArgumentError, match="is not a directory"):
        parse_args(["--save", str(blocker / "ckpt")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_nonfinite_check_on_a_plain_module():
    import torch

    from megatron_lrattn.training.numerics import (NonFiniteError, check_step,
                                                   first_nonfinite_grad, grads_finite)

    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    assert grads_finite([m]) and first_nonfinite_grad([m]) is None
    assert check_step(1.0, [m], 5, "stop") is None
    m.bias.grad[0] = float("nan")
    assert not grads_finite([m])
    assert check_step(1.0, [m], 5, "skip") == "first non-finite gradient: bias"
    with pytest.raises(NonFiniteError, match=r"iteration 5 \(loss is inf; first non-finite "
                                             r"gradient: bias\)"):
        check_step(float("inf"), [m], 5, "stop")


def test_nonfinite_check_on_the_optimizers_gradient_norm(monkeypatch):
    """With the norm the one-kernel optimizer step computed, the check reads it and makes
    no pass of its own over the gradients; a non-finite norm is handled as a non-finite
    gradient (named when found)."""
    import torch

    from megatron_lrattn.training import numerics
    from megatron_lrattn.training.numerics import NonFiniteError, check_step

    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()

    def no_pass(models):
        raise AssertionError("grads_finite ran")

    monkeypatch.setattr(numerics, "grads_finite", no_pass)
    assert check_step(1.0, [m], 5, "stop", grad_norm=2.5) is None
    assert check_step(1.0, [m], 5, "skip", grad_norm=float("inf")) == "gradients are finite"
    m.weight.grad[1, 2] = float("inf")
    assert check_step(1.0, [m], 5, "skip", grad_norm=float("nan")) == (
        "first non-finite gradient: weight")
    assert check_step(float("nan"), [m], 5, "skip", grad_norm=1.0) == (
        "loss is nan; first non-finite gradient: weight")
    with pytest.raises(NonFiniteError, match="iteration 5"):
        check_step(1.0, [m], 5, "stop", grad_norm=float("inf"))


class _NormFirstStep:
    """Stands in for ``MixedPrecisionAdamW``: records the order of the loop's calls."""

    def __init__(self, norm):
        self.norm, self.calls = norm, []

    def grad_norm(self):
        self.calls.append("grad_norm")
        return self.norm

    def discard(self):
        self.calls.append("discard")

    def __call__(self):
        self.calls.append("step")
        return True, self.norm, None


@pytest.mark.parametrize("norm,policy,calls", [
    (1.5, "skip", ["grad_norm", "step"]),
    (float("inf"), "skip", ["grad_norm", "discard"]),
    (float("nan"), "stop", ["grad_norm", "discard"]),
])
def test_train_step_checks_the_norm_before_the_update(monkeypatch, norm, policy, calls):
    """The training step asks the one-kernel step for its norm, checks it, then updates, or
    drops the norm when the step is skipped or stopped; the gradients are read once."""
    import torch

    from megatron_lrattn.training import numerics, step as step_mod
    from megatron_lrattn.training.numerics import NonFiniteError

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def zero_grad_buffer(self):
            pass

    class Opt:
        def zero_grad(self):
            pass

    class Sched:
        steps = 0

        def step(self, increment):
            Sched.steps += increment

    monkeypatch.setattr(step_mod, "reduce_loss", lambda losses: 2.0)
    monkeypatch.setattr(numerics, "grads_finite", lambda models: pytest.fail("a second pass"))
    fake = _NormFirstStep(norm)
    ts = step_mod.TrainStep(config=None, models=[Model()], optimizer=Opt(), scheduler=Sched(),
                            num_params=6, step_kwargs={}, forward_step=None,
                            on_nonfinite=policy, optimizer_step=fake)
    monkeypatch.setattr(ts, "_forward_backward", lambda it, forward_only: [])
    if policy == "stop":
        with pytest.raises(NonFiniteError):
            ts.train(iter([]), 3)
    else:
        result = ts.train(iter([]), 3)
        assert result.ok is (calls[-1] == "step")
        assert result.grad_norm == (norm if result.ok else None)
    assert fake.calls == calls
    assert Sched.steps == (1 if calls[-1] == "step" else 0)


@pytest.mark.parametrize("stats,policy,outcome", [
    ((2.0, 0.5, 1.0), "stop", "stepped"),
    ((float("nan"), 0.5, 0.0), "skip", "loss is nan; gradients are finite"),
    ((2.0, float("inf"), 0.0), "skip", "gradients are finite"),
    ((2.0, float("inf"), 0.0), "stop", "raises"),
])
def test_a_captured_step_is_read_once_and_checked_on_its_norm(monkeypatch, stats, policy,
                                                             outcome):
    """The step inside a CUDA graph hands back [loss, norm, stepped]: a stepped step
    advances the LR schedule; one the kernel did not step is reported (skip) or stops
    (stop) as an eager one, and the schedule stays."""
    import torch

    from megatron_lrattn.training import numerics, step as step_mod
    from megatron_lrattn.training.numerics import NonFiniteError

    class Sched:
        steps = 0

        def step(self, increment):
            Sched.steps += increment

    monkeypatch.setattr(numerics, "grads_finite", lambda models: pytest.fail("a gradient pass"))
    ts = step_mod.TrainStep(config=None, models=[torch.nn.Linear(2, 2)], optimizer=None,
                            scheduler=Sched(), num_params=6, step_kwargs={},
                            forward_step=None, on_nonfinite=policy)
    t = torch.tensor(stats, dtype=torch.float64)
    if outcome == "raises":
        with pytest.raises(NonFiniteError, match="iteration 4"):
            ts._after_captured_step(t, 4)
        assert Sched.steps == 0
        return
    result = ts._after_captured_step(t, 4)
    assert (result.loss, result.ok) == (stats[0], outcome == "stepped") or stats[0] != stats[0]
    if outcome == "stepped":
        assert result.grad_norm == 0.5 and result.nonfinite is None and Sched.steps == 1
    else:
        assert result.nonfinite == outcome and result.grad_norm is None and Sched.steps == 0


def test_the_optimizer_step_joins_the_graph_only_where_it_can(monkeypatch):
    from megatron_lrattn.training import faults
    from megatron_lrattn.training.step import captured_update_obstacles

    class Fused:
        def __init__(self, why):
            self.why = why

        def capture_obstacles(self):
            return list(self.why)

    monkeypatch.delenv(faults.ENV, raising=False)
    assert captured_update_obstacles(Fused([])) == []
    assert captured_update_obstacles(Fused(["log_num_zeros_in_grad"])) == [
        "log_num_zeros_in_grad"]
    assert "not the one-kernel step" in captured_update_obstacles(None)[0]
    te = argparse.Namespace(transformer_impl="transformer_engine")
    assert "TE spec" in captured_update_obstacles(Fused([]), te)[0]
    assert captured_update_obstacles(Fused([]), argparse.Namespace(transformer_impl="local")) == []
    monkeypatch.setenv(faults.ENV, "inf_grad@3")
    assert faults.ENV in captured_update_obstacles(Fused([]))[0]
