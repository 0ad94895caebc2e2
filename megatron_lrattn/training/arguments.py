"""Command-line arguments of ``lrattn-pretrain``: Megatron-LM's flag names plus ours."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_lrattn.model.config import DEPTH_BACKENDS, DEPTH_SCHEDULES, KEY_TYPES, RESIDUAL_MODES
from megatron_lrattn.training.arg_types import ArgumentError, positive_float, positive_int
from megatron_lrattn.training.config_file import load_config_file
from megatron_lrattn.training.fusions import add_fusion_args
from megatron_lrattn.training.presets import PRESETS
from megatron_lrattn.training.validation import validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults are filled from ``--preset``)."""
    p = argparse.ArgumentParser(
        prog="lrattn-pretrain",
        description="Pretrain a decoder LLM with (LR-)AttnRes residuals on megatron-core.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="named model/training defaults (default: tiny)")
    p.add_argument("--config", default=None,
                   help="YAML or JSON file of flag values (keys are flag names without '--'; "
                        "e.g. examples/presets/1b.yaml); explicit flags win over it")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=positive_int)
    g.add_argument("--hidden-size", type=positive_int)
    g.add_argument("--ffn-hidden-size", type=positive_int)
    g.add_argument("--num-attention-heads", type=positive_int)
    g.add_argument("--num-query-groups", type=positive_int, default=None)
    g.add_argument("--seq-length", type=positive_int)
    g.add_argument("--max-position-embeddings", type=positive_int, default=None)
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"])
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction)
    g.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"])
    g.add_argument("--rotary-base", type=int)
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction)
    g.add_argument("--disable-bias-linear", action=argparse.BooleanOptionalAction)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("depth attention")
    g.add_argument("--residual", choices=RESIDUAL_MODES)
    g.add_argument("--key", choices=KEY_TYPES)
    g.add_argument("--rank", type=int, default=None, help="key rank r (default d/4)")
    g.add_argument("--num-blocks", type=int, help="depth blocks N (2L = full granularity)")
    g.add_argument("--depth-scale", type=float, default=1.0)
    g.add_argument("--key-norm-eps", type=float, default=1e-6)
    g.add_argument("--depth-backend", choices=DEPTH_BACKENDS, default="auto")
    g.add_argument("--depth-schedule", choices=DEPTH_SCHEDULES, default="auto",
                   help="per_site reads, two_phase block reads (phase 1 once per block + "
                        "online-softmax merge per site), or auto (two_phase on CUDA with the "
                        "fused kernels when a depth block has more than one read site, "
                        "else per_site)")
    g.add_argument("--fuse-depth-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse the next sub-layer's RMSNorm into the two-phase merges (local "
                        "spec RMSNorm only; default on)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=positive_int)
    g.add_argument("--global-batch-size", type=positive_int)
    g.add_argument("--train-iters", type=positive_int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant", "WSD"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD decay length (default: the last 20%% of --train-iters)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--clip-grad", type=float)
    g.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a non-finite loss or gradient: stop with an error naming the iteration "
                        "and tensor (default), or skip the optimizer step")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms only (torch, cuBLAS workspace, no TF32): the "
                        "same seed and layout give bit-identical losses")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters with fp32 main weights (default: on with CUDA)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--tensor-model-parallel-size", type=positive_int)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
                   help="interleaved pipeline: layers per model chunk (V = L / (P x this))")

    add_fusion_args(p)

    g = p.add_argument_group("Transformer Engine (experimental)")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="layer modules: megatron-core's local ones (default) or Transformer "
                        "Engine's (norm fused into QKV/FC1, fused attention, FP8); TE must be "
                        "installed")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 GEMMs in the TE layers: e4m3, or hybrid (e4m3 forward, e5m2 "
                        "gradients); the depth read stays bf16/fp32 (default: no FP8)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise"], default="delayed",
                   help="FP8 scaling: delayed (scales from an amax history) or tensorwise "
                        "(per-tensor current scaling)")
    g.add_argument("--fp8-amax-history-len", type=positive_int, default=1,
                   help="amax history of the delayed recipe (megatron's default 1)")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"],
                   default="most_recent", help="scale from the newest or the largest amax")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed-dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ... "
                        "(default: the embedded standard-library corpus)")
    g.add_argument("--tokenizer-model", default=None,
                   help="Hugging Face tokenizer folder (required with --data-path)")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--cache-dir", default=None,
                   help="cache for the embedded corpus and dataset indices")

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=positive_int)
    g.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="dense bf16 peak per GPU for the logged MFU (default 989: H100/H200 "
                        "SXM); MFU = lrattn-flops' model FLOPs per token x tokens / (step "
                        "time x GPUs x peak)")
    g.add_argument("--eval-interval", type=positive_int)
    g.add_argument("--eval-iters", type=positive_int)
    g.add_argument("--log-json", default=None, help="JSON-lines metrics file")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let a run that does not resume from --save write over the "
                        "checkpoints already in it (refused by default)")
    g.add_argument("--exit-interval", type=positive_int, default=None,
                   help="stop after the first iteration that is a multiple of N (saving when "
                        "--save is given); the LR schedule still spans --train-iters")
    g.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    g.add_argument("--keep-last", type=positive_int, default=None,
                   help="keep only the newest N complete checkpoints (default: all)")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=None,
                   help="on SIGTERM save a checkpoint at the end of the current iteration and "
                        "exit 0 (default: on when --save is given)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoint shards in a background process while training "
                        "continues (megatron's async dist_checkpointing)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state so it loads at any TP/PP "
                        "layout (default: any DP size, same TP/PP)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard event files (default: SAVE/tensorboard with --save)")
    g.add_argument("--wandb-project", default=None,
                   help="log to this Weights & Biases project (needs the wandb package)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B local files (default: SAVE/wandb)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv``: preset defaults first, then ``--config`` values, explicit flags win.
    Then validate."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    config = load_config_file(pre.config, parser) if pre.config else {}
    preset = pre.preset
    if "preset" in config:
        cli = sys.argv[1:] if argv is None else list(argv)
        explicit = any(a == "--preset" or a.startswith("--preset=") for a in cli)
        if explicit and pre.preset != config["preset"]:
            raise ArgumentError(f"--preset {pre.preset} disagrees with preset "
                                f"{config['preset']!r} in {pre.config}")
        preset = config["preset"]
    parser.set_defaults(**{k: v for k, v in PRESETS[preset].items()})
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    validate_args(args)
    return args
