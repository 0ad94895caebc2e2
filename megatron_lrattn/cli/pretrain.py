"""``lrattn-pretrain``: pretrain an (LR-)AttnRes decoder with megatron-core.

The arguments are parsed before megatron-core (or torch) is imported, so ``--help`` and
argument errors answer at once.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging


def final_lines(result) -> list:
    """What the run reports at its end: the validation losses, each with its iteration, and
    the checkpoint. After an early stop (SIGTERM, Ctrl-C, ``--exit-interval``) without a validation
    at the last iteration, says so instead of repeating an earlier number as final."""
    lines = []
    if result.first_valid_loss is not None:
        lines.append(f"validation loss at start (iteration {result.first_valid_iteration}): "
                     f"{result.first_valid_loss:.4f}")
    if result.final_valid_loss is not None and result.final_valid_iteration == result.iterations:
        lines.append(f"final validation loss (iteration {result.iterations}): "
                     f"{result.final_valid_loss:.4f}")
    else:
        last = ("" if result.final_valid_loss is None else
                f"; the last one, at iteration {result.final_valid_iteration}, was "
                f"{result.final_valid_loss:.4f}")
        lines.append(f"final validation loss: none (stopped at iteration {result.iterations}"
                     f"{' (' + result.stop_reason + ')' if result.stop_reason else ''} "
                     f"before a validation there{last})")
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    args = None

    def _parse() -> int:
        nonlocal args
        args = parse_args(argv)
        return 0

    rc = run_cli("lrattn-pretrain", _parse, (ArgumentError,))
    if args is None:
        return rc

    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    def _main() -> int:
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
        # a first Ctrl-C: saved, then stopped (every rank: the launcher sees an interrupt)
        rc = 130 if result.stop_reason == "interrupt" else 0
        if os.environ.get("RANK", "0") != "0":
            return rc
        for line in final_lines(result):
            print(line)
        if rc:
            print("lrattn-pretrain: interrupted", file=sys.stderr)
        return rc

    return run_cli("lrattn-pretrain", _main,
                   (ArgumentError, ConfigError, DataError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
