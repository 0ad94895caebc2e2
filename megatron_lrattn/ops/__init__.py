"""Depth-read ops: one public function per op, several backends with the same semantics.

Op folders: ``site_read/`` (the read of one site: ``depth_read``) and ``two_phase/`` (the
block schedule: ``depth_read_multi``, ``depth_merge``, ``depth_merge_update``), each with a
readable torch reference beside its Triton kernels. Shared: ``validation`` (argument checks,
backend choice, kernel envelope), ``tuning`` (launch settings), ``triton_utils``.
"""

from __future__ import annotations

from typing import List

from megatron_lrattn.ops.site_read import (
    depth_read,
    depth_read_logits,
    depth_read_naive,
    depth_read_torch,
)
from megatron_lrattn.ops.two_phase import (
    depth_merge,
    depth_merge_torch,
    depth_merge_update,
    depth_merge_update_torch,
    depth_read_multi,
    depth_read_multi_naive,
    depth_read_multi_torch,
)
from megatron_lrattn.ops.validation import BACKENDS, triton_available

__all__ = ["depth_read", "depth_read_naive", "depth_read_torch", "depth_read_logits",
           "depth_read_multi", "depth_read_multi_torch", "depth_read_multi_naive",
           "depth_merge", "depth_merge_torch", "depth_merge_update", "depth_merge_update_torch",
           "triton_available", "fused_kernel_names", "BACKENDS", "BACKWARD_NODES"]

BACKWARD_NODES = ("_DepthReadBackward", "_DepthReadTritonBackward", "_Phase1TritonBackward",
                  "_DepthMergeTritonBackward", "_DepthMergeUpdateTritonBackward")
"""Names of the autograd nodes of the depth ops' custom Functions (reference and fused), as a
CPU profile shows their backward (``autograd::engine::evaluate_function: <name>``)."""


def fused_kernel_names() -> List[str]:
    """Names of every Triton kernel of the depth ops, as a GPU profile shows them (sorted;
    empty without Triton)."""
    if not triton_available():
        return []
    from megatron_lrattn.ops.site_read import fused
    from megatron_lrattn.ops.two_phase import merge, phase1

    return sorted(k.fn.__name__ for k in (*fused.KERNELS, *phase1.KERNELS, *merge.KERNELS))
