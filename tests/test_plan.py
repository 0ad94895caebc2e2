"""The cluster planner (``lrattn-plan``): memory and time model sanity, activation
recomputation, the recommendation, its ``lrattn-pretrain`` flags (parsed by the real
parser), ``--config`` files, and fuzzed command lines (a traceback is a failure)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_lrattn.analysis.plan import plan, recommend
from megatron_lrattn.analysis.plan_layouts import Cluster, Layout, layouts, sequence_splits
from megatron_lrattn.analysis.plan_model import (
    CALIBRATION,
    GIB,
    RECOMPUTE_INPUTS,
    USABLE_MEMORY,
    _shape_costs,
    predict,
    preset_shape,
)
from megatron_lrattn.cli.plan import main
from megatron_lrattn.training.arg_types import ArgumentError
from megatron_lrattn.training.arguments import parse_args

PRESET_FILES = Path(__file__).resolve().parents[1] / "examples" / "presets"


def _pred(name="1b", gbs=8, gpus=1, **layout):
    shape = preset_shape(name)
    lay = dict(tp=1, pp=1, vpp=1, dp=gpus, micro_batch=8 // gpus if gbs == 8 else 1,
               distributed_optimizer=False)
    lay.update(layout)
    return predict(shape, Layout(**lay), gbs, Cluster(gpus=gpus))


def test_calibration_points_are_reproduced():
    """The one-H200 standard steps the MFU curve is fitted to come back (optimizer time
    included), and lr_attnres costs its measured factor."""
    for name, mbs, seq, tp, ms, _ in CALIBRATION:
        shape = preset_shape(name, seq_length=seq, residual="standard")
        got = predict(shape, Layout(tp, 1, 1, 1, mbs, False), mbs, Cluster())
        assert got.step_s * 1e3 == pytest.approx(ms, rel=1e-6)
    std = predict(preset_shape("1b", residual="standard"), Layout(1, 1, 1, 1, 8, False),
                    8, Cluster())
    lr = _pred()
    assert 1.03 < lr.step_s / std.step_s < 1.06


def test_memory_model_parts():
    one = _pred(micro_batch=2)
    # 18 bytes per parameter without the distributed optimizer
    assert one.weights_gib * 9 == pytest.approx(one.weights_gib + one.grads_gib + one.optimizer_gib)
    assert one.depth_state_gib > 0
    # the 1b peak at micro-batch 2 x 2048 on one H200: 20.8 GiB
    assert one.memory_gib == pytest.approx(20.8, rel=0.05)
    # the distributed optimizer shards only the optimizer state
    a = _pred(gbs=16, gpus=2, micro_batch=2)
    b = _pred(gbs=16, gpus=2, micro_batch=2, distributed_optimizer=True)
    assert b.optimizer_gib == pytest.approx(a.optimizer_gib / 2)
    assert b.weights_gib == a.weights_gib and b.activations_gib == a.activations_gib
    # TP divides weights and activations; PP divides the layers
    t = _pred(gbs=8, gpus=2, tp=2, dp=1, micro_batch=2)
    assert t.weights_gib < 0.51 * one.weights_gib and t.activations_gib == pytest.approx(
        one.activations_gib / 2)
    p = _pred(gbs=8, gpus=2, pp=2, dp=1, micro_batch=2)
    assert p.weights_gib < 0.6 * one.weights_gib and p.bubble_s > 0 and p.pp_comm_s > 0
    # standard residuals carry no depth state
    s = predict(preset_shape("1b", residual="standard"), Layout(1, 1, 1, 1, 2, False), 8,
                  Cluster())
    assert s.depth_state_gib == 0


def test_time_model_sanity():
    base = _pred(gbs=64, gpus=8, micro_batch=1)
    # more micro-batches shrink the bubble; interleaving shrinks it further
    few = _pred(gbs=64, gpus=8, pp=2, dp=4, micro_batch=8)
    many = _pred(gbs=64, gpus=8, pp=2, dp=4, micro_batch=1)
    inter = _pred(gbs=64, gpus=8, pp=2, vpp=2, dp=4, micro_batch=1)
    assert few.bubble_s > many.bubble_s > inter.bubble_s > 0
    # overlap never makes the data-parallel reduce slower; a slower network makes it slower
    off = predict(preset_shape("1b"), Layout(1, 1, 1, 8, 1, False, overlap=False), 64,
                    Cluster(gpus=8))
    assert base.dp_comm_s <= off.dp_comm_s
    nodes = Cluster(gpus=16, gpus_per_node=8)
    slow = predict(preset_shape("1b"), Layout(1, 1, 1, 16, 1, False), 64, nodes)
    slower = predict(preset_shape("1b"), Layout(1, 1, 1, 16, 1, False), 64,
                       Cluster(gpus=16, gpus_per_node=8, inter_node_gbps=50))
    assert slower.dp_comm_s > slow.dp_comm_s
    # the step is the sum of its parts; tokens/s follows
    parts = (base.compute_s + base.optimizer_s + base.tp_comm_s + base.dp_comm_s
             + base.pp_comm_s + base.bubble_s)
    assert base.step_s == pytest.approx(parts)
    assert base.tokens_per_s == pytest.approx(64 * 2048 / base.step_s)


def test_layouts_cover_the_gpus_and_divide_the_model():
    shape = preset_shape("8b")
    cluster = Cluster(gpus=64)
    seen = list(layouts(shape, 256, cluster))
    assert seen
    assert {lay.cp for lay in seen} == {1, 2, 4, 8, 16, 32, 64}
    for lay in seen:
        assert lay.tp * lay.cp * lay.pp * lay.dp == 64
        assert sequence_splits(shape.seq_length, lay.tp, lay.cp)
        assert shape.num_layers % (lay.pp * lay.vpp) == 0
        assert 256 % (lay.micro_batch * lay.dp) == 0
        assert shape.num_query_groups % lay.tp == 0 and lay.tp <= 8


@pytest.mark.parametrize("name,gpus,gbs", [("1b", 1, 8), ("4b", 1, 8), ("8b", 8, 64),
                                           ("8b", 64, 256), ("4b", 1024, 1024)])
def test_recommendation_is_the_fastest_that_fits(name, gpus, gbs):
    preds = plan(preset_shape(name), gbs, Cluster(gpus=gpus))
    best = recommend(preds)
    assert best is not None and best.fits
    assert best.memory_gib <= USABLE_MEMORY * 141.0
    assert all(p.step_s >= best.step_s for p in preds if p.fits)
    # recomputation changes nothing where a layout fits without it
    assert best.recompute == "none"
    assert recommend(plan(preset_shape(name), gbs, Cluster(gpus=gpus),
                              recompute=False)) == best


def test_context_parallel_divides_the_per_token_memory():
    """CP divides activations, depth state and logits; weights and gradients are replicated;
    the distributed optimizer shards over DP x CP."""
    one = _pred(gbs=8, gpus=2, dp=2, micro_batch=2, distributed_optimizer=True)
    for cp in (2, 4):
        got = _pred(gbs=8, gpus=2 * cp, dp=2, cp=cp, micro_batch=2, distributed_optimizer=True)
        for part in ("activations_gib", "depth_state_gib", "logits_gib"):
            assert getattr(got, part) == pytest.approx(getattr(one, part) / cp), part
        assert got.weights_gib == one.weights_gib and got.grads_gib == one.grads_gib
        assert got.optimizer_gib == pytest.approx(one.optimizer_gib / cp)
        assert got.num_micro == one.num_micro and got.memory_gib < one.memory_gib
    # with TP: the sequence-parallel shard of a CP rank
    t = _pred(gbs=8, gpus=4, tp=2, cp=2, dp=1, micro_batch=2)
    assert t.activations_gib == pytest.approx(_pred(micro_batch=2).activations_gib / 4)


def test_context_parallel_kv_gather_cost():
    """The K/V all-gather (forward) and reduce-scatter (backward) appear only with CP > 1,
    grow with CP, follow the ring formula, and use the network once TP x CP spans nodes."""
    shape = preset_shape("8b")
    assert _pred("8b", gbs=8, gpus=8, micro_batch=1).cp_comm_s == 0
    cluster = Cluster(gpus=16)
    times = []
    for cp in (1, 2, 4, 8, 16):
        p = predict(shape, Layout(1, 1, 1, 16 // cp, 1, True, cp=cp), 16, cluster)
        times.append(p.cp_comm_s)
        parts = (p.compute_s + p.optimizer_s + p.tp_comm_s + p.cp_comm_s + p.dp_comm_s
                 + p.pp_comm_s + p.bubble_s)
        assert p.step_s == pytest.approx(parts)
    assert times[0] == 0 and all(a < b for a, b in zip(times, times[1:]))
    # 2 (gather + reduce-scatter) x L layers x m micro-batches x (c-1)/c x K and V bytes / bw
    s, gk = shape.seq_length, shape.num_query_groups * shape.head_dim
    tp, cp, m = 2, 4, 2
    got = predict(shape, Layout(tp, 1, 1, 1, 1, True, cp=cp), m, Cluster(gpus=8))
    kv = 2 * s * gk / tp * 2
    want = 2 * shape.num_layers * m * (cp - 1) / cp * kv / Cluster().bandwidth(8)
    assert got.cp_comm_s == pytest.approx(want)
    # TP=2 x CP=8 spans two nodes: the slower network carries the gather
    wide = predict(shape, Layout(2, 1, 1, 1, 1, True, cp=8), m, Cluster(gpus=16))
    assert wide.cp_comm_s / got.cp_comm_s == pytest.approx(
        (7 / 8) / (3 / 4) * Cluster().bandwidth(8) / Cluster().bandwidth(16))


def test_layouts_whose_sequence_does_not_split_are_absent(capsys):
    """s must divide by 2 CP (by 2 TP CP with sequence parallelism, s by TP at CP = 1)."""
    shape = preset_shape("1b", seq_length=4100)  # 4 x 1025
    seen = {(lay.tp, lay.cp) for lay in layouts(shape, 64, Cluster(gpus=16))}
    assert seen == {(1, 1), (2, 1), (4, 1), (1, 2)}
    with pytest.raises(ValueError, match="does not split"):
        predict(shape, Layout(2, 1, 1, 4, 1, False, cp=2), 64, Cluster(gpus=16))
    assert main(["--seq-length", "4100", "--gpus", "16", "--context-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrattn-plan: error: --context-parallel-size 4") and err.count("\n") == 1


def test_long_sequence_needs_context_parallelism(capsys):
    """8b at 32k tokens on 64 GPUs of 32 GiB: without recomputation no CP = 1 layout fits; a
    CP layout does (and stays the recommendation with recomputation allowed); at CP = 1
    only recomputation makes a layout fit."""
    shape = preset_shape("8b", seq_length=32768)
    cluster = Cluster(gpus=64, gpu_memory_gib=32)
    preds = plan(shape, 64, cluster, recompute=False)
    assert not [p for p in preds if p.layout.cp == 1 and p.fits]
    best = recommend(preds)
    assert best is not None and best.layout.cp > 1 and best.cp_comm_s > 0
    assert recommend(plan(shape, 64, cluster)) == best
    only_cp1 = recommend(plan(shape, 64, cluster, context_parallel=[1]))
    assert only_cp1.layout.cp == 1 and only_cp1.recompute != "none"
    argv = ["--preset", "8b", "--seq-length", "32768", "--gpus", "64", "--global-batch-size",
            "64", "--gpu-memory-gib", "32"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context_parallel_size"] == best.layout.cp == data["recommended"]["cp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"recommended (*): TP={best.layout.tp} CP={best.layout.cp} " in out
    assert "CP comm" in out
    assert main(argv + ["--context-parallel-size", "1", "--no-recompute"]) == 0
    assert "no layout fits in memory: the smallest needs" in capsys.readouterr().out
    assert main(argv + ["--context-parallel-size", "1"]) == 0
    assert "recommended (*): TP=" in capsys.readouterr().out


def test_nothing_fits_on_a_small_gpu(capsys):
    preds = plan(preset_shape("8b"), 8, Cluster(gpus=1, gpu_memory_gib=16))
    assert preds and recommend(preds) is None
    # the JSON says why in one line, from the layout of least memory (with recomputation)
    assert main(["--preset", "8b", "--gpus", "1", "--gpu-memory-gib", "16",
                 "--global-batch-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    low = min(preds, key=lambda p: p.memory_gib)
    assert data["recommended"] is None and low.recompute != "none"
    assert data["reason"].startswith(f"no layout fits in memory: the smallest needs "
                                     f"{low.memory_gib:.1f} GiB per GPU (TP=1 ")
    assert "\n" not in data["reason"] and "14.7 of 16 GiB are usable" in data["reason"]
    assert main(["--preset", "8b", "--gpus", "3", "--global-batch-size", "8", "--json"]) == 0
    reason = json.loads(capsys.readouterr().out)["reason"]
    assert reason.startswith("no layout: global batch 8 or sequence length 8192")


@pytest.mark.parametrize("residual", ["standard", "lr_attnres"])
def test_recompute_keeps_the_layer_inputs(residual):
    """Full recompute of every layer keeps RECOMPUTE_INPUTS [s, b, d] bf16 tensors per layer
    instead of its activations, plus one layer's activations rebuilt in the backward;
    block k keeps the activations of the other layers; nothing else changes."""
    shape = preset_shape("1b", residual=residual)
    lay = Layout(1, 1, 1, 1, 2, False)
    none = predict(shape, lay, 8, Cluster())
    full = none.activations_gib / 16  # one layer, one micro-batch
    kept = RECOMPUTE_INPUTS[residual] * 2 * 2048 * 2 * 2048 / GIB
    every = predict(shape, dataclasses.replace(lay, recompute_layers=16), 8, Cluster())
    assert every.recompute == "uniform"
    assert every.activations_gib == pytest.approx(16 * kept + full)
    assert every.activations_gib < none.activations_gib / 5
    block = predict(shape, dataclasses.replace(lay, recompute_layers=5), 8, Cluster())
    assert block.recompute == "block"
    assert block.activations_gib == pytest.approx(11 * full + 5 * kept)
    for part in ("weights_gib", "grads_gib", "optimizer_gib", "depth_state_gib", "logits_gib",
                 "compute_s"):
        assert getattr(every, part) == getattr(none, part) == getattr(block, part), part
    # PP = 2: the first stage's 8 layers for 2 (1 + 1/2) = 3 micro-batches in flight keep
    # their inputs (micro-batch 1: half the tokens), one layer is rebuilt
    pp = predict(shape, Layout(1, 2, 1, 1, 1, False, recompute_layers=8), 8,
                   Cluster(gpus=2))
    pp_none = predict(shape, Layout(1, 2, 1, 1, 1, False), 8, Cluster(gpus=2))
    one = pp_none.activations_gib / (8 * 3)
    assert pp.activations_gib == pytest.approx(3 * 8 * kept / 2 + one)


def test_recompute_reruns_the_forward_of_the_recomputed_layers():
    """The rerun costs 1/3 of the recomputed layers' compute (x 4/3; the LM head is not
    rerun), their forward TP collectives (x 3/2 with every layer) and CP K/V gathers, and
    sits in the step and the bubble."""
    shape = preset_shape("4b")
    cluster = Cluster(gpus=16)
    lay = Layout(2, 2, 1, 2, 1, True, cp=2)
    none = predict(shape, lay, 64, cluster)
    _, _, flops_token, _ = _shape_costs(shape)
    layers = none.compute_s * (1 - 6 * shape.vocab_size * shape.hidden_size / flops_token)
    every = predict(shape, dataclasses.replace(lay, recompute_layers=16), 64, cluster)
    assert every.recompute_s == pytest.approx(layers / 3)
    assert (every.compute_s + every.recompute_s - none.compute_s) / layers == pytest.approx(1 / 3)
    assert every.tp_comm_s == pytest.approx(1.5 * none.tp_comm_s)
    assert every.cp_comm_s == pytest.approx(1.5 * none.cp_comm_s)
    assert every.bubble_s == pytest.approx((every.compute_s + every.recompute_s) / 32)
    parts = (every.compute_s + every.recompute_s + every.optimizer_s + every.tp_comm_s
             + every.cp_comm_s + every.dp_comm_s + every.pp_comm_s + every.bubble_s)
    assert every.step_s == pytest.approx(parts) and every.step_s > none.step_s
    # block k: k of the 16 layers of a chunk (8 of a virtual stage with V = 2)
    half = predict(shape, dataclasses.replace(lay, recompute_layers=8), 64, cluster)
    assert half.recompute_s == pytest.approx(every.recompute_s / 2)
    inter = predict(shape, dataclasses.replace(lay, vpp=2, recompute_layers=8), 64, cluster)
    assert inter.recompute == "uniform" and inter.recompute_s == pytest.approx(
        every.recompute_s)
    with pytest.raises(ValueError, match="recompute_layers 9 is not in"):
        predict(shape, dataclasses.replace(lay, vpp=2, recompute_layers=9), 64, cluster)


def test_only_recompute_makes_a_layout_fit(capsys):
    """4b on one 64 GiB GPU: no layout fits without recomputation (no TP, CP or PP on one
    GPU); with it the fewest recomputed layers that fit are recommended, and a recomputed
    row is listed only for a layout that does not fit without."""
    shape = preset_shape("4b")
    cluster = Cluster(gpus=1, gpu_memory_gib=64)
    assert recommend(plan(shape, 8, cluster, recompute=False)) is None
    preds = plan(shape, 8, cluster)
    best = recommend(preds)
    assert best is not None and best.recompute == "block" and best.recompute_s > 0
    fewer = dataclasses.replace(best.layout, recompute_layers=best.layout.recompute_layers - 1)
    assert not predict(shape, fewer, 8, cluster).fits
    plain = {p.layout for p in preds if p.recompute == "none"}
    for p in preds:
        if p.recompute != "none":
            assert dataclasses.replace(p.layout, recompute_layers=0) in plain
            assert not predict(shape, dataclasses.replace(p.layout, recompute_layers=0), 8,
                                 cluster).fits
    assert main(["--preset", "4b", "--gpus", "1", "--gpu-memory-gib", "64",
                 "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out.splitlines()[1]
    assert f"full recompute of {best.layout.recompute_layers} layer(s) per chunk" in out
    assert f"--recompute-method block --recompute-num-layers {best.layout.recompute_layers}" in out


def test_cli_table_and_json(capsys):
    assert main(["--preset", "1b", "--gpus", "2", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended (*)" in out and "CP=1" in out and "CP tried: 1, 2" in out
    assert main(["--preset", "4b", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpus"] == 16 and data["context_parallel_size"] == 1
    assert data["recommended"]["fits"] and data["layouts"]
    assert {"cp", "cp_comm_s"} <= set(data["recommended"])
    assert main(["--gpus", "4", "--nodes", "1"]) == 2
    assert "disagrees" in capsys.readouterr().err


def _plan_json(argv):
    """``lrattn-plan argv --json`` as a dict."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv) + ["--json"]) == 0
    return json.loads(out.getvalue())


