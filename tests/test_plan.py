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
    for lay in seen:
        assert lay.tp * lay.pp * lay.dp == 64
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


def test_nothing_fits_on_a_small_gpu():
    preds = P.plan(P.preset_shape("8b"), 8, P.Cluster(gpus=1, gpu_memory_gib=16))
    assert preds and P.recommend(preds) is None


def test_cli_table_and_json(capsys):
    assert main(["--preset", "1b", "--gpus", "2", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended (*)" in out and "CP=1" in out
    assert main(["--preset", "4b", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpus"] == 16 and data["context_parallel_size"] == 1
    assert data["recommended"]["fits"] and data["layouts"]
    assert main(["--gpus", "4", "--nodes", "1"]) == 2
    assert "disagrees" in capsys.readouterr().err


_FLAGS = ["--preset", "--num-layers", "--hidden-size", "--ffn-hidden-size",
          "--num-attention-heads", "--num-query-groups", "--seq-length", "--rank",
          "--num-blocks", "--vocab-size", "--residual", "--key", "--global-batch-size",
          "--micro-batch-size", "--gpus", "--nodes", "--gpus-per-node", "--gpu-memory-gib",
          "--intra-node-gbps", "--inter-node-gbps", "--peak-tflops", "--top", "--json"]
_VALUES = ["0", "-1", "1", "2", "3", "8", "16", "48", "1e9", "nan", "inf", "x", "tiny", "8b",
           "standard", "attnres", "projected", "0.5"]


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_FLAGS), st.sampled_from(_VALUES)), max_size=5))
def test_fuzzed_flags_plan_or_refuse_in_one_line(pairs):
    import contextlib
    import io

    argv = [x for pair in pairs for x in pair]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert rc in (0, 2), (argv, rc)
    if rc == 2:
        assert err.getvalue().startswith("lrattn-plan: error:"), (argv, err.getvalue())
