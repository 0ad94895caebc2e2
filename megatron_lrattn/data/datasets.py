"""Train/valid/test GPT datasets over Megatron indexed datasets, with blending.

Thin layer over megatron-core's ``BlendedMegatronDatasetBuilder`` + ``GPTDataset``: parses a
Megatron-style blend (``["0.7", "a", "0.3", "b"]``), checks inputs up front with one-line
errors, and keeps the index caches in one directory. Works with and without
``torch.distributed``; when it is initialized, rank 0 builds the index caches first and the
other ranks read them (the cache directory must then be shared by all ranks).
"""
from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_lrattn.data.errors import DataError

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class LRGPTDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus where :class:`CachedGPTDataset` keeps its indices."""

    index_cache_dir: Optional[str] = None
    """Directory for the document/sample/shuffle index caches of every GPTDataset."""


class CachedGPTDataset(GPTDataset):
    """``GPTDataset`` that caches its indices in ``config.index_cache_dir``.

    The builder's own ``path_to_cache`` stays None: megatron-core's ``BlendedDataset`` only
    supports a cache when ``torch.distributed`` is initialized, while its blending indices
    are cheap to rebuild in memory. This keeps the GPT index caches (the expensive part) in
    one known directory in both modes.
    """

    def __init__(self, indexed_dataset, dataset_path, indices, num_samples, index_split, config):
        cache_dir = getattr(config, "index_cache_dir", None)
        if cache_dir is not None:
            config = copy.copy(config)
            config.path_to_cache = cache_dir
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)

    def _build_document_sample_shuffle_indices(self):
        """Check this dataset's cached index files (``check_index_caches``) before
        megatron-core loads them with ``allow_pickle=True``; then megatron's build/load.
        (Run per dataset: megatron builds on rank 0 first, so the files are complete.)"""
        cache = self.config.path_to_cache
        if cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            check_index_caches(cache, prefix=base)
        return super()._build_document_sample_shuffle_indices()


def parse_blend(
    data_prefix_or_blend: str | os.PathLike | Sequence,
) -> tuple[list[str], Optional[list[float]]]:
    """Parse a data path the way Megatron's ``--data-path`` does.

    Args:
        data_prefix_or_blend: one prefix; a list of prefixes (weighted by their sizes); or
            alternating weights and prefixes, e.g. ``[0.7, "a", 0.3, "b"]`` (strings or
            numbers). A single string is split on whitespace.

    Returns:
        ``(prefixes, weights)`` with ``weights`` None when not given.
    """
    if isinstance(data_prefix_or_blend, (str, os.PathLike)):
        items = str(data_prefix_or_blend).split()
    else:
        items = [str(x) for x in data_prefix_or_blend]
    if not items:
        raise DataError("empty data path")

    def _is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if len(items) == 1:
        return items, None
    if all(not _is_number(x) for x in items):
        return items, None
    if len(items) % 2 or not all(_is_number(w) for w in items[0::2]):
        raise DataError(f"data path must alternate weight and prefix: {' '.join(items)}")
    weights = [float(w) for w in items[0::2]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"blend weights must be non-negative with a positive sum: {weights}")
    return items[1::2], weights


_IDX_HEADER = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
_FULL_SCAN_TOKENS = 1 << 25
_SAMPLE_WINDOWS, _WINDOW_TOKENS = 32, 1 << 20


def check_indexed_dataset(prefix: str, vocab_size: Optional[int] = None) -> int:
    """Check a ``.bin``/``.idx`` pair cheaply before training reads it.

    Reads the ``.idx`` header and arrays (not the tokens) and checks that the ``.idx`` has
    the size its header announces and describes exactly the bytes of the ``.bin``: a
    truncated ``.bin`` or an ``.idx`` of another dataset fails here instead of deep inside
    training. With ``vocab_size``, the largest token id must be below it (a dataset made with
    another tokenizer): files up to 32M tokens are scanned whole, larger ones in 32 windows
    of 1M tokens spread over the file.

    Args:
        prefix: path without ``.bin``/``.idx``.
        vocab_size: the tokenizer's vocabulary size (None skips the token-id check).

    Returns:
        The number of tokens in the ``.bin``.

    Raises:
        DataError: one line naming the file and the problem.
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (bin_, idx):
        if not Path(path).is_file():
            raise DataError(f"dataset file not found: {path}")
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _IDX_HEADER:
        raise DataError(f"{idx}: not a Megatron indexed-dataset index (bad header)")
    version = int.from_bytes(head[9:17], "little")
    dtype = _IDX_DTYPES.get(head[17])
    if version != 1 or dtype is None:
        raise DataError(f"{idx}: unsupported index (version {version}, dtype code {head[17]})")
    if not np.issubdtype(dtype, np.integer):
        raise DataError(f"{idx}: token dtype {np.dtype(dtype).name} is not an integer type "
                        f"(token ids must be integers)")
    n_seq, n_doc = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
    expected_idx = 34 + 12 * n_seq + 8 * n_doc
    if idx_size not in (expected_idx, expected_idx + n_seq):  # + n_seq: multimodal modes
        raise DataError(f"{idx}: corrupt index ({idx_size} bytes, its header describes "
                        f"{expected_idx})")
    itemsize = np.dtype(dtype).itemsize
    if n_seq == 0:
        if bin_size:
            raise DataError(f"{idx} describes no tokens but {bin_} has {bin_size} bytes")
        raise DataError(f"{bin_}: empty dataset (its index lists no documents)")
    mm = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=34)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
    docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
    _check_index_arrays(idx, lengths, pointers, docs, itemsize)
    expected_bin = int(pointers[-1]) + int(lengths[-1]) * itemsize
    if bin_size != expected_bin:
        what = "truncated" if bin_size < expected_bin else "longer than its index"
        raise DataError(f"{bin_}: {bin_size} bytes but {idx} describes {expected_bin} "
                        f"({what}; or the .idx belongs to another dataset)")
    n_tokens = bin_size // itemsize
    if vocab_size is not None and n_tokens:
        tokens = np.memmap(bin_, mode="r", dtype=dtype)
        if n_tokens <= _FULL_SCAN_TOKENS:
            top = int(tokens.max())
        else:
            starts = np.linspace(0, n_tokens - _WINDOW_TOKENS, _SAMPLE_WINDOWS).astype(np.int64)
            top = max(int(tokens[s:s + _WINDOW_TOKENS].max()) for s in starts)
        if top >= vocab_size:
            raise DataError(f"{bin_}: token id {top} >= the tokenizer's vocabulary size "
                            f"{vocab_size} (tokenized with another tokenizer?)")
    return n_tokens


