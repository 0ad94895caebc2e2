"""Build the English prose corpus from pinned Debian documentation packages.

The sources are manuals, guides and references shipped as Debian packages (``apt-get
download``, no hub): HTML, man pages (roff), POD and info files. Each file is converted to
paragraphs, paragraphs that are not prose (code, tables, lists of names, headings) are
dropped by measured rules, paragraphs repeated across documents (navigation, licence
blurbs) are removed as boilerplate, then exact and near-duplicate documents. The result is
JSON lines (``{"text", "source", "path"}``, one document per file) that ``lrattn-preprocess``
reads, its gzip copy, and a manifest with per-source counts, licences, filter counts and
digests. The same packages give the same bytes. The pinned sources, the converters and the
prose rules are in ``tools/prose_corpus/``; this script builds, trains the tokenizer and is
the CLI.

    python tools/build_prose_corpus.py --out data/prose --vocab-size 8192
    lrattn-preprocess --input data/prose/prose.jsonl.gz --output-prefix data/prose/prose \\
        --tokenizer data/prose/tokenizer --workers 2
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import subprocess
import sys
import tarfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from prose_corpus.clean import (BOILERPLATE_DOCUMENTS, MAX_CODE_SYMBOLS, MAX_UPPER_FRACTION,
                                MIN_DOCUMENT_WORDS, MIN_PARAGRAPH_WORDS, MIN_STOPWORD_FRACTION,
                                MIN_WORD_FRACTION, NEAR_DUPLICATE_CONTAINMENT, PARAGRAPH_RULES,
                                clean_documents)
from prose_corpus.convert import BuildError, convert, deb_members, select
from prose_corpus.sources import SOURCES, Source

FORMAT_VERSION = 1


def fetch(source: Source, debs: Path, download: bool) -> Path:
    """The source's ``.deb`` in ``debs`` (downloaded with ``apt-get download`` when missing
    and ``download``), its digest checked against the pin."""
    # apt writes an epoch "1:" as "1%3a"; other tools drop it
    names = {source.version.replace(":", "%3a"), source.version.split(":", 1)[-1]}

    def matches() -> list[Path]:
        return sorted(p for v in names for p in debs.glob(f"{source.package}_{v}_*.deb"))

    found = matches() if debs.is_dir() else []
    if not found and download:
        debs.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["apt-get", "download", f"{source.package}={source.version}"],
                             cwd=debs, capture_output=True, text=True)
        found = matches()
        if res.returncode != 0 or not found:
            why = (res.stderr.strip().splitlines() or ["no file written"])[-1]
            # the pinned version is newer than the package lists when they were last read
            hint = "run apt-get update first, " if "was not found" in why else ""
            raise BuildError(f"apt-get download {source.package}={source.version} failed "
                             f"({why}); {hint}put the .deb in {debs} (--debs) or pass "
                             "--no-download")
    if not found:
        raise BuildError(f"no {source.package} {source.version} .deb in {debs}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if source.sha256 is not None and digest != source.sha256:
        raise BuildError(f"{found[0].name}: sha256 {digest[:12]}... differs from the pinned "
                         f"{source.sha256[:12]}...")
    return found[0]


def _convert_task(task: tuple[str, str, str, bytes]) -> tuple[str, str, list[str] | None, Counter]:
    package, path, fmt, raw = task
    counts: Counter = Counter()
    return package, path, convert(fmt, raw, counts), counts


def _tasks(sources: Sequence[Source], debs: Path, download: bool, stats: dict
           ) -> Iterator[tuple[str, str, str, bytes]]:
    for source in sources:
        deb = fetch(source, debs, download)
        raw_deb = deb.read_bytes()
        entry = stats[source.package]
        entry.update(version=source.version, licence=source.licence, deb=deb.name,
                     deb_sha256=hashlib.sha256(raw_deb).hexdigest())
        members = sorted(deb_members(raw_deb, lambda p: select(source, p) is not None))
        entry["files_read"] = len(members)
        for path, raw in members:
            yield source.package, path, select(source, path), raw


def build(sources: Sequence[Source], debs: Path, out: Path, *, download: bool = True,
          jobs: int = 1, progress: bool = False) -> dict:
    """Convert, filter and deduplicate ``sources``; write ``out/prose.jsonl`` and
    ``out/prose.jsonl.gz``; return the manifest (without the tokenizer part).

    Args:
        sources: packages in output order.
        debs: folder holding (or receiving) the ``.deb`` files.
        out: output folder (created).
        download: fetch missing packages with ``apt-get download``.
        jobs: conversion processes (1: in this process).
        progress: a tqdm bar over files on stderr.

    Returns:
        The manifest: per-source counts, filter counts and output digests.
    """
    stats: dict = defaultdict(dict)
    para_counts: Counter = Counter()
    doc_counts: Counter = Counter()
    docs = []
    tasks = _tasks(sources, debs, download, stats)
    if jobs > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(jobs)
        results: Iterable = pool.imap(_convert_task, tasks, chunksize=8)
    else:
        pool, results = None, map(_convert_task, tasks)
    if progress:
        from tqdm import tqdm

        results = tqdm(results, unit="file", desc="converting", dynamic_ncols=True)
    try:
        for package, path, paras, counts in results:
            para_counts.update(counts)
            doc_counts["files"] += 1
            if paras is None:
                doc_counts["not_utf8"] += 1
            else:
                docs.append((package, path, paras))
    finally:
        if pool is not None:
            pool.terminate()
    kept = clean_documents(docs, doc_counts)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "prose.jsonl"
    with open(jsonl, "wb") as f:
        for package, path, text in kept:
            f.write(json.dumps({"text": text, "source": package, "path": path},
                               ensure_ascii=False).encode() + b"\n")
            entry = stats[package]
            entry["documents"] = entry.get("documents", 0) + 1
            entry["bytes"] = entry.get("bytes", 0) + len(text.encode())
            entry["words"] = entry.get("words", 0) + len(text.split())
    raw = jsonl.read_bytes()
    with open(out / "prose.jsonl.gz", "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as gz:
            gz.write(raw)
    doc_keys = ("files", "not_utf8", "no_prose", "exact_duplicate", "boilerplate_paragraphs",
                "too_short", "not_english", "near_duplicate")
    return {
        "format": FORMAT_VERSION,
        "sources": {s.package: {"documents": 0, "bytes": 0, "words": 0, **stats[s.package]}
                    for s in sources},
        "filters": {
            "paragraph_rules": {
                "min_words": MIN_PARAGRAPH_WORDS, "max_code_symbols": MAX_CODE_SYMBOLS,
                "min_word_fraction": MIN_WORD_FRACTION, "max_upper_fraction": MAX_UPPER_FRACTION,
                "boilerplate_documents": BOILERPLATE_DOCUMENTS},
            "document_rules": {
                "min_words": MIN_DOCUMENT_WORDS, "min_stopword_fraction": MIN_STOPWORD_FRACTION,
                "near_duplicate_containment": NEAR_DUPLICATE_CONTAINMENT,
                "near_duplicate_shingles": "5 words, crc32 % 8 == 0 sample"},
            "paragraphs": {k: para_counts[k] for k in ("read", "kept", *PARAGRAPH_RULES)},
            "documents": {**{k: doc_counts[k] for k in doc_keys}, "kept": len(kept)},
        },
        "output": {
            "jsonl": jsonl.name, "documents": len(kept), "bytes": len(raw),
            "text_bytes": sum(e.get("bytes", 0) for e in stats.values()),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "gz": "prose.jsonl.gz",
            "gz_sha256": hashlib.sha256((out / "prose.jsonl.gz").read_bytes()).hexdigest(),
        },
    }


def train_tokenizer(out: Path, vocab_size: int, manifest: dict, progress: bool) -> None:
    """Train the byte-level BPE tokenizer on ``out/prose.jsonl`` into ``out/tokenizer``
    (the project's trainer) and add token counts per source to ``manifest``."""
    from megatron_lrattn.data.tokenizer import HFTokenizer, train_bpe_tokenizer

    with open(out / "prose.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    train_bpe_tokenizer((r["text"] for r in rows), out / "tokenizer", vocab_size,
                        length=len(rows))
    tok = HFTokenizer(out / "tokenizer")
    per_source: Counter = Counter()
    chunks: Iterable = range(0, len(rows), 256)
    if progress:
        from tqdm import tqdm

        chunks = tqdm(chunks, unit="chunk", desc="counting tokens", dynamic_ncols=True)
    for i in chunks:
        batch = rows[i:i + 256]
        for r, ids in zip(batch, tok.tokenize_batch([r["text"] for r in batch])):
            per_source[r["source"]] += len(ids)
    for package, entry in manifest["sources"].items():
        entry["tokens"] = per_source[package]
    manifest["tokenizer"] = {
        "folder": "tokenizer", "vocab_size": tok.vocab_size,
        "sha256": hashlib.sha256((out / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest(),
        "tokens": sum(per_source.values()),
        "tokens_with_eod": sum(per_source.values()) + len(rows),
    }


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tools/build_prose_corpus.py``."""
    p = argparse.ArgumentParser(prog="build_prose_corpus", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("data/prose"),
                   help="output folder: prose.jsonl(.gz), manifest.json, tokenizer/ "
                        "(default: data/prose)")
    p.add_argument("--debs", type=Path, default=None,
                   help="folder of the .deb files, filled by apt-get download when missing "
                        "(default: OUT/debs)")
    p.add_argument("--sources", default=None,
                   help="comma-separated package names to build from (default: every source)")
    p.add_argument("--no-download", action="store_true", help="never run apt-get download")
    p.add_argument("--vocab-size", type=_count, default=8192,
                   help="train a byte-level BPE tokenizer of this size on the corpus and count "
                        "tokens per source (0: no tokenizer; default 8192)")
    p.add_argument("--jobs", type=_count, default=1, help="conversion processes (default 1)")
    p.add_argument("--list", action="store_true", help="print the sources and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on bad flags or inputs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for s in SOURCES:
            print(f"{s.package}={s.version}\t{s.licence}")
        return 0

    def fail(message: str) -> None:
        parser.exit(2, f"build_prose_corpus: error: {message}\n")

    sources = list(SOURCES)
    if args.sources is not None:
        names = [n.strip() for n in args.sources.split(",") if n.strip()]
        known = {s.package: s for s in SOURCES}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            fail(f"unknown source(s) {', '.join(unknown) or '(none given)'}; see --list")
        sources = [known[n] for n in names]
    if args.vocab_size and args.vocab_size < 258:
        fail("--vocab-size must be 0 or >= 258 (256 bytes and the end-of-document token)")
    if args.jobs < 1:
        fail("--jobs must be >= 1")
    if args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} is not a folder")
    if args.debs is not None and args.debs.exists() and not args.debs.is_dir():
        fail(f"--debs {args.debs} is not a folder")
    if args.debs is not None and not args.debs.exists() and args.no_download:
        fail(f"--debs {args.debs} is not a folder (and --no-download)")
    debs = args.debs if args.debs is not None else args.out / "debs"
    try:
        manifest = build(sources, debs, args.out, download=not args.no_download,
                         jobs=args.jobs, progress=not args.no_progress)
        if args.vocab_size:
            train_tokenizer(args.out, args.vocab_size, manifest, not args.no_progress)
    except (BuildError, OSError, tarfile.TarError, lzma.LZMAError, EOFError) as err:
        print(f"build_prose_corpus: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("build_prose_corpus: interrupted", file=sys.stderr)
        return 130
    manifest["command"] = "python tools/build_prose_corpus.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    o = manifest["output"]
    print(f"{o['documents']} documents, {o['text_bytes'] / 1e6:.1f} MB of text"
          + (f", {manifest['tokenizer']['tokens']:,} tokens" if "tokenizer" in manifest else "")
          + f" -> {args.out / o['jsonl']} (sha256 {o['sha256'][:16]}...)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
