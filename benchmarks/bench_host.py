"""The host's share of the one-kernel optimizer step, per preset: the Python that runs
between the step's last host read and the kernel's launch, while the GPU has nothing to do.

    python benchmarks/bench_host.py --presets 0.5b 1b 4b --csv host.csv

The host cost depends on how many parameter tensors the model has, not on their sizes, so
each preset is built with its own number of layers (and so its tensors) at the tiny
preset's widths, on the CPU, with bf16 weights and megatron-core's mixed-precision
optimizer, and these parts of ``training.optimizer_step.MixedPrecisionAdamW`` and of the
training step are timed (median of ``--rounds`` rounds of 20 calls each):

- ``prepare_grads``: megatron's gradient preparation (points the fp32 main weights'
  gradients at the gradient buffer);
- ``launch tensors``: the list of (weight, gradient, moments, step, bf16 weight) per tensor;
- ``launch tables``: the check that the kernel's address tables still hold (their rebuild
  when an address changed);
- ``grads for norm``: megatron's selection of the gradients its norm reads;
- ``zero_grad`` and ``zero_grad_buffer``: the next step's start (megatron's optimizer and
  DDP), which the host runs while the GPU runs the kernel.

The first four run after the step's loss, finiteness and norm reads, so the GPU waits for
them. Rows: provenance (the CPU's name in the gpu column), preset, layers, tensors, part, ms.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FIELDS = ["date", "gpu", "git_sha", "torch", "triton", "megatron_core", "preset", "layers",
          "tensors", "part", "ms"]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "host: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "host: " + (platform.processor() or platform.machine())


def _median_ms(fn, rounds: int, calls: int = 20) -> float:
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(out)


def measure(preset: str, rounds: int):
    """[(part, ms)], layers and tensors of ``preset``'s tensor count."""
    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.builder import (build_config, build_model, build_optimizer,
                                                  wrap_model)
    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW
    from megatron_lrattn.training.presets import PRESETS

    layers = PRESETS[preset]["num_layers"]
    args = parse_args(["--preset", "tiny", "--num-layers", str(layers), "--num-blocks", "1",
                       "--residual", "standard", "--seq-length", "32", "--micro-batch-size",
                       "1", "--global-batch-size", "1", "--bf16"])
    config = build_config(args, bf16=True)
    ddp = wrap_model(build_model(config, args, 256), config, args)
    opt, _ = build_optimizer([ddp], config, args)
    step = MixedPrecisionAdamW(opt)
    for b in ddp.buffers:
        b.grad_data.normal_()
    opt.prepare_grads()
    part, model_of, table = step.parts[0]
    tensors = step._tensors(part, model_of)
    device = tensors[0].param.device
    parts = [("prepare_grads", opt.prepare_grads),
             ("launch tensors", lambda: step._tensors(part, model_of)),
             ("launch tables", lambda: table.tables(tensors, device)),
             ("grads for norm", part.get_main_grads_for_grad_norm),
             ("zero_grad", opt.zero_grad),
             ("zero_grad_buffer", ddp.zero_grad_buffer)]
    out = []
    for name, fn in parts:
        if name == "launch tensors":
            opt.prepare_grads()  # zero_grad dropped the main gradients
        out.append((name, _median_ms(fn, rounds)))
    return out, layers, sum(1 for _ in ddp.parameters())


def main(argv=None) -> int:
    from megatron_lrattn.training.arg_types import positive_int
    from megatron_lrattn.training.presets import PRESETS

    ap = argparse.ArgumentParser(prog="bench_host.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["0.5b", "1b", "4b"])
    ap.add_argument("--rounds", type=positive_int, default=5,
                    help="rounds of 20 calls per part (median taken)")
    ap.add_argument("--csv", default=None, help="append one row per preset and part here")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_common as bc

    if args.csv:
        bc.check_csv(ap, "--csv", args.csv)
    warnings.filterwarnings("ignore")
    import torch
    import triton

    from megatron_lrattn.training.runtime import provenance, single_process_model_parallel

    torch.set_num_threads(1)
    info = provenance()
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=_cpu_name(), git_sha=info["git_sha"],
                torch=torch.__version__, triton=triton.__version__,
                megatron_core=info["megatron_core"])
    print(f"{meta}")
    with single_process_model_parallel():
        for preset in args.presets:
            parts, layers, tensors = measure(preset, args.rounds)
            waited = sum(ms for name, ms in parts if not name.startswith("zero"))
            print(f"{preset}: {layers} layers, {tensors} tensors: "
                  + ", ".join(f"{n} {ms:.3f}" for n, ms in parts)
                  + f" ms; before the kernel {waited:.2f} ms", flush=True)
            if args.csv:
                bc.append_rows(args.csv, FIELDS, [
                    dict(meta, preset=preset, layers=layers, tensors=tensors, part=n,
                         ms=round(ms, 4)) for n, ms in parts])
    return 0


if __name__ == "__main__":
    sys.exit(main())
