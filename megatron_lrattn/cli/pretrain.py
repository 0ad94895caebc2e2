"""``lrattn-pretrain``: pretrain an (LR-)AttnRes decoder with megatron-core."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.training.arguments import ArgumentError, parse_args
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    def _main() -> int:
        args = parse_args(argv)
        setup_logging()
        from megatron_lrattn.training.loop import pretrain
        from megatron_lrattn.training.numerics import NonFiniteError
        from megatron_lrattn.training.runtime import shutdown_runtime

        try:
            result = pretrain(args)
        except NonFiniteError as e:
            print(f"lrattn-pretrain: error: {e}", file=sys.stderr)
            return 3
        finally:
            shutdown_runtime()
        if os.environ.get("RANK", "0") != "0":
            return 0
        if result.final_valid_loss is not None:
            print(f"first validation loss: {result.first_valid_loss:.4f}")
            print(f"final validation loss: {result.final_valid_loss:.4f}")
        if result.checkpoint:
            print(f"checkpoint: {result.checkpoint}")
        return 0

    return run_cli("lrattn-pretrain", _main,
                   (ArgumentError, ConfigError, DataError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
