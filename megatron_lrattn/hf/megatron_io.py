"""Megatron side of the HF conversion: read a distributed checkpoint of any TP/PP layout into
a TP1PP1 model on the CPU, and write one from a state dict for a target layout.

``megatron.core.dist_checkpointing`` stores global tensors, so a TP1PP1 model loads any
layout and a checkpoint written from TP1PP1 loads into any layout; the only
layout-dependent shape is the vocabulary padding (a multiple of 128 * TP), which follows
the layout recorded in ``lrattn.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
from megatron_lrattn.training.checkpoint_io import (
    META_NAME,
    CheckpointError,
    load_state,
    model_settings,
    read_meta,
    single_threaded_on_cpu,
)

NORM_EPS = 1e-5
"""``layernorm_epsilon`` of every model built by ``training.builder.build_config``."""


def tokenizer_dir(args: Dict[str, Any], override: Optional[str] = None,
                  checkpoint: Optional[str] = None) -> str:
    """The tokenizer folder of a run, as an absolute path: ``override`` when given, else the
    run's ``--tokenizer-model`` (when that folder is gone, the ``tokenizer/`` beside the
    checkpoint folder ``checkpoint``, where ``lrattn-convert-megatron`` puts its copy, so a
    moved conversion still loads), else the default data's.

    Raises:
        CheckpointError: the folder is missing (a relative path recorded by a run started
            elsewhere resolves against the current directory: pass ``override``).
    """
    if override is not None:
        if not os.path.isdir(override):
            raise CheckpointError(f"--tokenizer {override}: not a directory")
        return os.path.abspath(override)
    if args.get("tokenizer_model"):
        beside = (os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "tokenizer")
                  if checkpoint else None)
        if not os.path.isdir(args["tokenizer_model"]) and beside and os.path.isdir(beside):
            return beside
        if not os.path.isdir(args["tokenizer_model"]):
            raise CheckpointError(f"tokenizer folder {args['tokenizer_model']} (recorded in "
                                  f"{META_NAME}) not found from {os.getcwd()}; pass "
                                  "--tokenizer FOLDER")
        return os.path.abspath(args["tokenizer_model"])
    from megatron_lrattn.data.default_corpus import ensure_default_data

    return ensure_default_data(cache_dir=args.get("cache_dir")).tokenizer_dir


def hf_config_from_meta(meta: Dict[str, Any], vocab_size: int, eod: int) -> LRAttnConfig:
    """``LRAttnConfig`` of the model described by a checkpoint's ``lrattn.json``."""
    a, s = meta.get("args") or {}, meta.get("model_settings") or {}
    if not a:
        raise CheckpointError(f"{META_NAME} has no 'args' (made by an older version?)")
    try:
        depth = s["residual"] != "standard"
        return LRAttnConfig(
            vocab_size=vocab_size,
            hidden_size=a["hidden_size"],
            intermediate_size=a["ffn_hidden_size"],
            num_hidden_layers=a["num_layers"],
            num_attention_heads=a["num_attention_heads"],
            num_key_value_heads=a.get("num_query_groups") or a["num_attention_heads"],
            head_dim=a["hidden_size"] // a["num_attention_heads"],
            max_position_embeddings=a.get("max_position_embeddings") or a["seq_length"],
            normalization=a["normalization"],
            norm_eps=NORM_EPS,
            swiglu=bool(a["swiglu"]),
            add_bias_linear=not a["disable_bias_linear"],
            qk_layernorm=bool(a.get("qk_layernorm")),
            position_embedding_type=a["position_embedding_type"],
            rotary_base=a.get("rotary_base") or 10000,
            residual=s["residual"],
            key_type=s["key"],
            key_rank=s["rank"] if depth else None,
            num_blocks=s["num_blocks"],
            key_norm_eps=a.get("key_norm_eps", 1e-6),
            depth_scale=a.get("depth_scale", 1.0),
            tie_word_embeddings=not a["untie_embeddings_and_output_weights"],
            bos_token_id=eod,
            eos_token_id=eod,
        )
    except KeyError as e:
        raise CheckpointError(f"{META_NAME}: missing field {e}") from None


def _build_tp1(args: argparse.Namespace, vocab_padded: int, bf16: bool):
    from megatron_lrattn.training.builder import build_config, build_model

    args = argparse.Namespace(**vars(args))
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.sequence_parallel = False
    # A TE-spec checkpoint has the same distributed-checkpoint keys as a local one
    # (megatron_lrattn.compat.te), so the CPU-side local model reads either.
    args.transformer_impl, args.fp8_format = "local", None
    config = build_config(args, bf16=bf16)
    model = build_model(config, args, vocab_padded)
    return model.eval(), config


