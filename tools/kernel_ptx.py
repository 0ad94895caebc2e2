"""Compile the source-tiled depth-read kernels for a GPU target on any machine (no GPU
needed) and report what decides their speed: registers per thread and the resident programs
that allows per SM, spills, shared memory, and how global memory is moved (16-byte vectors
or element by element).

    python tools/kernel_ptx.py                         # bf16, d = 2048 and 4096, sm_90a
    python tools/kernel_ptx.py --widths 2048 --warps 4 8 --no-align
    python tools/kernel_ptx.py --key-chunk 512 --maxnreg 0     # backward with key rows, no cap

``--no-align`` compiles without the alignment facts the host passes when every source
pointer and row stride allows 16-byte vectors
(``megatron_lrattn.ops.site_read.fused.alignment``). ``bar`` counts the barriers in the PTX
(each cross-warp reduction costs one or two); the ``async`` column counts asynchronous
copies and waits for all outstanding copies (``cp.async.wait_group 0``). Uses the ``ptxas``
bundled with Triton.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_lrattn.training.arg_types import nonnegative_int, positive_int  # noqa: E402

from megatron_lrattn.ops import tuning  # noqa: E402
from megatron_lrattn.ops.site_read import fused, source_tiled  # noqa: E402

FWD_ARGS = [("v_tab", "*i64"), ("vs_tab", "*i64"), ("k_tab", "*i64"), ("ks_tab", "*i64"),
            ("vref", "*bf16"), ("kref", "*bf16"), ("q_ptr", "*fp32"), ("out_ptr", "*bf16"),
            ("lse_ptr", "*fp32"), ("T", "i32"), ("S", "i32"), ("d", "i32"), ("r", "i32"),
            ("eps", "fp32"), ("scale", "fp32")]
BWD_ARGS = [("v_tab", "*i64"), ("vs_tab", "*i64"), ("k_tab", "*i64"), ("ks_tab", "*i64"),
            ("dv_tab", "*i64"), ("dk_tab", "*i64"), ("vref", "*bf16"), ("kref", "*bf16"),
            ("q_ptr", "*fp32"), ("lse_ptr", "*fp32"), ("g_ptr", "*bf16"), ("g_stride", "i32"),
            ("o_ptr", "*bf16"), ("da_ptr", "*fp32"), ("gq_part_ptr", "*fp32"), ("T", "i32"),
            ("S", "i32"), ("d", "i32"), ("r", "i32"), ("eps", "fp32"), ("scale", "fp32")]
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64


def compile_ptx(fn, args, constexprs, warps, arch, maxnreg=None):
    sig = dict(args)
    sig.update({k: "constexpr" for k in constexprs})
    # pointers and the widths are multiples of 16, as Triton's launcher would specialise them
    aligned = [i for i, (n, t) in enumerate(args)
               if t.startswith("*") or n in ("d", "r", "g_stride")]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "maxnreg": maxnreg}).asm["ptx"]


def ptxas_report(ptx, arch):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)

    def num(pattern):
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0
    return num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"), num(r"(\d+) bytes smem")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=positive_int, nargs="+", default=[2048, 4096])
    ap.add_argument("--warps", type=int, nargs="+", choices=(1, 2, 4, 8, 16, 32),
                    default=[4, 8], metavar="WARPS")
    ap.add_argument("--arch", type=positive_int, default=90,
                    help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--no-align", action="store_true", help="without the 16-byte alignment facts")
    ap.add_argument("--key-chunk", type=nonnegative_int, default=0, metavar="R",
                    help="backward with the sliced keys read as rows of their own (KC, what "
                         "the kernels do where pow2(r) < pow2(d)), r=R; without it the keys "
                         "are read inside the rows, as for AttnRes (r = d)")
    ap.add_argument("--maxnreg", type=nonnegative_int, default=None,
                    help="register cap per thread of both kernels, 0 = none (default: the "
                         "kernels' own, tuning.SOURCE_TILED_MAXNREG)")
    args = ap.parse_args()
    pa, sa = (1, 1) if args.no_align else (16, 8)
    print(f"{'kernel':>4} {'d':>5} {'warps':>5} | {'regs':>4} {'progs/SM':>8} {'spill B':>7} "
          f"{'smem B':>6} {'bar':>3} | global loads: 16-byte / 2-byte, stores: 16-byte / other | "
          f"async: cp.async / wait-all")
    for d in args.widths:
        bd = triton.next_power_of_2(d)
        for warps in args.warps:
            for name, fn, fargs, extra in (
                    ("fwd", source_tiled.depth_read_source_tiled_fwd_kernel, FWD_ARGS, {}),
                    ("bwd", source_tiled.depth_read_source_tiled_bwd_kernel, BWD_ARGS,
                     dict(HAS_OUT=True, KC=bool(args.key_chunk)))):
                bwd = name == "bwd"
                kc = bwd and bool(args.key_chunk)
                with tuning.override(**{f"source_tiled_{name}": {"warps": warps}}):
                    cfg = tuning.source_tiled(d, 9, backward=bwd)
                cs = dict(PROJECTED=False, BL=cfg.sources, BD=bd,
                          BR=triton.next_power_of_2(args.key_chunk) if kc else 1,
                          PA=pa, SA=sa, SK=sa if kc else 1, **extra)
                cap = (args.maxnreg if args.maxnreg is not None else
                       fused.launch_options(cfg).get("maxnreg"))
                ptx = compile_ptx(fn, fargs, cs, warps, args.arch, cap or None)
                regs, spill, smem = ptxas_report(ptx, args.arch)
                progs = min(REGISTERS_PER_SM // max(1, regs * 32 * warps),
                            MAX_WARPS_PER_SM // warps)
                lv = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
                ls = len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx))
                sv = len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx))
                so = len(re.findall(r"st\.global", ptx)) - sv
                bars = len(re.findall(r"bar\.sync", ptx))
                ca = len(re.findall(r"cp\.async\.\w+\.shared", ptx))
                wait_all = len(re.findall(r"cp\.async\.wait_group\s+0;", ptx))
                print(f"{name:>4} {d:>5} {warps:>5} | {regs:>4} {progs:>8} {spill:>7} "
                      f"{smem:>6} {bars:>3} | {lv:>4} / {ls:<4} {sv:>4} / {so:<5} | "
                      f"{ca:>4} / {wait_all}")


if __name__ == "__main__":
    main()
