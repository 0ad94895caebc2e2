"""``lrattn-convert-megatron``: a Hugging Face folder -> a Megatron checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging
from megatron_lrattn.training.arg_types import positive_int


def build_parser() -> argparse.ArgumentParser:
    """Command-line arguments."""
    p = argparse.ArgumentParser(
        prog="lrattn-convert-megatron",
        description="Convert a Hugging Face folder written by lrattn-convert-hf, or a "
                    "LlamaForCausalLM folder (safetensors and tokenizer), to a Megatron "
                    "distributed checkpoint (model weights; no optimizer state). A Llama "
                    "becomes a --residual standard model.")
    p.add_argument("hf_folder", help="lrattn-convert-hf output or a LlamaForCausalLM folder")
    p.add_argument("output", help="checkpoint folder to write (gets iter_0000000/ and latest)")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="target TP: sets the vocabulary padding and the recorded layout")
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1,
                   help="target PP: recorded layout (the stored tensors are layout-free)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)  # --help before the heavy imports
    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.hf.convert import ConversionError
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    def _main() -> int:
        setup_logging()
        from megatron_lrattn.hf.export import hf_to_megatron_checkpoint

        out = hf_to_megatron_checkpoint(args.hf_folder, args.output,
                                        args.tensor_model_parallel_size,
                                        args.pipeline_model_parallel_size)
        print(f"wrote {out}")
        return 0

    return run_cli("lrattn-convert-megatron", _main,
                   (CheckpointError, ConversionError, ConfigError))


if __name__ == "__main__":
    sys.exit(main())
