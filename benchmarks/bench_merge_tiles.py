"""The phase-2 merge's launch settings at each preset's shape: the update + RMSNorm merge
(``depth_merge_update`` with ``norm_weight``, sliced keys r = d/4) forward and backward under
every (backward warps, backward programs per SM, backward prefetch) of a small grid, each
checked against the current default's outputs and gradients and timed by device time
(torch.profiler, every kernel of the call); one line per setting, then the three fastest
backward and forward. The same widths with r = d (Block AttnRes) follow, default only.

    python benchmarks/bench_merge_tiles.py        # GPU: 0.5b, 1b and 4b shapes
    TRITON_INTERPRET=1 python benchmarks/bench_merge_tiles.py --smoke   # CPU: one tiny shape

With ``--smoke`` (the Triton interpreter on CPU) one tiny shape and the default only, timed
by wall clock.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

from megatron_lrattn.ops import tuning  # noqa: E402
from megatron_lrattn.ops.two_phase.merge import _DepthMergeUpdateTriton  # noqa: E402


def _time_ms(fn) -> float:
    return bc.kernel_times(fn, 5)[0] / 1e3 if bc.DEVICE == "cuda" else bc.bench(fn, 1)


def sweep(T: int, d: int, r: int, grid: bool) -> None:
    dev = bc.DEVICE
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dt)

    out, part, upd, lse = rn(T, d), rn(T, d), rn(T, d), rn(T, dt=torch.float32)
    q = (rn(r, dt=torch.float32) * (2.0 / r ** 0.5)).requires_grad_()
    w = (1 + 0.2 * rn(d, dt=torch.float32)).to(torch.bfloat16).requires_grad_()
    inputs = [q, w] + [t.requires_grad_() for t in (out, lse, part, upd)]
    gh, gp = rn(T, d), rn(T, d)

    def fwd():
        return _DepthMergeUpdateTriton.apply(q, 1e-6, 1.0, 1e-5, out, lse, part, upd, None, w)

    default = tuning.merge(d, T)
    settings = [dict(tokens=default.tokens, warps=default.warps,
                     programs_per_sm=default.programs_per_sm, bwd_warps=default.bwd_warps,
                     prefetch=default.prefetch)]
    if grid:
        settings += [dict(tokens=1, bwd_warps=bw, programs_per_sm=pp, prefetch=pf)
                     for bw, pp, pf in itertools.product([2, 4, 8], [4, 8], [False, True])]
    ref, rows = None, []
    for s in settings:
        with tuning.override(merge=s):
            res = fwd()
            vals = [*res, *torch.autograd.grad(res, inputs, [gh, gp], retain_graph=True)]
            ref = ref or vals
            ok = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
                     for a, b in zip(vals, ref))
            tf = _time_ms(fwd)
            tb = _time_ms(lambda: torch.autograd.grad(res, inputs, [gh, gp], retain_graph=True))
        rows.append((tb, tf, s, ok))
        print(f"T={T} d={d} {s} ok={ok} fwd {tf * 1e3:.1f} us ({5 * T * d * 2 / tf / 1e6:.0f} "
              f"GB/s) bwd {tb * 1e3:.1f} us ({6 * T * d * 2 / tb / 1e6:.0f} GB/s)", flush=True)
    good = [x for x in rows if x[3]]
    print("BEST bwd", [(round(x[0] * 1e3, 1), x[2]) for x in sorted(good, key=lambda x: x[0])[:3]])
    print("BEST fwd", [(round(x[1] * 1e3, 1), x[2]) for x in sorted(good, key=lambda x: x[1])[:3]],
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1: one tiny shape, the default only")
    args = ap.parse_args()
    bc.start("bench_merge_tiles", args.smoke, 1)
    cuda = bc.DEVICE == "cuda"
    for T, d, r, grid in ([(16384, 1024, 256, True), (16384, 2048, 512, True),
                           (4096, 3072, 768, True), (16384, 1024, 1024, False),
                           (16384, 2048, 2048, False), (4096, 3072, 3072, False)] if cuda
                          else [(64, 128, 32, False)]):
        sweep(T, d, r, grid=grid)


if __name__ == "__main__":
    main()
