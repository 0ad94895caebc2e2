"""One depth block as the model runs it: per-site fused reads against the two-phase schedule.

The K read sites of a block after S completed sources (L=24, N=8: K=6 sites per block,
d=2048). The block's partial sums are formed from the K-1 sub-layer outputs y_k
(P_1 = y_1, P_k = P_{k-1} + y_k) and every read is followed by its sub-layer's RMSNorm:

- ``per_site``: K fused single-site reads (site k >= 1 also reads P_k) after torch adds,
  each followed by torch ``rms_norm``;
- ``two_phase``: one ``depth_read_multi`` (phase 1) over the S sources, then K-1 merges
  that form P_k themselves (``depth_merge_update``) and apply the norm (``norm_weight``),
  as ``DepthState`` does on the local spec.

Both are checked against the per-site torch reference (every output and gradient, the norm
weights' included; merged reads are rounded twice, so 2x the bf16 tolerance) and timed only
on a green check: wall and GPU busy time, fwd and fwd+bwd, against the block's minimal bytes
(fwd (S + 3K - 3)*T*d*2: S sources and K-1 outputs read, K reads written, K-2 partial sums
written; fwd+bwd (3S + 6K - 5)*T*d*2), peak memory, and with ``--profile`` the GPU time per
kernel.

    python benchmarks/bench_block.py                      # d=2048, S 5 and 9, K=6
    python benchmarks/bench_block.py --sources 9 --profile
    python benchmarks/bench_block.py --tokens 4096 --width 3072 --sources 9 --sites 8 \
        --keys sliced projected --profile          # the 4b preset's shape
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

from megatron_lrattn.ops import depth_read_torch  # noqa: E402

NORM_EPS = 1e-5  # RMSNorm epsilon of the presets
KEY_KINDS = {"sliced": lambda d: d // 4, "attnres": lambda d: d, "projected": lambda d: 32}


def block_inputs(T, d, r, S, K, seed, projected=False):
    """S sources, K-1 sub-layer outputs, K queries, K norm weights; K output gradients. With
    ``projected``, the [T, r] keys of the S sources and of the K-1 outputs (a partial sum's
    key is the sum of its outputs' keys, as ``DepthState`` forms it)."""
    g = torch.Generator(device=bc.DEVICE).manual_seed(seed)

    def randn(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, device=bc.DEVICE, generator=g).to(dt)
    inp = {"vals": [randn(T, d) for _ in range(S)], "ys": [randn(T, d) for _ in range(K - 1)],
           "queries": randn(K, r, dt=torch.float32) * (2.0 / r**0.5),
           "norm_w": [(1.0 + 0.2 * randn(d, dt=torch.float32)).to(torch.bfloat16)
                      for _ in range(K)]}
    if projected:
        inp["keys"] = [randn(T, r) for _ in range(S)]
        inp["ykeys"] = [randn(T, r) for _ in range(K - 1)]
    return inp, [randn(T, d) for _ in range(K)]


def partials(ys):
    ps = [ys[0]]
    for y in ys[1:]:
        ps.append(ps[-1] + y)
    return ps


def per_site(vals, ys, queries, norm_w, keys=None, ykeys=None, read=None):
    """K per-site reads after torch adds, each followed by its RMSNorm."""
    from megatron_lrattn.ops.site_read.fused import depth_read_triton

    read = read or depth_read_triton
    ps = partials(ys)
    pks = partials(ykeys) if keys is not None else None

    def site_keys(k):
        if keys is None:
            return None
        return keys + pks[k - 1:k] if k else keys
    outs = [read(vals + ps[k - 1:k] if k else vals, queries[k], site_keys(k))
            for k in range(len(queries))]
    return [F.rms_norm(h, (h.shape[-1],), w, NORM_EPS) for h, w in zip(outs, norm_w)]


def two_phase(vals, ys, queries, norm_w, keys=None, ykeys=None):
    """Phase 1 over the sources, then merges that form each P_k and apply the norm (with
    projected keys, the partial sums' keys are added in torch, as ``DepthState`` does)."""
    from megatron_lrattn.ops.two_phase.merge import depth_merge_triton, depth_merge_update_triton
    from megatron_lrattn.ops.two_phase.phase1 import depth_read_multi_triton

    d = vals[0].shape[-1]
    outs, lse = depth_read_multi_triton(vals, queries, keys, split=True)
    res, p = [F.rms_norm(outs[0], (d,), norm_w[0], NORM_EPS)], ys[0]
    pk = ykeys[0] if keys is not None else None
    for k in range(1, queries.shape[0]):
        kw = dict(norm_weight=norm_w[k], norm_eps=NORM_EPS)
        if k == 1:
            res.append(depth_merge_triton(outs[1], lse[1], p, queries[1], pk, **kw))
        else:
            if pk is not None:
                pk = pk + ykeys[k - 1]
            h, p = depth_merge_update_triton(outs[k], lse[k], p, ys[k - 1], queries[k], pk,
                                             **kw)
            res.append(h)
    return res


def block_fwd_bwd(fn, inp, grads):
    leaves = [inp["queries"], *inp["vals"], *inp["ys"], *inp["norm_w"],
              *inp.get("keys", []), *inp.get("ykeys", [])]
    for t in leaves:
        t.requires_grad_(True)
    try:
        outs = fn(**inp)
        gs = torch.autograd.grad(outs, leaves, grads)
    finally:
        for t in leaves:
            t.requires_grad_(False)
    return outs, gs


def bench_block(T, d, r, S, K, label, copy_tbps, meta, profile=False):
    """CSV rows of both schedules on one block."""
    inp, grads = block_inputs(T, d, r, S, K, seed=S + K + r, projected=label == "projected")
    up = {k: (v if k == "queries" else [t.float() for t in v]) for k, v in inp.items()}
    ref = block_fwd_bwd(functools.partial(per_site, read=depth_read_torch), up,
                        [g.float() for g in grads])
    del up
    nbytes = {"fwd": (S + 3 * K - 3) * T * d * 2, "fwdbwd": (3 * S + 6 * K - 5) * T * d * 2}
    # the Triton interpreter (--smoke) rounds fp32 to bf16 by truncation, the GPU to nearest
    tol = 2 * bc.TOL_BF16 * (1.0 if bc.DEVICE == "cuda" else 2.0)
    rows = []
    for name, fn in (("per_site", per_site), ("two_phase", two_phase)):
        outs, gs = block_fwd_bwd(fn, inp, grads)
        err = max(bc.rel_rms(a, b) for a, b in zip([*outs, *gs], [*ref[0], *ref[1]]))
        row = dict(meta, T=T, d=d, S=S, r=r, keys=label, backend=f"block_K{K}_{name}",
                   copy_tbps=f"{copy_tbps:.3f}", min_mib=f"{nbytes['fwd'] / 2**20:.0f}",
                   check=f"{'ok' if err <= tol else 'FAIL'} {err:.1e}")
        if not err <= tol:
            print(f"  {name}: RED CHECK rel-RMS {err:.2e} > {tol:.0e}; not timed", flush=True)
            rows.append(dict(row, **{"pass": "fwdbwd"}))
            continue
        fwd = functools.partial(fn, **inp)
        fb = functools.partial(block_fwd_bwd, fn, inp, grads)
        peak = bc.peak_extra_mib(fb)
        with torch.no_grad():
            wall = {"fwd": bc.bench(fwd, rep=200)}
            gpu = {"fwd": bc.device_ms(fwd)}
        wall["fwdbwd"], gpu["fwdbwd"] = bc.bench(fb, rep=300), bc.device_ms(fb)
        rows += [bc.timed_row(row, p, nbytes[p], wall[p], gpu[p], copy_tbps, peak)
                 for p in ("fwd", "fwdbwd")]
        print(f"  {name}: wall fwd {wall['fwd']:.3f} fwd+bwd {wall['fwdbwd']:.3f} ms | GPU busy "
              f"fwd {gpu['fwd']:.3f} fwd+bwd {gpu['fwdbwd']:.3f} ms "
              f"({bc.pct_copy(nbytes['fwdbwd'], gpu['fwdbwd'], copy_tbps):.1f}% of copy) | "
              f"peak {peak:.0f} MiB  check {row['check']}", flush=True)
        if profile and bc.DEVICE == "cuda":
            total, evs = bc.kernel_times(fb)
            print(f"  {name}: {total:.0f} us GPU per fwd+bwd", flush=True)
            for us, n, key in evs[:12]:
                print(f"    {us:8.1f} us  {n:3d} calls  {key[:90]}", flush=True)
    del inp, grads, ref
    if bc.DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=bc.positive_int, default=16384)
    ap.add_argument("--width", type=bc.positive_int, default=2048)
    ap.add_argument("--sources", type=bc.positive_int, nargs="+", default=[5, 9],
                    help="completed sources S before the block")
    ap.add_argument("--sites", type=bc.positive_int, default=6,
                    help="read sites K of the block (>= 2)")
    ap.add_argument("--keys", nargs="+", choices=KEY_KINDS, default=list(KEY_KINDS),
                    help="sliced r=d/4, attnres (r=d) or projected (r=32)")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of each arm")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "block.csv"))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU run of the harness under TRITON_INTERPRET=1 (no real timings)")
    args = ap.parse_args()
    if args.sites < 2:
        ap.error("--sites must be at least 2 (a block with one merged site)")
    if args.width < 4:
        ap.error(f"--width {args.width}: at least 4 (sliced keys take r = d/4)")
    bc.check_csv(ap, "--csv", args.csv)
    copy_tbps, meta = bc.start("bench_block", args.smoke, bc.ROUNDS)
    d, K = args.width, args.sites
    for S in args.sources:
        for label in args.keys:
            r = KEY_KINDS[label](d)
            print(f"block T={args.tokens} d={d} S={S} K={K} r={r} {label}", flush=True)
            bc.append_rows(args.csv, bc.FIELDS,
                           bench_block(args.tokens, d, r, S, K, label, copy_tbps, meta,
                                       args.profile))


if __name__ == "__main__":
    main()
