"""The fused depth read against the reference and public peers: one table per run.

For every shape it checks correctness first (every output and gradient against the fp32-math
reference on the same bf16 data; no number is reported on a red check), then times fwd and
fwd+bwd of every backend that passed in interleaved rounds (wall: median of the per-round
medians) and by GPU busy time, against the device-copy bandwidth measured in the same run.
Minimal bytes: fwd (S+1)*T*d*2, fwd+bwd (3S+2)*T*d*2, plus the projected keys (S*T*r*2
forward, 3*S*T*r*2 forward+backward).

Peers in the same run: the torch reference backend, ``torch.compile(depth_read_naive)`` (on
the S=9, d >= 2048 rows: each shape recompiles), and when importable FLA
(``fla.ops.attnres.fused_attnres``, r = d only) and fast-attnres (``attnres.attnres``,
sliced keys, bf16 query).

    python benchmarks/bench_kernels.py                   # d 2048 / 4096, S 4 / 9 / 17
    python benchmarks/bench_kernels.py --sources 9 --no-compile
    python benchmarks/bench_kernels.py --summarize benchmarks/results/kernels.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

from megatron_lrattn.ops import depth_read_naive, depth_read_torch  # noqa: E402

# table rows per width: label -> (key kind of depth_read, r)
KEY_KINDS = {"sliced": lambda d: ("sliced", d // 4), "attnres": lambda d: ("sliced", d),
             "projected": lambda d: ("projected", d // 4)}


def fla_peer():
    try:
        from fla.ops.attnres import fused_attnres
    except Exception:  # noqa: BLE001 - any import failure means the peer is absent
        return None

    def run(values, query, keys):
        if keys is not None or query.shape[0] != values[0].shape[-1]:
            return None
        return fused_attnres(query, values, torch.ones_like(query))
    return run


def fast_attnres_peer():
    try:
        from attnres import attnres
    except Exception:  # noqa: BLE001
        return None

    def run(values, query, keys):
        if keys is not None:
            return None
        return attnres(list(values), query.to(torch.bfloat16))
    return run


def backends(compile_peer: bool):
    """Name -> callable(values, query, keys) of every implementation of this run."""
    from megatron_lrattn.ops.site_read.fused import depth_read_triton

    out = {
        "triton": lambda v, q, k: depth_read_triton(v, q, k, save_output=True),
        "triton_recompute": lambda v, q, k: depth_read_triton(v, q, k, save_output=False),
        "torch_ref": depth_read_torch,
    }
    if compile_peer:
        out["compile_naive"] = torch.compile(depth_read_naive, dynamic=False)
    for name, peer in (("fla", fla_peer()), ("fast_attnres", fast_attnres_peer())):
        if peer is not None:
            out[name] = peer
    return out


def make(T, d, r, S, projected, seed):
    g = torch.Generator(device=bc.DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=bc.DEVICE, generator=g)
    vals = [randn(T, d).to(torch.bfloat16) for _ in range(S)]
    keys = [randn(T, r).to(torch.bfloat16) for _ in range(S)] if projected else None
    query = randn(r) * (2.0 / r**0.5)
    grad = randn(T, d).to(torch.bfloat16)
    return vals, query, keys, grad


def fwd_bwd(fn, vals, query, keys, grad):
    """(out, gradients of query, values and keys), or (None, None) if fn skips the shape."""
    leaves = [query, *vals, *(keys or [])]
    for t in leaves:
        t.requires_grad_(True)
    try:
        out = fn(vals, query, keys)
        gs = None if out is None else torch.autograd.grad(out, leaves, grad, allow_unused=True)
    finally:
        for t in leaves:
            t.requires_grad_(False)
    return out, gs


def check(fn, vals, query, keys, grad, ref):
    """Worst relative-RMS error of out and every gradient against the reference."""
    out, gs = fwd_bwd(fn, vals, query, keys, grad)
    if out is None:
        return None
    errs = [bc.rel_rms(out, ref[0])] + [bc.rel_rms(a, b) for a, b in zip(gs, ref[1])
                                        if a is not None]
    return max(errs)


def bench_shape(T, d, r, S, keys_kind, copy_tbps, meta, compile_peer=True):
    """CSV rows of one shape: a check row per red backend, a fwd and a fwdbwd row per green."""
    projected = keys_kind == "projected"
    vals, query, keys, grad = make(T, d, r, S, projected, seed=d + S + r)
    up = [v.float() for v in vals]
    kup = [k.float() for k in keys] if projected else None
    ref = fwd_bwd(depth_read_torch, up, query, kup, grad.float())  # fp32 math on bf16 data
    del up, kup
    kbytes = S * T * r * 2 if projected else 0
    nbytes = {"fwd": (S + 1) * T * d * 2 + kbytes, "fwdbwd": (3 * S + 2) * T * d * 2 + 3 * kbytes}
    base = dict(meta, T=T, d=d, S=S, r=r, keys=keys_kind, copy_tbps=f"{copy_tbps:.3f}",
                min_mib=f"{nbytes['fwd'] / 2**20:.0f}")
    rows, timed = [], {}
    fns = backends(compile_peer and S == 9 and d >= 2048 and not projected
                   and bc.DEVICE == "cuda")
    for name, fn in fns.items():
        try:
            err = check(fn, vals, query, keys, grad, ref)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape
            print(f"  {name}: error {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if err is None:
            continue
        # fast-attnres rounds the query to bf16: a logit change, not a bug; compare it looser
        tol = bc.TOL_BF16 * (4 if name == "fast_attnres" else 1)
        row = dict(base, backend=name, check=f"{'ok' if err <= tol else 'FAIL'} {err:.1e}")
        if not err <= tol:
            print(f"  {name}: RED CHECK rel-RMS {err:.2e} > {tol:.0e}; not timed", flush=True)
            rows.append(dict(row, **{"pass": "fwdbwd"}))
            continue
        timed[name] = (fn, row, bc.peak_extra_mib(lambda: fwd_bwd(fn, vals, query, keys, grad)))
    calls = {"fwd": {n: functools.partial(fn, vals, query, keys) for n, (fn, _, _) in
                     timed.items()},
             "fwdbwd": {n: functools.partial(fwd_bwd, fn, vals, query, keys, grad)
                        for n, (fn, _, _) in timed.items()}}
    with torch.no_grad():
        wall = {"fwd": bc.bench_rounds(calls["fwd"], rep=100)}
        gpu = {"fwd": {n: bc.device_ms(f) for n, f in calls["fwd"].items()}}
    wall["fwdbwd"] = bc.bench_rounds(calls["fwdbwd"], rep=150)
    gpu["fwdbwd"] = {n: bc.device_ms(f) for n, f in calls["fwdbwd"].items()}
    for name, (_, row, peak) in timed.items():
        print(f"  {name}: ms wall / GPU busy: fwd {wall['fwd'][name]:.3f} / "
              f"{gpu['fwd'][name]:.3f}, fwd+bwd {wall['fwdbwd'][name]:.3f} / "
              f"{gpu['fwdbwd'][name]:.3f}", flush=True)
        rows += [bc.timed_row(row, p, nbytes[p], wall[p][name], gpu[p][name], copy_tbps, peak)
                 for p in ("fwd", "fwdbwd")]
    del vals, keys, grad, ref
    if bc.DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def summarize(rows):
    """% of copy bandwidth per shape: ours vs the fastest peer (fwd | fwd+bwd), by wall time
    per call (CUDA events) and by GPU busy time where the CSV has it."""
    for col, title in (("pct_copy", "wall time per call (CUDA events; includes host waits)"),
                       ("gpu_pct_copy", "GPU busy time per call (profiler kernel sum)")):
        shapes = {}
        for row in rows:
            if row.get(col) not in (None, "", "nan"):
                key = (row["d"], row["S"], row["r"], row["keys"])
                shapes.setdefault(key, {})[(row["backend"], row["pass"])] = float(row[col])
        if not shapes:
            continue
        print(f"\n% of copy bandwidth, {title}")
        print(f"{'d':>5} {'S':>3} {'r':>5} {'keys':>9} | {'ours fwd':>8} {'fwd+bwd':>8} "
              f"{'recomp':>7} | {'best peer fwd':>22} {'fwd+bwd':>22} | speedup fwd  fb")
        nan = float("nan")
        for (d, S, r, keys), m in shapes.items():
            peers = {b for (b, _) in m if not b.startswith("triton")}

            def best(p):
                c = [(m[(b, p)], b) for b in peers if (b, p) in m]
                return max(c) if c else (nan, "-")
            bf, bfb = best("fwd"), best("fwdbwd")
            ours_f, ours = m.get(("triton", "fwd"), nan), m.get(("triton", "fwdbwd"), nan)
            print(f"{d:>5} {S:>3} {r:>5} {keys:>9} | {ours_f:>7.1f}% {ours:>7.1f}% "
                  f"{m.get(('triton_recompute', 'fwdbwd'), nan):>6.1f}% | "
                  f"{bf[0]:>6.1f}% {bf[1]:>14} {bfb[0]:>6.1f}% {bfb[1]:>14} | "
                  f"{ours_f / bf[0]:>6.2f}x {ours / bfb[0]:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=bc.positive_int, default=16384)
    ap.add_argument("--widths", type=bc.positive_int, nargs="+", default=[2048, 4096])
    ap.add_argument("--sources", type=bc.positive_int, nargs="+", default=[4, 9, 17])
    ap.add_argument("--extra", default="", help="more d:S pairs, comma separated (e.g. 2048:33)")
    ap.add_argument("--keys", nargs="+", choices=KEY_KINDS, default=list(KEY_KINDS),
                    help="key kinds of the rows: sliced r=d/4, attnres (r=d), projected r=d/4")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "kernels.csv"))
    ap.add_argument("--rounds", type=bc.positive_int, default=bc.ROUNDS,
                    help="interleaved timing rounds per candidate (median taken)")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the torch.compile peer (it compiles for every shape)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU run of the harness under TRITON_INTERPRET=1 (no real timings)")
    ap.add_argument("--summarize", metavar="CSV",
                    help="print the summary table of an earlier run's CSV and exit")
    args = ap.parse_args()
    if args.summarize:
        if not os.path.isfile(args.summarize):
            ap.error(f"--summarize: {args.summarize} is not a file")
        with open(args.summarize, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("pct_copy")]
        if not rows:
            ap.error(f"--summarize: {args.summarize} has no rows of this benchmark")
        summarize(rows)
        return
    extra = []
    for pair in filter(None, args.extra.split(",")):
        d, _, S = pair.partition(":")
        if not (d.isdigit() and S.isdigit() and int(d) > 0 and int(S) > 0):
            ap.error(f"--extra: {pair!r} is not d:S with positive integers (e.g. 2048:33)")
        extra.append((int(d), int(S)))
    if min(args.widths + [d for d, _ in extra]) < 4:
        ap.error("--widths: at least 4 (sliced keys take r = d/4)")
    bc.check_csv(ap, "--csv", args.csv)
    copy_tbps, meta = bc.start("bench_kernels", args.smoke, args.rounds)
    pairs = [(d, S) for S in args.sources for d in args.widths]
    pairs += extra
    rows = []
    for d, S in pairs:
        for label in args.keys:
            keys_kind, r = KEY_KINDS[label](d)
            print(f"T={args.tokens} d={d} S={S} r={r} {label}", flush=True)
            shape_rows = bench_shape(args.tokens, d, r, S, keys_kind, copy_tbps, meta,
                                     compile_peer=not args.no_compile)
            bc.append_rows(args.csv, bc.FIELDS, shape_rows)
            rows += shape_rows
    summarize(rows)


if __name__ == "__main__":
    main()
