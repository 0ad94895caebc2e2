"""Run megatron-core on machines without CUDA (CPU tensors, gloo process groups).

megatron-core assumes CUDA in a few places: the model-parallel RNG tracker reads and
writes CUDA generator states, and schedules, optimizers, gradient clipping and the
checkpoint writer allocate small bookkeeping tensors with ``device="cuda"`` or
``torch.cuda.current_device()``. ``apply_cpu_compat`` makes those work on the CPU:

* ``torch.cuda.current_device`` returns ``"cpu"``; ``torch.cuda.synchronize`` is a no-op;
* a global ``TorchFunctionMode`` maps any CUDA device argument, ``Tensor.cuda()`` and
  ``Tensor.to("cuda")`` to the CPU, and makes ``Tensor.type()`` report CUDA type names
  (megatron's optimizers assert them);
* the CUDA RNG accessors used by megatron's tracker act on the CPU default generator, so
  ``tracker.fork()`` switches the CPU stream exactly as it switches the CUDA stream on GPU.

This is the only module that patches anything, it patches only when CUDA is absent, and
every name it replaces is checked to exist first (``PATCHED_NAMES``; a test imports it), so
an upstream rename fails loudly instead of silently.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

PATCHED_NAMES: List[Tuple[str, str]] = [
    ("torch.cuda", "current_device"),
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "get_rng_state"),
    ("torch.cuda", "set_rng_state"),
    ("torch.cuda", "manual_seed"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CheckpointFunction"),
]

_applied = False
_mode = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CPUDeviceMode(TorchFunctionMode):
    """Redirects CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. ``grad.type() == 'torch.cuda.FloatTensor'``.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            # no pinned-memory allocator without an accelerator (megatron's context-parallel
            # rotary slicing builds its index this way)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _replacements() -> Dict[Tuple[str, str], Callable]:
    return {
        ("torch.cuda", "current_device"): lambda: "cpu",
        ("torch.cuda", "synchronize"): lambda device=None: None,
        ("torch.cuda", "get_rng_state"): lambda device="cuda": torch.get_rng_state(),
        ("torch.cuda", "set_rng_state"): lambda new_state, device="cuda": torch.set_rng_state(
            new_state
        ),
        ("torch.cuda", "manual_seed"): lambda seed: torch.manual_seed(seed),
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _cpu_get_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _cpu_set_rng_state,
    }


def _redirect_in_recompute() -> None:
    """Run the forward that megatron's activation checkpoint repeats in the backward under
    the device mode too: a mode is off inside its own handlers, and ``backward`` is one."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    plain = CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CPUDeviceMode():
            return plain(ctx, *grads)

    CheckpointFunction.backward = staticmethod(backward)


def check_patch_targets() -> None:
    """Raise ``RuntimeError`` naming every patched attribute that no longer exists."""
    missing = [
        f"{mod}.{name}"
        for mod, name in PATCHED_NAMES
        if not hasattr(importlib.import_module(mod), name)
    ]
    if missing:
        raise RuntimeError(
            "megatron_lrattn.compat.cpu: upstream no longer has " + ", ".join(missing)
            + "; update the CPU compatibility layer"
        )


def apply_cpu_compat(force: bool = False) -> bool:
    """Install the CPU compatibility layer when CUDA is absent (idempotent).

    Args:
        force: install even if CUDA is available (tests only).

    Returns:
        True when the layer is active after the call.
    """
    global _applied, _mode
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    check_patch_targets()
    for (mod, name), fn in _replacements().items():
        setattr(importlib.import_module(mod), name, fn)
    _redirect_in_recompute()
    _mode = _CPUDeviceMode()
    _mode.__enter__()
    _applied = True
    logger.info("CUDA not available: megatron-core runs on the CPU (gloo)")
    return True


def is_cpu_compat_active() -> bool:
    """True once ``apply_cpu_compat`` installed the layer."""
    return _applied
