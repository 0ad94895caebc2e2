"""``--mock-data``: synthetic token datasets, no files needed (Megatron-LM's meaning).

megatron-core's ``MockGPTDataset`` builds the three splits from generated documents (random
lengths below 4096, tokens ``1, 2, ...`` modulo the vocabulary, an end-of-document token
each), through the same builder, sample windows and masks as real data. Without a tokenizer
the vocabulary is ``--vocab-size`` ids, the last one the end-of-document token (as
megatron's ``NullTokenizer``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


class MockTokenizer:
    """A vocabulary of ``vocab_size`` ids without text; the last id ends a document.

    Args:
        vocab_size: number of token ids (>= 2).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size {vocab_size}: need at least 2 ids")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-document id (the last one)."""
        return self._vocab_size - 1

    @property
    def pad(self) -> int:
        """No padding id (-1: megatron's value for none; samples are never padded)."""
        return -1

    @property
    def unique_identifiers(self) -> dict:
        """What megatron's index caches key on."""
        return {"class": type(self).__name__, "vocab_size": self._vocab_size}

    def __repr__(self) -> str:
        return f"MockTokenizer(vocab_size={self._vocab_size})"


def build_mock_datasets(tokenizer, seq_length: int, *, seed: int = 1234,
                        num_samples: Sequence[Optional[int]] = (None, None, None),
                        split: str = "969,30,1", reset_position_ids: bool = False,
                        reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                        create_attention_mask: bool = False,
                        cache_dir: Optional[str] = None) -> Tuple:
    """(train, valid, test) ``MockGPTDataset`` splits; samples as ``build_gpt_datasets``'s.

    Args:
        tokenizer: ``vocab_size`` and ``eod`` (``MockTokenizer`` or an ``HFTokenizer``).
        seq_length: tokens per sample.
        seed: sample shuffle seed.
        num_samples: samples per split (None: one epoch of the generated documents).
        split: train/valid/test shares.
        cache_dir: where the sample indices are cached (default: ``build_gpt_datasets``'s).
        reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask: as
            ``build_gpt_datasets``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    from megatron_lrattn.data.datasets import default_index_cache_dir

    config = GPTDatasetConfig(
        path_to_cache=str(cache_dir) if cache_dir else default_index_cache_dir(),
        random_seed=seed, sequence_length=seq_length, blend=None, split=split,
        tokenizer=tokenizer, reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, list(num_samples), lambda: True,
                                         config).build()
