"""Signal handling of the training loop: SIGTERM recorded for save-and-exit, Ctrl-C held
while a checkpoint is written (``megatron_lrattn/training/signals.py``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_lrattn.training.signals import (ExitSignalHandler, InterruptHandler, any_rank,
                                              interrupts_held)

# A SIGINT that arrives while os.fork runs its hooks: the handler's KeyboardInterrupt is
# raised inside the hook, where Python prints it as "Exception ignored" and goes on.
FORK_UNDER_CTRL_C = textwrap.dedent("""
    import os, signal, sys
    from megatron_lrattn.training.signals import interrupts_held

    armed = [True]

    def before():
        if armed[0]:
            armed[0] = False
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the Python-level handler runs here, inside the hook
                pass

    os.register_at_fork(before=before)

    def fork_a_writer():
        pid = os.fork()
        if pid == 0:  # the writer: a Ctrl-C to the process group must not kill it
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
            except KeyboardInterrupt:
                os._exit(3)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("writer exit", os.waitstatus_to_exitcode(status), flush=True)

    try:
        if sys.argv[1] == "held":
            with interrupts_held():
                fork_a_writer()
        else:
            fork_a_writer()
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
""")


def _fork_under_ctrl_c(*modes):
    """(stdout lines, stderr) of the script in each mode; the processes run side by side
    (each spends seconds importing torch), each signalling only itself and its writer."""
    procs = [subprocess.Popen([sys.executable, "-c", FORK_UNDER_CTRL_C, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in modes]
    try:
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(out.split("\n"), err) for out, err in outs]


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.fork")
def test_ctrl_c_during_a_fork_is_lost_without_holding_and_raised_with_it():
    (out, err), (held, held_err) = _fork_under_ctrl_c("bare", "held")
    # The hazard itself: the interrupt vanished inside the hook, the writer died of it.
    assert "not interrupted" in out and "Exception ignored" in err, (out, err)
    assert "writer exit 3" in out, out
    assert held[:2] == ["writer exit 0", "interrupted"], (held, held_err)
    assert held_err.count("interrupt: finishing the checkpoint being written first") == 1, held_err
    assert "Exception ignored" not in held_err, held_err


def test_interrupts_held_raises_after_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupts_held_hands_the_signal_to_the_previous_handler_once():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_interrupts_held_leaves_other_errors_alone_and_restores_the_handler():
    with pytest.raises(ValueError):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("the save failed")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_exit_signal_handler_records_sigterm_and_restores_the_previous_handler():
    before = signal.getsignal(signal.SIGTERM)
    with ExitSignalHandler() as handler:
        assert not handler.received()
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.received()
    assert signal.getsignal(signal.SIGTERM) == before


def test_first_ctrl_c_is_recorded_and_the_second_raises(capfd):
    with InterruptHandler() as handler:
        os.kill(os.getpid(), signal.SIGINT)
        assert handler.received() and any_rank([False, True]) == [False, True]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert capfd.readouterr().err.count("interrupt: saving a checkpoint") == 1


def test_ctrl_c_held_during_a_save_reaches_the_interrupt_handler():
    with InterruptHandler() as handler:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert not handler.signalled
        assert handler.signalled


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with InterruptHandler() as handler:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not handler.received()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
