"""Probe: fused depth read with projected keys at the 1b model's shapes (T=8192, d=2048)
for several key ranks, next-source prefetch on and off, against sliced keys."""
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lrattn_kernels.depth_read as kdr  # noqa: E402

T, d, S = 8192, 2048, 9
g = torch.Generator(device="cuda").manual_seed(0)
vals = [torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(S)]
grad = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)
for r, projected in ((512, False), (32, True), (128, True), (512, True)):
    q = torch.randn(r, device="cuda", generator=g)
    keys = ([torch.randn(T, r, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(S)]
            if projected else None)
    for pf in (0, 1):
        kdr.TUNE.clear()
        kdr.TUNE.update(prefetch=pf)
        with torch.no_grad():
            tf = do_bench(lambda: kdr.depth_read_triton(vals, q, keys), rep=50)
        vs = [v.requires_grad_() for v in vals]

        def fb():
            kdr.depth_read_triton(vs, q, keys).backward(grad)
        tb = do_bench(fb, rep=50)
        fwd_gb = (S + 1) * T * d * 2 / 1e9
        print(f"r={r} projected={projected} prefetch={pf}: fwd {tf:.3f} ms "
              f"({fwd_gb / tf:.2f} TB/s) fwd+bwd {tb:.3f} ms", flush=True)
