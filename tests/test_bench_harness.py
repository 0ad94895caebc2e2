"""The kernel benchmarks' harness on CPU (``--smoke`` under TRITON_INTERPRET=1): every
backend is checked against the reference before it is timed, the CSV gets one row per
backend and pass with the correctness verdict and its provenance, the summary prints, and
candidates are timed in interleaved rounds. The GPU numbers themselves come from the box
(docs/kernels.md); this keeps the harness from breaking between those runs."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "benchmarks" / "bench_kernels.py"
BLOCK = ROOT / "benchmarks" / "bench_block.py"
ENV = dict(os.environ, TRITON_INTERPRET="1")


def _run(script, *args, timeout=600):
    return subprocess.run([sys.executable, str(script), "--smoke", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_kernel_table_smoke_writes_checked_rows(tmp_path):
    out = tmp_path / "rows.csv"
    proc = _run(KERNELS, "--tokens", "3", "--widths", "512", "--sources", "2", "--no-compile",
                "--rounds", "2", "--csv", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    got = {(r["keys"], r["r"], r["backend"], r["pass"]) for r in rows}
    for keys, r in (("sliced", "128"), ("sliced", "512"), ("projected", "128")):
        for backend in ("triton", "triton_recompute", "torch_ref"):
            for p in ("fwd", "fwdbwd"):
                assert (keys, r, backend, p) in got, (keys, r, backend, p)
    assert all(r["check"].startswith("ok") for r in rows), [r["check"] for r in rows]
    # every row names where and with what it ran
    assert all(r["gpu"] == "cpu-interpreter" and r["torch"] and r["triton"] and r["git_sha"]
               and r["date"] and r["megatron_core"] for r in rows)
    # no GPU: the busy-time columns say so instead of inventing a number
    assert all(r["gpu_ms"] == "nan" for r in rows)
    assert "% of copy bandwidth, wall time per call" in proc.stdout


@pytest.mark.slow
def test_keys_filter_selects_rows(tmp_path):
    """--keys runs only the named key kinds (here AttnRes, r = d) and rejects others."""
    out = tmp_path / "rows.csv"
    args = ("--tokens", "2", "--widths", "512", "--sources", "2", "--no-compile", "--rounds",
            "1", "--csv", str(out))
    proc = _run(KERNELS, *args, "--keys", "attnres")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert rows and {(r["keys"], r["r"]) for r in rows} == {("sliced", "512")}
    bad = _run(KERNELS, *args, "--keys", "full")
    assert bad.returncode == 2 and "invalid choice: 'full'" in bad.stderr


def test_a_csv_with_other_columns_is_refused(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_common as bc
    finally:
        sys.path.pop(0)
    path = tmp_path / "old.csv"
    path.write_text("date,gpu,T\n2026-12-01,H200,16384\n")
    with pytest.raises(SystemExit, match="columns are not this benchmark's"):
        bc.append_rows(str(path), bc.FIELDS, [])
    fresh = tmp_path / "new.csv"
    bc.append_rows(str(fresh), bc.FIELDS, [{"T": 3}])
    bc.append_rows(str(fresh), bc.FIELDS, [{"T": 4}])
    assert [r["T"] for r in csv.DictReader(fresh.open())] == ["3", "4"]


def test_rounds_interleave_candidates(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_common as bc
    finally:
        sys.path.pop(0)
    order = []
    monkeypatch.setattr(bc, "DEVICE", "cuda")
    monkeypatch.setattr(bc, "ROUNDS", 3)
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 9.0])}

    def fake_bench(fn, rep):
        name = fn()
        order.append(name)
        return next(times[name])
    monkeypatch.setattr(bc, "bench", fake_bench)
    ms = bc.bench_rounds({"a": lambda: "a", "b": lambda: "b"}, rep=10)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert ms == {"a": 2.0, "b": 5.0}  # median of each candidate's rounds


@pytest.mark.slow
def test_block_smoke_rows_are_checked(tmp_path):
    """The block as the model runs it on CPU: per-site and two-phase rows (partial sums formed
    from sub-layer outputs, every read followed by its RMSNorm; sliced, AttnRes and projected
    keys), each checked against the per-site torch reference."""
    out = tmp_path / "block.csv"
    proc = _run(BLOCK, "--tokens", "3", "--width", "64", "--sources", "2", "--sites", "3",
                "--csv", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    got = {(r["keys"], r["r"], r["backend"], r["pass"]) for r in rows}
    for keys, r in (("sliced", "16"), ("attnres", "64"), ("projected", "32")):
        for arm in ("per_site", "two_phase"):
            for p in ("fwd", "fwdbwd"):
                assert (keys, r, f"block_K3_{arm}", p) in got, (keys, arm, p)
    assert all(r["check"].startswith("ok") for r in rows), [r["check"] for r in rows]


STEP = ROOT / "benchmarks" / "bench_step.py"


@pytest.mark.slow
def test_step_benchmark_smoke_writes_rows_for_ours_and_plain(tmp_path):
    """bench_step.py on CPU: our arms and the plain model train, are timed and profiled, and
    each gets a row (ratio to the plain model) and its top kernels."""
    rows_csv, kernels_csv = tmp_path / "step.csv", tmp_path / "kernels.csv"
    copies_csv, saved_csv = tmp_path / "copies.csv", tmp_path / "saved.csv"
    proc = subprocess.run(
        [sys.executable, str(STEP), "--preset", "tiny", "--num-layers", "2", "--seq-length",
         "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--arms",
         "standard,lr_attnres", "--rounds", "2", "--steps-per-round", "1", "--no-compile",
         "--csv", str(rows_csv), "--kernels-csv", str(kernels_csv),
         "--copies-csv", str(copies_csv), "--saved-csv", str(saved_csv)],
        capture_output=True, text=True, env=dict(ENV, GIT_SHA="test"), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(rows_csv.open()))
    assert [r["model"] for r in rows] == ["ours standard", "ours lr_attnres", "plain eager"]
    assert rows[-1]["vs_reference"] == "1.0"
    assert all(float(r["last_loss"]) < float(r["first_loss"]) for r in rows)
    # the same shape: the plain model has exactly our standard arm's parameters
    assert rows[0]["params"] == rows[-1]["params"]
    assert all(r["git_sha"] == "test" and r["gpu"] == "cpu-interpreter" for r in rows)
    kernels = list(csv.DictReader(kernels_csv.open()))
    assert {k["model"] for k in kernels} == {r["model"] for r in rows}
    for r in rows:  # the family rows add up to the profiled step's kernel time
        own = [k for k in kernels if k["model"] == r["model"]]
        fams = [float(k["ms"]) for k in own if k["kernel"].startswith("[")
                and k["kernel"] not in ("[all kernels]",)
                and not k["kernel"].startswith("[GPU waiting")]
        total = next(float(k["ms"]) for k in own if k["kernel"] == "[all kernels]")
        assert fams and abs(sum(fams) - total) <= 1e-3 * len(fams) + 1e-6 * total
    copies = list(csv.DictReader(copies_csv.open()))
    assert {c["model"] for c in copies} == {"ours standard", "ours lr_attnres"}
    # forward copies named by megatron-core's lines (the rotary embedding's cat among
    # them), backward ones by their autograd node and its forward line
    assert any(c["op"] == "cat" and "rope_utils.py" in c["source"] for c in copies), copies[:5]
    assert any(c["source"].startswith("backward: ") and "megatron/core" in c["source"]
               for c in copies)
    assert not any("__torch_function__" in c["source"] for c in copies)
    saved = list(csv.DictReader(saved_csv.open()))
    assert {c["model"] for c in saved} == {"ours standard", "ours lr_attnres"}
    # the weights a linear layer saves are kept, not the step's; its input is an activation
    assert any(c["kind"] == "kept" and "layers.py" in c["source"] for c in saved)
    assert any(c["kind"] == "activation" and "mlp.py" in c["source"] for c in saved)


def test_kernel_families_sort_the_kernels_of_a_step():
    """Each kernel name the H200 profiles show lands in its family; our depth-read kernels
    by exact name; the family times add up to the total."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_step import family_times, kernel_family
    finally:
        sys.path.pop(0)
    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>":
            "optimizer",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16>":
            "norm",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": "copy",
        "triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_0": "elementwise",
        "merge_bwd_kernel": "depth read",
        "something_new": "other",
    }
    for name, fam in names.items():
        assert kernel_family(name, frozenset({"merge_bwd_kernel"})) == fam, name
    times = family_times({n: 1.0 for n in names}, frozenset({"merge_bwd_kernel"}))
    assert sum(times.values()) == len(names) and set(times) == set(names.values())