def assert_flags_realise(args, rec, gpus):
    """``args``, parsed by ``lrattn-pretrain``'s parser, run the layout ``rec`` (the
    planner's ``recommended`` object) on ``gpus`` GPUs."""
    tp, pp, cp = rec["tp"], rec["pp"], rec["cp"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size) == (tp, pp, cp)
    assert gpus % (tp * pp * cp) == 0 and gpus // (tp * pp * cp) == rec["dp"]
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    assert (1 if per_virtual is None else args.num_layers // (pp * per_virtual)) == rec["vpp"]
    assert args.sequence_parallel == (tp > 1)
    assert args.micro_batch_size == rec["micro_batch"]
    assert args.global_batch_size // (args.micro_batch_size * rec["dp"]) == rec["num_micro"]
    assert args.use_distributed_optimizer == rec["distributed_optimizer"]
    reduced = rec["dp"] * cp > 1
    assert args.overlap_grad_reduce is reduced
    assert args.overlap_param_gather is (reduced and rec["distributed_optimizer"])
    chunk = args.num_layers // (pp * rec["vpp"])
    if rec["recompute"] == "none":
        assert args.recompute_granularity is None and rec["recompute_layers"] == 0
    else:
        assert args.recompute_granularity == "full"
        assert args.recompute_method == rec["recompute"]
        # the layers of a chunk LRAttnResBlock.recompute_groups runs under recompute
        k = args.recompute_num_layers
        recomputed = chunk if args.recompute_method == "uniform" else min(k, chunk)
        assert recomputed == rec["recompute_layers"]
        assert (k == 1) if args.recompute_method == "uniform" else k < chunk


_FLAG_CASES = [
    ("1b", ["--nodes", "1"]),
    ("4b", ["--nodes", "4", "--gpus-per-node", "1", "--gpu-memory-gib", "24"]),
    ("4b", ["--nodes", "1", "--gpus-per-node", "4", "--gpu-memory-gib", "24",
            "--seq-length", "16384"]),
    ("4b", ["--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gib", "24",
            "--seq-length", "16384"]),
    ("8b", ["--nodes", "8", "--gpus-per-node", "4", "--gpu-memory-gib", "16",
            "--seq-length", "16384"]),
    ("0.5b", ["--gpus", "2", "--gpus-per-node", "2", "--gpu-memory-gib", "16"]),
]


def test_recommended_flags_parse_to_the_planned_layout():
    """The flags of the recommendation, given to lrattn-pretrain's parser with the preset,
    are accepted and run the planned layout; the cases cover TP (with sequence
    parallelism), CP, PP, VPP, both recompute methods, both optimizers and a model flag."""
    seen = set()
    for preset, argv in _FLAG_CASES:
        data = _plan_json(["--preset", preset] + argv)
        rec = data["recommended"]
        args = parse_args(["--preset", preset] + rec["flags"])
        assert_flags_realise(args, rec, data["cluster"]["gpus"])
        if "--seq-length" in argv:
            assert args.seq_length == int(argv[argv.index("--seq-length") + 1])
            seen.add("model flag")
        seen |= {name for name, on in (("tp", rec["tp"] > 1), ("cp", rec["cp"] > 1),
                                       ("pp", rec["pp"] > 1), ("vpp", rec["vpp"] > 1),
                                       ("distopt", rec["distributed_optimizer"]),
                                       ("no distopt", not rec["distributed_optimizer"])) if on}
        seen.add(rec["recompute"])
    assert seen == {"tp", "cp", "pp", "vpp", "distopt", "no distopt", "none", "uniform",
                    "block", "model flag"}


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["tiny", "0.5b", "1b", "4b", "8b"]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2, 4, 8]), st.sampled_from([16, 24, 40, 80, 141]),
       st.sampled_from([[], ["--seq-length", "16384"], ["--global-batch-size", "64"]]))
