"""Interleaved (virtual) pipeline stages with a rank-local cache of depth sources.

With V model chunks per pipeline rank, chunk c = v * P + p runs on rank p and receives
the depth state after the previous chunk. A rank has already seen most of that state in
its own previous chunk c - P (the embedding and completed blocks never change), so a hop
carries only the sources the receiving rank has not seen (Kimi's cross-stage caching;
``payload.hop_payloads`` counts them), and the receiving chunk takes the others from a
rank-local ``StageCache``.

Gradients: chunk c + P uses a cached source through a detached leaf, so its backward
never enters chunk c's graph (no graph is backpropagated twice). The leaf's gradient is
handed to chunk c's backward by ``_PackAndTap``, the function that packs chunk c's
outgoing sources: its backward adds each cached source's leaf gradient to the gradient
of that source. Chunk c + P's backward for a micro-batch always precedes chunk c's (the
gradient of chunk c's output travels through every rank first), and megatron runs the
forward and backward passes of one chunk in micro-batch order, so one FIFO per chunk
pairs cache entries with micro-batches. An entry leaves the cache when its only reader,
chunk c + P, takes it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_lrattn.depth.payload import hop_payloads


class StageCache:
    """Rank-local FIFO of depth states, one queue per producing model chunk."""

    def __init__(self) -> None:
        self._queues: Dict[int, Deque[Tuple[Dict[str, Tensor], Dict[str, Tensor]]]] = \
            defaultdict(deque)

    def put(self, chunk: int, sources: Dict[str, Tensor], leaves: Dict[str, Tensor]) -> None:
        """Store chunk ``chunk``'s output sources (by label) for one micro-batch;
        ``leaves`` is filled by the reader with the leaves it makes of them."""
        self._queues[chunk].append((sources, leaves))

    def take(self, chunk: int) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """Remove and return the oldest entry stored by chunk ``chunk``."""
        if not self._queues[chunk]:
            raise RuntimeError(f"depth-source cache of model chunk {chunk} is empty: the "
                               "chunks of a rank must share one StageCache "
                               "(block.link_model_chunks)")
        return self._queues[chunk].popleft()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())


class _PackAndTap(torch.autograd.Function):
    """Concatenate the sent sources; in backward also return the gradients that later
    chunks of this rank accumulated on their cached copies of the sources."""

    @staticmethod
    def forward(ctx, leaves: Dict[str, Tensor], send_idx: Tuple[int, ...],
                labels: Tuple[str, ...], *sources: Tensor) -> Tensor:
        ctx.leaves, ctx.send_idx, ctx.labels = leaves, send_idx, labels
        return torch.cat([sources[i] for i in send_idx], dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grads: List[Optional[Tensor]] = [None] * len(ctx.labels)
        for i, g in zip(ctx.send_idx, grad.chunk(len(ctx.send_idx), dim=0)):
            grads[i] = g
        for i, label in enumerate(ctx.labels):
            leaf = ctx.leaves.get(label)
            if leaf is not None and leaf.grad is not None:
                grads[i] = leaf.grad if grads[i] is None else grads[i] + leaf.grad
        ctx.leaves.clear()
        return (None, None, None, *grads)


@dataclass(frozen=True)
class ChunkPlan:
    """What one model chunk receives, takes from the cache, sends and caches.

    Attributes:
        chunk: c = vp_stage * P + pp_rank.
        in_labels: labels of the state the chunk starts from (empty for chunk 0).
        received: the subset of ``in_labels`` that crosses the wire, in label order.
        out_labels: labels of the state after the chunk (empty for the last chunk).
        sent: the subset of ``out_labels`` sent to the next chunk.
        cache_from: chunk whose cached state this chunk reads (c - P), or None.
        cache_for_next: True when chunk c + P exists and reads this chunk's state.
    """

    chunk: int
    in_labels: Tuple[str, ...]
    received: Tuple[str, ...]
    out_labels: Tuple[str, ...]
    sent: Tuple[str, ...]
    cache_from: Optional[int]
    cache_for_next: bool


def chunk_plan(schedule, chunk_ends: Sequence[int], pp_size: int, chunk: int) -> ChunkPlan:
    """``ChunkPlan`` of chunk ``chunk`` from the layer split (see ``payload.hop_payloads``)."""
    hops = hop_payloads(schedule, chunk_ends, pp_size, seq_rows=1, micro_batch_size=1,
                        width=1, bytes_per_element=1)
    recv = hops[chunk - 1] if chunk > 0 else None
    send = hops[chunk] if chunk < len(hops) else None
    return ChunkPlan(
        chunk=chunk,
        in_labels=recv.sources if recv else (),
        received=recv.new_sources if recv else (),
        out_labels=send.sources if send else (),
        sent=send.new_sources if send else (),
        cache_from=chunk - pp_size if chunk >= pp_size else None,
        cache_for_next=chunk + pp_size < len(chunk_ends),
    )


def assemble_input(plan: ChunkPlan, received: Sequence[Tensor],
                   cache: Optional[StageCache]) -> List[Tensor]:
    """The chunk's input sources in label order: received ones, and detached leaves of
    the cached ones (recorded so the producing chunk's backward can collect their
    gradients)."""
    by_label = dict(zip(plan.received, received))
    missing = [label for label in plan.in_labels if label not in by_label]
    if missing:
        if cache is None or plan.cache_from is None:
            raise RuntimeError(f"model chunk {plan.chunk} needs cached sources {missing} "
                               "but has no StageCache")
        cached, leaves = cache.take(plan.cache_from)
        for label in missing:
            src = cached[label]
            leaf = src.detach().requires_grad_(src.requires_grad)
            leaves[label] = leaf
            by_label[label] = leaf
    return [by_label[label] for label in plan.in_labels]


def pack_output(plan: ChunkPlan, sources: Sequence[Tensor], cache: Optional[StageCache]
                ) -> Tensor:
    """Pack the sources the next chunk has not seen; cache all of them for chunk c + P."""
    send_idx = tuple(plan.out_labels.index(label) for label in plan.sent)
    if not plan.cache_for_next:
        return torch.cat([sources[i] for i in send_idx], dim=0)
    if cache is None:
        raise RuntimeError(f"model chunk {plan.chunk} must cache its state but has no StageCache")
    leaves: Dict[str, Tensor] = {}
    cache.put(plan.chunk, dict(zip(plan.out_labels, sources)), leaves)
    return _PackAndTap.apply(leaves, send_idx, plan.out_labels, *sources)
