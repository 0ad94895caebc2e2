"""Byte-level BPE training and a Megatron-facing adapter around any Hugging Face tokenizer.

:func:`train_bpe_tokenizer` writes a folder (``tokenizer.json`` + ``tokenizer_config.json``)
that ``transformers.AutoTokenizer.from_pretrained(folder)`` loads. :class:`HFTokenizer` wraps
any such folder with what Megatron's ``GPTDatasetConfig.tokenizer`` and our preprocessing
need: ``vocab_size``, ``eod``, ``tokenize``, ``detokenize`` and ``unique_identifiers``.
"""
from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from megatron_lrattn.data.errors import DataError

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
"""The document separator of tokenizers trained here (also their BOS and EOS token)."""


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 4096,
    *,
    min_frequency: int = 2,
    eod_token: str = EOD_TOKEN,
    length: int | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer and save it as a Hugging Face tokenizer folder.

    Byte-level BPE is lossless: ``detokenize(tokenize(text)) == text`` for any string.

    Args:
        texts: training documents.
        out_dir: folder to write ``tokenizer.json`` and ``tokenizer_config.json`` to.
        vocab_size: total vocabulary size, including the 256 byte tokens and ``eod_token``.
        min_frequency: minimum pair count for a merge.
        eod_token: special token used as BOS, EOS and document separator (id 0).
        length: number of texts, if known (only for the trainer's bookkeeping).

    Returns:
        The folder path.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1:
        raise DataError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    if tok.get_vocab_size() < vocab_size:
        logger.warning(
            "tokenizer has %d tokens, fewer than the requested %d (corpus too small)",
            tok.get_vocab_size(),
            vocab_size,
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=eod_token,
        eos_token=eod_token,
        unk_token=eod_token,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    special = {"bos_token": eod_token, "eos_token": eod_token, "unk_token": eod_token}
    # A class name every transformers release knows (4.x has no "TokenizersBackend").
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({**config, **special}, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    logger.info("saved a %d-token byte-level BPE tokenizer to %s", len(hf), out_dir)
    return out_dir


class HFTokenizer:
    """Megatron-facing adapter around a Hugging Face tokenizer folder.

    Usable as ``GPTDatasetConfig.tokenizer`` (duck-typed like Megatron's tokenizers) and by
    :func:`megatron_lrattn.data.preprocess.preprocess`. Encoding never adds special tokens;
    the end-of-document id is appended by preprocessing.

    Args:
        path: folder loadable by ``transformers.AutoTokenizer.from_pretrained``.
        eod_token: token used as end of document; default the tokenizer's EOS token, else
            ``<|endoftext|>`` if in the vocabulary.

    Raises:
        DataError: the folder is missing, cannot be loaded, or has no end-of-document token.
    """

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None) -> None:
        self.path = str(Path(path).resolve())
        if not Path(path).is_dir():
            raise DataError(f"tokenizer folder not found: {path}")
        try:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise DataError(f"cannot load tokenizer from {path}: {lines[0]}") from None
        self._backend = getattr(self._hf, "backend_tokenizer", None)
        self._eod = self._find_eod(eod_token)
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_path", self.path),
                ("vocab_size", self.vocab_size),
                ("eod", self._eod),
            ]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def _find_eod(self, eod_token: str | None) -> int:
        vocab = self._hf.get_vocab()
        if eod_token is not None:
            if eod_token not in vocab:
                raise DataError(f"eod token {eod_token!r} is not in the tokenizer at {self.path}")
            return vocab[eod_token]
        if self._hf.eos_token_id is not None:
            return int(self._hf.eos_token_id)
        if EOD_TOKEN in vocab:
            return vocab[EOD_TOKEN]
        raise DataError(f"tokenizer at {self.path} has no EOS token; pass eod_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included (before any padding)."""
        return len(self._hf)

    @property
    def eod(self) -> int:
        """End-of-document token id (appended after every document)."""
        return self._eod

    @property
    def eos(self) -> int:
        """EOS id; the end-of-document id when the tokenizer defines none."""
        eos = self._hf.eos_token_id
        return self._eod if eos is None else int(eos)

    @property
    def bos(self) -> int:
        """BOS id. Raises AttributeError when the tokenizer has none."""
        if self._hf.bos_token_id is None:
            raise AttributeError("tokenizer has no BOS token")
        return int(self._hf.bos_token_id)

    @property
    def pad(self) -> int:
        """A pad id distinct from EOD. Raises AttributeError otherwise (Megatron then uses -1)."""
        pad = self._hf.pad_token_id
        if pad is None or pad == self._eod:
            raise AttributeError("tokenizer has no pad token distinct from EOD")
        return int(pad)

    @property
    def vocab(self) -> dict[str, int]:
        """Token string to id."""
        return self._hf.get_vocab()

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""
        return {i: t for t, i in self._hf.get_vocab().items()}

    def tokenize(self, text: str) -> list[int]:
        """Encode one text without adding special tokens."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts (in parallel inside the Rust backend when available)."""
        if self._backend is not None:
            encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
            return [e.ids for e in encodings]
        return [self._hf.encode(t, add_special_tokens=False) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text, special tokens kept, no whitespace clean-up."""
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"
