"""Tensor and pipeline parallelism on CPU/gloo reproduce the single-process model.

Every layout builds the model through the training builder, takes the weights of a
TP1PP1 model built from the same seed (TP shards cut along each parameter's
``partition_dim``/``partition_stride``, pipeline layers mapped to their global number),
runs megatron-core's schedule (1F1B with per-stage shapes under PP) on the same
micro-batches, and compares the per-micro-batch losses and the gradient of every parameter
(depth queries included, after ``finalize_model_grads``) with TP1PP1. A second test runs
``lrattn-pretrain`` under torchrun and compares its JSON-lines losses.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import pretrain_rows, rel_rms

MODES = {
    "standard": ["--residual", "standard"],
    "attnres": ["--residual", "attnres", "--num-blocks", "3"],
    "lr_sliced": ["--residual", "lr_attnres", "--key", "sliced", "--num-blocks", "3"],
    "lr_projected": ["--residual", "lr_attnres", "--key", "projected", "--num-blocks", "3"],
}
# L = 4 splits 2 + 2 under PP = 2; with N = 3 blocks (ends 3, 6, 8) the boundary after
# sub-layer 4 falls inside block 2, so the partial sum crosses it.
BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
]
VOCAB, SEQ, MBS, NUM_MICRO, SEED = 256, 32, 2, 4, 1234
LOSS_RTOL = 1e-6
# relative RMS error of each gradient tensor; depth queries against the RMS of all
# depth-query gradients (their common scale). fp32 sums taken in another order (TP shards,
# the CPU's SIMD width: 1.03e-6 for one depth query on an AVX-512 machine, under 1e-6 on
# the machines of earlier CI runs) differ by a few ulps (fp32 eps 1.2e-7); a wrong gradient is off by 1e-3 or more.
GRAD_RTOL = 4e-6


def _batches():
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(NUM_MICRO):
        out.append({
            "tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
            "position_ids": torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
            "loss_mask": torch.ones(MBS, SEQ),
        })
    return out


def _forward_step(data_iterator, model):
    from functools import partial

    from megatron_lrattn.training.step import loss_func

    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return out, partial(loss_func, b["loss_mask"])


def _shard(full: torch.Tensor, like: torch.nn.Parameter, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of ``full`` for a parameter shaped like ``like``."""
    if tuple(full.shape) == tuple(like.shape):
        return full
    dim, stride = like.partition_dim, getattr(like, "partition_stride", 1)
    pieces = full.chunk(tp * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def _global_name(name: str, model) -> str:
    if name.startswith("decoder.layers."):
        local = int(name.split(".")[2])
        layer = model.decoder.layers[local]
        rest = name.split(".", 3)[3]
        return f"decoder.layers.{layer.layer_number - 1}.{rest}"
    return name


def _run_layout(mode: str, tp: int, pp: int, ref, sp: bool = False, vp=None, layers: int = 4):
    """Build, (load ref weights), run one forward-backward; return weights, losses, grads.

    ``vp``: virtual stages per pipeline rank (interleaved schedule, one layer per chunk);
    ``layers``: the model's depth (``BASE`` has 4)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_lrattn.depth.pipeline import depth_tensor_shapes_fn
    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.builder import build_config, build_model_chunks, wrap_model

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp)
    try:
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        extra = ["--sequence-parallel"] if sp else []
        extra += ["--num-layers", str(layers)]
        if vp:
            extra += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vp))]
        args = parse_args(BASE + MODES[mode] + ["--tensor-model-parallel-size", str(tp),
                                               "--pipeline-model-parallel-size", str(pp)]
                          + extra)
        config = build_config(args, bf16=False)
        chunks = build_model_chunks(config, args, VOCAB)
        tp_rank = ps.get_tensor_model_parallel_rank()
        params = [(_global_name(n, m), p) for m in chunks for n, p in m.named_parameters()]
        if ref is not None:
            with torch.no_grad():
                for name, p in params:
                    p.copy_(_shard(ref["weights"][name], p, tp_rank, tp))
        weights = {name: p.detach().clone() for name, p in params}
        models = [wrap_model(m, config, False) for m in chunks]
        config.no_sync_func = [m.no_sync for m in models] if vp else models[0].no_sync
        kwargs = dict(num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=MBS,
                      decoder_seq_length=SEQ)
        shapes_fn = depth_tensor_shapes_fn(config)
        if shapes_fn is not None:
            kwargs["adjust_tensor_shapes_fn"] = shapes_fn
        rows = []  # sequence rows of the embedding output (split over TP ranks under SP)
        wire = {}  # interleaved: sources each chunk received over p2p, per micro-batch
        for m in chunks:
            if m.pre_process:
                m.embedding.register_forward_hook(lambda mod, a, out: rows.append(out.shape[0]))
            elif getattr(m.decoder, "chunk_plan", None) is not None:
                m.decoder.register_forward_pre_hook(
                    lambda mod, a: wire.setdefault(mod.chunk_plan.chunk, set()).add(
                        mod.packed_input.shape[0] // SEQ))
        for m in models:
            m.zero_grad_buffer()
        data = [iter(_batches()) for _ in models] if vp else iter(_batches())
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=data, model=models,
            forward_only=False, **kwargs)
        losses = [float(x["lm loss"]) for x in losses] if ps.is_pipeline_last_stage() else None
        grads = {name: p.main_grad.detach().clone() for name, p in params}
        errors = {}
        if ref is not None:
            # Depth-query gradients against the RMS of all of them: one query's gradient
            # can be several times smaller than the others' while its rounding error is not.
            queries = [g.double() for n, g in ref["grads"].items() if "depth_queries" in n]
            q_scale = (torch.cat([g.reshape(-1) for g in queries]).pow(2).mean().sqrt().item()
                       if queries else None)
            for name, p in params:
                want = _shard(ref["grads"][name], p, tp_rank, tp)
                errors[name] = rel_rms(grads[name], want)
                if "depth_queries" in name and q_scale:
                    diff = (grads[name].double() - want.double()).pow(2).mean().sqrt().item()
                    errors[name] = diff / q_scale
        cache = getattr(chunks[0].decoder, "stage_cache", None)
        return {"weights": weights, "grads": grads, "losses": losses, "errors": errors,
                "decoder_rows": sorted(set(rows)),
                "wire_sources": {str(c): sorted(v) for c, v in wire.items()},
                "cache_left": len(cache) if cache is not None else 0}
    finally:
        ps.destroy_model_parallel()


def _worker(rank: int, world: int, store: str, layouts, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_lrattn.compat.cpu import apply_cpu_compat

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    apply_cpu_compat()
    # a file rendezvous (``store``: a path not yet used): no port to race for
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    report = {}
    layers = 8 if any("L8" in layout for layout in layouts) else 4
    try:
        for mode in MODES:
            ref = _run_layout(mode, 1, 1, None, layers=layers)
            for layout in layouts:
                res = _run_layout(mode, *layout[:2], ref, sp="sp" in layout,
                                  vp=2 if "vp2" in layout else None, layers=layers)
                loss_err = None
                if res["losses"] is not None:
                    loss_err = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"]))
                worst = max(res["errors"].items(), key=lambda kv: kv[1])
                report[_key(mode, layout)] = {
                    "loss_rel_err": loss_err, "n_losses": len(res["losses"] or []),
                    "grad_rel_rms_max": worst[1], "worst_param": worst[0],
                    "n_params": len(res["errors"]),
                    "has_queries": any("depth_queries" in n for n in res["errors"]),
                    "decoder_rows": res["decoder_rows"],
                    "wire_sources": res["wire_sources"], "cache_left": res["cache_left"],
                }
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def _spawn(world: int, layouts, tmp_path) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), layouts, str(tmp_path)),
             nprocs=world)
    return {r: json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world)}


def _key(mode: str, layout) -> str:
    return f"{mode}/tp{layout[0]}pp{layout[1]}" + "".join(layout[2:])


def _check(reports: dict, layouts) -> None:
    for mode in MODES:
        for layout in layouts:
            key = _key(mode, layout)
            rows = [rep[key] for rep in reports.values()]
            loss_rows = [r for r in rows if r["loss_rel_err"] is not None]
            assert loss_rows and all(r["n_losses"] == NUM_MICRO for r in loss_rows), key
            for r in loss_rows:
                assert r["loss_rel_err"] <= LOSS_RTOL, (key, r)
            for r in rows:
                assert r["grad_rel_rms_max"] <= GRAD_RTOL, (key, r)
            if mode != "standard":
                assert any(r["has_queries"] for r in rows), key
            # The first stage's embedding output is split over TP ranks under SP.
            want = SEQ // layout[0] if "sp" in layout else SEQ
            assert all(r["decoder_rows"] in ([], [want]) for r in rows), (key, rows)
            assert any(r["decoder_rows"] for r in rows), key
            if "vp2" in layout and "L8" in layout and mode != "standard":
                # PP=4, 8 chunks of one layer: each chunk receives what hop_payloads says
                # is new to its rank (the payload formula), and the cache ends empty.
                from megatron_lrattn.depth.payload import hop_payloads
                from megatron_lrattn.depth.schedule import depth_schedule

                hops = hop_payloads(depth_schedule(8, 3),
                                    list(range(2, 17, 2)), 4, seq_rows=SEQ,
                                    micro_batch_size=MBS, width=64, bytes_per_element=4)
                want = {str(h.hop + 1): [len(h.new_sources)] for h in hops}
                wire = {c: n for r in rows for c, n in r["wire_sources"].items()}
                assert wire == want, (key, wire, want)
                assert sum(len(h.new_sources) for h in hops) < sum(len(h.sources) for h in hops)
                assert all(r["cache_left"] == 0 for r in rows), key
            elif "vp2" in layout and mode != "standard":
                # L=4, N=3, one layer per chunk (ends 2, 4, 6, 8 on ranks 0, 1, 0, 1): chunks
                # 1..3 receive v0 P[1:2] | B1 P[4:4] | B2 (naive: 2, 3, 3 sources); the
                # rest comes from the rank-local cache, which is empty after the step.
                wire = {c: n for r in rows for c, n in r["wire_sources"].items()}
                assert wire == {"1": [2], "2": [2], "3": [1]}, (key, wire)
                assert all(r["cache_left"] == 0 for r in rows), key


@pytest.mark.slow
def test_tp2_sp_pp2_and_interleaved_match_tp1pp1(tmp_path):
    """TP=2, TP=2 with sequence parallelism, PP=2 (stage boundary inside a depth block)
    and PP=2 with 2 virtual stages per rank (interleaved schedule, rank-local source
    cache): per-micro-batch losses and every gradient equal TP1PP1 from the same weights,
    for all residual modes. Under SP every depth source is [s/2, b, d] on each rank and the
    gradients of the norms, depth queries and embedding key projection are all-reduced
    across TP by ``finalize_model_grads``."""
    layouts = [(2, 1), (2, 1, "sp"), (1, 2), (1, 2, "vp2")]
    reports = _spawn(2, layouts, tmp_path)
    print(json.dumps(reports, indent=1))
    _check(reports, layouts)


@pytest.mark.slow
def test_tp2xpp2_matches_tp1pp1(tmp_path):
    """TP=2 x PP=2 on four processes."""
    layouts = [(2, 2)]
    reports = _spawn(4, layouts, tmp_path)
    print(json.dumps(reports, indent=1))
    _check(reports, layouts)


@pytest.mark.slow
def test_pp4_interleaved_matches_tp1pp1(tmp_path):
    """PP=4 with 2 virtual stages per rank (8 layers, one per chunk) on four processes: the
    layout of the four-GPU profile, with the rank-local source cache across 8 chunks."""
    layouts = [(1, 4, "vp2", "L8")]
    reports = _spawn(4, layouts, tmp_path)
    print(json.dumps(reports, indent=1))
    _check(reports, layouts)


@pytest.mark.parametrize("key,width", [("sliced", 64), ("projected", 80)])
def test_stage_shapes_follow_the_depth_schedule(key, width):
    """L=4, N=3 (block ends 3, 6, 8), PP=2: the boundary after sub-layer 4 carries v0, B1
    and the partial P[4:4], i.e. 3 sources of s rows; projected keys widen it by r."""
    from megatron_lrattn.model.config import LRAttnResConfig
    from megatron_lrattn.depth.pipeline import depth_tensor_shapes_fn, stage_sublayers

    config = LRAttnResConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                             pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                             residual="lr_attnres", key_type=key, num_blocks=3)
    assert [stage_sublayers(config, r) for r in (0, 1)] == [(0, 4), (4, 8)]
    default = [(SEQ, MBS, 64)]
    recv0, send0 = depth_tensor_shapes_fn(config, 0)(default, default)
    recv1, _ = depth_tensor_shapes_fn(config, 1)(default, default)
    assert recv0 == [(SEQ, MBS, width)]
    assert send0 == recv1 == [(3 * SEQ, MBS, width)]
    single = LRAttnResConfig(num_layers=4, hidden_size=64, num_attention_heads=4)
    assert depth_tensor_shapes_fn(single, 0) is None


CLI = BASE[:-4] + [
    "--global-batch-size", "4", "--num-blocks", "3", "--residual", "lr_attnres",
    "--key", "projected", "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "1",
    "--lr-warmup-iters", "1", "--no-progress",
]


def _pretrain(nproc: int, extra, log: Path, cache_dir: Path) -> list:
    rows = pretrain_rows(nproc, CLI + extra, log, cache_dir, timeout=300)
    return [(r["iteration"], r["loss"]) for r in rows if r["type"] == "train"]


@pytest.mark.slow
def test_pretrain_cli_tp2_pp2_vp2_dp2_distributed_optimizer_follows_one_process(tmp_path,
                                                                              data_cache):
    """The eight-GPU layout at the tiny scale: eight processes, TP=2 x PP=2 (2 virtual stages
    per rank) x DP=2 with the distributed optimizer, resumed from a one-process checkpoint
    whose optimizer state was saved ``fully_reshardable``, follow the one-process losses
    (the iteration after the load uses the loaded Adam moments and step count). The same
    checkpoint saved ``dp_reshardable`` is refused in one line naming both layouts."""
    many = ["--global-batch-size", "16", "--train-iters", "3", "--use-distributed-optimizer"]
    _pretrain(1, many + ["--save", str(tmp_path / "full"), "--exit-interval", "1",
                         "--dist-ckpt-optim-fully-reshardable"], tmp_path / "init.jsonl",
              data_cache)
    ref = _pretrain(1, many + ["--load", str(tmp_path / "full")], tmp_path / "ref.jsonl",
                    data_cache)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1"]
    big = _pretrain(8, many + layout + ["--load", str(tmp_path / "full")],
                    tmp_path / "big.jsonl", data_cache)
    assert [i for i, _ in ref] == [i for i, _ in big] == [2, 3]
    for (_, a), (_, b) in zip(big, ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (big, ref)

    _pretrain(1, many + ["--save", str(tmp_path / "dp"), "--exit-interval", "1"],
              tmp_path / "init_dp.jsonl", data_cache)
    with pytest.raises(AssertionError, match=r"saved in the dp_reshardable format at TP=1, "
                                             r"PP=1 and loads only at that layout; this run "
                                             r"has TP=2, PP=2 with 2 virtual stages per rank"):
        _pretrain(4, many + layout + ["--load", str(tmp_path / "dp")],
                  tmp_path / "refused.jsonl", data_cache)


@pytest.mark.slow
def test_pretrain_cli_tp2_and_pp2_match_one_process(tmp_path, data_cache):
    """``lrattn-pretrain`` under torchrun: TP=2 and PP=2 from scratch follow the 1-process
    losses (initial weights depend on the seed and each parameter's global name only), and
    PP=2 resuming the 1-process checkpoint of iteration 2 follows its iterations 3 and 4."""
    import shutil

    cache = data_cache
    ckpt = tmp_path / "ckpt"
    ref = _pretrain(1, ["--save", str(ckpt), "--save-interval", "2"], tmp_path / "ref.jsonl",
                    cache)
    assert [i for i, _ in ref] == [1, 2, 3, 4]
    tp2 = _pretrain(2, ["--tensor-model-parallel-size", "2"], tmp_path / "tp2.jsonl", cache)
    pp2_fresh = _pretrain(2, ["--pipeline-model-parallel-size", "2"], tmp_path / "pp2f.jsonl",
                          cache)
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copytree(ckpt / "iter_0000002", resume / "iter_0000002")
    (resume / "latest").write_text("iter_0000002\n")
    pp2 = _pretrain(2, ["--pipeline-model-parallel-size", "2", "--load", str(resume)],
                    tmp_path / "pp2.jsonl", cache)
    assert [i for i, _ in tp2] == [1, 2, 3, 4] == [i for i, _ in pp2_fresh]
    assert [i for i, _ in pp2] == [3, 4]
    for run in (tp2, pp2_fresh):
        for (_, a), (_, b) in zip(run, ref):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (run, ref)
    for (_, a), (_, b) in zip(pp2, ref[2:]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (pp2, ref)


@pytest.mark.slow
def test_pretrain_cli_interleaved_follows_one_process(tmp_path, data_cache):
    """``lrattn-pretrain`` with PP=2 and 2 virtual stages per rank, 8 micro-batches per step
    (so the interleaved schedule's steady state exchanges activations and gradients of
    different shapes between the same two ranks), resumed from a 1-process checkpoint, follows
    the 1-process losses."""
    ckpt = tmp_path / "ckpt"
    many = ["--global-batch-size", "16", "--train-iters", "3"]
    _pretrain(1, many + ["--save", str(ckpt), "--exit-interval", "1"], tmp_path / "init.jsonl",
              data_cache)
    ref = _pretrain(1, many + ["--load", str(ckpt)], tmp_path / "ref.jsonl", data_cache)
    vpp = _pretrain(2, many + ["--load", str(ckpt), "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1"],
                    tmp_path / "vpp.jsonl", data_cache)
    assert [i for i, _ in ref] == [i for i, _ in vpp] == [2, 3]
    for (_, a), (_, b) in zip(vpp, ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (vpp, ref)
