"""Save-and-exit on SIGTERM (Megatron-LM's ``--exit-signal-handler``), and Ctrl-C held
back while a checkpoint is written.

Schedulers announce the end of a job with SIGTERM (SLURM: at the time limit or on
``scancel``, after ``--signal``; torchrun forwards it to its workers; Kubernetes on
eviction). The handler only records the signal; the training loop asks at the end of every
iteration whether any rank got it (one small all-reduce), and then every rank saves a
checkpoint and leaves the loop together.

Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` wherever the main thread happens to be. While a
checkpoint is written that can be inside one of ``os.fork``'s hooks (the asynchronous writer
and megatron's file writers fork), where Python prints the exception as "Exception ignored"
and drops it: the run would go on training. :func:`interrupts_held` keeps the interrupt until
the save is done and raises it then; the forked writers inherit the holding handler, so a
Ctrl-C sent to the whole process group (a terminal) does not kill a writer mid-file either.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

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


@contextmanager
def interrupts_held(what: str = "the checkpoint being written") -> Iterator[None]:
    """Hold SIGINT for the duration of the block, then act on it as the handler in place
    before would have (the default one raises ``KeyboardInterrupt`` after the block).

    A no-op outside the main thread (Python runs signal handlers there only).

    Args:
        what: named in the one line written to stderr when an interrupt is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    note = f"interrupt: finishing {what} first\n".encode()
    pid = os.getpid()

    def _hold(signum, frame) -> None:
        # The forked writers inherit this handler: they hold the signal and say nothing.
        if not held and os.getpid() == pid:
            os.write(2, note)  # no locks: safe wherever the main thread was stopped
        held.append(signum)

    previous = signal.signal(signal.SIGINT, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if not held:
        return
    if callable(previous):
        previous(signal.SIGINT, None)
    elif previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
