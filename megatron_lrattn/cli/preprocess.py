"""``lrattn-preprocess``: text or JSON-lines files -> Megatron indexed dataset (.bin/.idx).

Examples::

    lrattn-preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer tok/
    lrattn-preprocess --input docs/ --input-format text --output-prefix data/docs \\
        --tokenizer tok/ --workers 4

Output names follow Megatron's ``preprocess_data.py``: ``PREFIX_KEY_document.bin/.idx`` per
JSON key, e.g. ``data/corpus_text_document`` (the ``--data-path`` of ``lrattn-pretrain``).
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings

from megatron_lrattn.data.errors import DataError


def document_prefix(output_prefix: str, key: str) -> str:
    """``PREFIX_KEY_document``: where the documents of JSON field ``key`` go (Megatron's
    ``preprocess_data.py`` naming)."""
    return f"{output_prefix}_{key}_document"


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``lrattn-preprocess``."""
    p = argparse.ArgumentParser(
        prog="lrattn-preprocess",
        description="Tokenize text or JSON-lines files into a Megatron indexed dataset.",
    )
    p.add_argument("--input", nargs="+", required=True, help="input files or folders")
    p.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_KEY_document.bin/.idx per JSON key (Megatron's naming), e.g. "
             "PREFIX_text_document.bin/.idx",
    )
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer folder")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields (default: text)")
    p.add_argument(
        "--input-format",
        choices=["auto", "jsonl", "text"],
        default="auto",
        help="auto: .jsonl/.json[.gz] are JSON lines, other files plain text",
    )
    p.add_argument(
        "--split-lines",
        action="store_true",
        help="text input: one document per non-empty line (default: one per file)",
    )
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document token to every document (default: on)",
    )
    p.add_argument("--eod-token", default=None, help="override the tokenizer's EOS token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--chunk-size", type=int, default=64, help="documents per worker task")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="logging level, any case (default: WARNING)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    if args.workers < 1 or args.chunk_size < 1:
        print("lrattn-preprocess: error: --workers and --chunk-size must be >= 1", file=sys.stderr)
        return 2
    from megatron_lrattn.data.preprocess import preprocess

    try:
        # One pass per JSON key, each written as PREFIX_KEY_document (Megatron's names).
        runs = [preprocess(
            args.input,
            document_prefix(args.output_prefix, key),
            args.tokenizer,
            json_keys=[key],
            input_format=args.input_format,
            split_lines=args.split_lines,
            append_eod=args.append_eod,
            eod_token=args.eod_token,
            workers=args.workers,
            chunk_size=args.chunk_size,
            progress=not args.no_progress,
        ) for key in args.json_keys]
    except DataError as err:
        print(f"lrattn-preprocess: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lrattn-preprocess: interrupted; no output written", file=sys.stderr)
        return 130
    for stats in runs:
        rate = stats.tokens / max(stats.seconds, 1e-9)
        print(
            f"{stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.1f} s "
            f"({rate:,.0f} tokens/s) -> "
            f"{', '.join(p + '.{bin,idx}' for p in stats.output_prefixes)}"
        )
        if stats.skipped_empty:
            print(f"skipped {stats.skipped_empty} empty documents")
        if stats.replaced_text:
            print(f"replaced invalid UTF-8 or lone surrogates by U+FFFD in "
                  f"{stats.replaced_text} documents")
        if stats.truncated_files:
            print(f"{stats.truncated_files} truncated compressed file(s): kept the documents "
                  "before each cut")
    return 0


if __name__ == "__main__":
    sys.exit(main())
