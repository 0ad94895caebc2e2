"""Training checkpoints through ``megatron.core.dist_checkpointing`` (any TP/PP layout loads
any other): save, prune, resume. The format and its reader are ``checkpoint_io``; the torch
Adam repairs of the optimizer load are ``adam_state``.

Layout of ``--save DIR``::

    DIR/iter_0000300/            distributed checkpoint (model, optimizer)
    DIR/iter_0000300/lrattn.json iteration, consumed samples, LR schedule, model settings
    DIR/latest                   name of the newest complete checkpoint

A checkpoint is written to ``iter_N.tmp`` and renamed when every rank has finished (a folder
of the same name that exists is replaced atomically: ``durable.replace_dir``), and
``latest`` is replaced atomically afterwards (written, fsynced, renamed), so an interrupted
save never damages the last good checkpoint. With ``keep_last`` older complete checkpoints
are deleted after a save succeeded (never the one ``latest`` names). An asynchronous save writes the shards in a background process; the rename,
``latest`` and pruning happen when it is finalized.

The distributed optimizer's state is saved in megatron's ``dp_reshardable`` format by default
(each rank writes its own shard; the checkpoint loads at any data-parallel size but the same
TP/PP layout) or ``fully_reshardable`` (gathered per parameter; loads at any TP/PP/DP layout,
at the cost of an all-gather of the optimizer state). The model is always fully reshardable.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from functools import partial
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lrattn.training import faults
from megatron_lrattn.training.signals import interrupts_held
from megatron_lrattn.training.durable import (
    disk_error,
    fsync_dir,
    probe_disk,
    replace_dir,
    replace_file,
    write_durably,
)
from megatron_lrattn.training.adam_state import (
    fully_reshardable_adam_load,
    init_empty_adam_state,
    restore_adam_steps,
)
from megatron_lrattn.training.checkpoint_io import (
    ITER_NAME,
    META_NAME,
    CheckpointError,
    check_compatible,
    latest_checkpoint,
    latest_name,
    load_state,
    model_settings,
    model_sharded_state_dict,
    read_meta,
    single_threaded_on_cpu,
)

OPTIM_SHARDINGS = ("dp_reshardable", "fully_reshardable")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(save_dir: str, iteration: int, models: List, optimizer, scheduler,
                    config, consumed_samples: int, args: Optional[Dict[str, Any]] = None, *,
                    keep_last: Optional[int] = None, optim_sharding: str = "dp_reshardable",
                    async_queue=None, records: Optional[Dict[str, Any]] = None) -> str:
    """Save model and optimizer state.

    Args:
        save_dir: the ``--save`` folder.
        iteration, consumed_samples: where training stands (restored by ``load_checkpoint``).
        args: the run's arguments, kept in ``lrattn.json`` for provenance.
        keep_last: after the save, delete all but the newest ``keep_last`` complete
            checkpoints (None keeps all).
        optim_sharding: distributed-optimizer format, ``dp_reshardable`` or
            ``fully_reshardable`` (ignored by the plain optimizer).
        async_queue: a ``megatron.core.dist_checkpointing`` ``AsyncCallsQueue``: write the
            shards in the background; the checkpoint becomes ``latest`` when the caller
            finalizes the request (``async_queue.maybe_finalize_async_calls``).
        records: more entries of ``lrattn.json`` (``architecture``, ``data``: what a load
            compares, see ``checkpoint_io.check_compatible``).

    Returns:
        The checkpoint folder (complete once a synchronous save returns).
    """
    from megatron.core import dist_checkpointing

    name = f"iter_{iteration:07d}"
    final = os.path.join(save_dir, name)
    tmp = final + ".tmp"
    if _is_rank0():
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd = model_sharded_state_dict(models)
    state = {"model": model_sd,
             "optimizer": optimizer.sharded_state_dict(model_sd, metadata=_optim_metadata(
                 optim_sharding))}
    meta = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "scheduler": scheduler.state_dict(),
        "model_settings": model_settings(config),
        "optimizer_sharding": optim_sharding,
        "args": args or {},
        **(records or {}),
    }
    finalize = partial(_finalize_save, save_dir, name, meta, keep_last)
    # Ctrl-C waits for the save: raised inside os.fork's hooks (the writers fork) it
    # would be dropped and the run would train on.
    with single_threaded_on_cpu(), interrupts_held():
        try:
            if async_queue is None:
                dist_checkpointing.save(state, tmp)
                faults.after_checkpoint_shards(iteration)
                finalize()
            else:
                request = dist_checkpointing.save(state, tmp, async_sharded_save=True)
                request.add_finalize_fn(finalize)
                async_queue.schedule_async_request(request)
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            raise_write_error(e, save_dir, tmp)
            raise
    return final


def raise_write_error(e: BaseException, save_dir: str, tmp: str) -> None:
    """A save that failed on the file system (disk full, permissions, I/O): drop the
    partial ``.tmp`` folder and raise a one-line ``CheckpointError`` (``latest`` and every
    complete checkpoint are untouched). Other errors are left to the caller."""
    if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
        return
    err = disk_error(e) or probe_disk(save_dir)
    if err is None and "unexpected pos" in str(e):
        # torch's zip writer reports a short write (a disk that filled up or failed) as
        # "unexpected pos", without the OS error.
        err = OSError(errno.EIO, "short write: the disk filled up or failed")
    if err is None:
        return
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        name = latest_name(save_dir)
    except CheckpointError:
        name = None
    kept = f"{name} is still the latest checkpoint" if name else "no earlier checkpoint"
    raise CheckpointError(f"{tmp}: checkpoint save failed ({err.strerror or err}); {kept}"
                          ) from None


def checkpoint_bytes(n_params: int, bf16: bool) -> int:
    """Estimated size of one checkpoint of ``n_params`` parameters: the weights (2 bytes in
    bf16, else 4), fp32 main weights in bf16 runs, and Adam's two fp32 moments."""
    return n_params * ((2 + 4) if bf16 else 4) + n_params * 8


