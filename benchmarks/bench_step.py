"""Our training step beside a compiled plain-PyTorch model of the same shape, in one process.

For one preset (``lrattn-profile``'s flags, so the step is the one ``lrattn-profile`` and
``lrattn-pretrain`` run), build our arms and ``plain_gpt.PlainTrainer`` of the same shape,
check that every model trains (the loss on a fixed batch falls over the warm-up steps), then
time them alternating (``--rounds`` rounds of ``--steps-per-round`` steps each) and profile
one step of each. Reports median step time, tokens/s, MFU, peak memory (of the model alone:
what its build and steps keep plus its largest step's growth; the process-wide peak beside
it) and the ratio to the plain model, the top kernels of each model by device time
(torch.profiler), and each model's device time by kernel family with the time the GPU
waits (median step time minus the profiled step's total kernel time: host work between
kernels and synchronisations).

MFU = F * tokens_per_step / (step_time * peak), F = 6 M + 12 L s a k (+ the depth reads'
3 x forward FLOPs for our depth arms): M the matmul parameters, L layers, s sequence, a
heads, k head size (``megatron_lrattn.analysis.flops``); peak ``--peak-tflops`` (989, H200
dense bf16). The same F is used for the plain model (same shape).

    python benchmarks/bench_step.py --preset 1b --no-qk-layernorm --vocab-size 32768 \\
        --micro-batch-size 8 --global-batch-size 8 --arms standard,lr_attnres \\
        --csv benchmarks/results/step.csv --kernels-csv benchmarks/results/step_kernels.csv
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import shlex
import statistics
import sys
import time
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402
from step_sources import CopySources, KernelLaunchers, SavedTensors  # noqa: E402
from plain_gpt import PlainShape, PlainTrainer  # noqa: E402

logger = logging.getLogger("bench_step")
TOP_KERNELS = 25
TOP_COPIES = 20
TOP_LAUNCHERS = 40
# Kernel families of the summary rows, first match wins (lower-cased substrings of the name).
FAMILIES = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("norm", ("layer_norm", "rms_norm", "rmsnorm", "gammabeta")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("elementwise", ("triton_poi",)),  # Inductor's pointwise kernels, whatever they fuse
    ("reduction", ("triton_red", "triton_per", "reduce")),
    ("copy", ("copy", "catarray", "fill")),
    ("elementwise", ("elementwise", "functor")),
)


def kernel_family(name: str, depth_read_names=frozenset()) -> str:
    """The family of one kernel name for the summary rows (``depth read`` for our fused
    depth-read kernels, ``other`` when no family matches)."""
    if name.split("(")[0] in depth_read_names:
        return "depth read"
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def family_times(kernels: Dict[str, float], depth_read_names=frozenset()) -> Dict[str, float]:
    """Device time per kernel family (the units of ``kernels``), largest first."""
    out: Dict[str, float] = {}
    for name, t in kernels.items():
        fam = kernel_family(name, depth_read_names)
        out[fam] = out.get(fam, 0.0) + t
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _own_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_step.py", add_help=False,
        description="the flags of this benchmark; every other flag is lrattn-profile's")
    p.add_argument("--csv", default=None, help="append one row per model here")
    p.add_argument("--kernels-csv", default=None, help="append the top kernels per model here")
    p.add_argument("--no-plain", action="store_true", help="leave the plain model out")
    p.add_argument("--no-compile", action="store_true", help="plain model without torch.compile")
    p.add_argument("--copies-csv", default=None,
                   help="attribute the copies of one eager step of each of our models to their "
                        "source lines (step_sources.py) and append them here")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also build every arm with these extra lrattn-profile flags, named "
                        "'ours ARM [NAME]', timed alternating with the rest (e.g. "
                        "--variant 'ce_native=--cross-entropy-fusion-impl native'); "
                        "repeatable")
    p.add_argument("--launchers-csv", default=None,
                   help="append, for every GPU kernel of one eager step of each of our arms "
                        "(a fresh build), the op chain that launched it and its device time "
                        "(torch.profiler with Python stacks: copies inside an op's C++ code "
                        "and inside compiled regions included)")
    p.add_argument("--saved-csv", default=None,
                   help="the tensors autograd saves in that step, by forward line "
                        "(step_sources.py), appended here")
    return p


def _own_flags(argv: Sequence[str]):
    """This benchmark's flags and the rest (``lrattn-profile``'s); an output path that
    cannot be written is refused before anything is built."""
    from megatron_lrattn.training.arguments import ArgumentError

    own, rest = _own_parser().parse_known_args(argv)
    for flag in ("csv", "kernels_csv", "copies_csv", "saved_csv", "launchers_csv"):
        path = getattr(own, flag)
        problem = path is not None and bench_common.csv_path_problem(
            "--" + flag.replace("_", "-"), path)
        if problem:
            raise ArgumentError(problem)
    return own, rest


class _Timed:
    """Step times, peak memory and losses of one model."""

    def __init__(self, name: str, step, num_params: int, flops_per_token: float,
                 capture_bytes=lambda: 0, tensors=lambda: []):
        self.name, self.step, self.num_params = name, step, num_params
        self.tensors = tensors  # what outlives a step (parameters), for SavedTensors
        self.flops_per_token = flops_per_token
        self.times: List[float] = []
        self.losses: List[float] = []
        self.peak = 0  # process-wide max_memory_allocated over this model's steps
        # memory of the model alone: what its build and its steps keep (weights, gradient
        # buffers, optimizer states: ``resident``), plus the largest growth during one step
        # (a captured graph's pool growth counted as its step's: ``capture_bytes``)
        self.resident = 0
        self.step_growth = 0
        self.capture_bytes = capture_bytes
        self.kernels: Dict[str, float] = {}

    def run(self, timed: bool) -> None:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = self.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.losses.append(float(loss))
        if timed:
            self.times.append(dt)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            self.peak = max(self.peak, peak)
            self.step_growth = max(self.step_growth, peak - before, self.capture_bytes())
            # what a step leaves behind stays (torch's lazily created AdamW states)
            self.resident += max(0, torch.cuda.memory_allocated() - before)

    def own_peak(self) -> int:
        """Peak memory of this model alone (bytes; 0 without CUDA)."""
        return self.resident + self.step_growth

    def profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from megatron_lrattn.profiling.runner import device_kernel_times_us

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        with profile(activities=acts) as prof:
            self.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if torch.cuda.is_available():
            self.kernels = device_kernel_times_us(prof)
        else:
            self.kernels = {e.key: float(e.self_cpu_time_total) for e in prof.key_averages()}


def _our_model(arm, args, vocab: int, num_micro: int, batch, device, tag=None) -> _Timed:
    """One of our arms, stepped by the training step ``lrattn-pretrain`` runs."""
    import itertools

    from megatron_lrattn.profiling.arms import arm_args, flops_per_token, model_shape
    from megatron_lrattn.profiling.runner import build_arm

    run = build_arm(arm, args, vocab, num_micro, device)
    batches = itertools.repeat(batch)
    counter = itertools.count(1)
    flops = flops_per_token(model_shape(arm_args(args, arm), vocab))["total"]
    graph = run.step.graph
    name = f"ours {arm.name}" + (f" [{tag}]" if tag else "")
    return _Timed(name, lambda: run.step.train(batches, next(counter)).loss,
                  run.step.num_params, flops,
                  capture_bytes=lambda: graph.capture_peak_bytes if graph is not None else 0,
                  tensors=lambda: [p for m in run.step.models for p in m.parameters()])


def _plain_model(args, vocab: int, batch, compile: bool) -> _Timed:
    from megatron_lrattn.profiling.arms import flops_per_token, make_arms, arm_args, model_shape

    shape = PlainShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       ffn_hidden_size=args.ffn_hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       num_query_groups=args.num_query_groups or args.num_attention_heads,
                       vocab_size=vocab, seq_length=args.seq_length,
                       rotary_base=float(args.rotary_base))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = PlainTrainer(shape, device, lr=args.lr, weight_decay=args.weight_decay,
                           compile=compile, seed=args.seed)
    tokens, labels = batch["tokens"], batch["labels"]
    std = make_arms(["standard"], args.hidden_size, 1, args.num_blocks)[0]
    flops = flops_per_token(model_shape(arm_args(args, std), vocab))["total"]
    return _Timed("plain compiled" if compile else "plain eager",
                  lambda: trainer.step(tokens, labels), trainer.num_params(), flops)


def _release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _step_sources(builders, dispatch: bool = True
                  ) -> "tuple[Dict[str, List], Dict[str, List], Dict[str, List]]":
    """(copies, saved, launchers) tables of eager steps of each of our models, each built
    afresh: the kernel launchers of its second step (profiled, compiled regions running
    compiled), then with ``dispatch`` the copies and saved tensors of its third (a Python
    dispatch mode: compiled regions run eager); a CUDA graph is captured only after 3."""
    copies: Dict[str, List[Dict[str, object]]] = {}
    saved: Dict[str, List[Dict[str, object]]] = {}
    launchers: Dict[str, List[Dict[str, object]]] = {}
    for build in builders:
        m = build()
        m.run(timed=False)
        with KernelLaunchers() as kl:
            m.run(timed=False)
        launchers[m.name] = kl.table()
        if dispatch:
            with CopySources() as cs, SavedTensors(before=m.tensors()) as st:
                m.run(timed=False)
            copies[m.name], saved[m.name] = cs.table(), st.table()
        del m
        _release()
    return copies, saved, launchers


def _summary(m: _Timed, tokens: int, peak_tflops: float) -> Dict[str, object]:
    step = statistics.median(m.times)
    return {"model": m.name, "params": m.num_params, "median_step_ms": round(step * 1e3, 2),
            "tokens_per_s": round(tokens / step), "mfu": round(
                m.flops_per_token * tokens / (step * peak_tflops * 1e12), 4),
            "peak_memory_gib": round(m.own_peak() / 2**30, 2),
            "process_peak_memory_gib": round(m.peak / 2**30, 2), "steps": len(m.times),
            "first_loss": round(m.losses[0], 4), "last_loss": round(m.losses[-1], 4)}


def _report_sources(tables: Dict[str, List[Dict[str, object]]], path: str, base: Dict,
                    label: str, heading) -> None:
    """Print the top rows of each model's ``step_sources`` table and append all to ``path``."""
    rows = []
    for name, table in tables.items():
        print("\n" + heading(name, table))
        for r in table[:TOP_COPIES if label else TOP_LAUNCHERS]:
            if label is None:  # KernelLaunchers rows
                print(f"  {r['device_us'] / 1e3:8.2f} {r['calls']:5d}x {r['kernel'][:48]:48s} "
                      f"{r['launcher'][:150]} [{r['shapes'][:60]}]")
                continue
            print(f"  {r['bytes'] / 1e6:9.1f} {r['calls']:5d}x {r[label]:10s} "
                  f"{r['dtype']:18s} {r['source'][:120]}")
        rows += [dict(base, model=name, **r) for r in table]
    if rows:
        bench_common.append_rows(path, list(rows[0]), rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 and one line on stderr for a refused flag)."""
    from megatron_lrattn.cli.common import run_cli
    from megatron_lrattn.model.errors import ConfigError
    from megatron_lrattn.training.arguments import ArgumentError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        _own_parser().print_help()
        print()
    return run_cli("bench_step.py", functools.partial(_main, argv), (ArgumentError, ConfigError))


def parse(argv: List[str]):
    """(own flags, lrattn-profile's args); ``ArgumentError`` on a refused flag."""
    from megatron_lrattn.cli.profile import parse_args
    from megatron_lrattn.training.arguments import ArgumentError

    own, rest = _own_flags(argv)
    args = parse_args(rest)
    own.variants = []
    for spec in own.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ArgumentError(f"--variant {spec!r}: NAME=FLAGS with a name of letters, "
                                "digits, '_', '.' or '-'")
        if name in [n for n, _ in own.variants]:
            raise ArgumentError(f"--variant {name}: given twice")
        try:
            extra = shlex.split(flags)
            variant = parse_args(rest + extra)
        except (ArgumentError, ValueError) as e:
            raise ArgumentError(f"--variant {name}: {str(e).splitlines()[0]}") from None
        except SystemExit:
            raise ArgumentError(f"--variant {name}: lrattn-profile refused {flags!r} "
                                "(its message is above)") from None
        own.variants.append((name, variant))
    if args.tensor_model_parallel_size * args.pipeline_model_parallel_size != 1:
        raise ArgumentError("one GPU only: --tensor-model-parallel-size and "
                            "--pipeline-model-parallel-size must be 1")
    if args.global_batch_size != args.micro_batch_size:
        raise ArgumentError(f"one micro-batch per step: --global-batch-size "
                            f"{args.global_batch_size} must equal --micro-batch-size "
                            f"{args.micro_batch_size}")
    return own, args


def _main(argv: List[str]) -> int:
    own, args = parse(argv)
    return run(own, args)


def run(own, args) -> int:
    """Build, check, time and profile the models of one parsed command line."""
    from megatron_lrattn.profiling.runner import depth_read_kernel_names, synthetic_batch
    from megatron_lrattn.training.builder import padded_vocab_size
    from megatron_lrattn.training.runtime import init_runtime, shutdown_runtime

    if not torch.cuda.is_available():
        bench_common.use_cpu_smoke()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rt = init_runtime(1, 1, args.seed)
    try:
        vocab = padded_vocab_size(args.vocab_size, 1)
        batch = synthetic_batch(args.micro_batch_size, args.seq_length, vocab, rt.device,
                                args.seed)
        tokens = args.micro_batch_size * args.seq_length
        ours = [functools.partial(_our_model, a, a_args, vocab, 1, batch, rt.device, tag)
                for tag, a_args in [(None, args)] + own.variants for a in a_args.arm_specs]
        builders = list(ours)
        if not own.no_plain:
            builders.append(functools.partial(_plain_model, args, vocab, batch,
                                              compile=not own.no_compile))
        models = []
        for build in builders:
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            m = build()
            if torch.cuda.is_available():
                m.resident = torch.cuda.memory_allocated() - before
            models.append(m)
        for m in models:
            for _ in range(1 + args.warmup_steps + 3):
                m.run(timed=False)
            if not m.losses[-1] < m.losses[0]:
                raise SystemExit(f"bench_step.py: {m.name} does not train (loss {m.losses[0]:.4f}"
                                 f" -> {m.losses[-1]:.4f} on a fixed batch); no numbers reported")
            logger.info("%s trains: loss %.4f -> %.4f", m.name, m.losses[0], m.losses[-1])
        for r in range(args.rounds):
            for m in models:
                for _ in range(args.steps_per_round):
                    m.run(timed=True)
            logger.info("round %d/%d: %s", r + 1, args.rounds, ", ".join(
                f"{m.name} {statistics.median(m.times) * 1e3:.1f} ms" for m in models))
        for m in models:
            m.profile()
        rows = [_summary(m, tokens, args.peak_tflops) for m in models]
        ref = rows[-1]["median_step_ms"] if not own.no_plain else rows[0]["median_step_ms"]
        base = dict(bench_common.meta(), preset=args.preset, micro_batch_size=args.micro_batch_size,
                    seq_length=args.seq_length, vocab_size=vocab)
        print(f"{'model':36s} {'step ms':>9s} {'x ref':>6s} {'MFU':>6s} {'peak GiB':>9s}")
        for row in rows:
            row["vs_reference"] = round(row["median_step_ms"] / ref, 4)
            print(f"{row['model']:36s} {row['median_step_ms']:9.1f} {row['vs_reference']:6.3f} "
                  f"{row['mfu']:6.1%} {row['peak_memory_gib']:9.2f}")
        if own.csv:
            out = [dict(base, **row) for row in rows]
            bench_common.append_rows(own.csv, list(out[0]), out)
        krows = []
        depth_names = frozenset(depth_read_kernel_names())
        for m, row in zip(models, rows):
            total = sum(m.kernels.values()) or 1.0
            step_us = row["median_step_ms"] * 1e3
            print(f"\ndevice time of {m.name} by kernel family (ms per step, share of the "
                  f"median step {row['median_step_ms']:.1f} ms)")
            fams = dict(family_times(m.kernels, depth_names))
            fams["[all kernels]"] = total
            fams["[GPU waiting: median step - all kernels]"] = step_us - total
            for fam, us in fams.items():
                print(f"  {us / 1e3:8.2f} {us / step_us:6.1%}  {fam}")
                label = fam if fam.startswith("[") else f"[{fam}]"
                krows.append(dict(base, model=m.name, kernel=label, ms=round(us / 1e3, 3),
                                  share=round(us / step_us, 4)))
            top = sorted(m.kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
            print(f"\ntop kernels of {m.name} (device ms per step, share of the median step)")
            for name, us in top:
                print(f"  {us / 1e3:8.2f} {us / step_us:6.1%}  {name[:110]}")
                krows.append(dict(base, model=m.name, kernel=name[:200],
                                  ms=round(us / 1e3, 3), share=round(us / step_us, 4)))
        if own.kernels_csv:
            bench_common.append_rows(own.kernels_csv, list(krows[0]), krows)
        if not (own.copies_csv or own.saved_csv or own.launchers_csv):
            return 0
        # The sources of copies and saved tensors come last, from fresh builds: under a
        # Python dispatch mode torch.compile cannot run, and a compiled function it skipped
        # may stay eager in that process (torch 2.11 kept the rotary kernel eager for the
        # rest of the run), so nothing timed may follow it.
        models.clear()
        m = None
        _release()
        copies, saved, launchers = _step_sources(ours, dispatch=bool(own.copies_csv
                                                                     or own.saved_csv))
        if own.launchers_csv:
            _report_sources(launchers, own.launchers_csv, base, None, lambda name, table: (
                f"kernels of {name} by launcher, one eager step (device ms, the most first)"))
        if own.copies_csv:
            _report_sources(copies, own.copies_csv, base, "op", lambda name, table: (
                f"copies of {name}, one eager step (MB moved: read + write of the output; "
                "the most first)"))
        if own.saved_csv:
            _report_sources(saved, own.saved_csv, base, "kind", lambda name, table: (
                f"saved for the backward by {name}, one eager step: "
                f"{sum(r['bytes'] for r in table if r['kind'] == 'activation') / 2**30:.2f} "
                "GiB of activations (MB by forward line, the most first)"))
        return 0
    finally:
        shutdown_runtime()


if __name__ == "__main__":
    sys.exit(main())
