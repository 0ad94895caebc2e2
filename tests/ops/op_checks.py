"""Shared pieces of the op tests: device, the tolerance table, the relative-RMS metric, the
GPU marker and the per-gradient error check."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# relative RMS error vs the float64 formula, per input dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}

def gpu(fn):
    """Mark a test that needs CUDA (large shapes: the GPU box); it skips on CPU."""
    fn = pytest.mark.skipif(not CUDA, reason="large shapes need a CUDA GPU (GPU box)")(fn)
    return pytest.mark.gpu(fn)


def rel_rms(x, ref, floor=1e-30):
    """RMS(x - ref) / RMS(ref); ``floor`` stands in for RMS(ref) when that is smaller
    (an identically zero reference, e.g. every key gradient of a single source)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(floor)).item()


def randn(gen, *shape, dtype=torch.float32):
    """Standard normal on DEVICE from ``gen``, cast to ``dtype``."""
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def up(ts):
    """float64 leaf copies (None stays None)."""
    return None if ts is None else [t.detach().double().requires_grad_() for t in ts]


def grad_errors(errs, names, grads, ref_grads, leaves, floor):
    """Add each leaf's gradient error (relative RMS, ``floor`` for tiny references) to
    ``errs``; every gradient must have its leaf's dtype and shape."""
    for name, gr, rg, t in zip(names, grads, ref_grads, leaves):
        assert gr.dtype == t.dtype and gr.shape == t.shape, name
        errs[name] = rel_rms(gr, torch.zeros_like(gr, dtype=torch.float64) if rg is None
                             else rg, floor=floor)
    return errs


def assert_table(errs, dtype, factor=1.0):
    """Every error within the table (times ``factor`` for bf16 / fp16)."""
    tol = TOL[dtype] * (1.0 if dtype in (torch.float32, torch.float64) else factor)
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"errors over {tol:.0e}: {bad}"
