"""``lrattn-flops``: parameter, FLOP and depth-read byte accounting for a model config.

Takes the model flags of ``lrattn-pretrain`` (defaults from ``--preset``, explicit flags
win) and prints a table, or with ``--json`` exactly one JSON object (the keys of
``megatron_lrattn.analysis.flops.flops_report``). The formulas are documented in
``megatron_lrattn/analysis/flops.py``. Imports neither torch nor megatron-core.

Example, the paper's 0.5B model with sliced keys, r = 64, N = 8 (0.0932% added FLOPs)::

    lrattn-flops --preset 0.5b --rank 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, NoReturn, Optional, Sequence

from megatron_lrattn.analysis.flops import (
    DEFAULT_VOCAB_SIZE,
    KEY_TYPES,
    RESIDUAL_MODES,
    FlopsConfigError,
    ModelShape,
    flops_report,
)
from megatron_lrattn.cli.common import run_cli
from megatron_lrattn.training.presets import PRESETS

PROG = "lrattn-flops"


class FlopsArgumentError(ValueError):
    """A bad command-line value; reported as one ``lrattn-flops: error: ...`` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise FlopsArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (model defaults are filled from ``--preset``)."""
    p = _Parser(prog=PROG, description="Parameter, FLOP and depth-read byte accounting "
                                       "(the LR-AttnRes paper's Appendix A).")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="named model defaults, as for lrattn-pretrain (default: tiny)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"V (default {DEFAULT_VOCAB_SIZE}: GPT-2's vocabulary padded to a "
                        "multiple of 128; does not change the added-FLOP percentage)")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction)
    g.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--untie-embeddings-and-output-weights",
                   action=argparse.BooleanOptionalAction)
    g.add_argument("--disable-bias-linear", action=argparse.BooleanOptionalAction)
    g = p.add_argument_group("depth attention")
    g.add_argument("--residual", choices=RESIDUAL_MODES)
    g.add_argument("--key", choices=KEY_TYPES)
    g.add_argument("--rank", type=int, default=None,
                   help="key rank r (default d/4 for lr_attnres, d for attnres)")
    g.add_argument("--num-blocks", type=int, help="depth blocks N (2L = full granularity)")
    g = p.add_argument_group("output")
    g.add_argument("--bytes-per-elem", type=int, default=2,
                   help="activation element size for depth-read bytes (default 2: bf16)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def parse_shape(argv: Optional[Sequence[str]] = None) -> tuple:
    """Parse ``argv`` into ``(ModelShape, bytes_per_elem, as_json)``.

    Raises:
        FlopsArgumentError: bad flag or value.
        FlopsConfigError: a value or combination the accounting refuses.
    """
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    parser.set_defaults(**PRESETS[pre.preset])
    args = parser.parse_args(argv)
    if args.bytes_per_elem < 1:
        raise FlopsArgumentError(f"--bytes-per-elem {args.bytes_per_elem} must be >= 1")
    shape = ModelShape.from_args(args, args.vocab_size)
    return shape, args.bytes_per_elem, args.json


def format_table(report: Dict[str, object]) -> str:
    """A readable multi-line table of a ``flops_report``."""
    r = report
    mode = r["residual"]
    if mode != "standard":
        mode += f" ({r['key']} keys, r={r['rank']}, N={r['num_blocks']})"
    model = (f"L={r['num_layers']} d={r['hidden_size']} h={r['ffn_hidden_size']} "
             f"heads={r['num_attention_heads']} groups={r['num_query_groups']} "
             f"seq={r['seq_length']} V={r['vocab_size']} "
             f"{'swiglu' if r['swiglu'] else 'gelu'} {'untied' if r['untied'] else 'tied'}")
    rows = [
        ("model", model),
        ("residual", mode),
        ("params total", f"{r['params_total']:,}"),
        ("params non-embedding", f"{r['params_non_embedding']:,}"),
        ("params added by residual", f"{r['params_added']:,}"),
        ("fwd FLOPs/token, layers L(8d^2+6dh)", f"{r['flops_denominator']:,}"),
        ("fwd FLOPs/token added, depth reads", f"{r['added_flops_depth_reads']:,}"),
        ("fwd FLOPs/token added, key projections", f"{r['added_flops_key_projections']:,}"),
        ("added FLOPs", f"{r['added_flops_percent']:.4f}%"),
        ("sources read, all sites", f"{r['sources_per_site_total']:,}"),
        (f"depth-read bytes/token fwd ({r['bytes_per_elem']} B/elem)",
         f"{r['depth_read_bytes_per_token_fwd']:,}"),
        ("depth-read bytes/token fwd+bwd", f"{r['depth_read_bytes_per_token_fwd_bwd']:,}"),
        ("model FLOPs/token fwd+bwd (MFU)", f"{r['model_flops_per_token']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code (2 on a bad input)."""

    def _main() -> int:
        shape, bytes_per_elem, as_json = parse_shape(argv)
        report = flops_report(shape, bytes_per_elem)
        print(json.dumps(report) if as_json else format_table(report))
        return 0

    return run_cli(PROG, _main, (FlopsArgumentError, FlopsConfigError))


if __name__ == "__main__":
    sys.exit(main())
