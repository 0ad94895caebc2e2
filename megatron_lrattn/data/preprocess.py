"""Tokenize text or JSON-lines files into a Megatron indexed dataset (``.bin`` + ``.idx``).

Documents are read in the main process, tokenized in chunks (in-process through the Rust
backend's batch encoder, or in ``workers`` spawned processes, order preserved), and written
through megatron-core's ``IndexedDatasetBuilder`` under temporary names that are renamed
into place only after the index is complete, so an interrupted run never leaves a
half-written dataset under the final name.
"""
from __future__ import annotations

import gzip
import json
import logging
import multiprocessing
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

from megatron_lrattn.data.errors import DataError
from megatron_lrattn.data.tokenizer import HFTokenizer
from megatron_lrattn.training.durable import check_output_parent

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


@dataclass
class PreprocessStats:
    """Summary of one :func:`preprocess` run.

    Attributes:
        documents: documents written (per output; empty documents are skipped).
        tokens: tokens written over all outputs, EOD included.
        seconds: wall time.
        output_prefixes: one ``.bin``/``.idx`` prefix per JSON key.
        skipped_empty: documents skipped because they tokenized to nothing.
        replaced_text: documents in which bytes that are not UTF-8 or lone surrogate
            escapes were replaced by U+FFFD.
        truncated_files: compressed inputs that end early (a cut ``.gz``): the documents
            before the cut are kept, a partial last line is dropped.
    """

    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    output_prefixes: list[str] = field(default_factory=list)
    skipped_empty: int = 0
    replaced_text: int = 0
    truncated_files: int = 0


