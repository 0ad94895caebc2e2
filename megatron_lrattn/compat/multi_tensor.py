"""megatron-core's multi-tensor gradient kernels on torch's foreach ops (no Apex, no TE).

megatron-core's gradient clipping takes its L2 norm and its scaling from Transformer Engine
or Apex when one is installed. Without them it falls back to
``megatron.core.utils.local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``, which
on a GPU cost far more than the work:

* the norm launches one reduction per gradient tensor, then builds a host tensor from the
  list of device scalars, one device-to-host copy and one host synchronisation per tensor
  (hundreds per step for a 1B model), before the result goes back to the device;
* the scale computes ``src * scale`` into a new tensor and copies it back, per tensor: two
  passes over every gradient and a temporary the size of each one; megatron-core also
  copies the fp32 main weights into the bf16 model this way (scale 1.0) after every step.

``install`` replaces those two fallbacks, where megatron-core uses them, by foreach
versions with the same contract (``(chunk_size, noop_flag, tensor_lists, *args)``): one
``torch._foreach_norm`` over the list (fp32 accumulation) and the norm of the per-tensor
norms on the device, no host synchronisation; an in-place ``torch._foreach_mul_`` when the
source is the destination (clipping), a plain ``torch._foreach_copy_`` for a scale of 1.0
(the weight copy: no temporaries), else the product copied into the destination as before.
The results are the fallbacks' results: the scale is the same fp32 product, and the norm
differs only by the order of the sums inside each tensor (``tests/test_multi_tensor.py``).

It touches only names that still hold megatron's own fallbacks (``PATCHED_NAMES``, each
checked to exist first), so with TE or Apex installed nothing changes.
"""

from __future__ import annotations

import importlib
import logging
from typing import List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

# (module, attribute, megatron.core.utils fallback that the attribute holds without TE/Apex)
PATCHED_NAMES: List[Tuple[str, str, str]] = [
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl", "local_multi_tensor_l2_norm"),
    ("megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl", "local_multi_tensor_scale"),
    ("megatron.core.optimizer.optimizer", "multi_tensor_scale_impl", "local_multi_tensor_scale"),
]

_installed: List[str] = []


def multi_tensor_l2_norm(chunk_size: int, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]],
                         per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """L2 norm over every tensor of ``tensor_lists[0]``, as ``amp_C.multi_tensor_l2norm``.

    Returns:
        ``(norm, per_tensor_norms)``: a [1] fp32 tensor on the tensors' device, and the
        [n] per-tensor norms when ``per_tensor`` (else None).
    """
    tensors = list(tensor_lists[0])
    if not tensors:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def multi_tensor_scale(chunk_size: int, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]],
                       scale: float) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists`` = [srcs, dsts]."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: {len(src)} sources, {len(dst)} destinations")
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        # megatron-core's copy of the fp32 main weights into the bf16 model after every
        # optimizer step: x * 1.0 is x, so copy (and cast) without the fp32 temporaries.
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


_OURS = {"local_multi_tensor_l2_norm": multi_tensor_l2_norm,
         "local_multi_tensor_scale": multi_tensor_scale}


def check_patch_targets() -> None:
    """Raise ``RuntimeError`` naming every replaced attribute that no longer exists."""
    utils = importlib.import_module("megatron.core.utils")
    missing = [f"{mod}.{name}" for mod, name, _ in PATCHED_NAMES
               if not hasattr(importlib.import_module(mod), name)]
    missing += [f"megatron.core.utils.{fallback}" for _, _, fallback in PATCHED_NAMES
                if not hasattr(utils, fallback)]
    if missing:
        raise RuntimeError("megatron_lrattn.compat.multi_tensor: upstream no longer has "
                           + ", ".join(sorted(set(missing)))
                           + "; update the multi-tensor compatibility layer")


def install() -> List[str]:
    """Put the foreach versions where megatron-core uses its local fallbacks (idempotent).

    Returns:
        The ``module.attribute`` names that now hold the foreach versions.
    """
    if _installed:
        return list(_installed)
    check_patch_targets()
    utils = importlib.import_module("megatron.core.utils")
    for mod_name, name, fallback in PATCHED_NAMES:
        mod = importlib.import_module(mod_name)
        if getattr(mod, name) is getattr(utils, fallback):
            setattr(mod, name, _OURS[fallback])
            _installed.append(f"{mod_name}.{name}")
    if _installed:
        logger.debug("foreach multi-tensor kernels for megatron-core: %s", ", ".join(_installed))
    return list(_installed)