def check_save_space(save_dir: str, n_params: int, bf16: bool, dp: int = 1) -> int:
    """Refuse to start when ``save_dir``'s file system cannot hold one more checkpoint.

    Args:
        save_dir: the ``--save`` folder (need not exist yet).
        n_params: this rank's parameter count (summed over all ranks here, divided by
            the data-parallel size: replicas save one copy).
        bf16: bf16 parameters with fp32 main weights.
        dp: data-parallel size.

    Returns:
        The estimated checkpoint size in bytes.

    Raises:
        CheckpointError: the free space is below the estimate (a collective on all ranks).
    """
    total = torch.tensor([float(n_params)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if torch.cuda.is_available():
            total = total.cuda()
        dist.all_reduce(total)
        total /= dp
    need = checkpoint_bytes(int(total.item()), bf16)
    where = os.path.abspath(save_dir)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = faults.disk_free_override()
    if free is None:
        free = shutil.disk_usage(where).free
    if free < need:
        raise CheckpointError(
            f"--save {save_dir}: {free / 2**30:.2f} GiB free on its file system, one checkpoint "
            f"needs about {need / 2**30:.2f} GiB ({int(total.item())} parameters: weights, "
            f"fp32 main weights and Adam moments)")
    return need


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _optim_metadata(optim_sharding: str) -> Dict[str, Any]:
    if optim_sharding not in OPTIM_SHARDINGS:
        raise CheckpointError(f"optimizer sharding {optim_sharding!r}: use one of {OPTIM_SHARDINGS}")
    return {"distrib_optim_sharding_type": optim_sharding}


def _finalize_save(save_dir: str, name: str, meta: Dict[str, Any], keep_last: Optional[int]
                   ) -> None:
    """After every rank wrote its shards: meta file, rename (replacing a folder of that
    name atomically), ``latest``, pruning."""
    _barrier()
    if _is_rank0():
        final = os.path.join(save_dir, name)
        tmp = final + ".tmp"
        write_durably(os.path.join(tmp, META_NAME), json.dumps(meta, indent=1, default=str))
        fsync_dir(tmp)
        faults.before_checkpoint_rename(meta["iteration"])
        replace_dir(tmp, final)
        replace_file(os.path.join(save_dir, "latest"), name + "\n")
        if keep_last is not None:
            prune_checkpoints(save_dir, keep_last)
    _barrier()


def complete_checkpoints(save_dir: str) -> List[str]:
    """Names of the complete checkpoints under ``save_dir`` (``iter_NNNNNNN`` with
    ``lrattn.json``), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir) if ITER_NAME.fullmatch(n)
             and os.path.isfile(os.path.join(save_dir, n, META_NAME))]
    return sorted(names)


def prune_checkpoints(save_dir: str, keep_last: int) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, never the one ``latest``
    names (nothing at all when ``latest`` names no complete checkpoint); returns the
    deleted names. Incomplete ``.tmp`` folders are left alone; ``.deleting`` folders of an
    interrupted earlier pruning are removed."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last {keep_last}: must keep at least 1 checkpoint")
    try:
        latest = latest_name(save_dir)
    except CheckpointError:
        latest = None
    if latest is None or not os.path.isfile(os.path.join(save_dir, latest, META_NAME)):
        return []
    names = complete_checkpoints(save_dir)
    deleted = [n for n in names[:-keep_last] if n != latest]
    for n in deleted:
        # Rename first: a crash mid-delete leaves a .deleting folder, never a half
        # checkpoint that looks complete.
        doomed = os.path.join(save_dir, n + ".deleting")
        os.replace(os.path.join(save_dir, n), doomed)
    if deleted:
        fsync_dir(save_dir)
    for n in os.listdir(save_dir):
        if n.endswith(".deleting") and ITER_NAME.fullmatch(n[:-len(".deleting")]):
            shutil.rmtree(os.path.join(save_dir, n), ignore_errors=True)
    return deleted


def _layout_text(tp: int, pp: int, vp: Optional[int]) -> str:
    return f"TP={tp}, PP={pp}" + (f" with {vp} virtual stages per rank" if vp else "")


def check_optimizer_layout(meta: Dict[str, Any], config, path: str) -> None:
    """Refuse, in one line, distributed-optimizer state that cannot load at this layout.

    ``dp_reshardable`` state (the default) is cut by megatron along its per-model-chunk
    gradient buffers: it loads at any data-parallel size, but only at the TP, PP and virtual
    stage counts it was saved with (anything else fails deep inside megatron's loader with a
    ``KeyError`` about ``dp_group_idx``). ``fully_reshardable`` state and the plain
    optimizer's state load anywhere.
    """
    saved = meta.get("args") or {}
    if meta.get("optimizer_sharding", "dp_reshardable") != "dp_reshardable" or not saved.get(
            "use_distributed_optimizer"):
        return
    tp, pp = saved.get("tensor_model_parallel_size", 1), saved.get(
        "pipeline_model_parallel_size", 1)
    per_virtual = saved.get("num_layers_per_virtual_pipeline_stage")
    vp = saved["num_layers"] // (pp * per_virtual) if per_virtual and saved.get(
        "num_layers") else None
    now = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
           config.virtual_pipeline_model_parallel_size or None)
    if (tp, pp, vp) != now:
        raise CheckpointError(
            f"{path}: its distributed-optimizer state was saved in the dp_reshardable format at "
            f"{_layout_text(tp, pp, vp)} and loads only at that layout; this run has "
            f"{_layout_text(*now)}. Resume at the saved layout (with "
            "--dist-ckpt-optim-fully-reshardable there, its next checkpoints load at any "
            "layout)")


def load_checkpoint(load_dir: str, models: List, optimizer, scheduler, config,
                    records: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Load the newest checkpoint into ``models``/``optimizer``/``scheduler``; returns its meta.

    ``records`` (``architecture``, ``data``: what this run would save) are compared with
    the checkpoint's before any tensor is read (``checkpoint_io.check_compatible``)."""
    path = latest_checkpoint(load_dir)
    meta = read_meta(path)
    records = records or {}
    check_compatible(meta, config, path, records.get("architecture"), records.get("data"))
    check_optimizer_layout(meta, config, path)
    model_sd = model_sharded_state_dict(models)
    init_empty_adam_state(optimizer)
    metadata = _optim_metadata(meta.get("optimizer_sharding", "dp_reshardable"))
    loaded = load_state(path, models, model_sd, optimizer=optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=metadata))
    with torch.no_grad(), fully_reshardable_adam_load(
            optimizer, metadata["distrib_optim_sharding_type"] == "fully_reshardable"):
        # In fp32 the distributed optimizer's main parameters are views of the model's
        # leaf parameters; the in-place copy of the load must not be recorded by autograd.
        optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    return meta
