"""The error and the argparse value types shared by every ``lrattn-*`` command line."""

from __future__ import annotations

import argparse
import os


class ArgumentError(ValueError):
    """A bad command-line value; the message names the flag and what is allowed."""


TE_DETERMINISM_SWITCH = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"


def check_te_determinism_switch() -> None:
    """``--deterministic``'s check of Transformer Engine's switch: unset or 0.

    Raises:
        ArgumentError: the variable allows TE's non-deterministic attention.
    """
    value = os.environ.get(TE_DETERMINISM_SWITCH)
    if value not in (None, "0"):
        raise ArgumentError(f"--deterministic: {TE_DETERMINISM_SWITCH}={value} allows "
                            "Transformer Engine's non-deterministic attention; unset it or "
                            "set 0")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 0")
    return value


_SIZE_UNITS = {"": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
               "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def file_size(text: str) -> int:
    """argparse type: a size in bytes > 0, as an integer or an integer with a unit (KB, MB,
    GB, TB, KiB, MiB, GiB, TiB; case-insensitive), e.g. ``5GB``."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if unit not in _SIZE_UNITS or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size > 0 (bytes, or a number with KB, MB, GB, TB, KiB, MiB, "
            f"GiB or TiB, e.g. 5GB)")
    return int(m.group(1)) * _SIZE_UNITS[unit]