def test_copy_sources_name_the_forward_line_of_each_copy():
    """Forward copies are named by their Python line, backward copies by their autograd node
    and the forward line that created it; bytes are read + write of the output."""
    import inspect

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_sources import CopySources
    finally:
        sys.path.pop(0)

    def f(x, y):
        z = torch.cat([x, y], dim=0)
        return (z.t().contiguous().to(torch.bfloat16).float() * 2).sum()

    first = inspect.getsourcelines(f)[1]
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=True)
    with CopySources() as cs:
        f(x, y).backward()
    rows = {(r["op"], r["dtype"], r["source"].split(" <- ")[0]): r for r in cs.table()}
    here = f"tests/test_bench_harness.py:{first + 1} f"
    assert rows[("cat", "float32", here)]["bytes"] == 2 * 8 * 8 * 4
    line2 = f"tests/test_bench_harness.py:{first + 2} f"
    assert ("clone", "float32", line2) in rows
    assert ("_to_copy", "float32->bfloat16", line2) in rows
    assert ("_to_copy", "bfloat16->float32", f"backward: ToCopyBackward0 of {line2}") in rows
    assert not torch.is_anomaly_enabled()  # anomaly mode only inside the block


def test_kernel_launchers_charge_each_kernel_to_the_op_that_launched_it():
    """Each GPU kernel goes to its innermost launching op, named with the ops around it and
    the nearest frames outside torch (in the backward: the autograd node, not the caller of
    backward()); a kernel linked to no op is listed as such; the most time first."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_sources import KernelLaunchers
    finally:
        sys.path.pop(0)

    ids = iter(range(1, 100))

    def cpu(name, parent=None, shapes=None, python=False):
        e = FunctionEvent(next(ids), name, 1, 0, 10, input_shapes=shapes,
                          is_python_function=python)
        if parent is not None:
            e.set_cpu_parent(parent)
        return e

    def gpu(name, us):
        return FunctionEvent(next(ids), name, 7, 0, us, device_type=DeviceType.CUDA)

    frame = cpu("/x/lib/python3.12/site-packages/megatron_lrattn/model/attention.py(181): forward",
                python=True)
    torch_frame = cpu("/x/site-packages/torch/nn/modules/module.py(1775): _call_impl",
                      parent=frame, python=True)
    sdpa = cpu("aten::_scaled_dot_product_cudnn_attention", parent=torch_frame)
    contig = cpu("aten::contiguous", parent=sdpa)
    copy = cpu("aten::copy_", parent=contig, shapes=[[8, 16, 2048, 128], [8, 16, 2048, 128]])
    caller = cpu("/x/benchmarks/bench_step.py(190): <lambda>", python=True)
    node = cpu("autograd::engine::evaluate_function: SplitWithSizesBackward0", parent=caller)
    inner = cpu("SplitWithSizesBackward0", parent=node)
    cat = cpu("aten::cat", parent=inner)
    k1, k2, k3, stray = (gpu("direct_copy_kernel_cuda", 300), gpu("direct_copy_kernel_cuda", 200),
                         gpu("CatArrayBatchedCopy", 100), gpu("triton_poi_fused_0", 50))
    copy.append_kernel(k1.name, 0, 300)
    copy.append_kernel(k2.name, 0, 200)
    cat.append_kernel(k3.name, 0, 100)
    kl = KernelLaunchers()
    kl.add([frame, torch_frame, sdpa, contig, copy, caller, node, inner, cat, k1, k2, k3, stray])
    rows = kl.table()
    assert [r["device_us"] for r in rows] == [500.0, 100.0, 50.0]
    assert rows[0]["calls"] == 2 and rows[0]["kernel"] == "direct_copy_kernel_cuda"
    assert rows[0]["launcher"] == ("aten::copy_ < aten::contiguous < "
                                   "aten::_scaled_dot_product_cudnn_attention < "
                                   "megatron_lrattn/model/attention.py(181): forward")
    assert rows[0]["shapes"] == "8x16x2048x128;8x16x2048x128"
    assert rows[1]["launcher"] == "aten::cat < backward: SplitWithSizesBackward0"
    assert rows[2]["launcher"] == "(no CPU op)" and rows[2]["kernel"] == "triton_poi_fused_0"


def test_saved_tensors_counts_each_storage_once_and_tells_weights_apart():
    """What autograd saves, by forward line: a linear layer's input (activation) and weight
    (kept: it existed before the step); a tensor saved twice is counted once."""
    import inspect

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_sources import SavedTensors
    finally:
        sys.path.pop(0)

    lin = torch.nn.Linear(8, 16, bias=False)

    def f(x):
        y = torch.sigmoid(lin(x))
        return (y * y).sum()

    first = inspect.getsourcelines(f)[1]
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(before=list(lin.parameters())) as st:
        loss = f(x)
    loss.backward()
    rows = {(r["kind"], r["source"].split(" <- ")[0]): r for r in st.table()}
    line = f"tests/test_bench_harness.py:{first + 1} f"
    assert rows[("kept", line)]["bytes"] == 16 * 8 * 4  # the weight
    # x (4 x 8) for the linear layer's weight gradient, y (4 x 16) for sigmoid's backward;
    # y * y saves y again, which is not counted twice
    assert rows[("activation", line)]["bytes"] == (4 * 8 + 4 * 16) * 4
    assert len(rows) == 2


def _bench_step_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_under_test", STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a valid base command line, then fuzzed flags: each with values it takes and values it
# must refuse (flags without a value are given one too, and values stand alone)
_STEP_BASE = ["--preset", "tiny", "--micro-batch-size", "2", "--global-batch-size", "2"]
_STEP_VALUES = {
    "--csv": ["{tmp}/a.csv", "{tmp}", "{tmp}/missing/a.csv", ""],
    "--kernels-csv": ["{tmp}/k.csv", "{tmp}"],
    "--copies-csv": ["{tmp}/c.csv", "{tmp}/missing/c.csv"],
    "--saved-csv": ["{tmp}/s.csv", "{tmp}"],
    "--no-plain": [None, "x"], "--no-compile": [None],
    "--preset": ["tiny", "1b", "0.5b", "x"],
    "--num-layers": ["1", "2", "0", "-1", "x"],
    "--micro-batch-size": ["2", "4", "0"], "--global-batch-size": ["2", "4", "nan"],
    "--arms": ["standard", "standard,lr_attnres", "standard,foo", "standard,standard", ""],
    "--rounds": ["1", "0", "-3"], "--num-blocks": ["1", "2", "3", "99", "0"],
    "--seq-length": ["16", "0", "1e9"], "--hidden-size": ["64", "65", "0"],
    "--tensor-model-parallel-size": ["1", "2"], "--projected-rank": ["8", "0", "1000"],
    "--bogus": [None, "1"],
    "--variant": ["ce=--cross-entropy-fusion-impl triton", "x", "ce=--bogus", "ce='open",
                  "n=--num-blocks 99"],
}
_STEP_PAIRS = [(f, v) for f, vs in _STEP_VALUES.items() for v in vs]


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_STEP_PAIRS), max_size=4))
def test_bench_step_fuzzed_flags_run_or_refuse_in_one_line(tmp_path, pairs):
    """Any command line either reaches the run (replaced here) or is refused with exit code 2
    and one ``bench_step.py: error:`` line (argparse's own usage errors: exit 2, no
    traceback)."""
    import contextlib
    import io

    bench_step = _bench_step_module()
    reached = []
    bench_step.run = lambda own, args: reached.append(args) or 0
    argv = _STEP_BASE + [x.replace("{tmp}", str(tmp_path)) for pair in pairs for x in pair
                         if x is not None]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = bench_step.main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    text = err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert rc in (0, 2), (argv, rc, text)
    if rc == 0:
        assert len(reached) == 1
    elif text.startswith("bench_step.py: error:"):
        assert text.count("\n") == 1, (argv, text)
    else:  # argparse: usage, then "prog: error: ..."
        assert text.rstrip().splitlines()[-1].split(": error: ")[1], (argv, text)


@pytest.mark.parametrize("argv,needle", [
    (["--csv", "{tmp}"], "is a directory"),
    (["--saved-csv", "{tmp}/missing/a.csv"], "does not exist"),
    (["--micro-batch-size", "2", "--global-batch-size", "4"], "one micro-batch"),
    (["--preset", "1b", "--num-layers", "2"], "--num-blocks 8"),
])
def test_bench_step_refuses_in_one_line_before_building(argv, needle, tmp_path, capsys):
    bench_step = _bench_step_module()
    bench_step.run = lambda own, args: pytest.fail("reached the run")
    rc = bench_step.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("bench_step.py: error:") and needle in err, err
    assert err.count("\n") == 1


class _Reached(Exception):
    """The flags were accepted: the benchmark would start measuring here."""


def _load(script, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_bench_outcome(script, argv, monkeypatch):
    """(exit code or "ran", stderr) of bench_block.py / bench_kernels.py on ``argv``, in this
    process; the measurement itself is replaced by raising ``_Reached``."""
    import contextlib
    import io

    module = _load(script, script.stem + "_under_test")

    def reached(*a, **k):
        raise _Reached

    monkeypatch.setattr(module.bc, "copy_bandwidth", reached)
    monkeypatch.setattr(module, "summarize", reached, raising=False)
    monkeypatch.setattr(sys, "argv", [script.name] + argv)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            module.main()
            rc = 0
        except _Reached:
            rc = "ran"
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


_KERNEL_FLAGS = {
    "--tokens": ["64", "0", "-5", "x"], "--width": ["64", "2", "0"],
    "--widths": ["64", "0", "3"], "--sources": ["3", "0", "-1"], "--sites": ["2", "1", "0"],
    "--keys": ["sliced", "nope"], "--rounds": ["1", "0"], "--extra": ["64:3", "5:x", ":", ""],
    "--csv": ["{tmp}/a.csv", "{tmp}", "{tmp}/missing/a.csv", ""],
    "--summarize": ["{tmp}/none.csv", "{tmp}"], "--smoke": [None], "--profile": [None],
    "--no-compile": [None], "--bogus": [None], "--presets": ["1b", "nope", "tiny 0.5b"],
    "--vocab-size": ["256", "0", "x"],
}
_KERNEL_PAIRS = [(f, v) for f, vs in _KERNEL_FLAGS.items() for v in vs]


@pytest.mark.parametrize("script", [BLOCK, KERNELS, ROOT / "benchmarks" / "bench_optimizer.py",
                                    ROOT / "benchmarks" / "bench_merge_tiles.py"],
                         ids=["bench_block", "bench_kernels", "bench_optimizer",
                              "bench_merge_tiles"])
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.sampled_from(_KERNEL_PAIRS), max_size=4))
def test_kernel_benchmarks_fuzzed_flags_run_or_refuse_in_one_line(script, pairs, tmp_path,
                                                                  monkeypatch):
    """bench_block.py, bench_kernels.py, bench_optimizer.py and bench_merge_tiles.py: any
    command line reaches the
    measurement or ends with one error line (argparse's usage errors: usage, then one
    ``error:`` line); never a traceback."""
    argv = ["--smoke"] + [x.replace("{tmp}", str(tmp_path)) for pair in pairs for x in pair
                          if x is not None]
    rc, err = _kernel_bench_outcome(script, argv, monkeypatch)
    assert "Traceback" not in err, (argv, err)
    if rc != "ran":
        assert rc not in (0, None), (argv, rc, err)
        assert ": error: " in err.rstrip().splitlines()[-1], (argv, err)


@pytest.mark.parametrize("script,argv,needle", [
    (BLOCK, ["--width", "2"], "at least 4"),
    (BLOCK, ["--sources", "0"], "not a positive integer"),
    (BLOCK, ["--csv", "{tmp}"], "is a directory"),
    (KERNELS, ["--extra", "5:x"], "'5:x' is not d:S"),
    (KERNELS, ["--csv", "{tmp}/missing/k.csv"], "does not exist"),
    (KERNELS, ["--summarize", "{tmp}"], "is not a file"),
], ids=["block-width", "block-sources", "block-csv-dir", "kernels-extra", "kernels-csv-folder",
        "kernels-summarize-dir"])
def test_kernel_benchmarks_refuse_bad_flags_before_measuring(script, argv, needle, tmp_path,
                                                             monkeypatch):
    argv = ["--smoke"] + [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, err = _kernel_bench_outcome(script, argv, monkeypatch)
    assert rc == 2 and needle in err.rstrip().splitlines()[-1], (rc, err)


def test_bench_step_variants_parse_to_their_own_arguments():
    bench_step = _bench_step_module()
    own, args = bench_step.parse(_STEP_BASE + [
        "--variant", "ce=--cross-entropy-fusion-impl native",
        "--variant", "n4=--num-blocks 4 --cross-entropy-fusion-impl native"])
    assert args.cross_entropy_fusion_impl == "triton"
    assert [(n, a.cross_entropy_fusion_impl, a.num_blocks) for n, a in own.variants] == [
        ("ce", "native", args.num_blocks), ("n4", "native", 4)]
    with pytest.raises(Exception, match="given twice"):
        bench_step.parse(_STEP_BASE + ["--variant", "a=--seed 2", "--variant", "a=--seed 3"])


OPTIMIZER = ROOT / "benchmarks" / "bench_optimizer.py"


@pytest.mark.slow
def test_optimizer_benchmark_smoke_checks_the_kernel_before_timing(tmp_path):
    """bench_optimizer.py on CPU: one step of the one kernel matches megatron's passes from the
    same state, and each candidate gets a row with its bytes a parameter and provenance."""
    out = tmp_path / "opt.csv"
    proc = _run(OPTIMIZER, "--csv", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["candidate"], r["bytes_per_param"]) for r in rows] == [
        ("megatron clipped", "42"), ("megatron unclipped", "34"), ("one kernel", "30")]
    assert all(r["check"].startswith("ok") and r["gpu"] == "cpu-interpreter" and r["git_sha"]
               for r in rows), rows
    assert len({r["params"] for r in rows}) == 1 and int(rows[0]["params"]) > 0


HOST = ROOT / "benchmarks" / "bench_host.py"


def test_host_benchmark_times_each_part_and_refuses_bad_flags(tmp_path, monkeypatch):
    """bench_host.py: one row per part with provenance and the preset's tensor count; a bad
    flag or an unwritable CSV path is one error line before anything is built. The run and
    the CSV refusal (after torch's import) are its ``main`` in this process, where torch and
    megatron are imported already; the flag refusals run the script itself."""
    import contextlib
    import io

    import torch

    host = _load(HOST, "bench_host_under_test")
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts benchmarks/ first

    def in_process(argv):
        threads = torch.get_num_threads()  # main() runs on one thread
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = host.main(argv)
        except SystemExit as e:  # argparse's errors
            rc = e.code
        finally:
            torch.set_num_threads(threads)
        return rc, err.getvalue()

    out = tmp_path / "host.csv"
    rc, err = in_process(["--presets", "tiny", "--rounds", "1", "--csv", str(out)])
    assert rc == 0, err[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["part"] for r in rows] == ["prepare_grads", "launch tensors", "launch tables",
                                         "grads for norm", "zero_grad", "zero_grad_buffer"]
    assert all(r["gpu"].startswith("host: ") and r["git_sha"] and float(r["ms"]) > 0
               and r["tensors"] == str(2 + 1 + 4 * 6) for r in rows), rows
    for argv, needle in ((["--rounds", "0"], "not a positive integer"),
                         (["--presets", "nope"], "invalid choice"),
                         (["--csv", str(tmp_path)], "is a directory")):
        if argv[0] == "--csv":
            rc, err = in_process(argv)
        else:
            proc = subprocess.run([sys.executable, str(HOST), *argv], capture_output=True,
                                  text=True, env=ENV, cwd=ROOT, timeout=120)
            rc, err = proc.returncode, proc.stderr
        last = err.rstrip().splitlines()[-1]
        assert rc == 2 and "Traceback" not in err and needle in last, (argv, err[-1000:])


@pytest.mark.slow
def test_merge_tiles_smoke_checks_and_times_the_default(tmp_path):
    """bench_merge_tiles.py --smoke: the default merge setting at a tiny shape under the
    interpreter, checked (against itself) and timed, one line and the best lists."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_merge_tiles.py"),
                           "--smoke"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(x.startswith("T=64 d=128 ") and "ok=True" in x for x in lines), proc.stdout
    assert any(x.startswith("BEST bwd [(") for x in lines), proc.stdout
