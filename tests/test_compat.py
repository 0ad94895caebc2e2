"""CPU compatibility layer: patched names exist upstream, CUDA device arguments land on the
CPU, and megatron's RNG tracker forks a reproducible, separate stream."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron_lrattn.compat import cpu as compat
from megatron_lrattn.compat.cpu import PATCHED_NAMES, apply_cpu_compat, check_patch_targets

from helpers import model_parallel_1x1, seed_all

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is for CPU-only hosts")

FRESH_PROCESS = textwrap.dedent(
    """
    import importlib, torch
    import megatron_lrattn.compat.cpu as c

    # Every name exists upstream before anything is patched.
    for mod, name in c.PATCHED_NAMES:
        assert hasattr(importlib.import_module(mod), name), f"{mod}.{name}"
    c.check_patch_targets()
    originals = {k: getattr(importlib.import_module(k[0]), k[1]) for k in c.PATCHED_NAMES}

    def unchanged():
        return all(getattr(importlib.import_module(m), n) is fn
                   for (m, n), fn in originals.items())

    # With CUDA present (pretended) the layer does nothing.
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    assert c.apply_cpu_compat() is False and unchanged() and not c.is_cpu_compat_active()
    torch.cuda.is_available = real

    # A vanished upstream name fails loudly, before anything is patched.
    c.PATCHED_NAMES.append(("megatron.core.tensor_parallel.random", "_gone_upstream"))
    try:
        c.apply_cpu_compat()
    except RuntimeError as e:
        assert "megatron.core.tensor_parallel.random._gone_upstream" in str(e), e
    else:
        raise AssertionError("apply_cpu_compat accepted a missing patch target")
    assert unchanged() and not c.is_cpu_compat_active()
    c.PATCHED_NAMES.pop()

    assert c.apply_cpu_compat() is True and c.is_cpu_compat_active() and not unchanged()
    print("FRESH-OK")
    """
)


@pytest.mark.slow
def test_patch_targets_exist_upstream_in_a_fresh_process():
    """In this pytest process the names may already be patched (so trivially present);
    check them where nothing has been patched yet."""
    res = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "FRESH-OK" in res.stdout


def test_check_patch_targets_names_a_missing_attribute(monkeypatch):
    check_patch_targets()
    fake = [("torch.cuda", "current_device"), ("megatron.core.parallel_state", "no_such_thing_x"),
            ("torch.cuda", "no_such_thing_y")]
    monkeypatch.setattr(compat, "PATCHED_NAMES", fake)
    with pytest.raises(RuntimeError) as err:
        check_patch_targets()
    msg = str(err.value)
    assert "megatron.core.parallel_state.no_such_thing_x" in msg
    assert "torch.cuda.no_such_thing_y" in msg
    assert "current_device" not in msg


def test_patched_names_cover_the_rng_accessors():
    names = {f"{m}.{n}" for m, n in PATCHED_NAMES}
    assert {"megatron.core.tensor_parallel.random._get_cuda_rng_state",
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            "torch.cuda.current_device"} <= names


def test_cuda_device_arguments_land_on_the_cpu():
    assert apply_cpu_compat() is True
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(3, device="cuda:0").device.type == "cpu"
    t = torch.tensor([1.0], device=torch.cuda.current_device())
    assert t.device.type == "cpu" and t.item() == 1.0
    x = torch.arange(4.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert x.type(torch.float64).dtype == torch.float64  # conversions still convert
    torch.cuda.synchronize()


def test_rng_tracker_fork_is_reproducible_and_separate():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    ones = torch.ones(4096)

    def draw():
        seed_all(123)
        with get_cuda_rng_tracker().fork():
            forked = F.dropout(ones, 0.5)
        default = F.dropout(ones, 0.5)
        with get_cuda_rng_tracker().fork():
            forked2 = F.dropout(ones, 0.5)
        return forked, default, forked2

    with model_parallel_1x1():
        forked, default, forked2 = draw()
        again = draw()
        seed_all(123)
        no_fork = F.dropout(ones, 0.5)
    assert torch.equal(forked, again[0]) and torch.equal(default, again[1])
    assert torch.equal(forked2, again[2])
    assert not torch.equal(forked, default)
    assert not torch.equal(forked, forked2)  # the tracker stream advances
    assert torch.equal(no_fork, default)  # forking leaves the default stream where it was
