"""Shared pytest setup: Triton kernels run under the interpreter on machines without CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports the kernels (``megatron_lrattn.ops``).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
