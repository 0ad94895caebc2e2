"""Checks of parsed ``lrattn-pretrain`` arguments: values, combinations, paths, TE/FP8."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import tempfile
from typing import List, Optional

from megatron_lrattn.training.arg_types import ArgumentError


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


_SPLIT = re.compile(r"\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*")
_SEED_MAX = 2**31 - 1


def _check_numbers(args: argparse.Namespace) -> None:
    """Optimizer, schedule, init and seed values torch, numpy or megatron would fail on
    (or train silently wrong with): NaN, infinities, negative decay, betas outside [0, 1)."""
    def value(flag):
        return getattr(args, flag.lstrip("-").replace("-", "_"), None)

    for flag, lo, lo_open, hi in (
            ("--lr", 0.0, True, None), ("--min-lr", 0.0, False, None),
            ("--weight-decay", 0.0, False, None), ("--clip-grad", 0.0, False, None),
            ("--adam-beta1", 0.0, False, 1.0), ("--adam-beta2", 0.0, False, 1.0),
            ("--init-method-std", 0.0, True, None), ("--key-norm-eps", 0.0, True, None)):
        v = value(flag)
        if v is None:
            continue
        bad = not math.isfinite(v) or v < lo or (lo_open and v == lo) or (
            hi is not None and v >= hi)
        if bad:
            want = (f"in [{lo:g}, {hi:g})" if hi is not None else
                    f"a finite number {'>' if lo_open else '>='} {lo:g}")
            raise ArgumentError(f"{flag} {v}: must be {want}")
    if not 0 <= args.seed <= _SEED_MAX:
        raise ArgumentError(f"--seed {args.seed}: must be in [0, {_SEED_MAX}] (numpy's and "
                            "megatron's generators take 32-bit seeds)")
    if args.rotary_base is not None and args.rotary_base <= 0:
        raise ArgumentError(f"--rotary-base {args.rotary_base}: must be > 0")
    wsd = args.lr_wsd_decay_iters
    if wsd is not None and not 1 <= wsd <= args.train_iters:
        raise ArgumentError(f"--lr-wsd-decay-iters {wsd}: must be in [1, --train-iters "
                            f"({args.train_iters})]")


def check_split(split: str) -> None:
    """``--split``: up to three non-negative shares (train, valid, test); train and valid
    must be non-empty (the run trains and evaluates)."""
    if not isinstance(split, str) or not _SPLIT.fullmatch(split):
        raise ArgumentError(f"--split {split!r}: give train,valid,test shares, e.g. 969,30,1")
    shares = [float(x) for x in re.split(r"[,/]", split)] + [0.0, 0.0]
    if not shares[0] > 0 or not shares[1] > 0:
        raise ArgumentError(f"--split {split}: the train and valid shares must be > 0 (the "
                            "run trains on one and evaluates on the other), e.g. 98,2,0")


def _check_layout(args: argparse.Namespace) -> None:
    """Batch, sequence-parallel, position and depth-backend combinations."""
    tp = args.tensor_model_parallel_size
    if args.global_batch_size % args.micro_batch_size:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple "
                            f"of --micro-batch-size {args.micro_batch_size}")
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel splits activations over tensor-parallel ranks: "
                            "it needs --tensor-model-parallel-size > 1")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        if args.seq_length % (2 * cp):
            raise ArgumentError(
                f"--context-parallel-size {cp} splits each sequence into 2 x {cp} chunks: "
                f"--seq-length {args.seq_length} is not divisible by {2 * cp}")
        if args.transformer_impl == "transformer_engine":
            raise ArgumentError(
                f"--context-parallel-size {cp} runs on the local spec's SDPA core; with "
                "--transformer-impl transformer_engine it is not supported yet (use "
                "--transformer-impl local)")
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        raise ArgumentError(f"--seq-length {args.seq_length} > --max-position-embeddings "
                            f"{args.max_position_embeddings} (learned position embeddings)")
    if args.depth_backend == "triton":
        import torch

        if importlib.util.find_spec("triton") is None:
            raise ArgumentError("--depth-backend triton needs the triton package")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ArgumentError("--depth-backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 "
                                "for the slow interpreter); use --depth-backend torch or auto")


def _check_recompute(args: argparse.Namespace) -> None:
    """``--recompute-*`` as in Megatron-LM: ``--recompute-activations`` is granularity
    selective; full needs a method and 1 <= --recompute-num-layers <= the layers of a
    pipeline stage (virtual stage when interleaved), a divisor of them with uniform."""
    granularity = getattr(args, "recompute_granularity", None)
    method = getattr(args, "recompute_method", None)
    count = getattr(args, "recompute_num_layers", None)
    if getattr(args, "recompute_activations", False):
        if granularity == "full":
            raise ArgumentError("--recompute-activations is --recompute-granularity selective; "
                                "it contradicts --recompute-granularity full")
        granularity = args.recompute_granularity = "selective"
    if granularity != "full":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", count)):
            if value is not None:
                raise ArgumentError(f"{flag} {value} applies to --recompute-granularity full "
                                    f"(got {granularity or 'no recompute'})")
        return
    per_stage = (args.num_layers_per_virtual_pipeline_stage
                 or args.num_layers // args.pipeline_model_parallel_size)
    if method is None or count is None:
        raise ArgumentError("--recompute-granularity full needs --recompute-method "
                            "{uniform,block} and --recompute-num-layers N (e.g. uniform 1)")
    if not 1 <= count <= per_stage:
        raise ArgumentError(f"--recompute-num-layers {count}: must be in [1, {per_stage}], the "
                            "layers of a pipeline stage")
    if method == "uniform" and per_stage % count:
        raise ArgumentError(f"--recompute-num-layers {count} with --recompute-method uniform "
                            f"must divide the {per_stage} layers of a pipeline stage")
    if args.fp8_format and args.residual != "standard":
        raise ArgumentError("--recompute-granularity full with --fp8-format and depth "
                            "attention is not supported (TE's FP8 checkpoint is not wired into "
                            "the depth-attention block); use --residual standard or bf16")


def held_checkpoints(save_dir: str) -> Optional[str]:
    """What ``save_dir`` holds that a fresh run would overwrite (``latest`` or complete
    checkpoints), described in a few words; None for an empty or new folder."""
    if not os.path.isdir(save_dir):
        return None
    names = sorted(n for n in os.listdir(save_dir) if re.fullmatch(r"iter_\d{7}", n)
                   and os.path.isfile(os.path.join(save_dir, n, "lrattn.json")))
    if os.path.isfile(os.path.join(save_dir, "latest")):
        return f"latest, {len(names)} complete checkpoint(s)"
    return f"{len(names)} complete checkpoint(s), newest {names[-1]}" if names else None


def _check_overwrite(args: argparse.Namespace) -> None:
    """A run that does not resume from ``--save`` must not write over its checkpoints."""
    if args.save is None or getattr(args, "overwrite_checkpoints", False):
        return
    held = held_checkpoints(args.save)
    if held is None:
        return
    if args.load is not None and os.path.realpath(args.load) == os.path.realpath(args.save):
        return
    raise ArgumentError(f"--save {args.save} already holds checkpoints ({held}); resume with "
                        f"--load {args.save}, or choose another --save folder "
                        "(--overwrite-checkpoints writes over them)")


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
    from megatron_lrattn.training.downstream import check_downstream_args

    check_downstream_args(args)
    impl = getattr(args, "cross_entropy_fusion_impl", None)
    if impl is not None and not getattr(args, "cross_entropy_loss_fusion", True):
        raise ArgumentError(f"--cross-entropy-fusion-impl {impl} picks the fused cross "
                            "entropy; it contradicts --no-cross-entropy-loss-fusion")
    fused = getattr(args, "cross_entropy_loss_fusion", True)
    if hasattr(args, "cross_entropy_fusion_impl") and fused:
        args.cross_entropy_fusion_impl = impl or "triton"
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
    if not (math.isfinite(args.lr) and math.isfinite(args.min_lr)) or (
            args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr):
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
    _check_numbers(args)
    check_split(args.split)
    _check_layout(args)
    _check_recompute(args)
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
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and not os.path.isdir(pretrained):
        raise ArgumentError(f"--pretrained-checkpoint: {pretrained} is not a directory")
    # With --pretrained-checkpoint, --load may not exist yet (the run starts from the weights).
    if args.load is not None and not os.path.isdir(args.load) and pretrained is None:
        raise ArgumentError(f"--load: {args.load} is not a directory")
    if args.exit_signal_handler is None:
        args.exit_signal_handler = args.save is not None
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project needs the wandb package (pip install wandb)")
    for flag in ("keep_last", "async_save", "save_interval"):
        if getattr(args, flag) and args.save is None:
            raise ArgumentError(f"--{flag.replace('_', '-')} needs --save")
    _check_overwrite(args)
    for flag in ("save", "log_json", "cache_dir", "tensorboard_dir", "wandb_save_dir"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path)) or "."
        if os.path.exists(path) and flag == "log_json" and os.path.isdir(path):
            raise ArgumentError(f"--log-json: {path} is a directory")
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        _check_writable(f"--{flag.replace('_', '-')}", path, parent, flag != "log_json")
