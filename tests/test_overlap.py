"""Overlapped gradient reduce and parameter all-gather are exact (CPU/gloo, torchrun).

Each layout trains the tiny preset for 3 steps under ``lrattn-pretrain`` twice, with
``--no-overlap-grad-reduce`` (one bucket, reduced after the backward) and with
``--overlap-grad-reduce --ddp-bucket-size 20000`` (many buckets, each reduced by an async
collective launched from the backward hooks, the schedule's ``grad_sync_func`` and
``no_sync_func``), and compares the per-step losses and, on every rank, every parameter's
reduced gradient (``main_grad`` after ``finalize_model_grads``). With the distributed
optimizer the second run adds ``--overlap-param-gather`` (parameters all-gathered by the
next forward's pre-hooks) and the comparison is the losses and the final weights.

Run this file as a script under torchrun to get one worker: it wraps ``TrainStep.train``
to save each rank's gradients after every step, then runs ``lrattn-pretrain``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import cli_env, torchrun  # noqa: E402

CLI = ["--preset", "tiny", "--train-iters", "3", "--lr-warmup-iters", "1",
       "--eval-interval", "1000", "--eval-iters", "1", "--seed", "7", "--no-progress",
       "--micro-batch-size", "2"]
OFF = ["--no-overlap-grad-reduce", "--no-overlap-param-gather"]
ON = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    # name: (processes, layout flags); lr_attnres sliced keys (the preset's) in all
    "dp2": (2, []),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "pp2_dp2": (4, PP2),
    # interleaved: the rank-local depth-source cache crosses chunks
    "pp2_vpp2_dp2": (4, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
}
DISTOPT_LAYOUTS = {
    # name: (processes, layout flags, exact)
    "dp2_distopt": (2, ["--use-distributed-optimizer"], True),
    "pp2_dp2_distopt": (4, PP2 + ["--use-distributed-optimizer"], True),
    # the depth queries of later sites are read by the two-phase reads and phase 1 of a
    # received state before their layers run: they must still wait for the gather
    "pp2_vpp2_dp2_distopt": (
        4, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"],
        True),
    # many buckets with overlap against megatron's one bucket without: other optimizer
    # shards, so the reduce-scatter and clipping-norm sums run in another order
    "dp2_distopt_buckets": (2, ["--use-distributed-optimizer", "--ddp-bucket-size", "20000"],
                            False),
}


def _run(nproc: int, flags, out: Path, cache_dir: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(nproc) + [__file__, str(out)]
    log = out / "log.jsonl"
    proc = subprocess.run(cmd + CLI + flags + ["--cache-dir", str(cache_dir), "--log-json",
                                               str(log)],
                          env=cli_env(cache_dir, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {"train": [r["loss"] for r in rows if r["type"] == "train"],
            "valid": [r["loss"] for r in rows if r["type"] == "valid"]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("dp,distopt,flags,want", [
    (1, True, {}, (False, False)),
    (2, False, {}, (True, False)),
    (2, True, {}, (True, True)),
    (2, True, {"overlap_grad_reduce": False}, (False, False)),
    (2, True, {"overlap_param_gather": False}, (True, False)),
    (1, True, {"overlap_grad_reduce": True, "overlap_param_gather": True}, (True, True)),
])
def test_overlap_defaults(dp, distopt, flags, want):
    """Unset flags overlap both at DP > 1 (the gather with the distributed optimizer only);
    an explicit flag wins."""
    import argparse

    from megatron_lrattn.training.builder import resolve_overlap

    given = {"overlap_grad_reduce": None, "overlap_param_gather": None}
    given.update(flags)
    args = argparse.Namespace(use_distributed_optimizer=distopt, **given)
    resolve_overlap(args, dp)
    assert (args.overlap_grad_reduce, args.overlap_param_gather) == want


def test_param_gather_refusals():
    import argparse

    from megatron_lrattn.training.arg_types import ArgumentError
    from megatron_lrattn.training.builder import resolve_overlap

    with pytest.raises(ArgumentError, match="--use-distributed-optimizer"):
        resolve_overlap(argparse.Namespace(use_distributed_optimizer=False,
                                           overlap_grad_reduce=True,
                                           overlap_param_gather=True), 2)
    with pytest.raises(ArgumentError, match="requires --overlap-grad-reduce"):
        resolve_overlap(argparse.Namespace(use_distributed_optimizer=True,
                                           overlap_grad_reduce=False,
                                           overlap_param_gather=True), 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_overlapped_grad_reduce_is_exact(layout, tmp_path, data_cache):
    nproc, flags = LAYOUTS[layout]
    ref = _run(nproc, flags + OFF, tmp_path / "off", data_cache)
    got = _run(nproc, flags + ON, tmp_path / "on", data_cache)
    assert got["train"] == ref["train"], (got["train"], ref["train"])
    files = sorted(p.name for p in (tmp_path / "off").glob("grads_*.pt"))
    assert len(files) == 3 * nproc
    worst = 0.0
    for name in files:
        a = torch.load(tmp_path / "on" / name)
        b = torch.load(tmp_path / "off" / name)
        assert a.keys() == b.keys() and a
        for k in a:
            worst = max(worst, _rel(a[k], b[k]))
    # gradients are sums of the same two data-parallel partials in every bucketing
    assert worst == 0.0, worst


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(DISTOPT_LAYOUTS))
def test_overlapped_param_gather_is_exact(layout, tmp_path, data_cache):
    """With the distributed optimizer, ``--overlap-grad-reduce --overlap-param-gather``
    (parameters all-gathered bucket by bucket in the next forward's pre-hooks) gives the
    losses and final weights of the run without overlap: bit for bit where the buckets, and
    so the optimizer shards, are the same; within 1e-6 relative where they differ."""
    nproc, flags, exact = DISTOPT_LAYOUTS[layout]
    ref = _run(nproc, flags + OFF, tmp_path / "off", data_cache)
    got = _run(nproc, flags + ["--overlap-grad-reduce", "--overlap-param-gather"],
               tmp_path / "on", data_cache)
    pairs = list(zip(got["train"] + got["valid"], ref["train"] + ref["valid"]))
    assert len(pairs) == 5
    for a, b in pairs:
        assert a == b if exact else abs(a - b) <= 1e-6 * abs(b), (got, ref)
    for r in range(nproc):
        a = torch.load(tmp_path / "on" / f"weights_r{r}.pt")
        b = torch.load(tmp_path / "off" / f"weights_r{r}.pt")
        assert a.keys() == b.keys() and a
        for k in a:
            if exact:
                assert torch.equal(a[k], b[k]), k
            else:
                assert _rel(a[k], b[k]) <= 1e-6, (k, _rel(a[k], b[k]))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_flags_on_one_gpu_change_nothing(tmp_path, data_cache):
    """One GPU, ``--deterministic``, distributed optimizer: the overlapped reduce and
    parameter all-gather (10+ buckets) against neither, the same losses bit for bit."""
    flags = ["--preset", "study-25m", "--mock-data", "--train-iters", "12",
             "--lr-warmup-iters", "2", "--eval-interval", "1000", "--eval-iters", "1",
             "--seed", "7", "--no-progress", "--residual", "lr_attnres", "--num-blocks", "4",
             "--micro-batch-size", "8", "--global-batch-size", "8", "--deterministic",
             "--cuda-graph-impl", "none", "--use-distributed-optimizer"]
    losses = {}
    for name, extra in (("off", OFF), ("on", ["--overlap-grad-reduce", "--overlap-param-gather",
                                              "--ddp-bucket-size", "2000000"])):
        metrics = tmp_path / f"{name}.jsonl"
        r = subprocess.run([sys.executable, "-m", "megatron_lrattn.cli.pretrain", *flags, *extra,
                            "--log-json", str(metrics), "--log-interval", "1"],
                           env=cli_env(data_cache), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[name] = [row["loss"] for row in rows if row.get("type") == "train"]
    assert len(losses["on"]) == 12 and losses["on"] == losses["off"], losses


def _worker(out: str, argv) -> int:
    """Run ``lrattn-pretrain argv``, saving this rank's reduced gradients after every
    step and its weights (through the DDP state dict) at the end."""
    import torch.distributed as dist

    from megatron_lrattn.cli import pretrain as cli
    from megatron_lrattn.training import step as step_mod

    rank = int(os.environ.get("RANK", "0"))
    train = step_mod.TrainStep.train

    def recording(self, data_iterator, iteration):
        result = train(self, data_iterator, iteration)
        if not self.models[0].ddp_config.use_distributed_optimizer:
            grads = {f"{c}.{n}": p.main_grad.detach().clone()
                     for c, m in enumerate(self.models) for n, p in m.named_parameters()}
            torch.save(grads, os.path.join(out, f"grads_r{rank}_it{iteration}.pt"))
        if iteration == 3:
            weights = {f"{c}.{k}": v.detach().clone() for c, m in enumerate(self.models)
                       for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
            torch.save(weights, os.path.join(out, f"weights_r{rank}.pt"))
        return result

    step_mod.TrainStep.train = recording
    rc = cli.main(list(argv))
    if dist.is_initialized():
        dist.barrier()
    return rc


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2:]))
