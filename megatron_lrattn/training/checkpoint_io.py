"""The checkpoint format, its resolver and its one reader, shared by training (resume),
``lrattn-analyze`` and the Hugging Face converter.

A checkpoint folder ``iter_NNNNNNN`` holds a ``megatron.core.dist_checkpointing`` checkpoint
(global tensors: any TP/PP layout loads it) and ``lrattn.json`` (iteration, consumed samples,
LR schedule, model settings, the run's arguments). A ``--save`` folder holds checkpoint
folders and ``latest``, the name of the newest complete one. Model state is stored under
``model``: the keys of the bare model for one chunk, ``model0``, ``model1``, ... for virtual
pipeline stages. Nothing here imports megatron-core until a checkpoint is read.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Optional, Sequence

import torch

DEPTH_FIELDS = {"residual": "residual", "key": "key_type", "rank": "key_rank",
                "num_blocks": "num_blocks", "num_layers": "num_layers", "hidden_size": "hidden_size"}
"""Names as stored in ``lrattn.json`` (stable across releases) -> the config field they record."""

META_NAME = "lrattn.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file and the problem."""


def model_settings(config) -> Dict[str, Any]:
    """The config fields a checkpoint must agree on to be loaded."""
    return {name: getattr(config, field) for name, field in DEPTH_FIELDS.items()}


def latest_checkpoint(load_dir: str) -> str:
    """Folder of the newest complete checkpoint under ``load_dir`` (raises ``CheckpointError``)."""
    tracker = os.path.join(load_dir, "latest")
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{tracker}: not found (no complete checkpoint in {load_dir})")
    with open(tracker) as f:
        name = f.read().strip()
    path = os.path.join(load_dir, name)
    if not os.path.isfile(os.path.join(path, META_NAME)):
        raise CheckpointError(f"{path}: incomplete checkpoint ({META_NAME} missing)")
    return path


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder for ``path``: a ``--save`` folder (follows ``latest``) or a
    checkpoint folder itself.

    Raises:
        CheckpointError: naming what is missing (not a folder, an incomplete checkpoint,
            neither ``latest`` nor a checkpoint).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if os.path.isfile(os.path.join(path, "latest")):
        return latest_checkpoint(path)
    if os.path.isfile(os.path.join(path, META_NAME)):
        return path
    if os.path.isfile(os.path.join(path, "metadata.json")) or os.path.basename(
            os.path.normpath(path)).startswith("iter_"):
        raise CheckpointError(f"{path}: incomplete checkpoint ({META_NAME} missing)")
    raise CheckpointError(f"{path}: no 'latest' file and no checkpoint in it")


def read_meta(path: str) -> Dict[str, Any]:
    """The ``lrattn.json`` of a checkpoint folder."""
    try:
        with open(os.path.join(path, META_NAME)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{os.path.join(path, META_NAME)}: unreadable ({e})") from None


def check_compatible(meta: Dict[str, Any], config, path: str) -> None:
    """Refuse a checkpoint whose residual mode, key type, rank, N or shape differ."""
    saved = meta.get("model_settings", {})
    current = model_settings(config)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, run {v!r}" for k, v in current.items()
             if saved.get(k) != v]
    if diffs:
        raise CheckpointError(f"{path} was made with other model settings ({'; '.join(diffs)})")


@contextlib.contextmanager
def single_threaded_on_cpu():
    """megatron's checkpoint writer forks worker processes; after a fork, a child that
    enters an OpenMP parallel region of the parent's thread pool hangs. Writing with one
    intra-op thread avoids that on CPU-only machines."""
    if torch.cuda.is_available():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _bare(model):
    """The module inside megatron's DDP (whose ``sharded_state_dict`` adds a ``module.``
    prefix that its ``load_state_dict`` does not accept); any other module itself."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def model_sharded_state_dict(models: Sequence) -> Dict[str, Any]:
    """The sharded state dict stored under ``model``, of bare or DDP-wrapped chunks."""
    if len(models) == 1:
        return _bare(models[0]).sharded_state_dict()
    return {f"model{i}": _bare(m).sharded_state_dict() for i, m in enumerate(models)}


def load_state(path: str, models: Sequence, model_sd: Optional[Dict[str, Any]] = None,
               **extra: Any) -> Dict[str, Any]:
    """Read checkpoint folder ``path``: the model weights into ``models``, and whatever
    else ``extra`` asks for.

    Args:
        path: a checkpoint folder (``resolve_checkpoint``).
        models: the model chunks (bare or DDP-wrapped), in the layout of the module docstring.
        model_sd: their ``model_sharded_state_dict`` when the caller built it already (an
            optimizer's sharded state dict refers to it).
        extra: more top-level entries of the sharded state to read (e.g. ``optimizer``).

    Returns:
        The loaded state: ``model`` (already in ``models``) and the ``extra`` entries.
    """
    from megatron.core import dist_checkpointing

    model_sd = model_sharded_state_dict(models) if model_sd is None else model_sd
    loaded = dist_checkpointing.load({"model": model_sd, **extra}, path)
    if len(models) == 1:
        models[0].load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded["model"][f"model{i}"])
    return loaded


def load_model_only(path: str, models: Sequence[torch.nn.Module], config=None) -> Dict:
    """Load only the model weights of checkpoint folder ``path`` into ``models``.

    Any TP/PP layout loads (distributed checkpointing reshards); optimizer state in the
    checkpoint is ignored.

    Args:
        path: a checkpoint folder (see ``resolve_checkpoint``).
        models: the model chunks (bare or DDP-wrapped), in the layout ``save_checkpoint``
            used (one chunk, or ``model0``, ``model1``... for virtual pipeline stages).
        config: when given, the checkpoint's model settings must match it.

    Returns:
        The checkpoint's ``lrattn.json`` contents.
    """
    meta = read_meta(path)
    if config is not None:
        check_compatible(meta, config, path)
    load_state(path, models)
    return meta
