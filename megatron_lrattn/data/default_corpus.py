"""The embedded default data: stdlib corpus -> BPE tokenizer -> Megatron indexed dataset.

Built once per machine (no download) and cached under ``$LRATTN_CACHE`` (default
``~/.cache/megatron_lrattn``) in a folder keyed by a hash of the build parameters, the
Python version and the ``tokenizers`` version. The build happens in a temporary folder
renamed into place at the end, so a killed build never leaves a broken cache, and
concurrent builders (several ranks, several jobs) are safe: the first rename wins.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lrattn.data.corpus import DEFAULT_MAX_BYTES, write_stdlib_corpus

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the build changes in a way the parameters do not capture."""

DATA_NAME = "stdlib_text_document"
RECOMMENDED_SPLIT = "90,5,5"
"""The stdlib corpus has only a few hundred documents (one per file): Megatron's usual
``969,30,1`` leaves its test split empty."""


@dataclass(frozen=True)
class DefaultData:
    """Paths of the cached default data.

    Attributes:
        data_prefix: prefix of the ``.bin``/``.idx`` pair (pass to ``build_gpt_datasets``).
        tokenizer_dir: Hugging Face tokenizer folder (``HFTokenizer(tokenizer_dir)``).
        split: a train/valid/test split that leaves no split of this corpus empty.
        root: the cache folder holding both, and ``meta.json`` with build statistics.
        built: True when this call built the data, False when it came from the cache.
    """

    data_prefix: str
    tokenizer_dir: str
    split: str
    root: str
    built: bool


def default_cache_dir() -> Path:
    """``$LRATTN_CACHE`` if set, else ``~/.cache/megatron_lrattn``."""
    env = os.environ.get("LRATTN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_lrattn"


def _cache_key(params: dict) -> str:
    import tokenizers

    blob = json.dumps(
        {
            **params,
            "format": FORMAT_VERSION,
            "python": sys.version,
            "implementation": platform.python_implementation(),
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _result(root: Path, built: bool) -> DefaultData:
    return DefaultData(
        data_prefix=str(root / DATA_NAME),
        tokenizer_dir=str(root / "tokenizer"),
        split=RECOMMENDED_SPLIT,
        root=str(root),
        built=built,
    )


def _build(tmp: Path, vocab_size: int, max_bytes: int | None) -> dict:
    from megatron_lrattn.data.preprocess import preprocess
    from megatron_lrattn.data.tokenizer import train_bpe_tokenizer

    times = {}
    t0 = time.perf_counter()
    corpus = write_stdlib_corpus(tmp / "corpus.jsonl", max_bytes=max_bytes)
    times["corpus_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with open(tmp / "corpus.jsonl", encoding="utf-8") as f:
        texts = (json.loads(line)["text"] for line in f)
        train_bpe_tokenizer(texts, tmp / "tokenizer", vocab_size, length=corpus.documents)
    times["tokenizer_s"] = time.perf_counter() - t0
    logger.info("trained the %d-token tokenizer in %.1f s", vocab_size, times["tokenizer_s"])

    stats = preprocess(tmp / "corpus.jsonl", tmp / DATA_NAME, tmp / "tokenizer", workers=1)
    times["preprocess_s"] = stats.seconds
    return {
        "documents": stats.documents,
        "tokens": stats.tokens,
        "text_bytes": corpus.num_bytes,
        **{k: round(v, 2) for k, v in times.items()},
    }


def _build_if_missing(final: Path, params: dict) -> bool:
    if (final / "meta.json").is_file():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        start = time.perf_counter()
        logger.info("building the default data in %s", final)
        meta = _build(tmp, params["vocab_size"], params["max_bytes"])
        meta["seconds"] = round(time.perf_counter() - start, 2)
        meta["params"] = params
        meta["python"] = sys.version
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            logger.info("another process built %s first; using it", final)
            return False
        logger.info(
            "built the default data: %d documents, %d tokens in %.1f s",
            meta["documents"],
            meta["tokens"],
            meta["seconds"],
        )
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_data(
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = 4096,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> DefaultData:
    """Build the default data once and return its paths; later calls reuse the cache.

    With ``torch.distributed`` initialized, local rank 0 of each node builds while the other
    ranks wait at a barrier (call it on every rank); nodes without a shared file system
    each build their own copy.

    Args:
        cache_dir: cache root; default :func:`default_cache_dir`.
        vocab_size: tokenizer vocabulary size (including ``<|endoftext|>``, id 0).
        max_bytes: cap on the corpus text in UTF-8 bytes (None: the whole stdlib).

    Returns:
        :class:`DefaultData`.
    """
    params = {"vocab_size": int(vocab_size), "max_bytes": max_bytes}
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "default_data" / _cache_key(params)

    dist = None
    if "torch" in sys.modules:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            dist = None
    built = False
    if dist is not None:
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
            built = _build_if_missing(final, params)
        dist.barrier()
    built = _build_if_missing(final, params) or built
    return _result(final, built)
