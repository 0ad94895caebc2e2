"""Depth-read benchmark: fused Triton kernels against the reference and public peers.

For every shape it checks correctness first (every output and gradient of the fused op
against the reference backend; no number is reported on a red check), then times fwd and
fwd+bwd of all backends with ``triton.testing.do_bench`` in interleaved rounds (median of
the per-round medians, ``--rounds``), and also their GPU busy time per call (kernel and copy
durations from a ``torch.profiler`` trace; at d=2048 the host, not the GPU, sets the wall
time of a fwd+bwd call), against the device-copy bandwidth measured in the same run.
Minimal bytes: fwd (S+1)*T*d*2, fwd+bwd (3S+2)*T*d*2, plus the projected keys (S*T*r*2
forward, 3*S*T*r*2 forward+backward).

Peers in the same run: the torch reference backend, ``torch.compile(depth_read_naive)``
(on the S=9 rows: each shape recompiles), and when importable FLA
(``fla.ops.attnres.fused_attnres``, r = d only) and fast-attnres (``attnres.attnres``,
sliced keys, bf16 query).

    python benchmarks/bench_depth_read.py                # full table, appends the CSV
    python benchmarks/bench_depth_read.py --sweep        # also sweep the kernel tiles
    python benchmarks/bench_depth_read.py --block        # one depth block, per-site vs two-phase

``--block`` times the K read sites of one depth block (L=24, N=8: K=6 sites per block,
d=2048) after S completed sources: site 0 reads the S sources, site k >= 1 also the
block's partial sum P_k. ``per_site``: K fused single-site reads; ``two_phase``: one
``depth_read_multi`` (phase 1) plus K-1 ``depth_merge`` (phase 2). Minimal bytes of the
block (what any implementation must move): fwd (S + 2K - 1)*T*d*2 (S sources and K-1
partials read once, K outputs written), fwd+bwd (3S + 5K - 3)*T*d*2 (the backward reads the
K output gradients, the sources and partials again and writes their gradients); plus the
projected keys (S + K - 1)*T*r*2 fwd, 3x that fwd+bwd. Both schedules are checked against
the per-site torch reference first (every output and gradient; merged reads are rounded
twice, so 2x the bf16 tolerance) and timed only on a green check.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lrattn_kernels.depth_merge as kmg  # noqa: E402
import lrattn_kernels.depth_read as kdr  # noqa: E402
import lrattn_kernels.depth_read_multi as kmr  # noqa: E402
from megatron_lrattn.ops.reference import depth_read_naive, depth_read_torch  # noqa: E402

TOL_BF16 = 1e-2
NORM_EPS = 1e-5  # RMSNorm epsilon of the --block-updates norm arms (the presets' value)
DEVICE = "cuda"
FIELDS = ["date", "gpu", "git_sha", "torch", "triton", "T", "d", "S", "r", "keys", "backend",
          "pass", "ms", "gbytes", "tbps", "pct_copy", "copy_tbps", "peak_mib", "min_mib", "check",
          "gpu_ms", "gpu_pct_copy", "host_ms"]


def rel_rms(x, ref):
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def git_sha():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        top = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=root,
                                      text=True, stderr=subprocess.DEVNULL).strip()
        if os.path.realpath(top) != os.path.realpath(root):  # an exported copy inside a checkout
            raise OSError(top)
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                      stderr=subprocess.DEVNULL)
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "kernels", "benchmarks"],
                                cwd=root)
        return sha.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_SHA", "unknown")


def bench(fn, rep):
    """Median ms of fn; on CPU (--smoke, interpreter) a plain wall clock of 2 calls."""
    if DEVICE == "cuda":
        return do_bench(fn, warmup=25, rep=rep, return_mode="median")
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1e3


ROUNDS = 3  # --rounds: timed rounds per candidate, interleaved (see bench_rounds)


def bench_rounds(fns, rep):
    """{name: median ms} of several callables timed in ROUNDS interleaved rounds (A B C, A B
    C, ...; each entry the median of one ``bench``), so that a slow spell of the GPU (clocks,
    a neighbour) lands on every candidate instead of on whichever ran then."""
    runs = {name: [] for name in fns}
    for _ in range(ROUNDS if DEVICE == "cuda" else 1):
        for name, fn in fns.items():
            runs[name].append(bench(fn, rep))
    return {name: statistics.median(ms) for name, ms in runs.items()}


def device_ms(fn, iters=10):
    """GPU busy time of one call of fn (ms): the durations of the kernels and copies it
    enqueues, summed from a ``torch.profiler`` trace of ``iters`` calls. Unlike ``bench`` (CUDA
    events around each call) it leaves out the time the GPU waits for the host, which at
    d=2048 is most of a fwd+bwd call's wall time for every implementation measured here
    (Python, autograd and launch overhead; it is hidden in training as long as the host runs
    ahead of the GPU). NaN off CUDA or when the trace has no device events."""
    if DEVICE != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        us = sum(e.self_device_time_total for e in prof.key_averages())
    except Exception as e:  # noqa: BLE001 - a profiler that cannot trace: say so, go on
        print(f"  device_ms: profiler failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
        return float("nan")
    return us / iters / 1e3 if us > 0 else float("nan")


def host_ms(fn, iters=20):
    """CPU time of one call (ms, median): the Python call itself, without waiting for the
    GPU (the launches queue up). With ``bench`` (wall) and ``device_ms`` (GPU busy) it says
    which of the two sets a call's wall time."""
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def copy_bandwidth(gib=2):
    x = torch.randn(gib * 2**29 if DEVICE == "cuda" else 2**20, device=DEVICE).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=300)
    nbytes = 2 * x.numel() * x.element_size()
    del x, y
    return nbytes / ms / 1e9  # TB/s, bytes read + written


def fla_peer():
    try:
        from fla.ops.attnres import fused_attnres
    except Exception:  # noqa: BLE001 - any import failure means the peer is absent
        return None

    def run(values, query, keys):
        if keys is not None or query.shape[0] != values[0].shape[-1]:
            return None
        w = torch.ones_like(query)
        return fused_attnres(query, values, w)
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


def backends(shape_has_compile):
    out = {
        "triton": lambda v, q, k: kdr.depth_read_triton(v, q, k, save_output=True),
        "triton_recompute": lambda v, q, k: kdr.depth_read_triton(v, q, k, save_output=False),
        "torch_ref": depth_read_torch,
    }
    if shape_has_compile:
        out["compile_naive"] = torch.compile(depth_read_naive, dynamic=False)
    for name, peer in (("fla", fla_peer()), ("fast_attnres", fast_attnres_peer())):
        if peer is not None:
            out[name] = peer
    return out


