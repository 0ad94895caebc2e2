"""megatron-core's gradient-accumulation fusion without Apex (``fused_weight_gradient_mlp_cuda``).

With ``gradient_accumulation_fusion`` on, megatron-core's linear layers add each weight
gradient straight into the parameter's fp32 ``main_grad`` (the DDP gradient buffer) inside
the weight-gradient GEMM, through Apex's ``fused_weight_gradient_mlp_cuda`` extension.
Without it, the backward writes a bf16 weight gradient and megatron's DDP hook adds it to
``main_grad`` in a second kernel: one more read and write of every weight's gradient per
micro-batch (13.8 ms of a 230-ms 4b step on an H200).

This module has that extension's two functions on torch: on CUDA, one
``torch.addmm(main_grad, dY^T, X, out_dtype=float32, out=main_grad)`` (cuBLAS with an fp32
C matrix and beta = 1: the GEMM accumulates in fp32 and adds to the buffer in its epilogue,
with no bf16 rounding of the gradient in between); elsewhere the unfused arithmetic (the
product in the inputs' dtype, added to the buffer), so that CPU runs with the fusion on are
bit-identical to runs without it. ``install`` hands them to megatron-core only where Apex's
extension is missing (``tests/test_wgrad_fusion.py``).
"""

from __future__ import annotations

import importlib
import logging
from typing import List

import torch

logger = logging.getLogger(__name__)

# megatron-core's module whose linear layers use Apex's extension, its flag that says whether
# the extension was imported (checked to exist), and the name it imports the extension as
# (absent without Apex); ``install`` sets both
LAYERS = "megatron.core.tensor_parallel.layers"
PATCHED_NAMES = [(LAYERS, "_grad_accum_fusion_available"),
                 (LAYERS, "fused_weight_gradient_mlp_cuda")]

_installed: List[str] = []


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor,
                main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D: [n, in], [n, out], [out, in])."""
    if (total_input.shape[0] != grad_output.shape[0]
            or main_grad.shape != (grad_output.shape[1], total_input.shape[1])):
        raise ValueError(
            f"wgrad_gemm_accum: input {tuple(total_input.shape)}, grad_output "
            f"{tuple(grad_output.shape)}, main_grad {tuple(main_grad.shape)} do not match")
    low = total_input.dtype in (torch.bfloat16, torch.float16)
    if main_grad.is_cuda and low and main_grad.dtype == torch.float32:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                    out=main_grad)
    else:
        main_grad.add_(grad_output.t().matmul(total_input))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """Apex's ``wgrad_gemm_accum_fp32``: accumulate the weight gradient into an fp32
    ``main_grad``."""
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """Apex's ``wgrad_gemm_accum_fp16``: the same into a bf16/fp16 ``main_grad``."""
    _accumulate(total_input, grad_output, main_grad)


def check_patch_targets() -> None:
    """Raise ``RuntimeError`` when megatron-core no longer has the names ``install`` sets."""
    if not hasattr(importlib.import_module(LAYERS), "_grad_accum_fusion_available"):
        raise RuntimeError(f"megatron_lrattn.compat.wgrad_fusion: upstream no longer has "
                           f"{LAYERS}._grad_accum_fusion_available; update the "
                           "gradient-accumulation shim")


def install() -> List[str]:
    """Give megatron-core's linear layers these functions when Apex's extension is missing
    (idempotent; nothing changes where Apex provides it).

    Returns:
        The ``module.attribute`` names set.
    """
    if _installed:
        return list(_installed)
    check_patch_targets()
    layers = importlib.import_module(LAYERS)
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = importlib.import_module(__name__)
        layers._grad_accum_fusion_available = True
        _installed.extend(f"{mod}.{name}" for mod, name in PATCHED_NAMES)
        logger.debug("gradient-accumulation fusion for megatron-core: torch's addmm")
    return list(_installed)
