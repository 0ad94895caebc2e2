"""``--cuda-graph-impl full_iteration``: where it is refused, the static input buffers, and
(on the GPU box) that captured steps train exactly like eager ones in every residual mode."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from helpers import cli_env, finish
from megatron_lrattn.training.arg_types import ArgumentError
from megatron_lrattn.training.cuda_graph import StaticBatches
from megatron_lrattn.training.fusions import add_fusion_args, cuda_graph_impl


def _args(*argv, pp=1, hidden_dropout=0.0, attention_dropout=0.0, impl="local",
          recompute=None):
    p = argparse.ArgumentParser()
    add_fusion_args(p)
    a = p.parse_args(list(argv))
    a.pipeline_model_parallel_size = pp
    a.recompute_granularity = recompute
    a.hidden_dropout, a.attention_dropout = hidden_dropout, attention_dropout
    a.transformer_impl = impl
    return a


def test_auto_by_default_on_where_it_applies():
    a = _args()
    assert a.cuda_graph_impl == "auto" and a.cuda_graph_warmup_steps == 3
    assert cuda_graph_impl(a, cuda=True) == "full_iteration"
    assert cuda_graph_impl(_args("--cuda-graph-impl", "none"), cuda=True) == "none"
    assert cuda_graph_impl(_args(impl="transformer_engine"), cuda=True) == "full_iteration"


OBSTACLES = [
    ({}, False, "needs a CUDA device"),
    ({"pp": 2}, True, "--pipeline-model-parallel-size 1 (got 2)"),
    ({"hidden_dropout": 0.1}, True, "--hidden-dropout 0.1"),
    ({"attention_dropout": 0.1}, True, "--attention-dropout 0.1"),
    ({"recompute": "full"}, True, "--recompute-granularity full"),
]


@pytest.mark.parametrize("kw,cuda,needle", OBSTACLES)
def test_auto_steps_aside_where_it_cannot_run(kw, cuda, needle):
    assert cuda_graph_impl(_args(**kw), cuda=cuda) == "none"


@pytest.mark.parametrize("kw,cuda,needle", OBSTACLES)
def test_refused_where_it_cannot_run(kw, cuda, needle):
    with pytest.raises(ArgumentError) as e:
        cuda_graph_impl(_args("--cuda-graph-impl", "full_iteration", **kw), cuda=cuda)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_refuses_zero_warmup_steps():
    with pytest.raises(ArgumentError, match="--cuda-graph-warmup-steps 0"):
        cuda_graph_impl(
            _args("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "0"),
            cuda=True)


def _batch(seed, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (b, s), generator=g, dtype=torch.int32)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s)}


def test_static_batches_refill_the_same_memory_with_the_new_values():
    sb = StaticBatches(torch.device("cpu"))
    first = sb.fill(iter([_batch(0), _batch(1)]), 2)
    ptrs = [t.data_ptr() for mb in first for t in mb.values()]
    second = sb.fill(iter([_batch(2), _batch(3)]), 2)
    assert [t.data_ptr() for mb in second for t in mb.values()] == ptrs
    assert torch.equal(second[1]["tokens"], _batch(3)["tokens"].long())
    assert second[0]["tokens"].dtype == torch.int64 and second[0]["loss_mask"].dtype == torch.float32


def test_graphs_alive_together_share_a_pool_and_a_pool_is_never_taken_back(monkeypatch):
    """Step graphs alive at once capture into one pool; once all of them are gone the next
    capture gets a new pool (torch's pinned-host allocator asserts on an id whose last graph
    released it: ``lrattn-profile --sequential`` at 4b hit it at the third arm)."""
    import gc

    from megatron_lrattn.training import cuda_graph as cg

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(cg, "_graph_pool", None)
    monkeypatch.setattr(cg, "_pool_users", cg.weakref.WeakSet())

    class User:  # stands for a StepGraph
        pass

    a, b = User(), User()
    assert cg._shared_pool(a) == cg._shared_pool(b) == (0, 0)
    del a
    gc.collect()
    c = User()
    assert cg._shared_pool(c) == (0, 0)  # b still lives in pool 0
    del b, c
    gc.collect()
    d = User()
    assert cg._shared_pool(d) == (1, 0)  # every graph of pool 0 is gone: a new pool
    assert cg._shared_pool(User()) == (1, 0)


def test_static_batches_refuse_a_new_shape():
    sb = StaticBatches(torch.device("cpu"))
    sb.fill(iter([_batch(0)]), 1)
    with pytest.raises(ValueError, match="'tokens' of micro-batch 0 is \\(2, 6\\)"):
        sb.fill(iter([_batch(1, s=6)]), 1)


SMALL = ["--preset", "tiny", "--seq-length", "128", "--hidden-size", "128", "--num-layers", "4",
         "--num-blocks", "4", "--ffn-hidden-size", "256", "--global-batch-size", "8",
         "--micro-batch-size", "4", "--train-iters", "8", "--lr-warmup-iters", "2",
         "--eval-interval", "1000", "--eval-iters", "1", "--no-progress", "--deterministic",
         "--seed", "3"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, new_cache):
    return new_cache(tmp_path_factory.mktemp("lrattn_cache"))


def _losses(tmp_path, cache_dir, name, extra, logged=None):
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_lrattn.cli.pretrain", *SMALL, *extra,
         "--log-json", str(metrics), "--log-interval", "1", "--cache-dir", str(cache_dir)],
        env=cli_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    assert logged is None or logged in err + out, (logged, err[-3000:])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("type") == "train"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("mode", [["--residual", "standard"], ["--residual", "attnres"],
                                  ["--residual", "lr_attnres"],
                                  ["--residual", "lr_attnres", "--key", "projected",
                                   "--rank", "16"]])
def test_captured_steps_train_like_eager_steps(tmp_path, cache_dir, mode):
    """The whole step in the graph (forward, backward, loss, gradient norm and the
    one-kernel optimizer step): the same losses as eager steps."""
    eager = _losses(tmp_path, cache_dir, "eager", [*mode, "--cuda-graph-impl", "none"])
    graph = _losses(tmp_path, cache_dir, "graph", [*mode, "--cuda-graph-impl", "full_iteration",
                                        "--cuda-graph-warmup-steps", "2"],
                    logged="loss, gradient norm and optimizer step in a CUDA graph")
    assert len(eager) == len(graph) == 8
    # The same kernels on the same inputs: the replayed steps (3 to 8) equal the eager run.
    assert graph == eager, (eager, graph)


TE_ARMS = {"bf16": [], "fp8_delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                       "--fp8-amax-history-len", "16",
                                       "--fp8-amax-compute-algo", "max"],
           "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arm", list(TE_ARMS))
def test_captured_te_steps_train_like_eager_steps(tmp_path, cache_dir, arm):
    """The TE spec's captured step: the replays must recast the updated weights to FP8 and
    (delayed scaling) update the amax histories and scales as the eager steps do, so the
    losses of steps 3 to 8 equal the eager run's."""
    from megatron_lrattn.compat import te as te_compat

    if not te_compat.te_available():
        pytest.skip("Transformer Engine is not installed (tools/gpu_box/run.sh te build)")
    mode = ["--residual", "lr_attnres", "--transformer-impl", "transformer_engine",
            *TE_ARMS[arm]]
    eager = _losses(tmp_path, cache_dir, "eager", [*mode, "--cuda-graph-impl", "none"])
    graph = _losses(tmp_path, cache_dir, "graph", [*mode, "--cuda-graph-impl", "full_iteration",
                                        "--cuda-graph-warmup-steps", "2"])
    assert len(eager) == len(graph) == 8
    assert graph == eager, (eager, graph)
