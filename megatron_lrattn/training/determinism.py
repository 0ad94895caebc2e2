"""``--deterministic``: bitwise-reproducible runs for a fixed seed, layout and machine.

What it sets, before anything touches CUDA:

- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS needs a fixed workspace for reproducible
  GEMMs; kept when already set to ``:4096:8`` or ``:16:8``),
- ``torch.use_deterministic_algorithms(True)``: an op without a deterministic
  implementation raises instead of silently varying,
- cuDNN deterministic, benchmark off, TF32 off,
- ``deterministic_mode`` in megatron's config (its layers pick deterministic paths),
- ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for Transformer Engine's attention (megatron-core
  refuses deterministic mode with the TE spec otherwise); a value other than 0 set by the
  user is an error.

Seeds are fixed by the runtime in every run (``--seed``, offset per pipeline stage). The
depth-read kernels reduce without atomics, so the fused path needs no exception. On the CPU
runs are deterministic without the flag too; the flag makes the guarantee explicit.
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_lrattn.training.arg_types import TE_DETERMINISM_SWITCH, check_te_determinism_switch

logger = logging.getLogger(__name__)

CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def enable_deterministic() -> None:
    """Switch torch (and cuBLAS through the environment) to deterministic algorithms.

    Call before the first CUDA operation of the process: cuBLAS reads the workspace
    setting when its handle is created.

    Raises:
        ArgumentError: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO`` is set to something other than 0
            (the command lines report it in one line).
    """
    check_te_determinism_switch()
    os.environ[TE_DETERMINISM_SWITCH] = "0"
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACES[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if torch.cuda.is_available() and os.environ.get("NCCL_ALGO") is None:
        logger.warning("--deterministic: NCCL may pick different all-reduce algorithms between "
                       "runs; set NCCL_ALGO=Ring for bitwise-identical multi-GPU runs")