def _check_index_arrays(idx: str, lengths: np.ndarray, pointers: np.ndarray, docs: np.ndarray,
                        itemsize: int) -> None:
    """Every entry of an ``.idx``: lengths >= 0, each sequence starting where the previous
    one ends (megatron's builder writes them back to back), document boundaries from 0 to
    the sequence count and non-decreasing. Vectorised over the whole index."""
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        raise DataError(f"{idx}: corrupt index (sequence {bad[0]} has length {lengths[bad[0]]})")
    if pointers[0] != 0:
        raise DataError(f"{idx}: corrupt index (the first sequence starts at byte "
                        f"{pointers[0]}, not 0)")
    step = np.diff(pointers) != lengths[:-1].astype(np.int64) * itemsize
    bad = np.flatnonzero(step)
    if bad.size:
        i = int(bad[0]) + 1
        raise DataError(f"{idx}: corrupt index (sequence {i} starts at byte {pointers[i]}, "
                        f"the one before it ends at "
                        f"{int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize})")
    if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or np.any(np.diff(docs) < 0):
        raise DataError(f"{idx}: corrupt index (document boundaries must rise from 0 to the "
                        f"sequence count {lengths.size})")


def check_index_caches(cache_dir: str, prefix: str = "") -> None:
    """Refuse index cache files that are not plain arrays before megatron-core loads them.

    megatron-core loads its ``*_index.npy`` caches with ``allow_pickle=True``: a file that is
    a pickle instead of an ``.npy`` array would run code. Each one must have the ``.npy``
    header, a dtype without Python objects and exactly the size its header announces.

    Args:
        cache_dir: the index cache folder.
        prefix: check only the files whose names start with it (one dataset's).

    Raises:
        DataError: naming the file (delete it; it is rebuilt).
    """
    if not os.path.isdir(cache_dir):
        return
    for name in sorted(os.listdir(cache_dir)):
        if not name.endswith(".npy") or not name.startswith(prefix):
            continue
        path = os.path.join(cache_dir, name)
        problem = _npy_problem(path)
        if problem:
            raise DataError(f"{path}: not a plain index array ({problem}); not loaded; delete "
                            "it (it is rebuilt) and check who can write this cache folder")


