"""Micro-batches of one data-parallel rank, read in the background (``--num-workers``).

The order is Megatron's ``MegatronPretrainingSampler``: global sample ``base + r * mbs + k``
for rank ``r`` (``k < mbs``), then ``base += mbs * dp``, starting at the consumed samples of
a resumed run, so every layout and every worker count sees the same batches. With workers,
a ``torch.utils.data.DataLoader`` reads them in background processes, pins host memory when
CUDA is present and keeps ``prefetch_factor`` batches per worker ready (as Megatron's
``build_pretraining_data_loader``); with 0 workers the loop reads them itself.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Iterator, List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

DOCUMENT_SUFFIX = "_text_document"
"""What ``lrattn-preprocess`` (Megatron's naming) appends to ``--output-prefix``."""


class RankBatchSampler:
    """Index lists of this rank's micro-batches, endless, from ``start_sample`` on.

    Args:
        n: dataset length (indices wrap around past it).
        start_sample: samples of the global order already consumed.
        micro_batch_size: samples per micro-batch.
        dp_rank, dp: this rank and the data-parallel size.
    """

    def __init__(self, n: int, start_sample: int, micro_batch_size: int, dp_rank: int, dp: int):
        self.n, self.start = n, start_sample
        self.mbs, self.rank, self.dp = micro_batch_size, dp_rank, dp

    def __iter__(self) -> Iterator[List[int]]:
        base = self.start
        while True:
            yield [(base + self.rank * self.mbs + k) % self.n for k in range(self.mbs)]
            base += self.mbs * self.dp


def collate(samples: Sequence[Dict]) -> Dict[str, torch.Tensor]:
    """Stack the samples' tensors key by key."""
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def rank_batches(dataset, start_sample: int, micro_batch_size: int, dp_rank: int, dp: int,
                 num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: Optional[bool] = None) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's micro-batches (module docstring) as dicts of stacked tensors.

    Args:
        dataset: a map-style dataset of sample dicts (``build_gpt_datasets``).
        start_sample, micro_batch_size, dp_rank, dp: see ``RankBatchSampler``.
        num_workers: background reader processes (0: read in this process).
        prefetch_factor: batches each worker keeps ready.
        pin_memory: page-locked batches for fast host-to-device copies (default: with CUDA).

    Returns:
        An endless iterator.
    """
    sampler = RankBatchSampler(len(dataset), start_sample, micro_batch_size, dp_rank, dp)
    if num_workers == 0:
        return (collate([dataset[i] for i in idx]) for idx in sampler)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
        pin_memory=pin_memory, prefetch_factor=prefetch_factor, persistent_workers=True)
    return iter(loader)


def resolve_data_prefix(prefix: str) -> str:
    """``prefix``, or for a ``..._text_document`` prefix whose files are missing, the
    pre-Megatron name ``lrattn-preprocess`` used to write (the prefix without the suffix),
    with a one-line deprecation warning. Anything else is returned unchanged (the dataset
    checks report what is missing)."""
    if os.path.isfile(prefix + ".bin") or not prefix.endswith(DOCUMENT_SUFFIX):
        return prefix
    old = prefix[: -len(DOCUMENT_SUFFIX)]
    if os.path.isfile(old + ".bin") and os.path.isfile(old + ".idx"):
        logger.warning("%s.bin/.idx: the old lrattn-preprocess name, read for now; rename the "
                       "files to %s.bin/.idx (Megatron's naming)", old, prefix)
        return old
    return prefix


def resolve_data_path(data_path: Sequence[str]) -> List[str]:
    """``--data-path`` items with every prefix through ``resolve_data_prefix`` (weights kept)."""
    out = []
    for item in data_path:
        try:
            float(item)
            out.append(item)
        except ValueError:
            out.append(resolve_data_prefix(item))
    return out