def output_dtype(vocab_size: int) -> type[np.number]:
    """Token dtype of the ``.bin`` file: uint16 when ``vocab_size < 65500``, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _is_json(path: Path, input_format: str) -> bool:
    if input_format == "auto":
        return path.name.endswith(JSON_SUFFIXES)
    return input_format == "jsonl"


def _open_text(path: Path) -> IO[str]:
    # Bytes that are not UTF-8 come through as lone surrogates, replaced by ``_clean``.
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, "r", encoding="utf-8", errors="surrogateescape")


_TRUNCATED = (EOFError, zlib.error, gzip.BadGzipFile)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean(text: str, stats: "PreprocessStats") -> str:
    """``text`` with lone surrogates (undecodable bytes, or ``\\udXXX`` escapes in JSON)
    replaced by U+FFFD; the tokenizer cannot encode them."""
    cleaned, n = _SURROGATE.subn("\ufffd", text)
    stats.replaced_text += bool(n)
    return cleaned


def _lines(path: Path, stats: "PreprocessStats") -> Iterator[tuple[int, str]]:
    """Numbered lines of ``path``; a compressed file cut short yields the complete lines
    before the cut (counted in ``stats.truncated_files``)."""
    with _open_text(path) as f:
        it = iter(f)
        prev, lineno = None, 0
        while True:
            try:
                line = next(it)
            except StopIteration:
                break
            except _TRUNCATED as err:
                stats.truncated_files += 1
                logger.warning("%s: truncated (%s); keeping the %d complete lines before the "
                               "cut", path, err, lineno - (prev is not None))
                if prev is not None and not prev.endswith("\n"):
                    prev = None
                break
            if prev is not None:
                yield lineno, prev
            prev, lineno = line, lineno + 1
        if prev is not None:
            yield lineno, prev


def _read_whole(path: Path, stats: "PreprocessStats") -> str:
    parts = []
    with _open_text(path) as f:
        try:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                parts.append(chunk)
        except _TRUNCATED as err:
            stats.truncated_files += 1
            logger.warning("%s: truncated (%s); keeping the text before the cut", path, err)
    return "".join(parts)


def _expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise DataError(f"input {path}: not a regular file or folder")
        else:
            raise DataError(f"input file not found: {path}")
    if not files:
        raise DataError(f"no input files in {', '.join(map(str, inputs)) or '(none)'}")
    return files


def _parse_record(line: str, path: Path, lineno: int, json_keys: Sequence[str]) -> tuple[str, ...]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: record is not a JSON object")
    missing = [k for k in json_keys if k not in record]
    if missing:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(f"{path}:{lineno}: no key {missing[0]!r} in record (keys: {keys})")
    texts = tuple(record[k] for k in json_keys)
    for key, text in zip(json_keys, texts):
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: key {key!r} is not a string")
    return texts


def _check_first_record(path: Path, json_keys: Sequence[str]) -> None:
    try:
        for lineno, line in _lines(path, PreprocessStats()):
            if line.strip():
                _parse_record(line, path, lineno, json_keys)
                return
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None


def _iter_documents(
    files: Sequence[Path], input_format: str, json_keys: Sequence[str], split_lines: bool,
    stats: PreprocessStats,
) -> Iterator[tuple[str, ...]]:
    for path in files:
        try:
            if _is_json(path, input_format):
                for lineno, line in _lines(path, stats):
                    if line.strip():
                        texts = _parse_record(line, path, lineno, json_keys)
                        yield tuple(_clean(t, stats) for t in texts)
            elif split_lines:
                for _, line in _lines(path, stats):
                    line = line.rstrip("\r\n")
                    if line.strip():
                        yield (_clean(line, stats),)
            else:
                yield (_clean(_read_whole(path, stats), stats),)
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror or err}") from None


def _chunks(docs: Iterator[tuple[str, ...]], size: int) -> Iterator[list[tuple[str, ...]]]:
    chunk: list[tuple[str, ...]] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


_WORKER_TOKENIZER: HFTokenizer | None = None


def _worker_init(tokenizer_path: str, eod_token: str | None) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = HFTokenizer(tokenizer_path, eod_token=eod_token)


def _encode_chunk(
    chunk: list[tuple[str, ...]], tokenizer: HFTokenizer | None = None
) -> list[list[np.ndarray]]:
    """Encode a chunk of documents: result[doc][key] is an int32 array of token ids."""
    tokenizer = tokenizer if tokenizer is not None else _WORKER_TOKENIZER
    num_keys = len(chunk[0])
    flat = tokenizer.tokenize_batch([text for doc in chunk for text in doc])
    arrays = [np.asarray(ids, dtype=np.int32) for ids in flat]
    return [arrays[i : i + num_keys] for i in range(0, len(arrays), num_keys)]


def _prefix_for_key(output_prefix: str, key: str, num_keys: int) -> str:
    return output_prefix if num_keys == 1 else f"{output_prefix}_{key}"


def _remove_quietly(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def preprocess(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: str | os.PathLike | HFTokenizer,
    *,
    json_keys: Sequence[str] = ("text",),
    input_format: str = "auto",
    split_lines: bool = False,
    append_eod: bool = True,
    eod_token: str | None = None,
    workers: int = 1,
    chunk_size: int = 64,
    progress: bool = False,
) -> PreprocessStats:
    """Tokenize documents into Megatron indexed dataset(s).

    Args:
        inputs: files or folders (folders are read recursively in sorted order).
        output_prefix: writes ``{output_prefix}.bin`` and ``.idx``; with several
            ``json_keys``, one ``{output_prefix}_{key}`` pair per key.
        tokenizer: Hugging Face tokenizer folder, or an :class:`HFTokenizer`.
        json_keys: fields of each JSON-lines record to tokenize.
        input_format: "auto" (``.jsonl``/``.json``[``.gz``] are JSON lines, anything else
            text), "jsonl" or "text".
        split_lines: for text input, one document per non-empty line instead of per file.
        append_eod: append the end-of-document id to every document.
        eod_token: override the tokenizer's end-of-document token.
        workers: tokenizer processes; 1 tokenizes in-process (the Rust backend still uses
            every core for a batch).
        chunk_size: documents per task handed to a worker.
        progress: show a tqdm progress bar on stderr.

    Returns:
        :class:`PreprocessStats`.

    Raises:
        DataError: a missing input or tokenizer, bad JSON, or a missing JSON key. Nothing is
            left under the output names when it is raised.
    """
    start = time.perf_counter()
    json_keys = tuple(json_keys)
    if input_format not in ("auto", "jsonl", "text"):
        raise DataError(f"unknown input format {input_format!r} (use auto, jsonl or text)")
    if not json_keys:
        raise DataError("json_keys is empty")
    files = _expand_inputs(inputs)
    is_json = [_is_json(p, input_format) for p in files]
    if any(is_json) and not all(is_json):
        raise DataError("mixing JSON-lines and text inputs is not supported; pass --input-format")
    for path in files:
        if _is_json(path, input_format):
            _check_first_record(path, json_keys)
    keys = json_keys if is_json[0] else ("text",)
    if not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer(tokenizer, eod_token=eod_token)
    elif eod_token is not None:
        tokenizer = HFTokenizer(tokenizer.path, eod_token=eod_token)

    output_prefix = str(output_prefix)
    try:
        check_output_parent("--output-prefix", output_prefix)
        Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    except ValueError as err:
        raise DataError(str(err)) from None
    except OSError as err:
        raise DataError(f"--output-prefix: cannot create {Path(output_prefix).parent} "
                        f"({err.strerror})") from None
    finals = [_prefix_for_key(output_prefix, k, len(keys)) for k in keys]
    temps = [f"{p}.tmp{os.getpid()}" for p in finals]
    dtype = output_dtype(tokenizer.vocab_size)
    stats = PreprocessStats(output_prefixes=finals)

    docs = _iter_documents(files, input_format, json_keys, split_lines, stats)
    chunks = _chunks(docs, chunk_size)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer.path, eod_token))
        encoded = pool.imap(_encode_chunk, chunks)
    else:
        encoded = (_encode_chunk(c, tokenizer) for c in chunks)

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builders = [IndexedDatasetBuilder(f"{t}.bin", dtype=dtype) for t in temps]
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(unit="doc", desc="tokenizing", dynamic_ncols=True)
        for chunk in encoded:
            for doc in chunk:
                if all(len(ids) == 0 for ids in doc):
                    stats.skipped_empty += 1
                    continue
                for builder, ids in zip(builders, doc):
                    if append_eod:
                        ids = np.append(ids, np.int32(tokenizer.eod))
                    builder.add_document(ids, [len(ids)])
                    stats.tokens += len(ids)
                stats.documents += 1
            if bar is not None:
                bar.update(len(chunk))
        for builder, temp in zip(builders, temps):
            builder.finalize(f"{temp}.idx")
        for temp, final in zip(temps, finals):
            _remove_quietly(f"{final}.idx")
            os.replace(f"{temp}.bin", f"{final}.bin")
            os.replace(f"{temp}.idx", f"{final}.idx")
    except BaseException as err:
        for builder in builders:
            try:
                builder.data_file.close()
            except OSError:
                pass
        for temp in temps:
            _remove_quietly(f"{temp}.bin", f"{temp}.idx")
        if isinstance(err, OSError):
            raise DataError(f"{output_prefix}: writing the dataset failed "
                            f"({err.strerror or err}); nothing was written") from None
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.perf_counter() - start
    logger.info(
        "wrote %d documents, %d tokens to %s in %.1f s",
        stats.documents,
        stats.tokens,
        ", ".join(finals),
        stats.seconds,
    )
    return stats
