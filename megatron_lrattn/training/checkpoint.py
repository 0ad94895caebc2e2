"""Checkpoints through ``megatron.core.dist_checkpointing`` (any TP/PP layout loads any other).

Layout of ``--save DIR``::

    DIR/iter_0000300/            distributed checkpoint (model, optimizer)
    DIR/iter_0000300/lrattn.json iteration, consumed samples, LR schedule, model settings
    DIR/latest                   name of the newest complete checkpoint

A checkpoint is written to ``iter_N.tmp`` and renamed when every rank has finished, and
``latest`` is replaced atomically afterwards, so an interrupted save never damages the last
good checkpoint. With ``keep_last`` older complete checkpoints are deleted after a save
succeeded (never the one ``latest`` names). An asynchronous save (GPU) writes the shards in a
background process; the rename, ``latest`` and pruning happen when it is finalized.

The distributed optimizer's state is saved in megatron's ``dp_reshardable`` format by default
(each rank writes its own shard; the checkpoint loads at any data-parallel size but the same
TP/PP layout) or ``fully_reshardable`` (gathered per parameter; loads at any TP/PP/DP layout,
at the cost of an all-gather of the optimizer state). The model is always fully reshardable.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lrattn.training import faults

# Names as stored in lrattn.json (stable across releases) -> the config field they record.
DEPTH_FIELDS = {"residual": "residual", "key": "key_type", "rank": "key_rank",
                "num_blocks": "num_blocks", "num_layers": "num_layers", "hidden_size": "hidden_size"}
META_NAME = "lrattn.json"
OPTIM_SHARDINGS = ("dp_reshardable", "fully_reshardable")
_ITER_NAME = re.compile(r"iter_\d{7}")


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
    return {name: getattr(config, field) for name, field in DEPTH_FIELDS.items()}


def save_checkpoint(save_dir: str, iteration: int, models: List, optimizer, scheduler,
                    config, consumed_samples: int, args: Optional[Dict[str, Any]] = None, *,
                    keep_last: Optional[int] = None, optim_sharding: str = "dp_reshardable",
                    async_queue=None) -> str:
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
    model_sd = _model_sharded_state_dict(models)
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
    }
    finalize = partial(_finalize_save, save_dir, name, meta, keep_last)
    with _single_threaded_on_cpu():
        if async_queue is None:
            try:
                dist_checkpointing.save(state, tmp)
                faults.after_checkpoint_shards(iteration)
                finalize()
            except Exception as e:  # noqa: BLE001 - megatron wraps OSErrors in its own types
                _raise_write_error(e, save_dir, tmp)
                raise
        else:
            request = dist_checkpointing.save(state, tmp, async_sharded_save=True)
            request.add_finalize_fn(finalize)
            async_queue.schedule_async_request(request)
    return final


def _os_error(e: BaseException) -> Optional[OSError]:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _raise_write_error(e: BaseException, save_dir: str, tmp: str) -> None:
    """A save that failed on the file system (disk full, permissions, I/O): drop the
    partial ``.tmp`` folder and raise a one-line ``CheckpointError`` (``latest`` and every
    complete checkpoint are untouched). Other errors are left to the caller."""
    err = _os_error(e)
    if err is None:
        return
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            kept = f"{f.read().strip()} is still the latest checkpoint"
    except OSError:
        kept = "no earlier checkpoint"
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


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _optim_metadata(optim_sharding: str) -> Dict[str, Any]:
    if optim_sharding not in OPTIM_SHARDINGS:
        raise CheckpointError(f"optimizer sharding {optim_sharding!r}: use one of {OPTIM_SHARDINGS}")
    return {"distrib_optim_sharding_type": optim_sharding}


def _finalize_save(save_dir: str, name: str, meta: Dict[str, Any], keep_last: Optional[int]
                   ) -> None:
    """After every rank wrote its shards: meta file, rename, ``latest``, pruning."""
    _barrier()
    if _is_rank0():
        final = os.path.join(save_dir, name)
        tmp = final + ".tmp"
        _write_durably(os.path.join(tmp, META_NAME), json.dumps(meta, indent=1, default=str))
        faults.before_checkpoint_rename(meta["iteration"])
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(save_dir, "latest.tmp")
        _write_durably(latest_tmp, name + "\n")
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
        _fsync_dir(save_dir)
        if keep_last is not None:
            prune_checkpoints(save_dir, keep_last)
    _barrier()


def complete_checkpoints(save_dir: str) -> List[str]:
    """Names of the complete checkpoints under ``save_dir`` (``iter_NNNNNNN`` with
    ``lrattn.json``), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = [n for n in os.listdir(save_dir) if _ITER_NAME.fullmatch(n)
             and os.path.isfile(os.path.join(save_dir, n, META_NAME))]
    return sorted(names)


