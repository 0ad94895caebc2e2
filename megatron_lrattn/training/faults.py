"""Test-only fault injection for ``lrattn-pretrain``, off unless ``LRATTN_FAULT`` is set.

The reliability tests (``tests/test_reliability.py``) make a real run fail at a chosen point
and check what is left behind. ``LRATTN_FAULT`` holds comma-separated ``point@iteration``
items (``point=value`` for ``disk_free``):

- ``kill_before_rename@N``: SIGKILL this process while saving the iteration-N checkpoint,
  after its shards and ``lrattn.json`` are in ``iter_N.tmp`` and before the rename.
- ``enospc_during_save@N``: the iteration-N save fails with ``OSError(ENOSPC)`` after its
  shards are written (a disk that fills up during the save).
- ``inf_loss@N`` / ``nan_loss@N``: multiply the loss of iteration N by inf / nan (before
  backward, so the gradients are non-finite too).
- ``inf_grad@N``: set one element of the first parameter's gradient to inf after backward
  of iteration N (the loss stays finite).
- ``disk_free=BYTES``: report BYTES free on the ``--save`` file system.
- ``interrupt@N`` / ``interrupt_twice@N``: send this process one / two SIGINTs (Ctrl-C)
  after the forward and backward of iteration N, before its optimizer step.

Nothing here runs unless the variable is set; production code calls these functions at
fixed points and they return immediately.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Dict, Optional

ENV = "LRATTN_FAULT"
_iteration = 0


def _faults() -> Dict[str, str]:
    spec = os.environ.get(ENV, "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        sep = "@" if "@" in item else "="
        name, _, value = item.partition(sep)
        out[name] = value
    return out


def active() -> bool:
    """Whether any fault is configured (``LRATTN_FAULT`` set and not empty)."""
    return bool(_faults())


def _due(name: str, iteration: Optional[int] = None) -> bool:
    value = _faults().get(name)
    it = _iteration if iteration is None else iteration
    return value is not None and int(value) == it


def set_iteration(iteration: int) -> None:
    """Tell the hooks which iteration is running (1-based, the one being computed)."""
    global _iteration
    _iteration = iteration


def before_checkpoint_rename(iteration: int) -> None:
    """Hook between the complete ``iter_N.tmp`` and its rename."""
    if _due("kill_before_rename", iteration):
        os.kill(os.getpid(), signal.SIGKILL)


def after_checkpoint_shards(iteration: int) -> None:
    """Hook after the shards of a save are written, before it is finalized."""
    if _due("enospc_during_save", iteration):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def poison_loss(loss):
    """The loss, multiplied by inf or nan when ``inf_loss``/``nan_loss`` is due."""
    if _due("inf_loss"):
        return loss * float("inf")
    if _due("nan_loss"):
        return loss * float("nan")
    return loss


def interrupt() -> None:
    """Send SIGINT to this process once (``interrupt``) or twice (``interrupt_twice``) when due."""
    times = 2 if _due("interrupt_twice") else 1 if _due("interrupt") else 0
    for _ in range(times):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next one is sent


def poison_grads(models) -> None:
    """Put an inf into the first parameter's gradient when ``inf_grad`` is due."""
    if not _due("inf_grad"):
        return
    for model in models:
        for _, p in model.named_parameters():
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is not None:
                grad.view(-1)[0] = float("inf")
                return


def disk_free_override() -> Optional[int]:
    """Free bytes to report instead of the file system's (``disk_free=BYTES``), else None."""
    value = _faults().get("disk_free")
    return None if value is None else int(value)
