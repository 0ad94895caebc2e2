"""The key tile of the merge kernels: compiled for an H100/H200 (sm_90) without a GPU, the
merge at the presets' widths with the narrow projected key (r=32) keeps the key's per-row
weights in the rows' layout. A key tile narrower than the program's threads made Triton
convert them through shared memory at every use (9 conversions and 66 barriers per forward
program at d=3072, 28x slower on an H200)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_lrattn.ops import triton_utils as tu

pytest.importorskip("triton")

# Compiled in a child process: the test session runs Triton's interpreter, whose kernels
# cannot be compiled.
_COMPILE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from megatron_lrattn.ops.two_phase.merge import launch, merge_bwd_kernel, merge_fwd_kernel

FP32 = {"lse_ptr", "q_ptr", "dlse_ptr", "gq_part_ptr", "dw_part_ptr"}

def conversions(kernel, constexprs, warps):
    sig = {n: "constexpr" if n in constexprs else
           ("*fp32" if n in FP32 else "*bf16") if n.endswith("_ptr") else
           "fp32" if n in ("eps", "scale", "norm_eps") else "i32" for n in kernel.arg_names}
    src = ASTSource(kernel, signature=sig, constexprs={
        (kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return c.asm["ttgir"].count("ttg.convert_layout")

d, projected = int(sys.argv[1]), sys.argv[2] == "1"
out = {}
for kernel in (merge_fwd_kernel, merge_bwd_kernel):
    for r in (32, d // 4):
        cfg, tiles = launch(d, r, 4096)
        flags, warps = ((dict(UPDATE=not projected), cfg.warps) if kernel is merge_fwd_kernel
                        else (dict(ADD_GP=True, PREFETCH=cfg.prefetch), cfg.bwd_warps))
        c = dict(PROJECTED=projected, NORM=True, **flags, **tiles)
        out[f"{kernel.fn.__name__} r={r}"] = conversions(kernel, c, warps)
print(json.dumps(out))
"""


def test_key_tile_spans_the_program():
    for r in (1, 32, 128, 768, 3072):
        for warps in (4, 8, 16):
            t = tu.key_tile(r, warps)
            assert t >= r and t >= 32 * warps and t & (t - 1) == 0


@pytest.mark.slow
@pytest.mark.parametrize("d", [1024, 2048, 3072])
@pytest.mark.parametrize("projected", [True, False], ids=["projected", "sliced"])
def test_merge_rows_keep_one_layout(d, projected):
    """At r=32 the merge compiles to no more layout conversions than at r=d/4, forward and
    backward, with the launcher's settings (``merge.launch``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _COMPILE, str(d), str(int(projected))],
                       capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0:
        if "ptxas" in p.stderr or "GPUTarget" in p.stderr:
            pytest.skip(f"cannot compile for sm_90 here: {p.stderr.strip()[-200:]}")
        raise AssertionError(p.stderr[-2000:])
    counts = json.loads(p.stdout.strip().splitlines()[-1])
    for name in ("merge_fwd_kernel", "merge_bwd_kernel"):
        narrow, wide = counts[f"{name} r=32"], counts[f"{name} r={d // 4}"]
        assert narrow <= wide, (name, d, counts)
