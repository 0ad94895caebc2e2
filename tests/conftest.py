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

The embedded default data (corpus, tokenizer, token files; ``ensure_default_data``) takes
longer to build than a tiny training run: it is built once per session and every cache
folder a test hands to the CLIs starts as a copy of it (``new_cache``). One-process runs that
several modules compare against are run once per session too (``pretrain_once``).
"""
import copy
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def default_data_root(tmp_path_factory):
    """A cache folder holding the default data, built once per session:
    ``$LRATTN_TEST_CACHE`` when set (kept across sessions), else a session folder."""
    from megatron_lrattn.data.default_corpus import ensure_default_data

    env = os.environ.get("LRATTN_TEST_CACHE")
    root = Path(env) if env else tmp_path_factory.mktemp("default_data")
    ensure_default_data(cache_dir=root)
    return root


@pytest.fixture(scope="session")
def new_cache(default_data_root):
    """``new_cache(path)``: make ``path`` (it may exist) a cache folder for ``--cache-dir``
    holding its own copy of the default data, and return it as a ``Path``. Index caches and
    anything a test damages stay in that folder."""

    def make(path) -> Path:
        path = Path(path)
        shutil.copytree(default_data_root / "default_data", path / "default_data",
                        dirs_exist_ok=True)
        return path

    return make


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory, new_cache):
    """The default-data cache of CLI runs (``--cache-dir``): ``$LRATTN_CACHE`` when set
    (shared across runs), else one folder per test module."""
    env = os.environ.get("LRATTN_CACHE")
    return Path(env) if env else new_cache(tmp_path_factory.mktemp("lrattn_cache"))


@pytest.fixture(scope="session")
def pretrain_once(tmp_path_factory, new_cache):
    """``pretrain_once(nproc, argv)``: the metrics records of ``helpers.pretrain_rows(nproc,
    argv, ...)``, run once per session for each ``(nproc, argv)`` (an ``argv`` that writes no
    files besides the metrics) and shared by every test that asks for the same run; each call
    returns its own copy."""
    from helpers import pretrain_rows

    runs = {}

    def get(nproc: int, argv) -> list:
        key = (nproc, tuple(argv))
        if key not in runs:
            work = tmp_path_factory.mktemp("pretrain_once")
            runs[key] = pretrain_rows(nproc, argv, work / "metrics.jsonl",
                                      new_cache(work / "cache"))
        return copy.deepcopy(runs[key])

    return get
