"""Command-line arguments of ``lrattn-pretrain``: Megatron-LM's flag names plus ours."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Optional, Sequence, Set

from megatron_lrattn.training.arg_types import (
    ArgumentError,
    check_te_determinism_switch,
    nonnegative_int,
    positive_float,
    positive_int,
)
from megatron_lrattn.training.config_file import load_config_file
from megatron_lrattn.training.fusions import add_fusion_args
from megatron_lrattn.training.presets import PRESETS
from megatron_lrattn.training.schedule import resolve_schedule
from megatron_lrattn.training.validation import validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]

TRANSFORMER_IMPLS = ("local", "transformer_engine")
# The choices of ``megatron_lrattn.model.config`` (a test keeps them equal), repeated here so
# that building the parser, and ``--help``, import neither megatron-core nor torch.
RESIDUAL_MODES = ("standard", "attnres", "lr_attnres")
KEY_TYPES = ("sliced", "projected")
DEPTH_BACKENDS = ("auto", "torch", "triton")
DEPTH_SCHEDULES = ("auto", "per_site", "two_phase")


def build_parser(preset: Optional[str] = None) -> argparse.ArgumentParser:
    """The argument parser. Flags whose default comes from ``--preset`` show the presets'
    values in their help (only ``preset``'s when given); the others show their default.

    Args:
        preset: the preset whose values the help shows (None: all presets).
    """
    p = argparse.ArgumentParser(
        prog="lrattn-pretrain",
        description="Pretrain a decoder LLM with (LR-)AttnRes residuals on megatron-core. "
                    "Flag names and meanings follow Megatron-LM where it has the flag.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="named model/training defaults (megatron_lrattn/training/presets.py; "
                        "default: tiny)")
    p.add_argument("--config", default=None,
                   help="YAML or JSON file of flag values (keys are flag names without '--'; "
                        "e.g. examples/presets/1b.yaml); explicit flags win over it "
                        "(default: none)")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=positive_int, help="transformer layers L")
    g.add_argument("--hidden-size", type=positive_int, help="hidden width d")
    g.add_argument("--ffn-hidden-size", type=positive_int, help="MLP width h")
    g.add_argument("--num-attention-heads", type=positive_int, help="attention heads")
    g.add_argument("--num-query-groups", type=positive_int, default=None,
                   help="key/value heads (grouped-query attention; default: "
                        "--num-attention-heads, 8 in the 4b preset)")
    g.add_argument("--seq-length", type=positive_int, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=positive_int, default=None,
                   help="longest sequence the position embedding covers (default: "
                        "--seq-length)")
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], help="norm layers")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction,
                   help="SwiGLU MLP (--no-swiglu: GeLU)")
    g.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=False,
                   help="normalise queries and keys per head")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                   help="position embedding")
    g.add_argument("--rotary-base", type=int, help="RoPE base theta")
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction,
                   help="separate input embedding and LM head")
    g.add_argument("--disable-bias-linear", action=argparse.BooleanOptionalAction,
                   help="no biases in the linear layers")
    g.add_argument("--hidden-dropout", type=float, help="dropout after each sub-layer")
    g.add_argument("--attention-dropout", type=float, help="dropout of attention probabilities")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight init (default: 0.02)")

    g = p.add_argument_group("depth attention")
    g.add_argument("--residual", choices=RESIDUAL_MODES,
                   help="residual stream: plain sum, AttnRes (full-width keys) or LR-AttnRes "
                        "(rank-r keys)")
    g.add_argument("--key", choices=KEY_TYPES,
                   help="LR-AttnRes keys: the last r coordinates (sliced) or extra projection "
                        "rows (projected)")
    g.add_argument("--rank", type=int, default=None, help="key rank r (default: d/4)")
    g.add_argument("--num-blocks", type=int, help="depth blocks N (2L = full granularity)")
    g.add_argument("--depth-scale", type=float, default=1.0,
                   help="logit scale tau of the depth softmax (default: 1.0)")
    g.add_argument("--key-norm-eps", type=float, default=1e-6,
                   help="epsilon of the key RMSNorm (default: 1e-06)")
    g.add_argument("--depth-backend", choices=DEPTH_BACKENDS, default="auto",
                   help="depth-read implementation: torch reference, fused triton, or auto "
                        "(triton on CUDA) (default: auto)")
    g.add_argument("--depth-schedule", choices=DEPTH_SCHEDULES, default="auto",
                   help="per_site reads, two_phase block reads (phase 1 once per block + "
                        "online-softmax merge per site), or auto (two_phase on CUDA with the "
                        "fused kernels when a depth block has more than one read site, "
                        "else per_site; default: auto)")
    g.add_argument("--fuse-depth-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse the next sub-layer's RMSNorm into the two-phase merges (local "
                        "spec RMSNorm only)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=positive_int, help="samples per micro-batch")
    g.add_argument("--global-batch-size", type=positive_int,
                   help="samples per step (micro-batch x data-parallel x accumulation)")
    g.add_argument("--train-iters", type=positive_int, help="training iterations")
    g.add_argument("--train-samples", type=positive_int, default=None,
                   help="train this many samples instead (iterations = samples // global "
                        "batch; not with --train-iters; default: none)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=nonnegative_int,
                   help="linear warm-up iterations")
    g.add_argument("--lr-warmup-samples", type=nonnegative_int, default=None,
                   help="warm-up in samples (with --train-samples; default: none)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay length (instead of "
                        "--lr-warmup-iters; default: none)")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant", "WSD"],
                   help="decay after the warm-up")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None,
                   help="iterations over which the LR decays to --min-lr (default: "
                        "--train-iters)")
    g.add_argument("--lr-decay-samples", type=positive_int, default=None,
                   help="the decay length in samples (with --train-samples; default: "
                        "--train-samples)")
    g.add_argument("--lr-wsd-decay-iters", type=positive_int, default=None,
                   help="WSD decay length (default: the last 20%% of the decay length)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume use this run's LR schedule flags (--lr, --min-lr, warm-up, "
                        "decay length and style, weight decay) from the saved step on, "
                        "instead of the checkpoint's (default: off; a schedule that differs "
                        "from the checkpoint's is refused)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume keep the checkpoint's LR schedule and ignore these flags "
                        "(default: off)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (not on 1-D tensors)")
    g.add_argument("--adam-beta1", type=float, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, help="Adam beta2")
    g.add_argument("--clip-grad", type=float, help="gradient-norm clipping threshold")
    g.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a non-finite loss or gradient: stop with an error naming the iteration "
                        "and tensor, or skip the optimizer step (default: stop)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms only (torch, cuBLAS workspace, no TF32, "
                        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 for TE): the same seed and layout "
                        "give bit-identical losses (default: off)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of the initial weights and the data order (default: 1234)")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters with fp32 main weights (default: on with CUDA)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (default: off)")
    g.add_argument("--tensor-model-parallel-size", type=positive_int,
                   help="tensor-parallel size TP")
    g.add_argument("--pipeline-model-parallel-size", type=positive_int,
                   help="pipeline stages PP")
    g.add_argument("--context-parallel-size", type=positive_int,
                   help="context-parallel size CP: each sequence is split over CP ranks in "
                        "2 CP load-balanced chunks; attention all-gathers K/V over them (the "
                        "SDPA core of the local spec)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms and dropout over the TP ranks along the sequence "
                        "(default: off)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
                   help="interleaved pipeline: layers per model chunk (V = L / (P x this); "
                        "default: not interleaved)")

    g = p.add_argument_group("activation recomputation (Megatron-LM's flags)")
    g.add_argument("--recompute-granularity", choices=["selective", "full"], default=None,
                   help="full: rerun whole layers in the backward from their inputs (depth "
                        "attention: the depth state that entered them); selective: rerun the "
                        "core attention where it stores its probabilities (megatron's "
                        "DotProductAttention; a no-op with the SDPA core, see "
                        "docs/performance.md) (default: none)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with full: uniform checkpoints every --recompute-num-layers "
                        "consecutive layers of a pipeline stage as one unit; block checkpoints "
                        "each of a stage's first --recompute-num-layers layers (default: none)")
    g.add_argument("--recompute-num-layers", type=positive_int, default=None,
                   help="layers per recomputed unit (uniform) or recomputed layers per "
                        "pipeline stage (block) (default: none)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective (default: off)")
    g.add_argument("--recompute-mlp-activation", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="the SwiGLU MLP keeps only its first linear's output for the backward "
                        "and recomputes the SwiGLU output where the output projection's "
                        "weight gradient needs it (bit-identical gradients; peak 2.66 GiB "
                        "lower at 1b, 8 x 2048 tokens, H200, docs/performance.md; local spec; "
                        "default: on)")

    add_fusion_args(p)

    g = p.add_argument_group("communication overlap (Megatron-LM's flags)")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="reduce gradient buckets during the backward pass (default: on when "
                        "the data-parallel size is above 1)")
    g.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="all-gather updated parameter buckets during the next forward pass; "
                        "needs --use-distributed-optimizer and --overlap-grad-reduce (default: "
                        "on with both when the data-parallel size is above 1)")
    g.add_argument("--ddp-bucket-size", type=positive_int, default=None,
                   help="parameters per gradient bucket with --overlap-grad-reduce (default: "
                        "megatron's max(40M, 1M x data-parallel size))")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average gradients inside the collective (ReduceOp.AVG) instead of "
                        "scaling them before it (default: off)")

    g = p.add_argument_group("Transformer Engine (experimental)")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="layer modules: megatron-core's local ones or Transformer Engine's "
                        "(norm fused into QKV/FC1, fused attention, FP8); TE must be "
                        "installed (default: local)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 GEMMs in the TE layers: e4m3, or hybrid (e4m3 forward, e5m2 "
                        "gradients); the depth read stays bf16/fp32 (default: no FP8)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise"], default="delayed",
                   help="FP8 scaling: delayed (scales from an amax history) or tensorwise "
                        "(per-tensor current scaling) (default: delayed)")
    g.add_argument("--fp8-amax-history-len", type=positive_int, default=1,
                   help="amax history of the delayed recipe (default: 1, megatron's)")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"],
                   default="most_recent",
                   help="scale from the newest or the largest amax (default: most_recent)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed-dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ... "
                        "(lrattn-preprocess writes PREFIX_text_document; default: the "
                        "embedded standard-library corpus)")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic tokens instead of files (megatron-core's MockGPTDataset; "
                        "default: off)")
    g.add_argument("--vocab-size", type=positive_int, default=8192,
                   help="vocabulary of --mock-data without --tokenizer-model, the last id "
                        "ending each document (default: 8192)")
    g.add_argument("--tokenizer-model", default=None,
                   help="Hugging Face tokenizer folder (required with --data-path; default: "
                        "the embedded corpus's)")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test shares of the documents (default: 969,30,1; the "
                        "embedded corpus uses its own)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end-of-document token (used by "
                        "learned absolute position embeddings; RoPE ignores position ids; "
                        "default: off)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="tokens attend only within their own document (an explicit mask: "
                        "local core attention only, not SDPA or TE; default: off)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on end-of-document tokens (default: off)")
    g.add_argument("--num-workers", type=nonnegative_int, default=None,
                   help="background data-loader processes (pinned memory and prefetch with "
                        "CUDA; default: 2 with CUDA, 0 on CPU)")
    g.add_argument("--cache-dir", default=None,
                   help="cache for the embedded corpus and dataset indices (default: "
                        "~/.cache/megatron_lrattn, or $LRATTN_CACHE)")

    g = p.add_argument_group("starting from weights (Megatron-LM's flags)")
    g.add_argument("--load", default=None,
                   help="checkpoint directory to resume from (default: none)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights of --load: iteration 0, fresh optimizer "
                        "and LR schedule (needed for weights-only checkpoints such as "
                        "lrattn-convert-megatron's; default: off)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="start from these weights as with --finetune while --load holds no "
                        "checkpoint, then resume from --load (default: none)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="resume weights, iteration and consumed samples from --load but not "
                        "the optimizer (the LR schedule, saved with it, restarts at step 0; "
                        "default: off)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="accepted for Megatron compatibility: our checkpoints hold no RNG "
                        "state, every run seeds from --seed (default: off)")

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=positive_int, help="iterations between log lines")
    g.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="dense bf16 peak per GPU for the logged MFU (default: 989, H100/H200 "
                        "SXM); MFU = lrattn-flops' model FLOPs per token x tokens / (step "
                        "time x GPUs x peak)")
    g.add_argument("--eval-interval", type=positive_int,
                   help="iterations between validation runs")
    g.add_argument("--eval-iters", type=positive_int, help="global batches per validation run")
    from megatron_lrattn.training.downstream import add_downstream_args

    add_downstream_args(g)
    g.add_argument("--log-json", default=None, help="JSON-lines metrics file (default: none)")
    g.add_argument("--save", default=None, help="checkpoint directory (default: none)")
    g.add_argument("--save-interval", type=positive_int, default=None,
                   help="iterations between checkpoints (default: only at the end)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let a run that does not resume from --save write over the "
                        "checkpoints already in it (refused by default)")
    g.add_argument("--exit-interval", type=positive_int, default=None,
                   help="stop after the first iteration that is a multiple of N (saving when "
                        "--save is given); the LR schedule still spans --train-iters "
                        "(default: none)")
    g.add_argument("--exit-duration-in-mins", type=positive_float, default=None,
                   help="stop after the first iteration that ends this many minutes after "
                        "lrattn-pretrain started (saving when --save is given; all ranks "
                        "agree), e.g. a scheduler's time limit less the time a save takes "
                        "(default: none)")
    g.add_argument("--no-progress", action="store_true",
                   help="disable the progress bar (default: shown on rank 0)")
    g.add_argument("--keep-last", type=positive_int, default=None,
                   help="keep only the newest N complete checkpoints (default: all)")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=None,
                   help="on SIGTERM save a checkpoint at the end of the current iteration and "
                        "exit 0; with --save a first Ctrl-C does the same and exits 130 (a "
                        "second Ctrl-C stops at once, without saving) (default: on when "
                        "--save is given)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoint shards in a background process while training "
                        "continues (megatron's async dist_checkpointing; default: off)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state so it loads at any TP/PP "
                        "layout (default: off, any DP size at the same TP/PP)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard event files (default: SAVE/tensorboard with --save)")
    g.add_argument("--wandb-project", default=None,
                   help="log to this Weights & Biases project (needs the wandb package; "
                        "default: none)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name (default: W&B's)")
    g.add_argument("--wandb-save-dir", default=None, help="W&B local files (default: SAVE/wandb)")
    _show_defaults(p, preset)
    return p


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).replace("%", "%%")


def _show_defaults(parser: argparse.ArgumentParser, preset: Optional[str]) -> None:
    """Append each flag's default to its help: the presets' values for flags a preset sets
    (``preset``'s alone when given), else the parser default where the help does not name
    it already."""
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or action.dest in ("help", "preset"):
            continue
        text = action.help.replace(" (default: %(default)s)", "")  # BooleanOptionalAction's
        in_presets = [name for name in PRESETS if action.dest in PRESETS[name]]
        if in_presets and "default:" not in text:
            def value(name: str) -> Any:
                return PRESETS[name].get(action.dest, action.default)

            if preset in PRESETS:
                text += f" (default: {_value_text(value(preset))}, from --preset {preset})"
            elif len({repr(value(n)) for n in PRESETS}) == 1:
                text += f" (default: {_value_text(value(in_presets[0]))} in every preset)"
            else:
                text += " (default from --preset: " + ", ".join(
                    f"{n} {_value_text(value(n))}" for n in PRESETS) + ")"
        elif "default" not in text and action.default is not argparse.SUPPRESS:
            text += f" (default: {_value_text(action.default if action.default is not None else 'none')})"
        action.help = text


def _explicit_dests(argv: Optional[Sequence[str]], config: Dict[str, Any]) -> Set[str]:
    """Destinations given on the command line or in the ``--config`` file."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given, _ = probe.parse_known_args(argv)
    return set(vars(given)) | set(config)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv``: preset defaults first, then ``--config`` values, explicit flags win.
    Then resolve the LR schedule flags (``schedule.resolve_schedule``) and validate."""
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--preset", default="tiny")
    pre_parser.add_argument("--config", default=None)
    pre, _ = pre_parser.parse_known_args(argv)
    parser = build_parser(pre.preset if pre.preset in PRESETS else None)
    if pre.config and not any(a in ("-h", "--help") for a in (
            sys.argv[1:] if argv is None else argv)):
        config = load_config_file(pre.config, parser)
    else:
        config = {}
    preset = pre.preset
    if "preset" in config:
        cli = sys.argv[1:] if argv is None else list(argv)
        explicit = any(a == "--preset" or a.startswith("--preset=") for a in cli)
        if explicit and pre.preset != config["preset"]:
            raise ArgumentError(f"--preset {pre.preset} disagrees with preset "
                                f"{config['preset']!r} in {pre.config}")
        preset = config["preset"]
        parser = build_parser(preset)
    if preset in PRESETS:
        parser.set_defaults(**{k: v for k, v in PRESETS[preset].items()})
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    resolve_schedule(args, _explicit_dests(argv, config))
    if args.data_path is not None:
        from megatron_lrattn.data.loader import resolve_data_path

        args.data_path = resolve_data_path(args.data_path)
    validate_args(args)
    _check_data_flags(args)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather requires --use-distributed-optimizer")
    if args.deterministic:
        check_te_determinism_switch()
    return args


def _check_data_flags(args: argparse.Namespace) -> None:
    """``--mock-data``, ``--reset-attention-mask`` and ``--num-workers`` (default resolved
    here: 2 with CUDA, as Megatron's, 0 on CPU)."""
    import torch

    if args.mock_data and args.data_path is not None:
        raise ArgumentError("--mock-data and --data-path: synthetic tokens or files, not both")
    if args.reset_attention_mask:
        if args.transformer_impl == "transformer_engine":
            core = "TE's TEDotProductAttention (--transformer-impl transformer_engine)"
        elif (getattr(args, "context_parallel_size", 1) or 1) > 1:
            core = ("the context-parallel SDPA core attention (--context-parallel-size "
                    f"{args.context_parallel_size})")
        elif torch.cuda.is_available():
            core = "the SDPA core attention (megatron_lrattn.model.attention, used on CUDA)"
        else:
            core = None
        if core is not None:
            raise ArgumentError(f"--reset-attention-mask needs an explicit attention mask, and "
                                f"{core} applies a causal mask only; train without it (the "
                                "documents of a sample then see each other, as by default)")
    if args.num_workers is None:
        args.num_workers = 2 if torch.cuda.is_available() else 0
