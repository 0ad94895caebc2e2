"""Two-phase against per-site depth reads through the fused Triton kernels under the Triton
interpreter on the CPU, at a chosen shape, in the bf16 Float16Module + megatron DDP model
(the set-up of ``tests/test_two_phase_model.py``; the GPU-only test there runs the tiny
preset's shape, which takes minutes under the interpreter, hence this script).

    python tools/two_phase_cpu_check.py --seq 128 --mbs 8 --residual attnres

Prints both runs' losses and the largest relative main-grad differences (docs/kernels.md).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from megatron_lrattn.training.arg_types import positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=positive_int, default=128,
                   help="sequence length (tiny preset: 128)")
    p.add_argument("--mbs", type=positive_int, default=8, help="micro-batch size (tiny preset: 8)")
    p.add_argument("--residual", choices=("attnres", "lr_attnres"), default="attnres")
    p.add_argument("--key", choices=("sliced", "projected"), default="sliced")
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--top", type=positive_int, default=12, help="gradients to list")
    a = p.parse_args()

    import test_two_phase_model as t
    from helpers import model_parallel_1x1
    from megatron_lrattn.compat.cpu import apply_cpu_compat

    apply_cpu_compat()
    with model_parallel_1x1():
        runs = {s: t._bf16_ddp_run(s, "triton", a.residual, seq=a.seq, mbs=a.mbs,
                                   steps=a.steps, key=a.key)
                for s in ("two_phase", "per_site")}
    for s, (losses, _) in runs.items():
        print(f"{s}: losses {' '.join(f'{x:.4f}' for x in losses)}")
    two, per = runs["two_phase"][1], runs["per_site"][1]
    errs = {n: ((two[n] - per[n]).norm() / per[n].norm().clamp_min(1e-30)).item() for n in per}
    print("largest relative main-grad differences (two_phase vs per_site, first step):")
    for n, e in sorted(errs.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {e:.3e}  {n}")


if __name__ == "__main__":
    main()
