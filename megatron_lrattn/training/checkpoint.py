"""Checkpoints through ``megatron.core.dist_checkpointing`` (any TP/PP layout loads any other).

Layout of ``--save DIR``::

    DIR/iter_0000300/            distributed checkpoint (model, optimizer)
    DIR/iter_0000300/lrattn.json iteration, consumed samples, LR schedule, model settings
    DIR/latest                   name of the newest complete checkpoint

A checkpoint is written to ``iter_N.tmp`` and renamed when every rank has finished, and
``latest`` is replaced atomically afterwards, so an interrupted save never damages the last
good checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

DEPTH_FIELDS = ("residual", "key", "rank", "num_blocks", "num_layers", "hidden_size")
META_NAME = "lrattn.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file and the problem."""


@contextlib.contextmanager
def _single_threaded_on_cpu():
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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def model_settings(config) -> Dict[str, Any]:
    """The config fields a checkpoint must agree on to be loaded."""
    return {f: getattr(config, f) for f in DEPTH_FIELDS}


def save_checkpoint(save_dir: str, iteration: int, models: List, optimizer, scheduler,
                    config, consumed_samples: int, args: Optional[Dict[str, Any]] = None) -> str:
    """Save model and optimizer state; returns the checkpoint folder."""
    from megatron.core import dist_checkpointing

    name = f"iter_{iteration:07d}"
    final = os.path.join(save_dir, name)
    tmp = final + ".tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd = _model_sharded_state_dict(models)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    with _single_threaded_on_cpu():
        dist_checkpointing.save(state, tmp)
    _barrier()
    if rank0:
        meta = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "scheduler": scheduler.state_dict(),
            "model_settings": model_settings(config),
            "args": args or {},
        }
        with open(os.path.join(tmp, META_NAME), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(save_dir, "latest.tmp")
        with open(latest_tmp, "w") as f:
            f.write(name + "\n")
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
    _barrier()
    return final


def _model_sharded_state_dict(models: List) -> Dict[str, Any]:
    # Keys of the module inside DDP: DDP's sharded_state_dict adds a 'module.' prefix that
    # its load_state_dict does not accept.
    if len(models) == 1:
        return models[0].module.sharded_state_dict()
    return {f"model{i}": m.module.sharded_state_dict() for i, m in enumerate(models)}


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


def load_checkpoint(load_dir: str, models: List, optimizer, scheduler, config) -> Dict[str, Any]:
    """Load the newest checkpoint into ``models``/``optimizer``/``scheduler``; returns its meta."""
    from megatron.core import dist_checkpointing

    path = latest_checkpoint(load_dir)
    meta = read_meta(path)
    check_compatible(meta, config, path)
    model_sd = _model_sharded_state_dict(models)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(state, path)
    if len(models) == 1:
        models[0].load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded["model"][f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    return meta
