"""``--config FILE``: flag values of ``lrattn-pretrain`` from a YAML or JSON file."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from megatron_lrattn.training.arg_types import (
    ArgumentError,
    nonnegative_int,
    positive_float,
    positive_int,
)


def _config_value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """``value`` checked against the flag's action (type, choices), converted like the CLI."""
    def bad(expected: str) -> ArgumentError:
        return ArgumentError(f"{path}: key {key!r}: expected {expected}, got {value!r}")

    if value is None:
        return None
    if action.nargs == 0:  # store_true / --flag/--no-flag
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.nargs in ("+", "*"):
        if not isinstance(value, list) or not value or any(
                isinstance(v, (bool, list, dict)) or v is None for v in value):
            raise bad("a non-empty list")
        return [str(v) for v in value]
    kind = action.type
    if kind in (int, positive_int, nonnegative_int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        try:
            value = kind(str(value))
        except argparse.ArgumentTypeError as e:
            raise bad(f"a {'positive' if kind is positive_int else 'non-negative'} integer "
                      f"({e})") from None
    elif kind in (float, positive_float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        try:
            value = kind(str(value))
        except argparse.ArgumentTypeError as e:
            raise bad(f"a number > 0 ({e})") from None
    elif not isinstance(value, str):
        raise bad("a string")
    if action.choices is not None and value not in action.choices:
        raise bad(f"one of {sorted(action.choices)}")
    return value


def load_config_file(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Flag values from a YAML (``.yaml``/``.yml``) or JSON file, keyed by argument name
    (``num_layers`` or ``num-layers``); a ``preset`` key names the base preset.

    Args:
        path: the file.
        parser: the ``lrattn-pretrain`` parser (``arguments.build_parser``): its flags are
            the keys allowed, their types and choices check the values.

    Raises:
        ArgumentError: an unreadable file, an unknown key or a value of the wrong type, in one
            line naming the file and the key.
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ArgumentError(f"--config: {path}: {e.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
        raise ArgumentError(f"--config: {path}: not valid {kind} ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config: {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise ArgumentError(f"{path}: unknown key {key!r} (not an lrattn-pretrain flag)")
        out[dest] = _config_value(path, str(key), actions[dest], value)
    return out