def _npy_problem(path: str) -> Optional[str]:
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = fmt.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, _, dtype = fmt.read_array_header_2_0(f)
            else:
                return f".npy version {version}"
            offset = f.tell()
    except (OSError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else "unreadable"
    if dtype.hasobject:
        return f"dtype {dtype} holds Python objects"
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(path)
    if size != expected:
        return f"{size} bytes, its header describes {expected}"
    return None


def _check_prefixes(prefixes: Sequence[str], split: str,
                    vocab_size: Optional[int] = None) -> None:
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        check_indexed_dataset(prefix, vocab_size)
        num_docs = len(IndexedDataset(prefix, mmap=True).sequence_lengths)
        for name, bookends in zip(SPLIT_NAMES, matrix):
            if bookends is None:
                continue
            begin, end = (int(round(b * num_docs)) for b in bookends)
            if end <= begin:
                raise DataError(
                    f"the {name} split of {prefix} is empty ({num_docs} documents, split "
                    f"{split}); give it a larger share (e.g. split '98,1,1') or weight 0 "
                    f"(e.g. '99,1,0')"
                )


def default_index_cache_dir() -> str:
    """``$LRATTN_CACHE/gpt_indices``, default ``~/.cache/megatron_lrattn/gpt_indices``."""
    root = os.environ.get("LRATTN_CACHE") or os.path.join(Path.home(), ".cache", "megatron_lrattn")
    return os.path.join(root, "gpt_indices")


def build_gpt_datasets(
    data_prefix_or_blend: str | os.PathLike | Sequence,
    tokenizer,
    seq_length: int,
    *,
    split: str = "969,30,1",
    seed: int = 1234,
    num_samples: Sequence[Optional[int]] = (None, None, None),
    cache_dir: str | os.PathLike | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple:
    """Build (train, valid, test) GPT datasets through megatron-core's builder.

    Each sample is a dict of tensors of length ``seq_length``: ``tokens`` and ``labels``
    (``labels[i] == tokens[i + 1]``: the two are windows of one ``seq_length + 1`` token
    span), ``loss_mask`` (float), ``position_ids`` (and ``attention_mask`` when asked for).

    Args:
        data_prefix_or_blend: see :func:`parse_blend`; e.g. ``"data/a"`` or
            ``["0.7", "data/a", "0.3", "data/b"]``. Each prefix names a ``.bin``/``.idx`` pair.
        tokenizer: an object with ``vocab_size``, ``eod`` and ``unique_identifiers``
            (e.g. :class:`~megatron_lrattn.data.tokenizer.HFTokenizer`).
        seq_length: tokens per sample.
        split: train/valid/test document shares, as Megatron's ``--split``; each prefix is
            split by documents.
        seed: seed of the document and sample shuffles (same seed, same order).
        num_samples: samples per split; None builds one epoch of that split. Required for
            every used split when blend weights are given.
        cache_dir: where the index caches go; default :func:`default_index_cache_dir`.
        reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron's options for
            documents packed in one sample (all off: plain causal LM over packed text).
        create_attention_mask: also return an explicit [1, s, s] mask (off: causal masking
            belongs to the attention kernel).
        is_built_on_rank: Megatron's callable choosing the ranks that build (default: all).

    Returns:
        ``(train, valid, test)``; a split is None when its share is 0 (or when
        ``is_built_on_rank`` is False on this rank).

    Raises:
        DataError: missing or corrupt ``.bin``/``.idx`` (see :func:`check_indexed_dataset`),
            token ids beyond the tokenizer's vocabulary, a malformed blend, or an empty split.
    """
    prefixes, weights = parse_blend(data_prefix_or_blend)
    num_samples = list(num_samples)
    if len(num_samples) != 3:
        raise DataError(f"num_samples needs 3 entries (train, valid, test), got {num_samples}")
    if weights is not None and any(n is None for n in num_samples):
        raise DataError("blend weights need num_samples for every split (Megatron requires it)")
    _check_prefixes(prefixes, split, getattr(tokenizer, "vocab_size", None))
    cache_dir = str(cache_dir) if cache_dir is not None else default_index_cache_dir()
    config = LRGPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        index_cache_dir=cache_dir,
    )
    builder = BlendedMegatronDatasetBuilder(
        CachedGPTDataset, num_samples, is_built_on_rank or (lambda: True), config
    )
    train, valid, test = builder.build()
    return train, valid, test


def get_batch(
    batch: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn samples of :func:`build_gpt_datasets` into model inputs.

    Args:
        batch: a collated dict (from ``torch.utils.data.DataLoader``) or a list of samples.
        device: move the tensors there (non-blocking).

    Returns:
        ``tokens`` [b, s] int64, ``labels`` [b, s] int64, ``loss_mask`` [b, s] float32,
        ``position_ids`` [b, s] int64.
    """
    if not isinstance(batch, Mapping):
        batch = {k: torch.stack([sample[k] for sample in batch]) for k in batch[0]}
    out = (
        batch["tokens"].long(),
        batch["labels"].long(),
        batch["loss_mask"].float(),
        batch["position_ids"].long(),
    )
    if device is not None:
        out = tuple(t.to(device, non_blocking=True) for t in out)
    return out
