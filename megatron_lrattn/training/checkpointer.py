"""When the training loop saves: every ``--save-interval``, at the end, and after SIGTERM
or a first Ctrl-C.

:class:`Checkpointer` owns the save policy around :func:`~.checkpoint.save_checkpoint`:
interval saves, the exit-signal handlers (SIGTERM, and with ``--save`` a first Ctrl-C:
save at the end of the current iteration, then leave the loop), asynchronous saves (megatron's ``AsyncCallsQueue``: the shards are staged
in host memory and written by a forked process while training continues; the previous save
is finalized before the next starts and before the run ends; meant for GPU runs, and it also
works on the CPU) and ``--keep-last`` pruning. A pending asynchronous save is finalized on
every way out of the loop: the end, SIGTERM, a non-finite stop, Ctrl-C or an exception
(:meth:`abort`).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from typing import Any, Dict, List, Optional

from megatron_lrattn.training.checkpoint import raise_write_error, save_checkpoint
from megatron_lrattn.training.signals import ExitSignalHandler, InterruptHandler, any_rank

logger = logging.getLogger(__name__)


class Checkpointer:
    """Checkpoint policy of one run.

    Args:
        args: parsed ``lrattn-pretrain`` arguments (``save``, ``save_interval``,
            ``keep_last``, ``async_save``, ``exit_signal_handler``,
            ``dist_ckpt_optim_fully_reshardable``).
        models, optimizer, scheduler, config: what is saved.

        records: more ``lrattn.json`` entries of every save (``architecture``, ``data``).
        loaded: the iteration loaded from ``--load`` when that is the ``--save`` folder (it
            is not saved again unless training moved on).

    The exit-signal handlers are installed here (main thread only) and removed by
    :meth:`finish` or :meth:`abort`.
    """

    def __init__(self, args: argparse.Namespace, models: List, optimizer, scheduler, config,
                 records: Optional[Dict[str, Any]] = None, loaded: Optional[int] = None):
        self.args = args
        self.models, self.optimizer, self.scheduler, self.config = models, optimizer, scheduler, config
        self.save_dir: Optional[str] = args.save
        self.records = records
        self.optim_sharding = ("fully_reshardable" if args.dist_ckpt_optim_fully_reshardable
                               else "dp_reshardable")
        self.last_saved: Optional[int] = loaded
        self.pending: Optional[str] = None
        self.queue = None
        if self.save_dir and args.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        self.handler: Optional[ExitSignalHandler] = None
        self.interrupt: Optional[InterruptHandler] = None
        if args.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self.handler = ExitSignalHandler().__enter__()
            if self.save_dir:
                self.interrupt = InterruptHandler().__enter__()

    def save(self, iteration: int, consumed_samples: int) -> str:
        """Save now (asynchronously with ``--async-save``); returns the checkpoint folder."""
        # One save in flight at a time: its finalize step renames and prunes.
        self._finalize(blocking=True)
        path = save_checkpoint(self.save_dir, iteration, self.models, self.optimizer,
                               self.scheduler, self.config, consumed_samples, vars(self.args),
                               keep_last=self.args.keep_last,
                               optim_sharding=self.optim_sharding, async_queue=self.queue,
                               records=self.records)
        self.last_saved = iteration
        if self.queue is not None:
            self.pending = path + ".tmp"
        return path

    def _finalize(self, blocking: bool) -> None:
        """Finalize finished asynchronous saves (wait for the pending one when
        ``blocking``); a write that failed in the background ends in the same one-line
        ``CheckpointError`` as a synchronous one."""
        if self.queue is None:
            return
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as e:  # noqa: BLE001 - megatron raises RuntimeError with text only
            raise_write_error(e, self.save_dir, self.pending)
            raise

    def after_iteration(self, iteration: int, consumed_samples: int) -> None:
        """Finalize finished async saves; save when ``--save-interval`` is due (not at the
        last iteration: :meth:`finish` saves that one)."""
        self._finalize(blocking=False)
        interval = self.args.save_interval
        if (self.save_dir and interval and iteration % interval == 0
                and iteration < self.args.train_iters):
            self.save(iteration, consumed_samples)

    def exit_requested(self, time_up: bool = False) -> Optional[str]:
        """Why to save and stop, on every rank once any rank got SIGTERM (``"exit signal"``),
        a first Ctrl-C (``"interrupt"``) or passed ``--exit-duration-in-mins`` (``time_up``);
        None otherwise. A collective when the handlers are on or a duration is set."""
        duration = getattr(self.args, "exit_duration_in_mins", None)
        if self.handler is None and not duration:
            return None
        term, interrupt, late = any_rank([
            self.handler is not None and self.handler.signalled,
            self.interrupt is not None and self.interrupt.signalled, time_up])
        if term:
            return "exit signal"
        if interrupt:
            return "interrupt"
        return f"--exit-duration-in-mins {duration:g}" if late else None

    def finish(self, iteration: int, consumed_samples: int) -> Optional[str]:
        """Save the final state (unless this iteration was just saved), wait for async
        saves to complete, remove the signal handler. Returns the last checkpoint folder."""
        path = None
        try:
            if self.save_dir:
                if self.last_saved != iteration:
                    self.save(iteration, consumed_samples)
                path = os.path.join(self.save_dir, f"iter_{iteration:07d}")
            if self.queue is not None:
                self._finalize(blocking=True)
                self.queue.close()
                self.queue = None
        finally:
            self.close()
        return path

    def abort(self) -> None:
        """Leave after an error (non-finite stop, Ctrl-C, an exception): complete and
        finalize a pending asynchronous save so that it becomes ``latest``, save nothing
        new, remove the signal handler. Errors of the finalization are logged, not raised
        (the error that ended the run is the one reported)."""
        try:
            if self.queue is not None:
                queue, self.queue = self.queue, None
                queue.maybe_finalize_async_calls(blocking=True)
                queue.close()
        except BaseException as e:  # noqa: BLE001 - report the original error instead
            logger.error("pending asynchronous checkpoint not finalized: %s", e)
        finally:
            self.close()

    def close(self) -> None:
        """Remove the signal handlers (idempotent)."""
        for name in ("interrupt", "handler"):
            handler = getattr(self, name)
            if handler is not None:
                handler.__exit__(None, None, None)
                setattr(self, name, None)

