"""Shared command-line plumbing: readable logs and one-line errors."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Callable, Tuple, Type

# megatron-core warns on import that TE/apex are absent; the fallbacks are what we use.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


def setup_logging(verbose: bool = False) -> None:
    """Readable logging on rank 0; warnings only on other ranks."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if (rank == 0 or verbose) else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def run_cli(prog: str, main: Callable[[], int], user_errors: Tuple[Type[BaseException], ...]) -> int:
    """Run ``main``; a user error ends with ``prog: error: message`` and exit code 2."""
    try:
        return main()
    except user_errors as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
