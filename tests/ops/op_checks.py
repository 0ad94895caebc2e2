"""Shared pieces of the op tests: device, the tolerance table and the GPU marker, beside the
relative-RMS metric and the per-gradient error check of tests/helpers.py."""

import pytest
import torch

from helpers import grad_errors, rel_rms  # noqa: F401 (the tests import them from here)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# relative RMS error vs the float64 formula, per input dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}

def shape_dtypes(names, fast_fp32=(), slow=()):
    """``(name, dtype)`` parameters of a parity test, ids ``name-fp32`` / ``name-bf16``: bf16
    (the training dtype) of every shape in the fast tier, fp32 only of the small shapes in
    ``fast_fp32``; the other fp32 cases and both dtypes of the shapes in ``slow`` in the full
    suite only (interpreted, each takes up to seconds; on the GPU box every case runs)."""
    return [pytest.param(n, dt, id=f"{n}-{k}",
                         marks=[pytest.mark.slow] if n in slow or (k == "fp32"
                                                                   and n not in fast_fp32)
                         else [])
            for n in names for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))]


def gpu(fn):
    """Mark a test that needs CUDA (large shapes: the GPU box); it skips on CPU."""
    fn = pytest.mark.skipif(not CUDA, reason="large shapes need a CUDA GPU (GPU box)")(fn)
    return pytest.mark.gpu(fn)


def randn(gen, *shape, dtype=torch.float32):
    """Standard normal on DEVICE from ``gen``, cast to ``dtype``."""
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def up(ts):
    """float64 leaf copies (None stays None)."""
    return None if ts is None else [t.detach().double().requires_grad_() for t in ts]


def assert_table(errs, dtype, factor=1.0):
    """Every error within the table (times ``factor`` for bf16 / fp16)."""
    tol = TOL[dtype] * (1.0 if dtype in (torch.float32, torch.float64) else factor)
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"errors over {tol:.0e}: {bad}"
