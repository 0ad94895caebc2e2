"""Resume exactness under data parallelism: 2-process torchrun (gloo) runs of a tiny model
with the distributed optimizer.

Phase 1 runs three trainings side by side: an uninterrupted reference (asynchronous saves,
``--keep-last 2``), a run SIGKILLed (torchrun and both workers, no cleanup) after its
iteration-4 checkpoint, and a run whose rank 1 alone gets SIGTERM. Phase 2 resumes the two
interrupted runs; their losses must equal the reference's bit for bit. Evaluation runs every
iteration only to make iterations slow enough that the kill lands mid-run.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import cli_env, finish

ITERS = 8
TINY = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "4",
    "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--global-batch-size", "4",
    "--micro-batch-size", "1", "--train-iters", str(ITERS), "--lr-warmup-iters", "1",
    "--eval-interval", "1", "--eval-iters", "12", "--no-progress",
    "--use-distributed-optimizer",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, new_cache):
    """Holds the default data already: the three runs below never race to build it."""
    return new_cache(tmp_path_factory.mktemp("lrattn_cache"))


def _torchrun(args, cache_dir, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron_lrattn.cli.pretrain", *TINY, *args, "--cache-dir",
           str(cache_dir), "--log-json", str(log)]
    return subprocess.Popen(cmd, cwd=log.parent, env=cli_env(cache_dir, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers(proc):
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "megatron_lrattn.cli.pretrain" in " ".join(p.cmdline())]


def _read(path: Path, kind: str):
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if r["type"] == kind]


def _latest(ckpt: Path):
    try:
        return (ckpt / "latest").read_text().strip()
    except OSError:
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("resume")
    ref_ckpt, kill_ckpt, term_ckpt = work / "ref", work / "kill", work / "term"
    ref = _torchrun(["--save", str(ref_ckpt), "--save-interval", "2", "--keep-last", "2",
                     "--async-save"], cache_dir, work / "ref.jsonl")
    kill = _torchrun(["--save", str(kill_ckpt), "--save-interval", "4"], cache_dir,
                     work / "kill.jsonl")
    term = _torchrun(["--save", str(term_ckpt)], cache_dir, work / "term.jsonl")

    # Act on both runs as soon as each reaches its point (they progress concurrently).
    killed_at = None
    term_sent = False
    deadline = time.monotonic() + 300
    while killed_at is None or not term_sent:
        assert time.monotonic() < deadline, "timed out waiting for the runs"
        if killed_at is None and _latest(kill_ckpt) == "iter_0000004":
            victims = [psutil.Process(kill.pid), *psutil.Process(kill.pid).children(recursive=True)]
            for p in victims:
                p.send_signal(signal.SIGKILL)
            kill.communicate(timeout=60)
            killed_at = max(r["iteration"] for r in _read(work / "kill.jsonl", "train"))
        if not term_sent and _read(work / "term.jsonl", "train"):
            rank1 = [p for p in _workers(term) if p.environ().get("RANK") == "1"]
            assert len(rank1) == 1
            rank1[0].send_signal(signal.SIGTERM)
            term_sent = True
        # a run may end once it was acted on (the terminated one saves and exits by itself,
        # possibly before the other reaches its checkpoint), never before
        for name, p, acted in (("kill", kill, killed_at is not None), ("term", term, term_sent)):
            if p.poll() is not None and not acted:
                raise AssertionError(f"{name} run ended early: {p.stderr.read()[-3000:]}")
        time.sleep(0.01)

    results = {name: finish(p) for name, p in (("ref", ref), ("term", term))}
    for name, (rc, _, err) in results.items():
        assert rc == 0, (name, err[-4000:])
    term_err = results["term"][2]

    resumed_kill = _torchrun(["--load", str(kill_ckpt), "--save", str(kill_ckpt)], cache_dir,
                             work / "kill_resumed.jsonl")
    resumed_term = _torchrun(["--load", str(term_ckpt), "--save", str(term_ckpt)], cache_dir,
                             work / "term_resumed.jsonl")
    for name, p in (("kill_resumed", resumed_kill), ("term_resumed", resumed_term)):
        rc, _, err = finish(p)
        assert rc == 0, (name, err[-4000:])
    return dict(work=work, killed_at=killed_at, term_err=term_err, ref_ckpt=ref_ckpt,
                kill_ckpt=kill_ckpt, term_ckpt=term_ckpt)


def _losses(path: Path):
    return {r["iteration"]: r["loss"] for r in _read(path, "train")}


@pytest.mark.slow
def test_sigkilled_run_resumes_with_identical_losses(runs):
    work = runs["work"]
    assert 4 <= runs["killed_at"] < ITERS, "the kill must land between iterations 4 and 8"
    ref = _losses(work / "ref.jsonl")
    resumed = _losses(work / "kill_resumed.jsonl")
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert sorted(resumed) == list(range(5, ITERS + 1))
    assert {i: ref[i] for i in resumed} == resumed
    assert _latest(runs["kill_ckpt"]) == f"iter_{ITERS:07d}"


@pytest.mark.slow
def test_sigterm_saves_a_loadable_checkpoint_and_exits_0(runs):
    work = runs["work"]
    assert "exit signal received: saving and exiting at iteration" in runs["term_err"]
    stopped = max(_losses(work / "term.jsonl"))
    assert stopped < ITERS
    meta = json.loads((runs["term_ckpt"] / f"iter_{stopped:07d}" / "lrattn.json").read_text())
    assert meta["iteration"] == stopped and meta["consumed_samples"] == 4 * stopped
    ref = _losses(work / "ref.jsonl")
    resumed = _losses(work / "term_resumed.jsonl")
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    assert {i: ref[i] for i in resumed} == resumed


@pytest.mark.slow
def test_async_saves_and_keep_last(runs):
    ckpt = runs["ref_ckpt"]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000006", "iter_0000008"]
    assert _latest(ckpt) == "iter_0000008"


@pytest.mark.slow
def test_global_batch_not_divisible_under_two_processes(tmp_path, cache_dir):
    proc = _torchrun(["--global-batch-size", "3"], cache_dir, tmp_path / "m.jsonl")
    rc, out, err = finish(proc)
    assert rc != 0
    assert ("lrattn-pretrain: error: --global-batch-size 3 is not divisible by "
            "--micro-batch-size 1 x data-parallel size 2") in err, err
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err


def test_prune_keeps_the_newest_and_the_one_latest_names(tmp_path):
    from megatron_lrattn.training.checkpoint import META_NAME, prune_checkpoints

    for i in range(1, 5):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / META_NAME).write_text("{}")
    (tmp_path / "iter_0000005.tmp").mkdir()
    (tmp_path / "iter_0000006").mkdir()  # incomplete: no meta file
    (tmp_path / "latest").write_text("iter_0000001\n")
    assert prune_checkpoints(str(tmp_path), 2) == ["iter_0000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000003", "iter_0000004", "iter_0000005.tmp", "iter_0000006",
        "latest"]


@pytest.mark.parametrize("saved, now, refused", [
    # (TP, PP, layers per virtual stage, distributed optimizer, sharding) saved; (TP, PP, V) now
    ((1, 1, None, True, "dp_reshardable"), (1, 1, None), False),
    ((2, 2, 1, True, "dp_reshardable"), (2, 2, 2), False),
    ((1, 1, None, True, "dp_reshardable"), (2, 1, None), True),
    ((2, 2, None, True, "dp_reshardable"), (2, 2, 2), True),
    ((2, 2, 1, True, "dp_reshardable"), (2, 2, None), True),
    ((1, 1, None, True, "fully_reshardable"), (2, 2, 2), False),
    ((1, 1, None, False, "dp_reshardable"), (2, 2, 2), False),
])
def test_optimizer_state_layout_check(saved, now, refused):
    """dp_reshardable distributed-optimizer state is refused, in one line naming both layouts,
    at another TP/PP/virtual layout (any DP size is fine); fully_reshardable state and the
    plain optimizer's state are not."""
    from types import SimpleNamespace

    from megatron_lrattn.training.checkpoint import CheckpointError, check_optimizer_layout

    tp, pp, per_virtual, distributed, sharding = saved
    meta = {"optimizer_sharding": sharding,
            "args": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "num_layers_per_virtual_pipeline_stage": per_virtual, "num_layers": 4,
                     "use_distributed_optimizer": distributed}}
    config = SimpleNamespace(tensor_model_parallel_size=now[0],
                             pipeline_model_parallel_size=now[1],
                             virtual_pipeline_model_parallel_size=now[2])
    if not refused:
        check_optimizer_layout(meta, config, "ckpt/iter_0000002")
        return
    with pytest.raises(CheckpointError) as err:
        check_optimizer_layout(meta, config, "ckpt/iter_0000002")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ckpt/iter_0000002: ")
    assert f"saved in the dp_reshardable format at TP={tp}, PP={pp}" in msg
    assert f"this run has TP={now[0]}, PP={now[1]}" in msg
    assert "--dist-ckpt-optim-fully-reshardable" in msg
