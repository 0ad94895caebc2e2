"""A text corpus present on every machine: the Python standard library's own sources.

No download is needed: the ``.py`` files of the running interpreter's standard library are
read, ordered deterministically and written as JSON lines, one ``{"text": ...}`` document
per file. The same interpreter build always yields byte-identical output.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10_000_000
"""Default cap on the corpus text (UTF-8 bytes); the whole non-test stdlib is about 9 MB."""

SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "encodings",
        "turtledemo",
        "ensurepip",
        "pydoc_data",
        "venv",
    }
)
"""Directory names never descended into: third-party packages, tests, tables, tools."""


@dataclass(frozen=True)
class CorpusStats:
    """What :func:`write_stdlib_corpus` wrote.

    Attributes:
        documents: number of JSON-lines documents (one per source file).
        num_bytes: total UTF-8 bytes of document text.
        path: the JSON-lines file.
    """

    documents: int
    num_bytes: int
    path: str


def stdlib_dir() -> Path:
    """Return the directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(("config-", "."))


def list_stdlib_sources(root: str | os.PathLike | None = None) -> list[str]:
    """List the standard library's ``.py`` files in a fixed, machine-independent order.

    Files are ordered by the SHA-1 of their POSIX path relative to ``root``: a deterministic
    order that mixes packages, so a size cap keeps a varied sample rather than the
    alphabetically first packages.

    Args:
        root: directory to scan; default the running interpreter's stdlib.

    Returns:
        Relative POSIX paths of the ``.py`` files, skipping :data:`SKIP_DIRS`.
    """
    root = Path(root) if root is not None else stdlib_dir()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _skipped(d)]
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    found.sort(key=lambda rel: (hashlib.sha1(rel.encode()).hexdigest(), rel))
    return found


def iter_stdlib_documents(
    max_bytes: int | None = DEFAULT_MAX_BYTES, root: str | os.PathLike | None = None
) -> Iterator[tuple[str, str]]:
    """Yield ``(relative_path, text)`` for stdlib sources until ``max_bytes`` is reached.

    Files that are not valid UTF-8 or are empty are skipped. A file that would overflow the
    cap is skipped and smaller later files may still fit, so the cap is filled closely.

    Args:
        max_bytes: cap on the total UTF-8 bytes yielded; None for no cap.
        root: directory to scan; default the running interpreter's stdlib.
    """
    root = Path(root) if root is not None else stdlib_dir()
    total = 0
    for rel in list_stdlib_sources(root):
        raw = (root / rel).read_bytes()
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            logger.debug("skipping non-UTF-8 file %s", rel)
            continue
        if max_bytes is not None and total + len(raw) > max_bytes:
            continue
        total += len(raw)
        yield rel, text


def write_stdlib_corpus(
    path: str | os.PathLike,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    root: str | os.PathLike | None = None,
) -> CorpusStats:
    """Write the stdlib corpus as JSON lines, one ``{"text": ...}`` document per file.

    Args:
        path: output ``.jsonl`` file (parent directories are created).
        max_bytes: cap on the total UTF-8 bytes of text; None for the whole stdlib.
        root: directory to scan; default the running interpreter's stdlib.

    Returns:
        :class:`CorpusStats` with the document count and text size.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    documents = num_bytes = 0
    with open(path, "w", encoding="utf-8") as out:
        for _, text in iter_stdlib_documents(max_bytes, root):
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents += 1
            num_bytes += len(text.encode("utf-8"))
    logger.info("wrote %d stdlib documents (%.1f MB) to %s", documents, num_bytes / 1e6, path)
    return CorpusStats(documents=documents, num_bytes=num_bytes, path=str(path))