def _sharded_keys(sharded_sd) -> Dict[str, Any]:
    """Flat {checkpoint key: ShardedTensor or factory} of a model's sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for v in sharded_sd.values():
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            out[v.key] = v
    return out


def load_megatron(path: str, tokenizer: Optional[str] = None
                  ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], Any]:
    """Load a checkpoint of any layout into a TP1PP1 model (inside
    ``single_process_model_parallel``); ``tokenizer`` overrides the recorded tokenizer
    folder (its size sets the vocabulary padding).

    Returns:
        (model state dict, lrattn.json contents, the model).

    Raises:
        CheckpointError: unreadable, incomplete or inconsistent checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_lrattn.data.tokenizer import HFTokenizer
    from megatron_lrattn.training.builder import padded_vocab_size

    # torch.distributed.checkpoint reports reader failures as CheckpointException, a
    # BaseException: catch it explicitly.
    failures = (Exception, CheckpointException)

    meta = read_meta(path)
    args = argparse.Namespace(**(meta.get("args") or {}))
    if not vars(args):
        raise CheckpointError(f"{os.path.join(path, META_NAME)}: no 'args' recorded")
    try:
        stored = dist_checkpointing.load_tensors_metadata(path)
    except failures as e:  # any reader failure is a broken checkpoint
        raise CheckpointError(f"{path}: unreadable distributed checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    emb = stored.get("embedding.word_embeddings.weight")
    bf16 = emb is not None and emb.dtype == torch.bfloat16
    vocab = HFTokenizer(tokenizer_dir(vars(args), tokenizer, path)).vocab_size
    model, config = _build_tp1(args, padded_vocab_size(vocab, args.tensor_model_parallel_size), bf16)
    saved_settings = meta.get("model_settings", {})
    diffs = [f"{k}: {saved_settings.get(k)!r} vs args {v!r}"
             for k, v in model_settings(config).items() if saved_settings.get(k) != v]
    if diffs:
        raise CheckpointError(f"{path}: {META_NAME} model_settings disagree with its args "
                              f"({'; '.join(diffs)})")
    sharded = model.sharded_state_dict()
    wanted = _sharded_keys(sharded)
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {len(missing)} tensor(s): "
                              f"{', '.join(missing[:5])}")
    for key, st in wanted.items():
        if isinstance(st, ShardedTensor) and tuple(stored[key].global_shape) != tuple(st.global_shape):
            raise CheckpointError(f"{path}: {key} has shape {tuple(stored[key].global_shape)}, "
                                  f"the recorded config implies {tuple(st.global_shape)}")
    try:
        load_state(path, [model], sharded)
    except failures as e:
        raise CheckpointError(f"{path}: cannot load the model tensors ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    sd = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return sd, meta, model


def megatron_args_from_hf(config: LRAttnConfig, tp: int, pp: int, tokenizer: str
                          ) -> argparse.Namespace:
    """``lrattn-pretrain`` arguments describing ``config`` at a TP/PP layout.

    Raises:
        ValueError: a config Megatron cannot express, or a layout that does not divide it.
    """
    from megatron_lrattn.training.arguments import parse_args

    c = config
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim={c.head_dim} x heads={c.num_attention_heads} != hidden_size "
                         f"{c.hidden_size}: megatron_lrattn builds kv_channels = d / heads")
    if abs(c.norm_eps - NORM_EPS) > 1e-12:
        raise ValueError(f"norm_eps={c.norm_eps}; megatron_lrattn models use {NORM_EPS}")
    if float(c.rotary_base) != int(c.rotary_base):
        raise ValueError(f"rotary_base={c.rotary_base} is not an integer")
    for what, n, div in (("num_attention_heads", c.num_attention_heads, tp),
                         ("num_key_value_heads", c.num_key_value_heads, tp),
                         ("intermediate_size", c.intermediate_size, tp),
                         ("num_hidden_layers", c.num_hidden_layers, pp)):
        if n % div:
            raise ValueError(f"{what}={n} is not divisible by the target layout ({div})")

    def flag(name, on):
        return [f"--{name}" if on else f"--no-{name}"]

    argv = [
        "--num-layers", str(c.num_hidden_layers), "--hidden-size", str(c.hidden_size),
        "--ffn-hidden-size", str(c.intermediate_size),
        "--num-attention-heads", str(c.num_attention_heads),
        "--num-query-groups", str(c.num_key_value_heads),
        "--seq-length", str(c.max_position_embeddings),
        "--max-position-embeddings", str(c.max_position_embeddings),
        "--normalization", c.normalization,
        *flag("swiglu", c.swiglu), *flag("qk-layernorm", c.qk_layernorm),
        "--position-embedding-type", c.position_embedding_type,
        "--rotary-base", str(int(c.rotary_base)),
        *flag("untie-embeddings-and-output-weights", not c.tie_word_embeddings),
        *flag("disable-bias-linear", not c.add_bias_linear),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--residual", c.residual, "--key", c.key_type, "--num-blocks", str(c.num_blocks),
        "--depth-scale", str(c.depth_scale), "--key-norm-eps", str(c.key_norm_eps),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--tokenizer-model", tokenizer,
    ]
    if c.residual != "standard":
        argv += ["--rank", str(c.key_rank)]
    return parse_args(argv)


def save_megatron(sd: Dict[str, torch.Tensor], out_dir: str, args: argparse.Namespace,
                  bf16: bool, source: str) -> str:
    """Write ``sd`` (TP1PP1 keys, vocabulary already padded for the target TP) as
    ``out_dir/iter_0000000`` with ``lrattn.json`` and ``latest``; returns the folder.

    The checkpoint holds model weights only (no optimizer state).
    """
    from megatron.core import dist_checkpointing

    vocab_padded = sd["embedding.word_embeddings.weight"].shape[0]
    model, config = _build_tp1(args, vocab_padded, bf16)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"model does not accept the converted weights (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    name = "iter_0000000"
    final = os.path.join(out_dir, name)
    tmp = final + ".tmp"
    os.makedirs(out_dir, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with single_threaded_on_cpu():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, tmp)
    meta = {"iteration": 0, "consumed_samples": 0, "scheduler": None,
            "model_settings": model_settings(config), "args": vars(args),
            "contents": ["model"], "converted_from": source}
    with open(os.path.join(tmp, META_NAME), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write(name + "\n")
    return final