def make(T, d, r, S, projected, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=g)
    vals = [randn(T, d).to(torch.bfloat16) for _ in range(S)]
    keys = [randn(T, r).to(torch.bfloat16) for _ in range(S)] if projected else None
    query = randn(r) * (2.0 / r**0.5)
    grad = randn(T, d).to(torch.bfloat16)
    return vals, query, keys, grad


def peak_extra_mib(call) -> float:
    """Peak device memory above what was allocated before ``call()`` (MiB); NaN off CUDA."""
    if DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd(fn, vals, query, keys, grad):
    leaves = [query, *vals, *(keys or [])]
    for t in leaves:
        t.requires_grad_(True)
    out = fn(vals, query, keys)
    if out is None:
        for t in leaves:
            t.requires_grad_(False)
        return None, None
    gs = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    for t in leaves:
        t.requires_grad_(False)
    return out, gs


def check(fn, vals, query, keys, grad, ref):
    """Worst relative-RMS error of out and every gradient against the reference."""
    out, gs = fwd_bwd(fn, vals, query, keys, grad)
    if out is None:
        return None
    errs = [rel_rms(out, ref[0])]
    errs += [rel_rms(a, b) for a, b in zip(gs, ref[1]) if a is not None]
    return max(errs)


def bench_shape(T, d, r, S, keys_kind, copy_tbps, meta, sweep_only=False, compile_peer=True):
    projected = keys_kind == "projected"
    vals, query, keys, grad = make(T, d, r, S, projected, seed=d + S + r)
    up = [v.float() for v in vals]
    kup = [k.float() for k in keys] if projected else None
    ref = fwd_bwd(depth_read_torch, up, query, kup, grad.float())  # fp32 math on bf16 data
    del up, kup
    kbytes = S * T * r * 2 if projected else 0
    nbytes = {"fwd": (S + 1) * T * d * 2 + kbytes, "fwdbwd": (3 * S + 2) * T * d * 2 + 3 * kbytes}
    min_mib = (S + 1) * T * d * 2 / 2**20 + kbytes / 2**20
    rows, timed = [], {}
    fns = backends(compile_peer and S == 9 and d >= 2048 and not projected and DEVICE == "cuda")
    for name, fn in fns.items():
        row = dict(meta, T=T, d=d, S=S, r=r, keys=keys_kind, backend=name, copy_tbps=f"{copy_tbps:.3f}",
                   min_mib=f"{min_mib:.0f}")
        try:
            err = check(fn, vals, query, keys, grad, ref)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape
            print(f"  {name}: error {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if err is None:
            continue
        # fast-attnres rounds the query to bf16: a logit change, not a bug; compare it looser
        tol = TOL_BF16 * (4 if name == "fast_attnres" else 1)
        ok = err <= tol
        row["check"] = f"ok {err:.1e}" if ok else f"FAIL {err:.1e}"
        if not ok:
            print(f"  {name}: RED CHECK rel-RMS {err:.2e} > {tol:.0e}; not timed", flush=True)
            rows.append(dict(row, **{"pass": "fwdbwd"}))
            continue
        peak = peak_extra_mib(lambda: fwd_bwd(fn, vals, query, keys, grad))
        timed[name] = (fn, row, peak)
    # all backends that passed, timed in interleaved rounds (bench_rounds)
    with torch.no_grad():
        t_fwd = bench_rounds({n: functools.partial(fn, vals, query, keys)
                              for n, (fn, _, _) in timed.items()}, rep=100)
    t_fb = bench_rounds({n: functools.partial(fwd_bwd, fn, vals, query, keys, grad)
                         for n, (fn, _, _) in timed.items()}, rep=150)
    for name, (fn, row, peak) in timed.items():
        with torch.no_grad():
            g_fwd = device_ms(functools.partial(fn, vals, query, keys))
            h_fwd = host_ms(functools.partial(fn, vals, query, keys))
        g_fb = device_ms(functools.partial(fwd_bwd, fn, vals, query, keys, grad))
        h_fb = host_ms(functools.partial(fwd_bwd, fn, vals, query, keys, grad))
        print(f"  {name}: ms wall / GPU busy / host: fwd {t_fwd[name]:.3f} / {g_fwd:.3f} / "
              f"{h_fwd:.3f}, fwd+bwd {t_fb[name]:.3f} / {g_fb:.3f} / {h_fb:.3f}", flush=True)
        for p, ms, gms, hms in (("fwd", t_fwd[name], g_fwd, h_fwd),
                                ("fwdbwd", t_fb[name], g_fb, h_fb)):
            tbps = nbytes[p] / ms / 1e9
            gpct = 100 * nbytes[p] / gms / 1e9 / copy_tbps
            rows.append(dict(row, **{"pass": p, "ms": f"{ms:.4f}", "gbytes": f"{nbytes[p] / 1e9:.3f}",
                                     "tbps": f"{tbps:.3f}", "pct_copy": f"{100 * tbps / copy_tbps:.1f}",
                                     "peak_mib": f"{peak:.0f}" if p == "fwdbwd" else "",
                                     "gpu_ms": f"{gms:.4f}", "gpu_pct_copy": f"{gpct:.1f}",
                                     "host_ms": f"{hms:.4f}"}))
    del vals, keys, grad, ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def sweep(T, copy_tbps):
    """Time the kernel tiles (tokens x width per program, warps, backward programs per SM)."""
    for d in (2048, 4096):
        S, r = 9, d // 4
        vals, query, _, grad = make(T, d, r, S, False, seed=1)
        fwd_bytes, fb_bytes = (S + 1) * T * d * 2, (3 * S + 2) * T * d * 2
        configs = [(t, w, 4) for t in (2048, 4096, 8192, 16384) for w in (4, 8, 16)]
        configs += [(4096, 8, 2), (4096, 8, 8)]
        for tile, warps, ctas in configs:
            if warps * 32 * 4 > max(tile, triton.next_power_of_2(d)):
                continue
            kdr.TUNE.clear()
            kdr.TUNE.update(tile=tile, warps=warps, ctas_per_sm=ctas)
            fn = kdr.depth_read_triton
            with torch.no_grad():
                tf = bench(lambda: fn(vals, query), rep=100)
            tb = bench(lambda: fwd_bwd(fn, vals, query, None, grad), rep=150)
            print(f"sweep d={d} tile={tile} warps={warps} ctas/sm={ctas}: "
                  f"fwd {100 * fwd_bytes / tf / 1e9 / copy_tbps:.1f}% "
                  f"fwd+bwd {100 * fb_bytes / tb / 1e9 / copy_tbps:.1f}%", flush=True)
        kdr.TUNE.clear()


def _with_tune(settings, fn, *args):
    kdr.TUNE.clear()
    kdr.TUNE.update(settings)
    return fn(*args)


def _sweep_times(wall, gpu, nbytes, copy_tbps):
    """'wall W ms P% | gpu G ms Q%' for a sweep line (% of the copy bandwidth)."""
    pct = lambda ms: 100 * nbytes / ms / 1e9 / copy_tbps  # noqa: E731
    return f"wall {wall:.3f} ms {pct(wall):.1f}% | gpu {gpu:.3f} ms {pct(gpu):.1f}%"


def _rank(wall, gpu):
    """Sort key of sweep candidates: GPU busy time where it was measured (the wall time of a
    d=2048 call is set by the host), else wall time."""
    return lambda n: gpu[n] if math.isfinite(gpu[n]) else wall[n]


def src_sweep(T, copy_tbps, widths=(2048, 4096)):
    """Sweep the source-tiled kernels at S=9, sliced r=d/4: forward (hand pipelining on or
    off, sources per step, warps), then backward (pipelining, sources per step, programs per
    SM) in both backward modes (saved output / recompute), each group timed in interleaved
    rounds (bench_rounds) and by GPU busy time (device_ms); keep the fastest forward and
    saved-output backward settings per width in ``kdr.TUNE`` for the table that follows
    (printed, so the run says which settings produced its rows). Returns {d: settings}."""
    S = 9
    best = {}
    base = dict(kdr.TUNE)  # LRATTN_KERNELS_TUNE, restored at the end
    for d in widths:
        r = d // 4
        vals, query, _, grad = make(T, d, r, S, False, seed=3)
        fwd_bytes, fb_bytes = (S + 1) * T * d * 2, (3 * S + 2) * T * d * 2
        ref = fwd_bwd(depth_read_torch, [v.float() for v in vals], query, None, grad.float())
        fwd = {}
        # (hand pipelining, sources per step, warps, fused row sums, register cap, 0 = none);
        # the default at d=2048 is the first, at d=4096 the last (kdr.SRC_MAXNREG)
        for pf, bl, warps, fs, cap in ((1, 1, 4, 1, 0), (1, 1, 4, 0, 0), (1, 1, 8, 1, 0),
                                       (1, 2, 4, 1, 0), (0, 1, 4, 1, 0), (1, 1, 4, 1, 128)):
            cfg = dict(src_sources=bl, src_warps=warps, src_stages=1, src_prefetch=pf,
                       src_fused_sums=fs, src_maxnreg=cap)
            tune = dict(base, impl=1, **cfg)
            name = f"prefetch={pf} BL={bl} warps={warps} fused_sums={fs} maxnreg={cap or '-'}"
            with torch.no_grad():
                err = rel_rms(_with_tune(tune, kdr.depth_read_triton, vals, query), ref[0])
            if not err <= TOL_BF16:
                print(f"src sweep fwd d={d} {name}: RED CHECK {err:.1e}", flush=True)
                continue
            fwd[name] = (cfg, functools.partial(_with_tune, tune, kdr.depth_read_triton,
                                                vals, query))
        with torch.no_grad():
            ms = bench_rounds({n: f for n, (_, f) in fwd.items()}, rep=100)
            gpu = {n: device_ms(f) for n, (_, f) in fwd.items()}
        for n, t in ms.items():
            print(f"src sweep fwd d={d} {n}: {_sweep_times(t, gpu[n], fwd_bytes, copy_tbps)}",
                  flush=True)
        fbest = fwd[min(ms, key=_rank(ms, gpu))][0]
        bwd = {}
        # (saved output, hand pipelining, sources per step, warps, programs per SM, fused row
        # sums, register cap: None = the default SRC_MAXNREG, 0 = none, keys as rows of
        # their own, the default where r pads to less than the row); the first is the
        # default; the forward keeps the best setting above.
        # A register cap buys programs per SM with spills (tools/kernel_ptx.py --maxnreg);
        # with the keys as rows of their own (--key-chunk) the backward needs 96 registers
        # at d=2048 (5 programs per SM; 80: 6) and 168 at d=4096 (3; 128: 4, 132 bytes
        # spilled; 8 warps: 115, 2 programs).
        for save, pf, bl, warps, ctas, fs, cap, kc in (
                (True, 1, 1, 4, 8, 1, None, 1), (True, 1, 1, 4, 8, 1, None, 0),
                (True, 1, 1, 4, 8, 1, 0, 0), (True, 1, 1, 4, 8, 1, 0, 1),
                (True, 1, 1, 4, 8, 1, 96, 1), (True, 1, 1, 4, 8, 1, 80, 1),
                (True, 1, 1, 4, 8, 1, 128, 1),
                (True, 1, 1, 8, 8, 1, 0, 1), (True, 1, 1, 4, 16, 1, 96, 1),
                (True, 1, 2, 4, 8, 1, 0, 1), (True, 1, 2, 4, 8, 1, 128, 1),
                (True, 1, 2, 8, 8, 1, 0, 1),
                (False, 1, 1, 4, 8, 1, None, 1), (False, 1, 1, 4, 8, 1, None, 0)):
            fn = functools.partial(kdr.depth_read_triton, save_output=save)
            cfg = dict(src_bwd_sources=bl, src_bwd_warps=warps, src_bwd_stages=1,
                       src_bwd_prefetch=pf, src_ctas_per_sm=ctas, src_bwd_fused_sums=fs,
                       src_bwd_key_chunk=kc, **({} if cap is None else
                                                {"src_bwd_maxnreg": cap}))
            tune = dict(base, impl=1, **fbest, **cfg)
            name = (f"save_output={save} prefetch={pf} BL={bl} warps={warps} "
                    f"ctas/sm={ctas} fused_sums={fs} "
                    f"maxnreg={'default' if cap is None else cap or '-'} key_rows={kc}")
            err = _with_tune(tune, check, fn, vals, query, None, grad, ref)
            if not err <= TOL_BF16:
                print(f"src sweep fwd+bwd d={d} {name}: RED CHECK {err:.1e}", flush=True)
                continue
            bwd[name] = (cfg, save, functools.partial(
                _with_tune, tune, fwd_bwd, fn, vals, query, None, grad))
        ms = bench_rounds({n: f for n, (_, _, f) in bwd.items()}, rep=150)
        gpu = {n: device_ms(f) for n, (_, _, f) in bwd.items()}
        for n, t in ms.items():
            print(f"src sweep fwd+bwd d={d} {n}: {_sweep_times(t, gpu[n], fb_bytes, copy_tbps)}",
                  flush=True)
        saved = {n: t for n, t in ms.items() if bwd[n][1]}
        best[d] = dict(fbest, **bwd[min(saved, key=_rank(saved, gpu))][0])
        print(f"src sweep best d={d}: {best[d]}", flush=True)
        del vals, grad, ref
    kdr.TUNE.clear()
    kdr.TUNE.update(base)
    return best


def layout_probe(T, copy_tbps, d=2048, S=9):
    """Does where the sources sit in memory change the speed? The same sources as separate
    allocations (the default), carved back to back from one buffer, and carved with random
    gaps (multiples of 4 KiB) between them; ours and the peers, sliced r=d/4 and r=d,
    timed in interleaved rounds."""
    gen = torch.Generator().manual_seed(11)
    for r in (d // 4, d):
        vals, query, _, grad = make(T, d, r, S, False, seed=5)
        layouts = {"separate": vals}
        for kind in ("back_to_back", "gapped"):
            gaps = [0] * S if kind == "back_to_back" else \
                [int(x) * 2048 for x in torch.randint(1, 64, (S,), generator=gen)]
            buf = torch.empty(S * T * d + sum(gaps), dtype=vals[0].dtype, device=DEVICE)
            placed, off = [], 0
            for v, gap in zip(vals, gaps):
                off += gap
                placed.append(buf[off:off + T * d].view(T, d).copy_(v))
                off += T * d
            layouts[kind] = placed
        fns = {}
        for name, fn in backends(False).items():
            if name == "torch_ref" or fn(vals, query, None) is None:
                continue
            for kind, vs in layouts.items():
                fns[f"{name} {kind}"] = functools.partial(fwd_bwd, fn, vs, query, None, grad)
        ms = bench_rounds(fns, rep=150)
        fb_bytes = (3 * S + 2) * T * d * 2
        for n, t in ms.items():
            print(f"layout d={d} r={r} {n}: fwd+bwd {t:.3f} ms "
                  f"{100 * fb_bytes / t / 1e9 / copy_tbps:.1f}%", flush=True)
        del vals, grad, layouts, fns


RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                 "cudaMemcpy", "cudaHostAlloc", "cudaMalloc", "cudaLaunchKernel",
                 "cuLaunchKernel", "cuLaunchKernelEx", "cudaEventQuery", "cudaEventRecord")


def host_probe(T, copy_tbps, d=2048, S=9, iters=20):
    """Where the wall time of one fwd+bwd call goes, ours and the peers side by side: wall
    (CUDA events, as in the table), GPU busy time, host time, and the CUDA runtime calls the
    host makes per call (a synchronising call such as cudaStreamSynchronize, or a copy from
    pageable memory, stalls the host until the GPU has drained, so host and GPU time add up
    instead of overlapping). Then the Python profile of our call."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile
    if DEVICE != "cuda":
        print("host probe: needs a CUDA GPU, skipped", flush=True)
        return
    for r in (d // 4, d):
        vals, query, _, grad = make(T, d, r, S, False, seed=7)
        fb_bytes = (3 * S + 2) * T * d * 2
        for name, fn in backends(False).items():
            if name == "torch_ref" or fn(vals, query, None) is None:
                continue
            call = functools.partial(fwd_bwd, fn, vals, query, None, grad)
            wall, gpu, host = bench(call, rep=150), device_ms(call), host_ms(call)
            call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(iters):
                    call()
                torch.cuda.synchronize()
            counts = {e.key: (e.count / iters, e.cpu_time_total / iters)
                      for e in prof.key_averages() if e.key in RUNTIME_CALLS}
            calls = ", ".join(f"{k} {n:g}x {us:.0f}us" for k, (n, us) in sorted(counts.items()))
            pct = lambda ms: 100 * fb_bytes / ms / 1e9 / copy_tbps  # noqa: E731
            print(f"host probe d={d} r={r} {name}: wall {wall:.3f} ms ({pct(wall):.1f}%) "
                  f"gpu {gpu:.3f} ms ({pct(gpu):.1f}%) host {host:.3f} ms | per call: {calls}",
                  flush=True)
            if name == "triton":
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(iters):
                    call()
                pr.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(12)
                print("\n".join(ln for ln in buf.getvalue().splitlines()[6:] if ln.strip()),
                      flush=True)
        del vals, grad


def prefetch_ab(T, copy_tbps):
    """The same kernels with and without loading the next source ahead, side by side."""
    for d in (2048, 4096):
        for r in (d // 4, d):
            S = 9
            vals, query, _, grad = make(T, d, r, S, False, seed=2)
            fwd_bytes, fb_bytes = (S + 1) * T * d * 2, (3 * S + 2) * T * d * 2
            for pf in (0, 1, 0, 1):
                kdr.TUNE.clear()
                kdr.TUNE.update(prefetch=pf)
                fn = kdr.depth_read_triton
                with torch.no_grad():
                    tf = bench(lambda: fn(vals, query), rep=100)
                tb = bench(lambda: fwd_bwd(fn, vals, query, None, grad), rep=150)
                print(f"prefetch={pf} d={d} r={r} S={S}: fwd {tf:.3f} ms "
                      f"{100 * fwd_bytes / tf / 1e9 / copy_tbps:.1f}% | fwd+bwd {tb:.3f} ms "
                      f"{100 * fb_bytes / tb / 1e9 / copy_tbps:.1f}%", flush=True)
            kdr.TUNE.clear()
            del vals, grad


def _interp_factor() -> float:
    """Tolerance factor of the block checks: 2 under the Triton interpreter (--smoke), which
    rounds fp32 to bf16 by truncation where the GPU rounds to nearest."""
    return 1.0 if DEVICE == "cuda" else 2.0


def block_inputs(T, d, r, S, K, projected, seed):
    """S sources, K-1 partial sums (site k >= 1 reads P_k), K queries and output grads."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, device=DEVICE, generator=g).to(dt)
    inp = {"vals": [randn(T, d) for _ in range(S)], "parts": [randn(T, d) for _ in range(K - 1)],
           "keys": [randn(T, r) for _ in range(S)] if projected else None,
           "pkeys": [randn(T, r) for _ in range(K - 1)] if projected else None,
           "queries": randn(K, r, dt=torch.float32) * (2.0 / r**0.5)}
    grads = [randn(T, d) for _ in range(K)]
    return inp, grads


def block_per_site(read):
    def run(vals, parts, keys, pkeys, queries):
        outs = []
        for k in range(queries.shape[0]):
            v = vals + parts[k - 1:k] if k else vals
            ks = None if keys is None else (keys + pkeys[k - 1:k] if k else keys)
            outs.append(read(v, queries[k], ks))
        return outs
    return run


def block_two_phase(vals, parts, keys, pkeys, queries):
    outs, lse = kmr.depth_read_multi_triton(vals, queries, keys, split=True)
    return [outs[0]] + [kmg.depth_merge_triton(outs[k], lse[k], parts[k - 1], queries[k],
                                               None if keys is None else pkeys[k - 1])
                        for k in range(1, queries.shape[0])]


def block_fwd_bwd(fn, inp, grads):
    leaves = [inp["queries"], *inp["vals"], *inp["parts"], *(inp["keys"] or []),
              *(inp["pkeys"] or []), *(inp.get("norm_w") or [])]
    for t in leaves:
        t.requires_grad_(True)
    outs = fn(**inp)
    gs = torch.autograd.grad(outs, leaves, grads)
    for t in leaves:
        t.requires_grad_(False)
    return outs, gs


def bench_block(T, d, r, S, K, keys_kind, copy_tbps, meta):
    """Per-site fused reads vs two-phase for the K sites of one block; CSV rows."""
    projected = keys_kind == "projected"
    inp, grads = block_inputs(T, d, r, S, K, projected, seed=S + K + r)
    up = {k: (None if v is None else v if k == "queries" else [t.float() for t in v])
          for k, v in inp.items()}
    ref = block_fwd_bwd(block_per_site(depth_read_torch), up, [g.float() for g in grads])
    del up
    kb = (S + K - 1) * T * r * 2 if projected else 0
    nbytes = {"fwd": (S + 2 * K - 1) * T * d * 2 + kb,
              "fwdbwd": (3 * S + 5 * K - 3) * T * d * 2 + 3 * kb}
    rows = []
    arms = (("per_site", block_per_site(kdr.depth_read_triton), TOL_BF16, None),
            ("two_phase", block_two_phase, 2 * TOL_BF16, None))
    if os.environ.get("BLOCK_TILES3D"):  # the previous phase 1 (3-D tiles) as a third arm
        arms += (("two_phase_tiles3d", block_two_phase, 2 * TOL_BF16, {"multi_impl": 3}),)
    for name, fn, tol, tune in arms:
        kdr.TUNE.clear()
        kdr.TUNE.update(tune or {})
        row = dict(meta, T=T, d=d, S=S, r=r, keys=keys_kind, backend=f"block_K{K}_{name}",
                   copy_tbps=f"{copy_tbps:.3f}", min_mib=f"{nbytes['fwd'] / 2**20:.0f}")
        outs, gs = block_fwd_bwd(fn, inp, grads)
        err = max(rel_rms(a, b) for a, b in zip([*outs, *gs], [*ref[0], *ref[1]]))
        tol *= _interp_factor()
        row["check"] = f"ok {err:.1e}" if err <= tol else f"FAIL {err:.1e}"
        if err > tol:
            print(f"  {name}: RED CHECK rel-RMS {err:.2e} > {tol:.0e}; not timed", flush=True)
            rows.append(dict(row, **{"pass": "fwdbwd"}))
            continue
        peak = peak_extra_mib(lambda: block_fwd_bwd(fn, inp, grads))
        with torch.no_grad():
            t_fwd = bench(lambda: fn(**inp), rep=200)
        t_fb = bench(lambda: block_fwd_bwd(fn, inp, grads), rep=300)
        with torch.no_grad():
            g_fwd = device_ms(lambda: fn(**inp))
        g_fb = device_ms(lambda: block_fwd_bwd(fn, inp, grads))
        for p, ms, gms in (("fwd", t_fwd, g_fwd), ("fwdbwd", t_fb, g_fb)):
            tbps = nbytes[p] / ms / 1e9
            rows.append(dict(row, **{
                "pass": p, "ms": f"{ms:.4f}", "gbytes": f"{nbytes[p] / 1e9:.3f}",
                "tbps": f"{tbps:.3f}", "pct_copy": f"{100 * tbps / copy_tbps:.1f}",
                "gpu_ms": f"{gms:.4f}",
                "gpu_pct_copy": f"{100 * nbytes[p] / gms / 1e9 / copy_tbps:.1f}",
                "peak_mib": f"{peak:.0f}" if p == "fwdbwd" else ""}))

        def pct(p, ms):
            return f"{ms:.3f} ms ({100 * nbytes[p] / ms / 1e9 / copy_tbps:.1f}%)"
        print(f"  {name}: wall fwd {pct('fwd', t_fwd)} fwd+bwd {pct('fwdbwd', t_fb)} | GPU busy "
              f"fwd {pct('fwd', g_fwd)} fwd+bwd {pct('fwdbwd', g_fb)} | peak {peak:.0f} MiB  "
              f"check {row['check']}", flush=True)
    kdr.TUNE.clear()
    del inp, grads, ref
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


# table rows per width: label -> (key kind of depth_read, r)
KEY_KINDS = {"sliced": lambda d: ("sliced", d // 4), "attnres": lambda d: ("sliced", d),
             "projected": lambda d: ("projected", d // 4)}


def main():
    global DEVICE, ROUNDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--widths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--sources", type=int, nargs="+", default=[4, 9, 17])
    ap.add_argument("--extra", default="", help="more d:S pairs, comma separated (e.g. 2048:33)")
    ap.add_argument("--keys", nargs="+", choices=KEY_KINDS, default=list(KEY_KINDS),
                    help="key kinds of the table rows: sliced r=d/4, attnres (r=d), "
                         "projected r=d/4")
    ap.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "depth_read.csv"))
    ap.add_argument("--sweep", action="store_true",
                    help="sweep kernel tiles first (with --block: the phase-1 tiles)")
    ap.add_argument("--src-sweep", action="store_true",
                    help="sweep the source-tiled kernels first and time the table with the "
                         "fastest settings per width (printed)")
    ap.add_argument("--prefetch-ab", action="store_true",
                    help="time the kernels with and without next-source prefetch first")
    ap.add_argument("--layout-probe", action="store_true",
                    help="fwd+bwd with the sources at other places in memory (d=2048, S=9)")
    ap.add_argument("--host-probe", action="store_true",
                    help="where a fwd+bwd call's wall time goes (d=2048, S=9): wall, GPU and "
                         "host time and the CUDA runtime calls per call, ours and the peers")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="interleaved timing rounds per candidate (median taken)")
    ap.add_argument("--no-table", action="store_true", help="sweeps and probes only")
    ap.add_argument("--block", action="store_true",
                    help="time one depth block (per-site reads vs two-phase) instead of the table")
    ap.add_argument("--block-width", type=int, default=2048)
    ap.add_argument("--block-sources", type=int, nargs="+", default=[5, 9],
                    help="completed sources S before the block")
    ap.add_argument("--block-sites", type=int, default=6, help="read sites K of the block")
    ap.add_argument("--block-updates", action="store_true",
                    help="with --block: partial sums formed from sub-layer outputs (adds then "
                         "merges, or merges that form them)")
    ap.add_argument("--block-norm-sweep", action="store_true",
                    help="with --block-updates: merge settings timed on the blocks with "
                         "fused updates")
    ap.add_argument("--block-phase1-ab", action="store_true",
                    help="with --block: phase-1 settings timed on the two-phase block "
                         "(PHASE1_AB), interleaved rounds, and the GPU time per kernel")
    ap.add_argument("--block-profile", action="store_true",
                    help="with --block: GPU time per kernel of one block, both schedules")
    ap.add_argument("--sweep-only", action="store_true",
                    help="with --block --sweep: the sweep without the block rows")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the torch.compile peer (it compiles for every shape)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU run of the harness logic under TRITON_INTERPRET=1 (no real timings)")
    ap.add_argument("--summarize", metavar="CSV",
                    help="print the summary table of an earlier run's CSV and exit")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize, newline="") as f:
            summarize([r for r in csv.DictReader(f) if r.get("pct_copy")])
        return
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("bench_depth_read: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    ROUNDS = args.rounds
    T = args.tokens
    copy_tbps = copy_bandwidth()
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter"
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu,
                git_sha=git_sha(), torch=torch.__version__, triton=triton.__version__)
    print(f"{meta}  copy {copy_tbps:.3f} TB/s", flush=True)
    if args.sweep and not args.block:
        sweep(T, copy_tbps)
    tuned = src_sweep(T, copy_tbps, sorted(set(args.widths) & {2048, 4096}) or (2048,)) \
        if args.src_sweep else {}
    if args.prefetch_ab:
        prefetch_ab(T, copy_tbps)
    if args.layout_probe:
        layout_probe(T, copy_tbps)
    if args.host_probe:
        host_probe(T, copy_tbps)
    if args.block:
        run_blocks(args, T, copy_tbps, meta)
        return
    if args.no_table:
        return
    pairs = [(d, S) for S in args.sources for d in args.widths]
    pairs += [tuple(int(x) for x in p.split(":")) for p in args.extra.split(",") if p]
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        base = dict(kdr.TUNE)
        for d, S in pairs:
            if tuned:
                kdr.TUNE.clear()
                kdr.TUNE.update(base, **tuned.get(d, {}))
                print(f"d={d}: source-tiled settings from the sweep {tuned.get(d, 'none')}",
                      flush=True)
            for label in args.keys:
                keys_kind, r = KEY_KINDS[label](d)
                print(f"T={T} d={d} S={S} r={r} {label}", flush=True)
                shape_rows = bench_shape(T, d, r, S, keys_kind, copy_tbps, meta,
                                         compile_peer=not args.no_compile)
                w.writerows(shape_rows)
                f.flush()
                rows += shape_rows
    summarize(rows)


