"""Shared pytest setup: Triton kernels run under the interpreter on machines without CUDA,
and Ctrl-C is live in the tests and their child processes.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports the kernels (``megatron_lrattn.ops``).

A suite started as a background job of a non-interactive shell (``cmd &``, as CI scripts
and ``nohup`` do) inherits SIGINT ignored, and so would every process a test starts: the
Ctrl-C tests would send signals nobody receives (and a run told to ignore SIGINT rightly
keeps ignoring it). Python's own handler is put back here; processes started from here
then begin with SIGINT at its default (a caught signal is reset on exec, an ignored one is
not).
"""
import os
import signal
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """The default-data cache of CLI runs (``--cache-dir``): ``$LRATTN_CACHE`` when set
    (shared across runs), else one folder per test module."""
    env = os.environ.get("LRATTN_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("lrattn_cache")