def test_fuzzed_recommendations_parse_to_the_planned_layout(preset, nodes, per_node, memory,
                                                             extra):
    data = _plan_json(["--preset", preset, "--nodes", str(nodes), "--gpus-per-node",
                       str(per_node), "--gpu-memory-gib", str(memory)] + extra)
    rec = data["recommended"]
    if rec is None:
        assert data["reason"].startswith("no layout") and "\n" not in data["reason"]
        return
    assert data["reason"] is None and rec["summary"].startswith(f"TP={rec['tp']} CP=")
    args = parse_args(["--preset", preset] + rec["flags"])
    assert_flags_realise(args, rec, nodes * per_node)


def test_config_file_plans_as_lrattn_pretrain_reads_it(tmp_path):
    """``--config``: a generated preset file plans as its preset; an edited copy with a
    ``preset`` key plans its own model and batch, and lrattn-pretrain given the same file
    and the recommended flags runs that layout."""
    a = _plan_json(["--preset", "1b", "--nodes", "2"])
    b = _plan_json(["--config", str(PRESET_FILES / "1b.yaml"), "--nodes", "2"])
    assert b["preset"] == "tiny" and b["config"].endswith("1b.yaml")  # lrattn-pretrain's base
    assert b["layouts"] == a["layouts"] and b["recommended"] == a["recommended"]
    cfg = tmp_path / "long.yaml"
    cfg.write_text("preset: 4b\nseq_length: 16384\nglobal_batch_size: 64\n")
    data = _plan_json(["--config", str(cfg), "--gpu-memory-gib", "80", "--gpus", "8"])
    assert data["preset"] == "4b" and data["global_batch_size"] == 64
    rec = data["recommended"]
    args = parse_args(["--config", str(cfg)] + rec["flags"])
    assert (args.num_layers, args.seq_length, args.global_batch_size) == (32, 16384, 64)
    assert_flags_realise(args, rec, 8)
    # TE runs CP = 1 only; FP8 with depth attention is not recomputed
    te = tmp_path / "te.yaml"
    te.write_text("preset: 4b\ntransformer_impl: transformer_engine\nfp8_format: e4m3\n")
    data = _plan_json(["--config", str(te), "--gpus", "8", "--gpu-memory-gib", "24"])
    assert {row["cp"] for row in data["layouts"]} == {1}
    assert {row["recompute"] for row in data["layouts"]} == {"none"}


