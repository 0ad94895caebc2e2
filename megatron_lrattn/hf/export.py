"""Whole-folder conversions: Megatron checkpoint -> HF folder (``LlamaForCausalLM`` or our
``LRAttnForCausalLM``) and back (either kind of folder)."""

from __future__ import annotations

import json
import os
import shutil
import logging
from typing import Dict, Optional, Tuple

import torch

from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
from megatron_lrattn.hf.convert import ConversionError, hf_to_megatron, megatron_to_hf
from megatron_lrattn.hf.llama import (
    drop_ignored_keys,
    from_llama_config,
    is_llama,
    llama_blockers,
    to_llama_config,
)
from megatron_lrattn.training.durable import disk_error, output_dir

logger = logging.getLogger(__name__)

HF_FORMATS = ("auto", "llama", "lrattn")
"""``auto``: Llama when the model can be one (``llama_blockers``), else ``lrattn``."""
HERE = os.path.dirname(os.path.abspath(__file__))
CODE_FILES = ("configuration_lrattn.py", "modeling_lrattn.py")
AUTO_MAP = {
    "AutoConfig": "configuration_lrattn.LRAttnConfig",
    "AutoModel": "modeling_lrattn.LRAttnModel",
    "AutoModelForCausalLM": "modeling_lrattn.LRAttnForCausalLM",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja")


def copy_tokenizer(src: str, dst: str) -> None:
    """Copy the tokenizer files of a Hugging Face tokenizer folder."""
    copied = 0
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied += 1
    if not copied:
        raise ConversionError(f"{src}: no tokenizer files found")


def _save_model(model_cls, config, hf_sd: Dict[str, torch.Tensor], out_dir: str,
                max_shard_size) -> None:
    """Build ``model_cls(config)`` on the meta device, assign ``hf_sd`` (every parameter
    must get a weight) and ``save_pretrained`` it into ``out_dir``."""
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(hf_sd, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ConversionError(f"parameters without weights after conversion: {left[:5]}")
    model.config.dtype = model.model.embed_tokens.weight.dtype
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)


def save_hf(hf_sd: Dict[str, torch.Tensor], config: LRAttnConfig, out_dir: str,
            tokenizer: str, max_shard_size="5GB") -> str:
    """Write an HF folder: config.json (with auto_map), safetensors, tokenizer, code."""
    from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM

    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["LRAttnForCausalLM"]
    _save_model(LRAttnForCausalLM, config, hf_sd, out_dir, max_shard_size)
    for name in CODE_FILES:
        shutil.copy2(os.path.join(HERE, name), os.path.join(out_dir, name))
    copy_tokenizer(tokenizer, out_dir)
    return out_dir


def save_llama(hf_sd: Dict[str, torch.Tensor], config: LRAttnConfig, out_dir: str,
               tokenizer: str, max_shard_size="5GB") -> str:
    """Write a plain ``LlamaForCausalLM`` folder (no remote code) for a standard ``config``.

    Raises:
        ConversionError: the model has a feature Llama cannot express (named).
    """
    from transformers import LlamaForCausalLM

    try:
        llama_config = to_llama_config(config)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    _save_model(LlamaForCausalLM, llama_config, hf_sd, out_dir, max_shard_size)
    copy_tokenizer(tokenizer, out_dir)
    return out_dir


def choose_format(config: LRAttnConfig, requested: str = "auto") -> str:
    """``llama`` or ``lrattn`` for ``requested`` (one of ``HF_FORMATS``).

    Raises:
        ConversionError: ``llama`` requested for a model Llama cannot express (one line
            naming the features).
    """
    if requested not in HF_FORMATS:
        raise ConversionError(f"format {requested!r}; allowed: {', '.join(HF_FORMATS)}")
    blockers = llama_blockers(config)
    if requested == "llama" and blockers:
        raise ConversionError("cannot export as Llama: " + "; ".join(blockers)
                              + " (use --format lrattn)")
    if requested == "auto":
        if config.residual == "standard" and blockers:
            logger.info("exporting as lrattn (remote code), not Llama: %s", "; ".join(blockers))
        return "lrattn" if blockers else "llama"
    return requested


def _check_output(out_dir: str, allow_hf: bool) -> None:
    """Refuse an output folder whose contents a conversion would destroy or mix: one that
    holds training checkpoints (``latest``, ``iter_*``), or any other non-empty folder
    (except an earlier HF export when ``allow_hf``: it is replaced as a whole). The nearest
    existing parent must be writable."""
    from megatron_lrattn.training.durable import check_output_parent

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConversionError(f"{out_dir}: exists and is not a directory")
    try:
        check_output_parent("output", out_dir)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    names = os.listdir(out_dir)
    if "latest" in names or any(n.startswith("iter_") for n in names):
        raise ConversionError(f"{out_dir}: holds training checkpoints; a conversion writes a "
                              "new folder (it would move 'latest' to a weights-only "
                              "checkpoint): choose another output path")
    if not (allow_hf and "config.json" in names):
        raise ConversionError(f"{out_dir}: exists and is not empty; choose a new output path")


def _raise_if_disk_error(e: BaseException, out_dir: str) -> None:
    """A write that failed on the file system (disk full, I/O, permissions) becomes one
    line; the temporary folder is already gone (``durable.output_dir``)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, ConversionError)):
        return
    err = disk_error(e)
    if err is not None:
        raise ConversionError(f"{out_dir}: writing the output failed ({err.strerror or err}); "
                              "nothing was written under that name") from None


def megatron_checkpoint_to_hf(checkpoint: str, out_dir: str, max_shard_size="5GB", *,
                              tokenizer: Optional[str] = None, hf_format: str = "auto") -> str:
    """Convert the newest checkpoint under ``checkpoint`` (any TP/PP layout) to an HF folder.

    Args:
        tokenizer: tokenizer folder to copy into the export (default: the one the run
            recorded, ``--tokenizer-model``, or the embedded default data's).
        hf_format: ``auto`` (a plain ``LlamaForCausalLM`` when the model can be one, else
            ``LRAttnForCausalLM`` with its code), ``llama`` (refused, naming the feature, when
            it cannot) or ``lrattn``.

    The export holds its own copy of the tokenizer; nothing in it points back to the
    source. The folder is written under a temporary name and renamed when complete (an earlier
    export at ``out_dir`` is replaced as a whole; a folder with other contents is refused).

    Raises:
        CheckpointError, ConversionError: one-line messages naming the problem.
    """
    from megatron_lrattn.data.tokenizer import HFTokenizer
    from megatron_lrattn.hf.megatron_io import hf_config_from_meta, load_megatron, tokenizer_dir
    from megatron_lrattn.training.checkpoint_io import read_meta, resolve_checkpoint
    from megatron_lrattn.training.runtime import single_process_model_parallel

    _check_output(out_dir, allow_hf=True)
    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path)
    tok_dir = tokenizer_dir(meta.get("args") or {}, tokenizer, path)
    tok = HFTokenizer(tok_dir)
    config = hf_config_from_meta(meta, tok.vocab_size, tok.eod)
    fmt = choose_format(config, hf_format)
    with single_process_model_parallel():
        sd, _, _ = load_megatron(path, tokenizer=tok_dir)
    hf_sd = megatron_to_hf(sd, config)
    save = save_llama if fmt == "llama" else save_hf
    try:
        with output_dir(out_dir) as tmp:
            save(hf_sd, config, tmp, tok_dir, max_shard_size)
    except BaseException as e:  # noqa: BLE001 - safetensors' writer raises its own type
        _raise_if_disk_error(e, out_dir)
        raise
    return out_dir


def read_hf_folder(path: str) -> Tuple[LRAttnConfig, Dict[str, torch.Tensor]]:
    """Config and state dict of an exported folder or a ``LlamaForCausalLM`` folder (single
    or sharded safetensors); a Llama becomes a standard ``LRAttnConfig``.

    Raises:
        ConversionError: missing or unreadable files.
    """
    from safetensors.torch import load_file

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConversionError(f"{path}: config.json not found")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{cfg_file}: unreadable ({e})") from None
    llama = is_llama(raw)
    if not llama and raw.get("model_type") != LRAttnConfig.model_type:
        raise ConversionError(f"{cfg_file}: model_type {raw.get('model_type')!r}, expected "
                              f"{LRAttnConfig.model_type!r} or 'llama'")
    try:
        if llama:
            from megatron_lrattn.hf.megatron_io import NORM_EPS

            config = from_llama_config(raw, NORM_EPS)
        else:
            config = LRAttnConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{cfg_file}: {str(e).splitlines()[0]}") from None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
        if not os.path.isfile(os.path.join(path, files[0])) and any(
                os.path.isfile(os.path.join(path, n))
                for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            raise ConversionError(f"{path}: only pytorch_model.bin weights; safetensors are "
                                  "read (re-save with save_pretrained(safe_serialization=True))")
    sd: Dict[str, torch.Tensor] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConversionError(f"{file}: not found")
        try:
            sd.update(load_file(file))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ConversionError(f"{file}: unreadable safetensors ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return config, (drop_ignored_keys(sd) if llama else sd)


def _check_vocab(tok_dir: str, config: LRAttnConfig, hf_dir: str) -> None:
    """The model's vocabulary must be the tokenizer's: Megatron pads the embedding from the
    tokenizer's size, and the export writes that size back."""
    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.data.tokenizer import HFTokenizer

    try:
        n = HFTokenizer(tok_dir).vocab_size
    except DataError as e:
        raise ConversionError(f"{hf_dir}: {e}") from None
    if n != config.vocab_size:
        raise ConversionError(f"{hf_dir}: vocab_size={config.vocab_size} in config.json, but the "
                              f"tokenizer has {n} tokens; megatron_lrattn needs them equal")


def hf_to_megatron_checkpoint(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1) -> str:
    """Convert an exported HF folder, or a ``LlamaForCausalLM`` folder, to a Megatron
    checkpoint for a TP x PP layout (a Llama becomes a ``--residual standard`` model).

    The checkpoint holds the model weights (loadable into any layout by
    ``dist_checkpointing``; vocabulary padded for ``tp``) and copies the tokenizer into
    ``out_dir/tokenizer``.

    Raises:
        ConversionError: bad folder, key or shape mismatch, layout that does not divide.
    """
    from megatron_lrattn.hf.megatron_io import (
        megatron_args_from_hf,
        save_megatron,
    )
    from megatron_lrattn.training.builder import padded_vocab_size
    from megatron_lrattn.training.runtime import single_process_model_parallel

    _check_output(out_dir, allow_hf=False)
    config, hf_sd = read_hf_folder(hf_dir)
    msd = hf_to_megatron(hf_sd, config, padded_vocab_size(config.vocab_size, tp))
    bf16 = msd["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    final = os.path.abspath(out_dir)
    try:
        with output_dir(final) as tmp:
            tok_dir = os.path.join(tmp, "tokenizer")
            os.makedirs(tok_dir)
            copy_tokenizer(hf_dir, tok_dir)
            _check_vocab(tok_dir, config, hf_dir)
            try:
                args = megatron_args_from_hf(config, tp, pp, tok_dir)
            except ValueError as e:
                raise ConversionError(f"{hf_dir}: {e}") from None
            args.tokenizer_model = os.path.join(final, "tokenizer")
            with single_process_model_parallel():
                written = save_megatron(msd, tmp, args, bf16, os.path.abspath(hf_dir))
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        _raise_if_disk_error(e, out_dir)
        raise
    return os.path.join(final, os.path.basename(written))
