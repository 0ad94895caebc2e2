"""The cluster planner (``lrattn-plan``): memory and time model sanity, the recommendation,
and fuzzed command lines (a traceback is a failure)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_lrattn.analysis import plan as P
from megatron_lrattn.cli.plan import main


def _pred(name="1b", gbs=8, gpus=1, **layout):
    shape = P.preset_shape(name)
    lay = dict(tp=1, pp=1, vpp=1, dp=gpus, micro_batch=8 // gpus if gbs == 8 else 1,
               distributed_optimizer=False)
    lay.update(layout)
    return P.predict(shape, P.Layout(**lay), gbs, P.Cluster(gpus=gpus))


def test_calibration_points_are_reproduced():
    """The one-H200 standard steps the MFU curve is fitted to come back (optimizer time
    included), and lr_attnres costs its measured factor."""
    for name, mbs, seq, tp, ms, _ in P.CALIBRATION:
        shape = P.preset_shape(name, seq_length=seq, residual="standard")
        got = P.predict(shape, P.Layout(tp, 1, 1, 1, mbs, False), mbs, P.Cluster())
        assert got.step_s * 1e3 == pytest.approx(ms, rel=1e-6)
    std = P.predict(P.preset_shape("1b", residual="standard"), P.Layout(1, 1, 1, 1, 8, False),
                    8, P.Cluster())
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
    s = P.predict(P.preset_shape("1b", residual="standard"), P.Layout(1, 1, 1, 1, 2, False), 8,
                  P.Cluster())
    assert s.depth_state_gib == 0


def test_time_model_sanity():
    base = _pred(gbs=64, gpus=8, micro_batch=1)
    # more micro-batches shrink the bubble; interleaving shrinks it further
    few = _pred(gbs=64, gpus=8, pp=2, dp=4, micro_batch=8)
    many = _pred(gbs=64, gpus=8, pp=2, dp=4, micro_batch=1)
    inter = _pred(gbs=64, gpus=8, pp=2, vpp=2, dp=4, micro_batch=1)
    assert few.bubble_s > many.bubble_s > inter.bubble_s > 0
    # overlap never makes the data-parallel reduce slower; a slower network makes it slower
    off = P.predict(P.preset_shape("1b"), P.Layout(1, 1, 1, 8, 1, False, overlap=False), 64,
                    P.Cluster(gpus=8))
    assert base.dp_comm_s <= off.dp_comm_s
    nodes = P.Cluster(gpus=16, gpus_per_node=8)
    slow = P.predict(P.preset_shape("1b"), P.Layout(1, 1, 1, 16, 1, False), 64, nodes)
    slower = P.predict(P.preset_shape("1b"), P.Layout(1, 1, 1, 16, 1, False), 64,
                       P.Cluster(gpus=16, gpus_per_node=8, inter_node_gbps=50))
    assert slower.dp_comm_s > slow.dp_comm_s
    # the step is the sum of its parts; tokens/s follows
    parts = (base.compute_s + base.optimizer_s + base.tp_comm_s + base.dp_comm_s
             + base.pp_comm_s + base.bubble_s)
    assert base.step_s == pytest.approx(parts)
    assert base.tokens_per_s == pytest.approx(64 * 2048 / base.step_s)


def test_layouts_cover_the_gpus_and_divide_the_model():
    shape = P.preset_shape("8b")
    cluster = P.Cluster(gpus=64)
    seen = list(P.layouts(shape, 256, cluster))
    assert seen
    assert {lay.cp for lay in seen} == {1, 2, 4, 8, 16, 32, 64}
    for lay in seen:
        assert lay.tp * lay.cp * lay.pp * lay.dp == 64
        assert P.sequence_splits(shape.seq_length, lay.tp, lay.cp)
        assert shape.num_layers % (lay.pp * lay.vpp) == 0
        assert 256 % (lay.micro_batch * lay.dp) == 0
        assert shape.num_query_groups % lay.tp == 0 and lay.tp <= 8


@pytest.mark.parametrize("name,gpus,gbs", [("1b", 1, 8), ("4b", 1, 8), ("8b", 8, 64),
                                           ("8b", 64, 256), ("4b", 1024, 1024)])
def test_recommendation_is_the_fastest_that_fits(name, gpus, gbs):
    preds = P.plan(P.preset_shape(name), gbs, P.Cluster(gpus=gpus))
    best = P.recommend(preds)
    assert best is not None and best.fits
    assert best.memory_gib <= P.USABLE_MEMORY * 141.0
    assert all(p.step_s >= best.step_s for p in preds if p.fits)


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
    shape = P.preset_shape("8b")
    assert _pred("8b", gbs=8, gpus=8, micro_batch=1).cp_comm_s == 0
    cluster = P.Cluster(gpus=16)
    times = []
    for cp in (1, 2, 4, 8, 16):
        p = P.predict(shape, P.Layout(1, 1, 1, 16 // cp, 1, True, cp=cp), 16, cluster)
        times.append(p.cp_comm_s)
        parts = (p.compute_s + p.optimizer_s + p.tp_comm_s + p.cp_comm_s + p.dp_comm_s
                 + p.pp_comm_s + p.bubble_s)
        assert p.step_s == pytest.approx(parts)
    assert times[0] == 0 and all(a < b for a, b in zip(times, times[1:]))
    # 2 (gather + reduce-scatter) x L layers x m micro-batches x (c-1)/c x K and V bytes / bw
    s, gk = shape.seq_length, shape.num_query_groups * shape.head_dim
    tp, cp, m = 2, 4, 2
    got = P.predict(shape, P.Layout(tp, 1, 1, 1, 1, True, cp=cp), m, P.Cluster(gpus=8))
    kv = 2 * s * gk / tp * 2
    want = 2 * shape.num_layers * m * (cp - 1) / cp * kv / P.Cluster().bandwidth(8)
    assert got.cp_comm_s == pytest.approx(want)
    # TP=2 x CP=8 spans two nodes: the slower network carries the gather
    wide = P.predict(shape, P.Layout(2, 1, 1, 1, 1, True, cp=8), m, P.Cluster(gpus=16))
    assert wide.cp_comm_s / got.cp_comm_s == pytest.approx(
        (7 / 8) / (3 / 4) * P.Cluster().bandwidth(8) / P.Cluster().bandwidth(16))


def test_layouts_whose_sequence_does_not_split_are_absent(capsys):
    """s must divide by 2 CP (by 2 TP CP with sequence parallelism, s by TP at CP = 1)."""
    shape = P.preset_shape("1b", seq_length=4100)  # 4 x 1025
    seen = {(lay.tp, lay.cp) for lay in P.layouts(shape, 64, P.Cluster(gpus=16))}
    assert seen == {(1, 1), (2, 1), (4, 1), (1, 2)}
    with pytest.raises(ValueError, match="does not split"):
        P.predict(shape, P.Layout(2, 1, 1, 4, 1, False, cp=2), 64, P.Cluster(gpus=16))
    assert main(["--seq-length", "4100", "--gpus", "16", "--context-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrattn-plan: error: --context-parallel-size 4") and err.count("\n") == 1


def test_long_sequence_needs_context_parallelism(capsys):
    """8b at 32k tokens on 64 GPUs of 32 GiB: no CP = 1 layout fits; a CP layout does."""
    shape = P.preset_shape("8b", seq_length=32768)
    cluster = P.Cluster(gpus=64, gpu_memory_gib=32)
    preds = P.plan(shape, 64, cluster)
    assert not [p for p in preds if p.layout.cp == 1 and p.fits]
    best = P.recommend(preds)
    assert best is not None and best.layout.cp > 1 and best.cp_comm_s > 0
    argv = ["--preset", "8b", "--seq-length", "32768", "--gpus", "64", "--global-batch-size",
            "64", "--gpu-memory-gib", "32"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context_parallel_size"] == best.layout.cp == data["recommended"]["cp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"recommended (*): TP={best.layout.tp} CP={best.layout.cp} " in out
    assert "CP comm" in out
    assert main(argv + ["--context-parallel-size", "1"]) == 0
    assert "no layout fits in memory" in capsys.readouterr().out


def test_nothing_fits_on_a_small_gpu():
    preds = P.plan(P.preset_shape("8b"), 8, P.Cluster(gpus=1, gpu_memory_gib=16))
    assert preds and P.recommend(preds) is None


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


_FLAGS = ["--preset", "--num-layers", "--hidden-size", "--ffn-hidden-size",
          "--num-attention-heads", "--num-query-groups", "--seq-length", "--rank",
          "--num-blocks", "--vocab-size", "--residual", "--key", "--global-batch-size",
          "--micro-batch-size", "--gpus", "--nodes", "--gpus-per-node", "--gpu-memory-gib",
          "--intra-node-gbps", "--inter-node-gbps", "--peak-tflops", "--top", "--json",
          "--context-parallel-size"]
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
