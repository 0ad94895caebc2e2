"""The arms ``lrattn-profile`` compares, and the FLOP count behind their MFU.

MFU
---
::

    flops_per_token = model_flops_per_token(shape) + 3 * depth_read_flops(shape)
    MFU = flops_per_token * tokens_per_step / (step_time * num_gpus * peak_flops)

``model_flops_per_token`` (``megatron_lrattn.analysis.flops``) is ``6 M + 12 L s (a k)``
with ``M`` the matmul weights a token passes through (projected keys' extra rows and the
embedding key included). ``depth_read_flops`` is the forward FLOPs of every depth read,
``sum_j S_j (2 kw + 2 d)`` (Appendix A of the paper); forward + backward counts it three
times, as for the matmuls. ``standard`` has no depth reads. ``tokens_per_step`` is the
global batch (``global_batch_size * seq_length``), ``num_gpus`` the world size and
``peak_flops`` the dense bf16 datasheet peak (``--peak-tflops``, 989 for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_lrattn.analysis.flops import ModelShape, forward_flops, model_flops_per_token

ARM_NAMES = ("standard", "attnres", "lr_attnres", "lr_attnres_projected")
"""Arms in their reporting order: standard residuals, Block AttnRes (r = d), sliced
LR-AttnRes (r = d/4) and projected LR-AttnRes (r = ``--projected-rank``)."""


@dataclass(frozen=True)
class Arm:
    """One residual configuration to time.

    Attributes:
        name: one of ``ARM_NAMES``.
        residual: ``standard``, ``attnres`` or ``lr_attnres``.
        key: ``sliced`` or ``projected``.
        rank: key rank r (None for ``standard``).
        num_blocks: depth blocks N (same for every arm that has blocks).
    """

    name: str
    residual: str
    key: str
    rank: Optional[int]
    num_blocks: int

    @property
    def label(self) -> str:
        """Short human-readable description, e.g. ``lr_attnres sliced r=512 N=8``."""
        if self.residual == "standard":
            return "standard"
        if self.residual == "attnres":
            return f"attnres N={self.num_blocks}"
        return f"lr_attnres {self.key} r={self.rank} N={self.num_blocks}"


def make_arms(names: List[str], hidden_size: int, projected_rank: int,
              num_blocks: int) -> List[Arm]:
    """The arms named in ``names`` (any order, no repeats), in ``ARM_NAMES`` order."""
    table: Dict[str, Arm] = {
        "standard": Arm("standard", "standard", "sliced", None, num_blocks),
        "attnres": Arm("attnres", "attnres", "sliced", hidden_size, num_blocks),
        "lr_attnres": Arm("lr_attnres", "lr_attnres", "sliced", max(1, hidden_size // 4),
                          num_blocks),
        "lr_attnres_projected": Arm("lr_attnres_projected", "lr_attnres", "projected",
                                    projected_rank, num_blocks),
    }
    return [table[n] for n in ARM_NAMES if n in names]


def arm_args(args: argparse.Namespace, arm: Arm) -> argparse.Namespace:
    """A copy of the parsed arguments with the arm's residual, key and rank filled in."""
    out = copy.copy(args)
    out.residual, out.key = arm.residual, arm.key
    out.rank = None if arm.residual == "standard" else arm.rank
    out.num_blocks = arm.num_blocks
    return out


def model_shape(args: argparse.Namespace, vocab_size: int) -> ModelShape:
    """The ``ModelShape`` of an arm's arguments (from ``arm_args``)."""
    return ModelShape.from_args(args, vocab_size)


def flops_per_token(shape: ModelShape) -> Dict[str, int]:
    """Forward + backward FLOPs per token used for MFU (module docstring).

    Returns:
        ``model`` (6 M + 12 L s a k), ``depth_reads`` (3 x the forward depth-read FLOPs)
        and ``total`` (their sum).
    """
    model = model_flops_per_token(shape)
    reads = 3 * forward_flops(shape).depth_reads
    return {"model": model, "depth_reads": reads, "total": model + reads}


def mfu(total_flops_per_token: float, tokens_per_step: int, step_time_s: float,
        num_gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1] (module docstring)."""
    return total_flops_per_token * tokens_per_step / (step_time_s * num_gpus * peak_tflops * 1e12)
