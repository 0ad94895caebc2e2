"""Save-and-exit on SIGTERM (Megatron-LM's ``--exit-signal-handler``).

Schedulers announce the end of a job with SIGTERM (SLURM: at the time limit or on
``scancel``, after ``--signal``; torchrun forwards it to its workers; Kubernetes on
eviction). The handler only records the signal; the training loop asks at the end of every
iteration whether any rank got it (one small all-reduce), and then every rank saves a
checkpoint and leaves the loop together.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class ExitSignalHandler:
    """Records a signal; :meth:`received` tells every rank whether any rank got it.

    Use as a context manager: the previous handler is restored on exit.

    Args:
        sig: the signal to catch (default SIGTERM).
    """

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self.signalled = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    def __enter__(self) -> "ExitSignalHandler":
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    def received(self, group: Optional[dist.ProcessGroup] = None) -> bool:
        """True on every rank when any rank has received the signal (a collective: call it
        on all ranks at the same point)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.signalled
        device = "cuda" if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