@pytest.mark.parametrize("text,extra,message,pretrain_refuses", [
    ("sequence_parallel: true\n", [], "sequence_parallel fix(es) a layout choice", False),
    ("recompute_granularity: full\nrecompute_method: uniform\nrecompute_num_layers: 1\n", [],
     "recompute_granularity, recompute_method, recompute_num_layers fix(es)", False),
    ("num_layerz: 3\n", [], "unknown key 'num_layerz'", True),
    ("hidden_size: big\n", [], "key 'hidden_size': expected an integer", True),
    ("preset: 4b\n", ["--preset", "1b"], "--preset 1b disagrees with preset '4b'", True),
    ("[1, 2]\n", [], "expected a mapping", True),
])
def test_config_file_refusals_are_one_line(tmp_path, capsys, text, extra, message,
                                           pretrain_refuses):
    """A file lrattn-pretrain refuses is refused with its message (the same reader); keys
    that fix a layout choice the recommended flags could not undo are refused too."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert main(["--config", str(cfg)] + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrattn-plan: error:") and message in err and err.count("\n") == 1
    if pretrain_refuses:
        with pytest.raises(ArgumentError, match=re.escape(message)):
            parse_args(["--config", str(cfg)] + extra)


_FLAGS = ["--preset", "--num-layers", "--hidden-size", "--ffn-hidden-size",
          "--num-attention-heads", "--num-query-groups", "--seq-length", "--rank",
          "--num-blocks", "--vocab-size", "--residual", "--key", "--global-batch-size",
          "--micro-batch-size", "--gpus", "--nodes", "--gpus-per-node", "--gpu-memory-gib",
          "--intra-node-gbps", "--inter-node-gbps", "--peak-tflops", "--top", "--json",
          "--context-parallel-size", "--config", "--no-recompute"]
_VALUES = ["0", "-1", "1", "2", "3", "8", "16", "48", "1e9", "nan", "inf", "x", "tiny", "8b",
           "standard", "attnres", "projected", "0.5"]


def _plan_or_refuse(argv):
    """``lrattn-plan argv`` exits 0, or 2 with one ``lrattn-plan: error:`` line."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert rc in (0, 2), (argv, rc)
    if rc == 2:
        assert err.getvalue().startswith("lrattn-plan: error:"), (argv, err.getvalue())
        assert err.getvalue().count("\n") == 1, (argv, err.getvalue())


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_FLAGS), st.sampled_from(_VALUES)), max_size=5))
def test_fuzzed_flags_plan_or_refuse_in_one_line(pairs):
    _plan_or_refuse([x for pair in pairs for x in pair])


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_VALUES), st.sampled_from(_VALUES), st.sampled_from(_VALUES),
       st.lists(st.tuples(st.sampled_from(_FLAGS), st.sampled_from(_VALUES)), max_size=2))
def test_fuzzed_context_parallel_size_plans_or_refuses_in_one_line(cp, seq, gpus, pairs):
    _plan_or_refuse(["--context-parallel-size", cp, "--seq-length", seq, "--gpus", gpus]
                    + [x for pair in pairs for x in pair])