def prune_checkpoints(save_dir: str, keep_last: int) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, never the one ``latest``
    names; returns the deleted names. Incomplete ``.tmp`` folders are left alone."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last {keep_last}: must keep at least 1 checkpoint")
    names = complete_checkpoints(save_dir)
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            latest = f.read().strip()
    except OSError:
        latest = None
    deleted = [n for n in names[:-keep_last] if n != latest]
    for n in deleted:
        # Rename first: a crash mid-delete leaves a .tmp-like folder, never a half checkpoint
        # that looks complete.
        doomed = os.path.join(save_dir, n + ".deleting")
        os.replace(os.path.join(save_dir, n), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return deleted


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


def _distributed_torch_adams(optimizer) -> List[Tuple[int, Any]]:
    """``(index in the chain, optimizer)`` of every megatron ``DistributedOptimizer`` in
    ``optimizer`` (plain or chained) that wraps a torch Adam(W): the ones whose per-parameter
    ``step`` state megatron-core mishandles without Apex/TE."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [(i, opt) for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer]))
            if isinstance(opt, DistributedOptimizer)
            and isinstance(getattr(opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def _init_empty_adam_state(optimizer) -> None:
    """Give a fresh torch Adam(W) inside a distributed optimizer zero moments and step 0.

    Without Apex/TE, megatron's ``DistributedOptimizer.state_dict`` (called to build the
    loading state dict) reads every parameter's ``step`` and fails before the first step.
    The zeros are overwritten by the load; parameters are left untouched (unlike a dummy
    optimizer step, which would apply weight decay).
    """
    for _, opt in _distributed_torch_adams(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


@contextlib.contextmanager
def _fully_reshardable_adam_load(optimizer, active: bool):
    """Let megatron-core load ``fully_reshardable`` state into a torch Adam(W) (when
    ``active``).

    megatron's ``load_state_dict`` first gives every parameter's state a ``step`` (torch Adam
    keeps one per parameter), then copies the checkpoint's per-parameter tensors into every
    key of that state, and ``step`` is not among the tensors it read (the count lives in the
    param groups): ``KeyError: 'step'``. For the duration, each per-parameter copy runs with
    ``step`` held aside; ``_restore_adam_steps`` sets the saved count afterwards.
    """
    patched = []
    if active:
        for _, opt in _distributed_torch_adams(optimizer):
            original = opt._set_main_param_and_optimizer_states

            def copy_without_step(model_param, tensors, _opt=opt, _original=original):
                group, order = _opt.model_param_group_index_map[model_param]
                state = _opt.optimizer.state[_opt.optimizer.param_groups[group]["params"][order]]
                step = state.pop("step", None) if "step" not in tensors else None
                try:
                    _original(model_param, tensors)
                finally:
                    if step is not None:
                        state["step"] = step

            opt._set_main_param_and_optimizer_states = copy_without_step
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _restore_adam_steps(optimizer, loaded: Dict[str, Any]) -> None:
    """Give every parameter of a distributed optimizer's torch Adam(W) its own ``step``
    tensor holding the saved step count.

    megatron-core's ``DistributedOptimizer`` without Apex/TE loses the count on load: the
    bucket-space parameter state copies the template's ``step`` over the restored one, and
    ``load_state_dict`` puts one shared ``step`` tensor into every parameter's state (which
    torch's foreach Adam then increments once per parameter). Either way the bias
    correction of the resumed run is wrong. The count saved in the param groups is right.
    """
    single = len(getattr(optimizer, "chained_optimizers", [optimizer])) == 1
    for i, opt in _distributed_torch_adams(optimizer):
        inner = opt.optimizer
        saved = loaded if single else loaded[i]
        steps = {g.get("step") for g in saved.get("optimizer", {}).get("param_groups", [])}
        if len(steps) != 1 or None in steps:
            continue
        step = float(steps.pop())
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=state["step"].dtype,
                                             device=state["step"].device)


def load_checkpoint(load_dir: str, models: List, optimizer, scheduler, config) -> Dict[str, Any]:
    """Load the newest checkpoint into ``models``/``optimizer``/``scheduler``; returns its meta."""
    from megatron.core import dist_checkpointing

    path = latest_checkpoint(load_dir)
    meta = read_meta(path)
    check_compatible(meta, config, path)
    check_optimizer_layout(meta, config, path)
    model_sd = _model_sharded_state_dict(models)
    _init_empty_adam_state(optimizer)
    metadata = _optim_metadata(meta.get("optimizer_sharding", "dp_reshardable"))
    state = {"model": model_sd,
             "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                       metadata=metadata)}
    loaded = dist_checkpointing.load(state, path)
    if len(models) == 1:
        models[0].load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded["model"][f"model{i}"])
    with torch.no_grad(), _fully_reshardable_adam_load(
            optimizer, metadata["distrib_optim_sharding_type"] == "fully_reshardable"):
        # In fp32 the distributed optimizer's main parameters are views of the model's
        # leaf parameters; the in-place copy of the load must not be recorded by autograd.
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    return meta

