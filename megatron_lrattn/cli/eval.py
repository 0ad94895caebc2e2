"""``lrattn-eval``: evaluate an exported Hugging Face model on local tasks (no download)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from megatron_lrattn.cli.common import run_cli
from megatron_lrattn.training.arg_types import positive_int

TASKS = ("heldout", "last_word", "next_line")


def build_parser() -> argparse.ArgumentParser:
    """Command-line arguments."""
    p = argparse.ArgumentParser(
        prog="lrattn-eval",
        description="Evaluate a Hugging Face causal LM folder (an lrattn-convert-hf export or "
                    "any AutoModelForCausalLM) on tasks built from held-out text (the embedded "
                    "default corpus's test split, or a part of a preprocessed dataset with "
                    "--data-path): held-out perplexity and bits per byte, last-word cloze, "
                    "next-line choice. Prints a table; --output writes JSON.")
    p.add_argument("model", help="Hugging Face model folder")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated tasks (default {','.join(TASKS)})")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text file that 'heldout' scores instead of the held-out corpus")
    p.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="take every task's documents from a preprocessed dataset "
                        "(PREFIX.bin/.idx, e.g. the training data) instead of the embedded "
                        "corpus: the part --split-part of --split, decoded with the model's "
                        "tokenizer (default: the embedded corpus's test split)")
    p.add_argument("--split", default="969,30,1",
                   help="train,valid,test shares that training used with --data-path "
                        "(default 969,30,1, lrattn-pretrain's)")
    p.add_argument("--split-part", choices=("train", "valid", "test"), default="valid",
                   help="which part of --split the documents come from (default valid)")
    p.add_argument("--heldout-bytes", type=positive_int, default=None, metavar="N",
                   help="score only the first N bytes of the held-out corpus (default: all, "
                        "about 0.5 MB)")
    p.add_argument("--limit", type=positive_int, default=500,
                   help="items per accuracy task (default 500)")
    p.add_argument("--seed", type=int, default=0, help="item selection seed (default 0)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per forward pass (default 8)")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="context window in tokens (default: the model's "
                        "max_position_embeddings, at most 4096)")
    p.add_argument("--device", default=None,
                   help="torch device (default cuda when available, else cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the folder's own code (not needed for lrattn or Llama exports)")
    p.add_argument("--output", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def check_device(device: str) -> None:
    """``--device``: cpu, or cuda / cuda:N of a GPU that is there (one-line ValueError)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]

    def _main() -> int:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise ValueError(f"--tasks: unknown {', '.join(unknown) or '(none given)'}; "
                             f"known: {', '.join(TASKS)}")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"{args.model}: no config.json (an HF model folder is expected)")
        if args.text is not None and not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text}: not a file")
        if args.data_path is not None:
            from megatron_lrattn.training.validation import check_split

            check_split(args.split)  # one-line error on a malformed split
            for ext in (".bin", ".idx"):
                if not os.path.isfile(args.data_path + ext):
                    raise ValueError(f"--data-path {args.data_path}: no {args.data_path}{ext}")
        import torch

        from megatron_lrattn.eval.harness import format_table, run_eval

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_device(device)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}.get(args.dtype)
        if args.dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        results = run_eval(args.model, tasks, text_file=args.text, data_path=args.data_path,
                           split=args.split, split_part=args.split_part, limit=args.limit,
                           heldout_bytes=args.heldout_bytes, seed=args.seed,
                           batch_size=args.batch_size, max_length=args.max_length,
                           device=device, dtype=dtype,
                           trust_remote_code=args.trust_remote_code,
                           progress=not args.no_progress)
        print(format_table(results))
        if args.output:
            from megatron_lrattn.training.durable import replace_file

            out = os.path.abspath(args.output)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            replace_file(out, json.dumps(results, indent=1))
            print(f"wrote {out}")
        return 0

    return run_cli("lrattn-eval", _main, (ValueError, OSError, UnicodeDecodeError))


if __name__ == "__main__":
    sys.exit(main())
