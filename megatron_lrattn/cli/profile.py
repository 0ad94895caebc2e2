"""``lrattn-profile``: time standard residuals, Block AttnRes and LR-AttnRes side by side.

One process (or one torchrun job) builds every arm for the same preset and parallel layout,
runs them alternating after a warm-up, and reports per arm the median step time,
tokens/s/GPU, MFU, peak memory and the share of a step spent in depth reads, with ratios to
``standard``. Formulas: ``megatron_lrattn.profiling.arms`` (MFU) and
``megatron_lrattn.profiling.runner`` (memory, depth-read share).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import List, Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging
from megatron_lrattn.training.arg_types import positive_int

PROG = "lrattn-profile"

# Flags of lrattn-pretrain that the profiler sets itself or does not use.
_REFUSED = {
    "--residual": "the arms set the residual mode; choose arms with --arms",
    "--key": "the arms set the key type; choose arms with --arms",
    "--rank": "sliced arms use r = d (attnres) and r = d/4; set the projected arm's rank "
              "with --projected-rank",
    "--data-path": "the profiler trains on synthetic tokens (set --vocab-size)",
    "--tokenizer-model": "the profiler trains on synthetic tokens (set --vocab-size)",
    "--load": "the profiler does not load checkpoints",
    "--save": "the profiler does not save checkpoints",
    "--log-json": "use --json for the profiler's output",
}


def _arm_list(text: str) -> List[str]:
    from megatron_lrattn.profiling.arms import ARM_NAMES

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ARM_NAMES]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names from {', '.join(ARM_NAMES)}, comma-separated")
    return names


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def build_parser() -> argparse.ArgumentParser:
    """``lrattn-pretrain``'s model and parallelism flags plus the profiler's own."""
    from megatron_lrattn.profiling.arms import ARM_NAMES
    from megatron_lrattn.training.arguments import build_parser as pretrain_parser

    p = pretrain_parser()
    p.prog = PROG
    p.description = ("Time the residual modes side by side (alternating arms) on synthetic "
                     "tokens: step time, tokens/s/GPU, MFU, peak memory, depth-read share.")
    g = p.add_argument_group("profiling")
    g.add_argument("--arms", type=_arm_list, default=list(ARM_NAMES),
                   help=f"comma-separated arms (default: {','.join(ARM_NAMES)})")
    g.add_argument("--projected-rank", type=positive_int, default=32,
                   help="key rank r of the lr_attnres_projected arm (default 32)")
    g.add_argument("--rounds", type=positive_int, default=5,
                   help="rounds of alternating arms (default 5)")
    g.add_argument("--steps-per-round", type=positive_int, default=3,
                   help="timed steps per arm per round (default 3)")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=2,
                   help="untimed steps per arm after its first (build) step (default 2)")
    g.add_argument("--sequential", action="store_true",
                   help="build, run and free one arm at a time (models too big for all "
                        "arms at once; no alternation)")
    g.add_argument("--no-kernel-profile", action="store_true",
                   help="skip the torch.profiler step (no depth-read share)")
    g.add_argument("--json", default=None, help="write every number and provenance here")
    g.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    # lrattn-pretrain's --vocab-size (of --mock-data) sizes the synthetic vocabulary here,
    # before padding; the default is the embedded corpus tokenizer's.
    p.set_defaults(vocab_size=4096)
    for action in p._actions:
        if action.dest == "vocab_size":
            action.help = ("synthetic vocabulary before padding (default 4096, the embedded "
                           "corpus tokenizer's)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate; the global batch defaults to 2 micro-batches per data-parallel
    rank (4 x PP with pipeline parallelism) instead of the preset's.

    Raises:
        ArgumentError: on a refused flag or a bad combination.
    """
    from megatron_lrattn.profiling.arms import arm_args, make_arms
    from megatron_lrattn.training.arguments import ArgumentError, validate_args
    from megatron_lrattn.training.presets import PRESETS

    argv = list(sys.argv[1:] if argv is None else argv)
    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in _REFUSED:
            raise ArgumentError(f"{flag} is not a profiler flag: {_REFUSED[flag]}")
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    parser.set_defaults(**PRESETS[pre.preset])
    parser.set_defaults(global_batch_size=None)
    args = parser.parse_args(argv)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world} is not divisible by tensor x pipeline x context parallel size "
            f"{tp} x {pp} x {cp}")
    dp = world // (tp * pp * cp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp * (2 if pp == 1 else 4 * pp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    args.rank = None
    validate_args(args)
    arms = make_arms(args.arms, args.hidden_size, args.projected_rank, args.num_blocks)
    if args.projected_rank > args.hidden_size and "lr_attnres_projected" in args.arms:
        raise ArgumentError(f"--projected-rank {args.projected_rank} is not allowed: "
                            f"1 <= r <= --hidden-size ({args.hidden_size})")
    for arm in arms:
        validate_args(arm_args(args, arm))
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is not None and os.path.isdir(path):
            raise ArgumentError(f"--{flag}: {path} is a directory")
    args.arm_specs = arms
    args.world_size, args.dp = world, dp
    return args


