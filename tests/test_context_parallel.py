"""Context parallelism (``--context-parallel-size``): the SDPA core's K/V all-gather with
load-balanced chunks against full causal attention (outputs and every gradient, gloo
processes), the flag checks, and whole runs through the CLI against one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import pretrain_rows, rel_rms  # noqa: E402

from megatron_lrattn.model.attention import cp_chunk_order  # noqa: E402
from megatron_lrattn.training.arg_types import ArgumentError  # noqa: E402
from megatron_lrattn.training.arguments import parse_args  # noqa: E402

CLI = ["--preset", "tiny", "--train-iters", "4", "--lr-warmup-iters", "1",
       "--eval-interval", "1000", "--seed", "7", "--no-progress", "--micro-batch-size", "4"]
LOSS_RTOL = 1e-6


def test_chunk_order():
    """Rank i gathers chunks (i, 2C-1-i): the gathered order of C=2 is 0, 3, 1, 2."""
    assert cp_chunk_order(1).tolist() == [0, 1]
    assert cp_chunk_order(2).tolist() == [0, 2, 3, 1]
    gathered = [0, 5, 1, 4, 2, 3]
    assert [gathered[i] for i in cp_chunk_order(3).tolist()] == list(range(6))


def _attention_worker(rank: int, world: int, store: str, heads: int, groups: int, queue):
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_lrattn.compat.cpu import apply_cpu_compat
    from megatron_lrattn.model.attention import context_parallel_attention

    apply_cpu_compat()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(5)
        b, s, hn = 2, 8 * world, 8
        q = torch.randn(b, heads, s, hn, generator=g, dtype=torch.float64)
        k = torch.randn(b, groups, s, hn, generator=g, dtype=torch.float64)
        v = torch.randn(b, groups, s, hn, generator=g, dtype=torch.float64)
        dout = torch.randn(b, heads, s, hn, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True,
                                             enable_gqa=groups != heads)
        ref.backward(dout)
        c = s // (2 * world)
        mine = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])
        lq, lk, lv = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(lq, lk.permute(2, 0, 1, 3), lv.permute(2, 0, 1, 3),
                                         dist.group.WORLD, dropout_p=0.0, scale=None)
        out.backward(dout[:, :, mine])
        errors = [rel_rms(out, ref[:, :, mine])]
        errors += [rel_rms(a.grad, b.grad[:, :, mine]) for a, b in zip((lq, lk, lv), full)]
        queue.put((rank, errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,heads,groups", [
    pytest.param(2, 4, 4, id="cp2_mha", marks=pytest.mark.slow),
    pytest.param(2, 4, 2, id="cp2_gqa", marks=pytest.mark.slow),
    pytest.param(4, 2, 1, id="cp4_mqa", marks=pytest.mark.slow),
])
def test_context_parallel_attention_equals_full_attention(world, heads, groups, tmp_path):
    """Each rank's output and its query, key and value gradients (keys and values
    gathered, their gradients reduce-scattered back) equal full causal attention's on the
    rank's chunks (float64, gloo processes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=_attention_worker, args=(r, world, store, heads, groups, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, errors in results.items():
        assert max(errors) < 1e-12, (rank, errors)


@pytest.mark.parametrize("argv,match", [
    (["--context-parallel-size", "3", "--seq-length", "128"], "not divisible by 6"),
    (["--context-parallel-size", "2", "--transformer-impl", "transformer_engine"],
     "not supported yet"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], "context-parallel SDPA core"),
    (["--context-parallel-size", "2", "--downstream-eval-interval", "5"],
     "--context-parallel-size 1"),
    (["--context-parallel-size", "0"], "context-parallel-size"),
])
def test_flag_refusals(argv, match, capsys):
    """Each refused combination is one line naming the flag."""
    with pytest.raises((ArgumentError, SystemExit)) as info:
        parse_args(["--preset", "tiny"] + argv)
    text = str(info.value) + capsys.readouterr().err
    assert match in text


