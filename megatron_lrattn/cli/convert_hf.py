"""``lrattn-convert-hf``: a Megatron checkpoint (any TP/PP layout) -> a Hugging Face folder."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging
from megatron_lrattn.training.arg_types import file_size


def build_parser() -> argparse.ArgumentParser:
    """Command-line arguments."""
    p = argparse.ArgumentParser(
        prog="lrattn-convert-hf",
        description="Convert an lrattn-pretrain checkpoint to a Hugging Face folder: a plain "
                    "LlamaForCausalLM for a --residual standard model Llama can express, else "
                    "our LRAttnForCausalLM (AutoModelForCausalLM.from_pretrained(path, "
                    "trust_remote_code=True)).")
    p.add_argument("checkpoint", help="--save folder (its 'latest' is used) or an iter_N folder")
    p.add_argument("output", help="Hugging Face folder to write")
    p.add_argument("--max-shard-size", type=file_size, default="5GB",
                   help="largest safetensors file: bytes, or a number with KB, MB, GB, TB, KiB, "
                        "MiB, GiB or TiB (default 5GB)")
    p.add_argument("--format", dest="hf_format", choices=("auto", "llama", "lrattn"),
                   default="auto",
                   help="auto (default): LlamaForCausalLM when the model is a standard-residual "
                        "Llama (RMSNorm, SwiGLU, RoPE, no QK-norm), else lrattn; llama: refuse "
                        "otherwise, naming the feature; lrattn: always our type (remote code)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="tokenizer folder copied into the export (default: the run's "
                        "--tokenizer-model as recorded, or the embedded default data's)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)  # --help before the heavy imports
    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.hf.convert import ConversionError
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    def _main() -> int:
        setup_logging()
        from megatron_lrattn.hf.export import megatron_checkpoint_to_hf

        out = megatron_checkpoint_to_hf(args.checkpoint, args.output, args.max_shard_size,
                                        tokenizer=args.tokenizer, hf_format=args.hf_format)
        with open(os.path.join(out, "config.json")) as f:
            arch = (json.load(f).get("architectures") or ["?"])[0]
        print(f"wrote {out} ({arch})")
        return 0

    return run_cli("lrattn-convert-hf", _main,
                   (CheckpointError, ConversionError, ConfigError, DataError))


if __name__ == "__main__":
    sys.exit(main())