def kernel_times(fn, calls=5):
    """(total, [(us, calls, kernel name)...] largest first): GPU microseconds per call of
    ``fn`` by kernel, from a profiler trace of ``calls`` calls after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    evs = sorted(((e.self_device_time_total / calls, e.count // calls, e.key)
                  for e in prof.key_averages() if e.self_device_time_total > 0), reverse=True)
    return sum(us for us, _, _ in evs), evs


def block_tune_error(tune, inp, grads, ref):
    """Largest relative-RMS error of the two-phase block's outputs and gradients under the
    TUNE settings ``tune`` (left set) against ``ref`` (the defaults' outputs, gradients)."""
    kdr.TUNE.clear()
    kdr.TUNE.update(tune)
    outs, gs = block_fwd_bwd(block_two_phase, inp, grads)
    return max(rel_rms(a, b) for a, b in zip([*outs, *gs], [*ref[0], *ref[1]]))


def block_sweep(T, d, K, copy_tbps):
    """Two-phase block (S=9, sliced r=d/4 and AttnRes) under the tiles of the width-chunked
    phase 1 (``lrattn_kernels.multi_chunked``: sources in flight, column chunks and warps of
    the value passes, logit tiles, persistent programs of the key-gradient pass) and of the
    merges (``lrattn_kernels.depth_merge``: tile, warps, persistent backward programs).
    Ranked by GPU busy time; every candidate is checked against the defaults first."""
    S = 9
    cands = {"default": {}}
    for pf in (2, 3):
        cands[f"value passes prefetch {pf}"] = dict(mc_prefetch=pf, mc_dots_prefetch=pf)
    for pf in (2, 3):
        cands[f"key-gradient prefetch {pf}"] = dict(mc_keys_prefetch=pf)
    for bc, w in ((1024, 4), (2048, 8)):
        cands[f"fwd chunk {bc} warps {w}"] = dict(mc_chunk=bc, mc_warps=w)
    for bt, rc, w in ((128, 16, 4), (64, 32, 4), (128, 32, 2), (256, 32, 4), (128, 64, 4)):
        cands[f"logits tokens {bt} chunk {rc} warps {w}"] = dict(
            mc_logit_tokens=bt, mc_logit_chunk=rc, mc_logit_warps=w)
    for bc, w in ((256, 1), (512, 2), (2048, 8)):
        cands[f"dots chunk {bc} warps {w}"] = dict(mc_dots_chunk=bc, mc_dots_warps=w)
    for bc, w, c in ((128, 1, 16), (256, 2, 8), (256, 1, 16), (512, 2, 8), (256, 1, 8)):
        cands[f"grads chunk {bc} warps {w} ctas/SM {c}"] = dict(mc_bwd_chunk=bc, mc_bwd_warps=w,
                                                                mc_ctas_per_sm=c)
    for tile, w, c in ((2048, 4, 4), (2048, 4, 16), (2048, 2, 16), (4096, 8, 8)):
        cands[f"merge tile {tile} warps {w} ctas/SM {c}"] = dict(merge_tile=tile, merge_warps=w,
                                                                 merge_ctas_per_sm=c)
    for r in (d // 4, d):
        inp, grads = block_inputs(T, d, r, S, K, False, seed=7)
        kdr.TUNE.clear()
        ref = block_fwd_bwd(block_two_phase, inp, grads)
        nb = {"fwd": (S + 2 * K - 1) * T * d * 2, "fwdbwd": (3 * S + 5 * K - 3) * T * d * 2}
        res = []
        for name, tune in cands.items():
            err = block_tune_error(tune, inp, grads, ref)
            if err > 2 * TOL_BF16:
                print(f"sweep block d={d} r={r} {name}: RED CHECK {err:.1e}", flush=True)
                continue
            with torch.no_grad():
                gf = device_ms(lambda: block_two_phase(**inp))
            gb = device_ms(lambda: block_fwd_bwd(block_two_phase, inp, grads))
            res.append((gb, name))
            print(f"sweep block d={d} S={S} K={K} r={r} {name}: GPU busy fwd {gf:.3f} ms "
                  f"{100 * nb['fwd'] / gf / 1e9 / copy_tbps:.1f}% fwd+bwd {gb:.3f} ms "
                  f"{100 * nb['fwdbwd'] / gb / 1e9 / copy_tbps:.1f}% (vs default: {err:.1e})",
                  flush=True)
        print(f"sweep block best d={d} r={r} (fwd+bwd): {sorted(res)[:3]}", flush=True)
        del inp, grads, ref
    kdr.TUNE.clear()


# Phase-1 settings timed by --block-phase1-ab (TUNE keys of lrattn_kernels.multi_chunked;
# the first is the default)
PHASE1_AB = {
    "default": {},
    "logits: all sources in one program, 64 tokens": {"mc_logit_split": 0,
                                                       "mc_logit_tokens": 64},
    "logits tokens 64": {"mc_logit_tokens": 64},
    "logits tokens 256": {"mc_logit_tokens": 256},
    "value pass chunk 1024 warps 4": {"mc_chunk": 1024, "mc_warps": 4},
    "key-gradient prefetch 3": {"mc_keys_prefetch": 3},
}


def block_phase1_ab(T, d, K, copy_tbps, S=9):
    """Two-phase block (S sources, K sites; sliced r=d/4, AttnRes, projected r=d/4) under the
    phase-1 settings of ``PHASE1_AB``, each checked against the defaults, timed (fwd and
    fwd+bwd, GPU busy time) in ROUNDS interleaved rounds (median), then the GPU time per
    kernel of the defaults."""
    nb = (3 * S + 5 * K - 3) * T * d * 2
    nbf = (S + 2 * K - 1) * T * d * 2
    for keys_kind, r in (("sliced", d // 4), ("attnres", d), ("projected", d // 4)):
        inp, grads = block_inputs(T, d, r, S, K, keys_kind == "projected", seed=11)
        kdr.TUNE.clear()
        ref = block_fwd_bwd(block_two_phase, inp, grads)
        arms = {}
        for name, tune in PHASE1_AB.items():
            err = block_tune_error(tune, inp, grads, ref)
            if err > 2 * TOL_BF16:
                print(f"phase1-ab block {keys_kind} {name}: RED CHECK {err:.1e}", flush=True)
                continue
            arms[name] = (tune, err)
        times = {name: [] for name in arms}
        ftimes = {name: [] for name in arms}
        for _ in range(ROUNDS if DEVICE == "cuda" else 1):
            for name, (tune, _) in arms.items():
                kdr.TUNE.clear()
                kdr.TUNE.update(tune)
                with torch.no_grad():
                    ftimes[name].append(device_ms(lambda: block_two_phase(**inp)))
                times[name].append(device_ms(lambda: block_fwd_bwd(block_two_phase, inp,
                                                                   grads)))
        for name, (tune, err) in arms.items():
            ms, fms = statistics.median(times[name]), statistics.median(ftimes[name])
            print(f"phase1-ab block d={d} S={S} K={K} r={r} {keys_kind} {name}: GPU busy fwd "
                  f"{fms:.3f} ms {100 * nbf / fms / 1e9 / copy_tbps:.1f}% fwd+bwd "
                  f"{ms:.3f} ms {100 * nb / ms / 1e9 / copy_tbps:.1f}% (fwd+bwd rounds "
                  f"{' '.join(f'{x:.3f}' for x in times[name])}; vs default {err:.1e})",
                  flush=True)
        if DEVICE == "cuda":
            kdr.TUNE.clear()
            total, evs = kernel_times(lambda: block_fwd_bwd(block_two_phase, inp, grads))
            print(f"phase1-ab profile {keys_kind} default: {total:.0f} us per fwd+bwd",
                  flush=True)
            for us, n, key in evs[:10]:
                print(f"    {us:8.1f} us  {n:3d} calls  {key[:80]}", flush=True)
        del inp, grads, ref
    kdr.TUNE.clear()


def block_updates(T, d, K, copy_tbps, meta, S=9, sweep_norm=False):
    """One block whose partial sums are formed from the K-1 sub-layer outputs y_k
    (P_1 = y_1, P_k = P_{k-1} + y_k), as in the model: per-site reads after torch adds,
    two-phase merges after torch adds, and two-phase merges that form P themselves
    (``depth_merge_update``); then the same three with every site's read followed by its
    sub-layer's RMSNorm (torch ``rms_norm``, the local spec's norm) and a fourth whose
    merges apply the norm themselves (``norm_weight``). Each arm is checked against the
    per-site torch reference (every output and gradient, the norm weights' included); CSV
    rows with GPU busy time (% of copy bandwidth for the block's minimal bytes plus one
    write of every formed P_k, k >= 2; the norm adds no minimal bytes)."""
    rows = []
    for keys_kind, r in (("sliced", d // 4), ("attnres", d)):
        inp, grads = block_inputs(T, d, r, S, K, False, seed=5)
        ys = inp.pop("parts")
        gen = torch.Generator(device=DEVICE).manual_seed(7)
        norm_w = [(1.0 + 0.2 * torch.randn(d, device=DEVICE, generator=gen)).to(torch.bfloat16)
                  for _ in range(K)]
        nbytes = {"fwd": (S + 2 * K - 1 + K - 2) * T * d * 2,
                  "fwdbwd": (3 * S + 5 * K - 3 + K - 2) * T * d * 2}

        def partials(ys):
            ps = [ys[0]]
            for y in ys[1:]:
                ps.append(ps[-1] + y)
            return ps

        def normed(outs, norm_w):
            if norm_w is None:
                return outs
            return [F.rms_norm(h, (d,), w, NORM_EPS) for h, w in zip(outs, norm_w)]

        # ``parts`` (block_fwd_bwd's name for them) are the sub-layer outputs y_1..y_{K-1}
        def per_site(vals, parts, keys, pkeys, queries, norm_w=None, read=kdr.depth_read_triton):
            return normed(block_per_site(read)(vals, partials(parts), keys, pkeys, queries),
                          norm_w)

        def added(vals, parts, keys, pkeys, queries, norm_w=None):
            return normed(block_two_phase(vals, partials(parts), keys, pkeys, queries), norm_w)

        def fused(vals, parts, keys, pkeys, queries, norm_w=None, fuse_norm=False):
            ys = parts
            outs, lse = kmr.depth_read_multi_triton(vals, queries, None, split=True)
            res, p = [outs[0]], ys[0]
            for k in range(1, queries.shape[0]):
                kw = dict(norm_weight=norm_w[k], norm_eps=NORM_EPS) if fuse_norm else {}
                if k == 1:
                    res.append(kmg.depth_merge_triton(outs[1], lse[1], p, queries[1], **kw))
                else:
                    h, p = kmg.depth_merge_update_triton(outs[k], lse[k], p, ys[k - 1],
                                                         queries[k], **kw)
                    res.append(h)
            if not fuse_norm:
                return normed(res, norm_w)
            return [F.rms_norm(res[0], (d,), norm_w[0], NORM_EPS), *res[1:]]

        data = dict(inp, parts=ys)
        arms = (("per_site_adds", per_site, data), ("two_phase_adds", added, data),
                ("two_phase_fused_update", fused, data),
                ("per_site_adds_norm", per_site, dict(data, norm_w=norm_w)),
                ("two_phase_adds_norm", added, dict(data, norm_w=norm_w)),
                ("two_phase_fused_update_norm", fused, dict(data, norm_w=norm_w)),
                ("two_phase_fused_update_fused_norm", functools.partial(fused, fuse_norm=True),
                 dict(data, norm_w=norm_w)))
        refs = {}
        for with_norm in (False, True):
            src = dict(data, norm_w=norm_w) if with_norm else data
            up = {k: (None if v is None else v if k == "queries" else [t.float() for t in v])
                  for k, v in src.items()}
            refs[with_norm] = block_fwd_bwd(functools.partial(per_site, read=depth_read_torch),
                                            up, [g.float() for g in grads])
            del up
        for name, fn, args in arms:
            ref = refs["norm_w" in args]
            outs, gs = block_fwd_bwd(fn, args, grads)
            err = max(rel_rms(a, b) for a, b in zip([*outs, *gs], [*ref[0], *ref[1]]))
            ok = err <= 2 * TOL_BF16 * _interp_factor()
            row = dict(meta, T=T, d=d, S=S, r=r, keys=keys_kind,
                       backend=f"block_K{K}_{name}", copy_tbps=f"{copy_tbps:.3f}",
                       check=f"{'ok' if ok else 'FAIL'} {err:.1e}")
            if not ok:
                print(f"  block updates {keys_kind} {name}: RED CHECK {err:.1e}", flush=True)
                rows.append(dict(row, **{"pass": "fwdbwd"}))
                continue
            with torch.no_grad():
                gf = device_ms(lambda: fn(**args))
            gb = device_ms(lambda: block_fwd_bwd(fn, args, grads))
            for p, gms in (("fwd", gf), ("fwdbwd", gb)):
                rows.append(dict(row, **{
                    "pass": p, "gbytes": f"{nbytes[p] / 1e9:.3f}", "gpu_ms": f"{gms:.4f}",
                    "gpu_pct_copy": f"{100 * nbytes[p] / gms / 1e9 / copy_tbps:.1f}"}))
            print(f"block updates d={d} S={S} K={K} {keys_kind} {name}: GPU busy fwd "
                  f"{gf:.3f} ms fwd+bwd {gb:.3f} ms  check {row['check']}", flush=True)
            if sweep_norm and name.startswith("two_phase_fused_update") and name != \
                    "two_phase_fused_update_norm":
                for tune in NORM_SWEEP:
                    kdr.TUNE.clear()
                    kdr.TUNE.update(tune)
                    o2, g2 = block_fwd_bwd(fn, args, grads)
                    e2 = max(rel_rms(a, b) for a, b in zip([*o2, *g2], [*ref[0], *ref[1]]))
                    with torch.no_grad():
                        sf = device_ms(lambda: fn(**args))
                    sb = device_ms(lambda: block_fwd_bwd(fn, args, grads))
                    print(f"  merge sweep {keys_kind} {name} {tune}: GPU busy fwd {sf:.3f} ms "
                          f"fwd+bwd {sb:.3f} ms  check {e2:.1e}", flush=True)
                kdr.TUNE.clear()
        del inp, grads, refs, data
    return rows


# --block-norm-sweep: merge settings timed on the blocks with fused updates (and norm)
NORM_SWEEP = ({}, {"merge_norm_mode": 0}, {"merge_tile": 4096}, {"merge_warps": 8},
              {"merge_ctas_per_sm": 4}, {"merge_ctas_per_sm": 16})


def block_profile(T, d, K, S=9):
    """GPU busy time per kernel of one block's fwd+bwd, both schedules, each key kind: where
    the block's time goes (profiler trace of 5 calls, microseconds per call)."""
    for keys_kind, r in (("sliced", d // 4), ("attnres", d), ("projected", d // 4)):
        inp, grads = block_inputs(T, d, r, S, K, keys_kind == "projected", seed=3)
        for name, fn in (("per_site", block_per_site(kdr.depth_read_triton)),
                         ("two_phase", block_two_phase)):
            total, evs = kernel_times(lambda: block_fwd_bwd(fn, inp, grads))
            print(f"profile block d={d} S={S} K={K} {keys_kind} {name}: {total:.0f} us per "
                  f"fwd+bwd", flush=True)
            for us, n, key in evs[:10]:
                print(f"    {us:8.1f} us  {n:3d} calls  {key[:90]}", flush=True)
        del inp, grads


def run_blocks(args, T, copy_tbps, meta):
    d, K = args.block_width, args.block_sites
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for S in [] if args.sweep_only else args.block_sources:
            for keys_kind, r in (("sliced", d // 4), ("attnres", d), ("projected", d // 4)):
                print(f"block T={T} d={d} S={S} K={K} r={r} {keys_kind}", flush=True)
                kind = "sliced" if keys_kind == "attnres" else keys_kind
                w.writerows(bench_block(T, d, r, S, K, kind, copy_tbps, meta))
                f.flush()
    if args.sweep:
        block_sweep(T, d, K, copy_tbps)
    if args.block_updates:
        with open(args.csv, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=FIELDS).writerows(
                block_updates(T, d, K, copy_tbps, meta, sweep_norm=args.block_norm_sweep))
    if args.block_phase1_ab:
        block_phase1_ab(T, d, K, copy_tbps)
    if args.block_profile and DEVICE == "cuda":
        block_profile(T, d, K)


def summarize(rows):
    """% of copy bandwidth per shape: ours vs the fastest peer (fwd | fwd+bwd), first by wall
    time per call (CUDA events), then by GPU busy time (``device_ms``) where the CSV has it."""
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
        for (d, S, r, keys), m in shapes.items():
            peers = {b: p for (b, p) in m if not b.startswith("triton")}

            def best(p):
                c = [(m[(b, p)], b) for b in peers if (b, p) in m]
                return max(c) if c else (float("nan"), "-")
            bf, bfb = best("fwd"), best("fwdbwd")
            ours_f = m.get(("triton", "fwd"), float("nan"))
            ours = m.get(("triton", "fwdbwd"), float("nan"))
            print(f"{d:>5} {S:>3} {r:>5} {keys:>9} | {ours_f:>7.1f}% "
                  f"{ours:>7.1f}% {m.get(('triton_recompute', 'fwdbwd'), float('nan')):>6.1f}% | "
                  f"{bf[0]:>6.1f}% {bf[1]:>14} {bfb[0]:>6.1f}% {bfb[1]:>14} | "
                  f"{ours_f / bf[0]:>6.2f}x {ours / bfb[0]:.2f}x")


if __name__ == "__main__":
    main()
