"""Kernel tests: every buffer a fused op allocates is NaN-poisoned (an unwritten output element
fails the comparison) and followed by NaN guard elements that must still be NaN after the
test (no kernel wrote past a buffer)."""

import math

import pytest
import torch

from megatron_lrattn.ops import triton_utils

GUARD = 64


@pytest.fixture(autouse=True)
def nan_poisoned_buffers(monkeypatch):
    """Replace the launchers' allocator with a NaN-filling one; check the guards after."""
    guarded = []

    def empty(shape, dtype, device):
        n = math.prod(shape)
        buf = torch.full((n + GUARD,), float("nan"), dtype=dtype, device=device)
        guarded.append((buf, n))
        return buf[:n].view(shape)

    monkeypatch.setattr(triton_utils, "empty", empty)
    yield
    bad = []
    for buf, n in guarded:
        hit = (~torch.isnan(buf[n:].float())).nonzero().flatten()
        if hit.numel():
            bad.append((n, tuple(int(i) for i in hit[:8])))
    assert not bad, f"kernels wrote past the end of buffers (size, guard indices): {bad}"
