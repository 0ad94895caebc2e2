"""Shared pytest setup: Triton kernels run under the interpreter on machines without CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports the kernels (``megatron_lrattn.ops``).
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """The default-data cache of CLI runs (``--cache-dir``): ``$LRATTN_CACHE`` when set
    (shared across runs), else one folder per test module."""
    env = os.environ.get("LRATTN_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("lrattn_cache")
