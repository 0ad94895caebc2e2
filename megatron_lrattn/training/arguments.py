"""Command-line arguments of ``lrattn-pretrain``: Megatron-LM's flag names plus ours."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from megatron_lrattn.cli.common import positive_int
from megatron_lrattn.model.config import DEPTH_BACKENDS, DEPTH_SCHEDULES, KEY_TYPES, RESIDUAL_MODES
from megatron_lrattn.training.presets import PRESETS

TRANSFORMER_IMPLS = ("local", "transformer_engine")


class ArgumentError(ValueError):
    """A bad command-line value; the message names the flag and what is allowed."""


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
    g.add_argument("--eval-interval", type=positive_int)
    g.add_argument("--eval-iters", type=positive_int)
    g.add_argument("--log-json", default=None, help="JSON-lines metrics file")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=positive_int, default=None)
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
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
    if kind in (int, positive_int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        try:
            value = kind(str(value))
        except argparse.ArgumentTypeError as e:
            raise bad(f"a positive integer ({e})") from None
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
    elif not isinstance(value, str):
        raise bad("a string")
    if action.choices is not None and value not in action.choices:
        raise bad(f"one of {sorted(action.choices)}")
    return value


def load_config_file(path: str, parser: Optional[argparse.ArgumentParser] = None
                     ) -> Dict[str, Any]:
    """Flag values from a YAML (``.yaml``/``.yml``) or JSON file, keyed by argument name
    (``num_layers`` or ``num-layers``); a ``preset`` key names the base preset.

    Raises:
        ArgumentError: an unreadable file, an unknown key or a value of the wrong type, in one
            line naming the file and the key.
    """
    parser = parser or build_parser()
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


def _data_prefixes(data_path: List[str]) -> List[str]:
    items = list(data_path)
    try:
        float(items[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return items
    if len(items) % 2:
        raise ArgumentError("--data-path: weighted form needs pairs 'WEIGHT PREFIX'")
    for w in items[0::2]:
        try:
            if not float(w) > 0:
                raise ValueError
        except ValueError:
            raise ArgumentError(f"--data-path: weight {w!r} is not a positive number") from None
    return items[1::2]


def _check_writable(flag: str, path: str, parent: str, is_dir: bool) -> None:
    """Refuse a path that cannot be written: a file where a folder must go (or the other
    way round), or a folder where creating a file fails (permissions, a read-only file
    system; tried with a probe file that is removed at once, so it also holds for root)."""
    if is_dir and os.path.exists(path) and not os.path.isdir(path):
        raise ArgumentError(f"{flag}: {path} exists and is not a directory")
    if not os.path.isdir(parent):
        raise ArgumentError(f"{flag}: {parent} is not a directory")
    where = path if is_dir and os.path.isdir(path) else parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".lrattn_write_test_", dir=where)
    except OSError as e:
        raise ArgumentError(f"{flag}: {where} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def _check_transformer_engine(args: argparse.Namespace) -> None:
    """``--transformer-impl``/``--fp8-*``: FP8 only with TE, TE importable, FP8 shapes."""
    from megatron_lrattn.compat import te as te_compat

    if args.fp8_format and args.transformer_impl != "transformer_engine":
        raise ArgumentError(f"--fp8-format {args.fp8_format} needs --transformer-impl "
                            "transformer_engine (FP8 GEMMs are Transformer Engine modules)")
    if args.transformer_impl != "transformer_engine":
        return
    if args.fp8_format:
        tp = args.tensor_model_parallel_size
        tokens = args.seq_length * args.micro_batch_size // (tp if args.sequence_parallel else 1)
        projected = args.residual == "lr_attnres" and args.key == "projected"
        bad = te_compat.fp8_shape_problems(
            hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            kv_channels=args.hidden_size // args.num_attention_heads, tensor_parallel=tp,
            swiglu=args.swiglu,
            key_rows=(args.rank or args.hidden_size // 4) if projected else 0)
        if tokens % te_compat.FP8_TOKENS:
            bad.append(f"{tokens} tokens per micro-batch and rank (not a multiple of "
                       f"{te_compat.FP8_TOKENS})")
        if bad:
            raise ArgumentError(f"--fp8-format {args.fp8_format}: TE's FP8 GEMMs refuse "
                                f"{'; '.join(bad)}")
    try:
        te_compat.require_te()
    except te_compat.TEUnavailableError as e:
        raise ArgumentError(f"--transformer-impl transformer_engine: {e}") from None


def validate_args(args: argparse.Namespace) -> None:
    """Check values and combinations before anything is built or written.

    Raises:
        ArgumentError: naming the flag, the value and what is allowed.
    """
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError(
            f"--hidden-size {args.hidden_size} is not divisible by "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError("--num-attention-heads must be a multiple of --num-query-groups")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % tp:
            raise ArgumentError(f"{flag} {value} is not divisible by "
                                f"--tensor-model-parallel-size {tp} (each rank holds a slice)")
    if args.num_layers % pp:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by "
                            f"--pipeline-model-parallel-size {pp} (equal layers per stage)")
    head_dim = args.hidden_size // args.num_attention_heads
    if args.position_embedding_type == "rope" and head_dim % 2:
        raise ArgumentError(
            f"--position-embedding-type rope needs an even head dimension: --hidden-size "
            f"{args.hidden_size} / --num-attention-heads {args.num_attention_heads} = {head_dim}")
    n_sub = 2 * args.num_layers
    if args.residual != "standard":
        if not 1 <= args.num_blocks <= n_sub:
            raise ArgumentError(
                f"--num-blocks {args.num_blocks} is not allowed: 1 <= N <= 2 * --num-layers "
                f"({n_sub})"
            )
        if args.rank is not None and not 1 <= args.rank <= args.hidden_size:
            raise ArgumentError(
                f"--rank {args.rank} is not allowed: 1 <= r <= --hidden-size ({args.hidden_size})"
            )
    elif args.rank is not None:
        raise ArgumentError("--rank applies only to --residual attnres/lr_attnres")
    if args.residual == "attnres" and args.key != "sliced":
        raise ArgumentError("--key projected needs --residual lr_attnres (attnres keys are the sources)")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ArgumentError(f"--lr {args.lr} / --min-lr {args.min_lr}: need 0 <= min-lr <= lr, lr > 0")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ArgumentError(
            f"--lr-warmup-iters {args.lr_warmup_iters} is not allowed: 0 <= warm-up < "
            f"--train-iters ({args.train_iters})"
        )
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be in [0, 1)")
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        pp = args.pipeline_model_parallel_size
        if pp < 2 or args.num_layers % (pp * per_virtual) or args.num_layers == pp * per_virtual:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual}: needs "
                f"--pipeline-model-parallel-size >= 2 and --num-layers ({args.num_layers}) a "
                f"multiple of P x it with at least 2 virtual stages (P = {pp})"
            )
    if not (math.isfinite(args.depth_scale) and args.depth_scale > 0):
        raise ArgumentError(f"--depth-scale {args.depth_scale} must be a finite number > 0")
    _check_transformer_engine(args)
    if args.data_path is not None:
        for prefix in _data_prefixes(args.data_path):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ArgumentError(f"--data-path: {prefix + ext} not found")
        if args.tokenizer_model is None:
            raise ArgumentError("--data-path needs --tokenizer-model (a Hugging Face tokenizer folder)")
    if args.tokenizer_model is not None and not os.path.isdir(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model: {args.tokenizer_model} is not a directory")
    if args.load is not None and not os.path.isdir(args.load):
        raise ArgumentError(f"--load: {args.load} is not a directory")
    if args.exit_signal_handler is None:
        args.exit_signal_handler = args.save is not None
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project needs the wandb package (pip install wandb)")
    for flag in ("keep_last", "async_save", "save_interval"):
        if getattr(args, flag) and args.save is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} needs --save")
    for flag in ("save", "log_json"):
        path = getattr(args, flag)
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path)) or "."
        if os.path.exists(path) and flag == "log_json" and os.path.isdir(path):
            raise ArgumentError(f"--log-json: {path} is a directory")
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        _check_writable(f"--{flag.replace('_', '-')}", path, parent, flag == "save")