def test_sequence_parallel_split_is_checked_after_the_context_split():
    from megatron_lrattn.training.step import check_sequence_parallel

    args = parse_args(["--preset", "tiny", "--context-parallel-size", "2",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    check_sequence_parallel(args)
    args.seq_length = 132  # 66 tokens per context-parallel rank do not split over TP=4
    args.tensor_model_parallel_size = 4
    with pytest.raises(ArgumentError, match="--context-parallel-size 2"):
        check_sequence_parallel(args)


def test_cuda_graph_steps_aside_under_context_parallelism():
    from megatron_lrattn.training.fusions import _cuda_graph_obstacles

    args = parse_args(["--preset", "tiny", "--context-parallel-size", "2"])
    assert any("context parallelism" in o for o in _cuda_graph_obstacles(args, True))


def test_local_core_is_refused_with_context_parallelism():
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec
    from tests.helpers import tiny_config

    config = tiny_config("lr_attnres", num_blocks=2)
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match="core_attention='sdpa'"):
        get_lr_attnres_layer_spec(config, core_attention="local")


LAYOUTS = {
    # name: (model flags, processes, layout flags)
    "cp2": ([], 2, ["--context-parallel-size", "2"]),
    "cp2_tp2_sp": ([], 4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"]),
    "cp2_pp2": ([], 4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "cp2_dp2_distopt": ([], 4, ["--context-parallel-size", "2", "--use-distributed-optimizer"]),
    "projected_cp2_pp2": (["--key", "projected"], 4,
                          ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "standard_cp2": (["--residual", "standard"], 2, ["--context-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def one_process(pretrain_once):
    """One-process runs, computed once per model (and shared with test_seed_layouts, which
    runs the same command)."""
    return lambda model: _losses(pretrain_once(1, CLI + list(model)))


def _losses(rows) -> list:
    return [(r["type"], r["loss"]) for r in rows if r["type"] in ("train", "valid")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_run_matches_one_process(layout, one_process, tmp_path, data_cache):
    """A fresh 4-step run split over context-parallel ranks (alone, with TP and sequence
    parallelism, with PP and the depth payload, with DP and the distributed optimizer; the
    standard residual runs megatron's layer on the same core) gives
    the one-process validation and training losses within 1e-6 relative (the attention and
    loss sums run in another order)."""
    model, nproc, flags = LAYOUTS[layout]
    ref = one_process(model)
    got = _losses(pretrain_rows(nproc, CLI + model + flags, tmp_path / "run.jsonl", data_cache))
    assert [t for t, _ in got] == [t for t, _ in ref] == ["valid"] + ["train"] * 4 + ["valid"]
    for (_, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (got, ref)


@pytest.mark.slow
def test_checkpoint_saved_under_context_parallelism_resumes_in_one_process(
        one_process, tmp_path, data_cache):
    """A run stopped at iteration 2 under CP=2 and resumed in one process continues the uninterrupted one-process run: the checkpoint holds one copy of
    the weights and optimizer state whatever the context-parallel layout."""
    ckpt = tmp_path / "ckpt"
    first = _losses(pretrain_rows(2, CLI + ["--context-parallel-size", "2", "--save", str(ckpt),
                                            "--save-interval", "2", "--exit-interval", "2"],
                                  tmp_path / "a.jsonl", data_cache))
    rest = _losses(pretrain_rows(1, CLI + ["--load", str(ckpt), "--save", str(ckpt)],
                                 tmp_path / "b.jsonl", data_cache))
    ref = one_process([])
    # the resumed run validates at its start (iteration 2), which the reference does not
    got = [x for x in first + rest if x[0] == "train"] + [rest[-1]]
    want = [x for x in ref if x[0] == "train"] + [ref[-1]]
    assert [t for t, _ in got] == [t for t, _ in want] == ["train"] * 4 + ["valid"], (got, want)
    for (_, a), (_, b) in zip(got, want):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (got, want)
