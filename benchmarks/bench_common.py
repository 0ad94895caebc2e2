"""Timing, roofline and CSV helpers shared by the kernel benchmarks (``bench_kernels.py``,
``bench_block.py``).

Times are medians: ``bench`` (CUDA events around each call, ``triton.testing.do_bench``),
``bench_rounds`` (candidates interleaved over rounds), ``device_ms`` (GPU busy time per call
from a profiler trace: at d=2048 the host, not the GPU, sets the wall time of a fwd+bwd
call) and ``kernel_times`` (GPU time per kernel). ``copy_bandwidth`` is the roofline every
row is a percentage of. Every CSV row starts with GPU, versions, git SHA and date.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lrattn.training.arg_types import positive_int  # noqa: E402,F401 (flag type)

TOL_BF16 = 1e-2
"""Relative-RMS tolerance of a bf16 run against the fp32-math reference on the same data."""

DEVICE = "cuda"
"""Where the benchmarks run; ``cpu`` for ``--smoke`` (the Triton interpreter, no timings)."""

ROUNDS = 3
"""Interleaved timing rounds per candidate (``--rounds``)."""

META_FIELDS = ["date", "gpu", "git_sha", "torch", "triton", "megatron_core"]
FIELDS = META_FIELDS + [
    "T", "d", "S", "r", "keys", "backend", "pass", "check", "ms", "gbytes", "tbps", "pct_copy",
    "gpu_ms", "gpu_pct_copy", "copy_tbps", "peak_mib", "min_mib"]
"""The columns of a benchmark row: provenance, shape, backend, pass (fwd / fwdbwd), the
correctness verdict, wall and GPU busy time with their % of the copy bandwidth, peak memory
above the inputs and the minimal bytes (MiB)."""


def csv_path_problem(flag: str, path: str):
    """Why ``path`` cannot become a CSV file (empty, a directory, or in a folder that does
    not exist), as one message naming ``flag``; None when it can."""
    if not path.strip():
        return f"{flag}: an empty path"
    if os.path.isdir(path):
        return f"{flag}: {path} is a directory, not a CSV file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag}: the folder {folder} does not exist"
    return None


def check_csv(parser, flag: str, path: str) -> None:
    """``parser.error`` (one line, exit 2) when ``csv_path_problem`` finds one; checked
    before anything runs."""
    problem = csv_path_problem(flag, path)
    if problem:
        parser.error(problem)


def use_cpu_smoke() -> None:
    """Run on CPU under the Triton interpreter (harness checks, no real timings)."""
    global DEVICE
    DEVICE = "cpu"


def start(name: str, smoke: bool, rounds: int = ROUNDS):
    """A kernel benchmark's start: the CPU interpreter with ``smoke``, else a CUDA GPU (or
    exit with one line), the timing rounds, the copy bandwidth and the provenance columns,
    printed. Returns ``(copy TB/s, meta)``."""
    global ROUNDS
    if smoke:
        use_cpu_smoke()
    elif not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    ROUNDS = rounds
    copy_tbps = copy_bandwidth()
    info = meta()
    print(f"{info}  copy {copy_tbps:.3f} TB/s", flush=True)
    return copy_tbps, info


def rel_rms(x, ref) -> float:
    """RMS(x - ref) / RMS(ref) in fp32."""
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def meta() -> Dict[str, str]:
    """The provenance columns of this run's rows."""
    import triton

    from megatron_lrattn.training.runtime import provenance

    info = provenance()
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter"
    return dict(date=datetime.date.today().isoformat(), gpu=gpu, git_sha=info["git_sha"],
                torch=torch.__version__, triton=triton.__version__,
                megatron_core=info["megatron_core"])


def bench(fn: Callable, rep: int) -> float:
    """Median ms of fn; on CPU (--smoke, interpreter) a plain wall clock of 2 calls."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=rep, return_mode="median")
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1e3


def bench_rounds(fns: Dict[str, Callable], rep: int) -> Dict[str, float]:
    """{name: median ms} of several callables timed in ROUNDS interleaved rounds (A B C, A B
    C, ...; each entry the median of one ``bench``), so that a slow spell of the GPU lands
    on every candidate instead of on whichever ran then."""
    runs: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS if DEVICE == "cuda" else 1):
        for name, fn in fns.items():
            runs[name].append(bench(fn, rep))
    return {name: statistics.median(ms) for name, ms in runs.items()}


def kernel_times(fn: Callable, calls: int = 5):
    """(total us, [(us, calls, kernel name)...] largest first): GPU microseconds per call of
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


def device_ms(fn: Callable, iters: int = 10) -> float:
    """GPU busy time of one call of fn (ms): the durations of the kernels and copies it
    enqueues, summed over a profiler trace. It leaves out the time the GPU waits for the
    host (hidden in training as long as the host runs ahead). NaN off CUDA or when the
    profiler cannot trace."""
    if DEVICE != "cuda":
        return float("nan")
    try:
        total, _ = kernel_times(fn, iters)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot trace: say so, go on
        print(f"  device_ms: profiler failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
        return float("nan")
    return total / 1e3 if total > 0 else float("nan")


def copy_bandwidth(gib: int = 2) -> float:
    """Device copy bandwidth (TB/s, bytes read + written) of a bf16 tensor copy."""
    x = torch.randn(gib * 2**29 if DEVICE == "cuda" else 2**20, device=DEVICE).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=300)
    nbytes = 2 * x.numel() * x.element_size()
    del x, y
    return nbytes / ms / 1e9


def peak_extra_mib(call: Callable) -> float:
    """Peak device memory above what was allocated before ``call()`` (MiB); NaN off CUDA."""
    if DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def pct_copy(nbytes: float, ms: float, copy_tbps: float) -> float:
    """% of the copy bandwidth that moving ``nbytes`` in ``ms`` reaches."""
    return 100 * nbytes / ms / 1e9 / copy_tbps


def timed_row(row: Dict[str, object], p: str, nbytes: float, ms: float, gpu_ms: float,
              copy_tbps: float, peak_mib: float) -> Dict[str, object]:
    """``row`` with the numbers of pass ``p`` (peak memory only on the fwdbwd row)."""
    return dict(row, **{
        "pass": p, "ms": f"{ms:.4f}", "gbytes": f"{nbytes / 1e9:.3f}",
        "tbps": f"{nbytes / ms / 1e9:.3f}", "pct_copy": f"{pct_copy(nbytes, ms, copy_tbps):.1f}",
        "gpu_ms": f"{gpu_ms:.4f}", "gpu_pct_copy": f"{pct_copy(nbytes, gpu_ms, copy_tbps):.1f}",
        "peak_mib": f"{peak_mib:.0f}" if p == "fwdbwd" else ""})


def append_rows(path: str, fields: Sequence[str], rows: List[Dict[str, object]]) -> None:
    """Append rows to a CSV (header first when new); refuses a file with other columns."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != list(fields):
            sys.exit(f"{path}: its columns are not this benchmark's; write to a new file")
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            w.writeheader()
        w.writerows(rows)
