"""Save-and-exit on SIGTERM (Megatron-LM's ``--exit-signal-handler``) and on a first Ctrl-C,
and Ctrl-C held back while a checkpoint is written.

Schedulers announce the end of a job with SIGTERM (SLURM: at the time limit or on
``scancel``, after ``--signal``; torchrun forwards it to its workers; Kubernetes on
eviction). The handler only records the signal; the training loop asks at the end of every
iteration whether any rank got it (one small all-reduce), and then every rank saves a
checkpoint and leaves the loop together. With ``--save``, a first Ctrl-C does the same
(:class:`InterruptHandler`); a second one stops at once.

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
from typing import Iterator, List, Optional, Sequence

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
        return any_rank([self.signalled], group)[0]


class InterruptHandler(ExitSignalHandler):
    """Ctrl-C as a request to save and stop: the first SIGINT is recorded like SIGTERM (and
    said in one line on stderr), a second one raises ``KeyboardInterrupt`` at once.

    Processes forked while it is installed (data-loader workers) inherit it: they record
    the first SIGINT silently and leave on the second. Where SIGINT is ignored when it is
    entered, it installs nothing.
    """

    NOTE = (b"interrupt: saving a checkpoint at the end of this iteration, then stopping "
            b"(Ctrl-C again to stop now, without it)\n")

    def __init__(self):
        super().__init__(signal.SIGINT)
        self._pid = os.getpid()
        self.installed = False

    def __enter__(self) -> "InterruptHandler":
        # A process started with SIGINT ignored (a background job of a script, nohup)
        # keeps ignoring it, as Python itself does.
        if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            super().__enter__()
            self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            super().__exit__(*exc)
            self.installed = False

    def _handle(self, signum, frame) -> None:
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        if os.getpid() == self._pid:
            os.write(2, self.NOTE)  # no locks: safe wherever the main thread was stopped


def any_rank(flags: Sequence[bool], group: Optional[dist.ProcessGroup] = None) -> List[bool]:
    """Each flag OR-ed over the ranks of ``group`` (one small all-reduce when
    ``torch.distributed`` is initialized: call it on all ranks at the same point)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [bool(f) for f in flags]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


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