def _provenance(argv: Sequence[str]) -> dict:
    import torch

    from megatron_lrattn.training.runtime import provenance

    info = dict(provenance())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["cuda"] = torch.version.cuda
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["command"] = " ".join([PROG, *argv])
    return info


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    """Build and time every arm; print the table and write the outputs on rank 0.

    Returns:
        The report (``provenance``, ``settings``, ``arms``).
    """
    import torch

    from megatron_lrattn.profiling.report import (
        add_ratios, arm_result, format_table, write_json, write_plot,
    )
    from megatron_lrattn.profiling.runner import depth_read_kernel_names, run_arms
    from megatron_lrattn.training.builder import padded_vocab_size, virtual_stages
    from megatron_lrattn.training.determinism import enable_deterministic
    from megatron_lrattn.training.fusions import cuda_graph_impl
    from megatron_lrattn.training.runtime import init_runtime, shutdown_runtime
    from megatron_lrattn.training.step import check_sequence_parallel, num_microbatches, use_bf16

    # The same set-up as lrattn-pretrain's, so that the arms time the step training runs.
    check_sequence_parallel(args)
    if args.deterministic:
        enable_deterministic()
    rt = init_runtime(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.seed, vp=virtual_stages(args), cp=args.context_parallel_size)
    try:
        cuda = torch.cuda.is_available()
        vocab = padded_vocab_size(args.vocab_size, rt.tp)
        num_micro = num_microbatches(args, rt.dp)
        tokens_per_step = args.global_batch_size * args.seq_length
        runs = run_arms(args.arm_specs, args, rt, vocab, num_micro, args.rounds,
                        args.steps_per_round, args.warmup_steps, sequential=args.sequential,
                        profile=not args.no_kernel_profile)
        results = [arm_result(r, args, vocab, tokens_per_step, rt.world_size,
                              args.peak_tflops, cuda) for r in runs]
        add_ratios(results)
        report = {
            "provenance": _provenance(argv),
            "settings": {
                "preset": args.preset, "world_size": rt.world_size, "tp": rt.tp, "pp": rt.pp,
                "virtual_stages": virtual_stages(args),
                "dp": rt.dp, "num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "ffn_hidden_size": args.ffn_hidden_size,
                "num_attention_heads": args.num_attention_heads,
                "num_query_groups": args.num_query_groups, "seq_length": args.seq_length,
                "micro_batch_size": args.micro_batch_size,
                "global_batch_size": args.global_batch_size, "num_microbatches": num_micro,
                "tokens_per_step": tokens_per_step, "vocab_size": vocab,
                "bf16": use_bf16(args),
                "depth_backend": args.depth_backend,
                "cuda_graph": cuda_graph_impl(args, cuda), "rounds": args.rounds,
                "steps_per_round": args.steps_per_round, "warmup_steps": args.warmup_steps,
                "sequential": args.sequential, "peak_tflops": args.peak_tflops,
                "depth_read_kernels": depth_read_kernel_names() if cuda else [],
                "data": "synthetic uniform random tokens",
            },
            "arms": results,
        }
        if rt.is_main:
            print(format_table(results))
            if args.json:
                write_json(args.json, report)
                print(f"json: {args.json}")
            if args.plot and write_plot(args.plot, report):
                print(f"plot: {args.plot}")
        return report
    finally:
        shutdown_runtime()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    from megatron_lrattn.model.errors import ConfigError
    from megatron_lrattn.training.arguments import ArgumentError

    argv = list(sys.argv[1:] if argv is None else argv)

    def _main() -> int:
        args = parse_args(argv)
        setup_logging()
        run(args, argv)
        return 0

    return run_cli(PROG, _main, (ArgumentError, ConfigError))


if __name__ == "__main__":
    sys.exit(main())
