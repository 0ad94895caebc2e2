"""Parallel layouts of the cluster planner (pure Python): the ``Cluster`` and ``Layout``
types and the divisibility rules that decide which ``TP x CP x PP (x V) x DP`` layouts a
model and a global batch admit (``layouts``, ``check_layout``). The memory and time of a
layout are predicted by ``analysis.plan_model``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from megatron_lrattn.analysis.flops import ModelShape

LINK_EFFICIENCY = 0.8
"""Achieved over nominal link bandwidth for ring collectives and p2p."""


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths in Gbit/s per GPU and direction.

    Attributes:
        gpus: total GPUs; gpus_per_node: GPUs sharing the intra-node links.
        gpu_memory_gib: memory per GPU; peak_tflops: dense bf16 peak per GPU.
        intra_node_gbps: NVLink per GPU (H200 NVLink 4: 450 GB/s = 3600 Gbit/s).
        inter_node_gbps: network per GPU (one 400 Gbit/s NIC per GPU).
    """

    gpus: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 141.0
    peak_tflops: float = 989.0
    intra_node_gbps: float = 3600.0
    inter_node_gbps: float = 400.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        for name in ("gpu_memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number")

    def bandwidth(self, span: int) -> float:
        """Bytes/s of a group whose ranks lie within ``span`` consecutive ranks."""
        gbps = self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps
        return gbps * 1e9 / 8 * LINK_EFFICIENCY


@dataclass(frozen=True)
class Layout:
    """One parallel layout on ``tp x cp x pp x dp`` GPUs.

    Attributes:
        tp, pp, vpp, dp: tensor-, pipeline-parallel size, virtual stages per pipeline
            rank, data-parallel size (DP excludes CP, as in megatron).
        micro_batch: sequences per micro-batch; distributed_optimizer: optimizer state
            sharded over DP x CP; overlap: gradient reduce (and, with the distributed
            optimizer, parameter all-gather) overlapped with the backward (forward).
        cp: context-parallel size (default 1).
        recompute_layers: layers of each model chunk (L / (PP V) layers) under full
            activation recomputation: 0 none (default), all of them megatron's uniform
            method with one layer per unit, fewer its block method.
    """

    tp: int
    pp: int
    vpp: int
    dp: int
    micro_batch: int
    distributed_optimizer: bool
    overlap: bool = True
    cp: int = 1
    recompute_layers: int = 0

    def recompute_method(self, num_layers: int) -> Optional[str]:
        """``"uniform"``, ``"block"`` or None (no recomputation) for a model of
        ``num_layers`` layers."""
        if not self.recompute_layers:
            return None
        chunk = num_layers // (self.pp * self.vpp)
        return "uniform" if self.recompute_layers == chunk else "block"



def sequence_splits(seq_length: int, tp: int, cp: int) -> bool:
    """Whether a sequence splits over ``cp`` context-parallel ranks (2 CP chunks) and, under
    sequence parallelism (TP > 1), over the TP ranks of each CP rank."""
    chunks = 2 * cp if cp > 1 else 1
    return seq_length % (chunks * tp) == 0


def check_layout(shape: ModelShape, layout: Layout, global_batch: int) -> None:
    """Raise ``ValueError`` when the global batch does not split into ``layout``'s
    micro-batches, the sequence not over its TP x CP ranks (``sequence_splits``), or
    ``recompute_layers`` exceeds the layers of a model chunk."""
    b, dp, tp, cp = layout.micro_batch, layout.dp, layout.tp, layout.cp
    if global_batch % (b * dp):
        raise ValueError(f"global batch {global_batch} is not divisible by micro-batch {b} "
                         f"x DP {dp}")
    if not sequence_splits(shape.seq_length, tp, cp):
        raise ValueError(f"sequence length {shape.seq_length} does not split over TP {tp} x "
                         f"2 CP {2 * cp if cp > 1 else 1}")
    chunk = shape.num_layers // (layout.pp * layout.vpp)
    if not 0 <= layout.recompute_layers <= chunk:
        raise ValueError(f"recompute_layers {layout.recompute_layers} is not in [0, {chunk}] "
                         "(the layers of a model chunk)")



def context_parallel_sizes(gpus: int) -> List[int]:
    """The CP sizes tried by default: the powers of two up to ``gpus``."""
    return [1 << i for i in range(gpus.bit_length()) if 1 << i <= gpus]


def layouts(shape: ModelShape, global_batch: int, cluster: Cluster,
            micro_batches: Optional[Sequence[int]] = None,
            context_parallel: Optional[Sequence[int]] = None) -> Iterable[Layout]:
    """Every layout of ``cluster.gpus`` GPUs the model and batch admit, without
    recomputation: TP a power of two within a node dividing the heads, the key/value groups
    and the FFN width, CP from ``context_parallel`` (default ``context_parallel_sizes``)
    with the sequence split over TP x 2 CP (``sequence_splits``), PP dividing L, V in
    {1, 2, 4} dividing L / PP (with PP > 1 and micro-batches a multiple of PP),
    micro-batches from ``micro_batches`` (default 1, 2, 4, 8) dividing the batch per DP
    rank."""
    n = cluster.gpus
    tps = [t for t in (1, 2, 4, 8) if t <= min(cluster.gpus_per_node, n)
           and shape.num_attention_heads % t == 0 and shape.num_query_groups % t == 0
           and shape.ffn_hidden_size % t == 0]
    cps = context_parallel or context_parallel_sizes(n)
    for tp, cp, pp in itertools.product(tps, cps, range(1, shape.num_layers + 1)):
        if n % (tp * cp * pp) or shape.num_layers % pp:
            continue
        if not sequence_splits(shape.seq_length, tp, cp):
            continue
        dp = n // (tp * cp * pp)
        for v, b in itertools.product((1, 2, 4), micro_batches or (1, 2, 4, 8)):
            if v > 1 and (pp == 1 or (shape.num_layers // pp) % v):
                continue
            if global_batch % (b * dp):
                continue
            m = global_batch // (b * dp)
            if v > 1 and m % pp:
                continue
            for dist_opt in ((False, True) if dp * cp > 1 else (False,)):
                yield Layout(tp, pp, v, dp, b, dist_opt, cp=cp)
