"""The checkpoint format, its resolver and its one reader, shared by training (resume),
``lrattn-analyze`` and the Hugging Face converter.

A checkpoint folder ``iter_NNNNNNN`` holds a ``megatron.core.dist_checkpointing`` checkpoint
(global tensors: any TP/PP layout loads it) and ``lrattn.json`` (iteration, consumed samples,
LR schedule, model settings, the run's arguments). A ``--save`` folder holds checkpoint
folders and ``latest``, the name of the newest complete one. Model state is stored under
``model``: the keys of the bare model for one chunk, ``model0``, ``model1``, ... for virtual
pipeline stages. Nothing here imports megatron-core until a checkpoint is read.

Trust: a checkpoint folder may come from elsewhere. Before megatron or torch read it,
``read_meta`` checks what they would unpickle: torch's ``.metadata`` through an unpickler
that admits only the classes of torch's checkpoint metadata, every byte item of the shards
and ``common.pt`` through torch's weights-only unpickler, and every shard file name
recorded in the metadata must name a file inside the folder. ``latest`` must name an
``iter_NNNNNNN`` folder inside the ``--save`` folder.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
from typing import Any, Dict, Optional, Sequence

import torch

from megatron_lrattn.training.durable import replaced_path

DEPTH_FIELDS = {"residual": "residual", "key": "key_type", "rank": "key_rank",
                "num_blocks": "num_blocks", "num_layers": "num_layers", "hidden_size": "hidden_size"}
"""Names as stored in ``lrattn.json`` (stable across releases) -> the config field they record."""

META_NAME = "lrattn.json"
ITER_NAME = re.compile(r"iter_\d{7}")

ARCH_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "normalization", "swiglu", "qk_layernorm",
              "position_embedding_type", "untie_embeddings_and_output_weights",
              "disable_bias_linear", "residual", "key", "num_blocks", "depth_scale",
              "key_norm_eps", "use_distributed_optimizer")
"""``lrattn-pretrain`` flags (argument names) that change the computation or the stored
tensors; with ``rank`` (resolved), ``bf16`` (resolved), ``rotary_base`` (RoPE),
``max_position_embeddings`` (learned positions) and ``vocab_size`` they form a checkpoint's
``architecture`` record."""

_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file and the problem."""


def model_settings(config) -> Dict[str, Any]:
    """The config fields a checkpoint must agree on to be loaded."""
    return {name: getattr(config, field) for name, field in DEPTH_FIELDS.items()}


def latest_name(load_dir: str) -> Optional[str]:
    """The checkpoint name ``load_dir/latest`` holds (None without ``latest``).

    Raises:
        CheckpointError: ``latest`` is unreadable or holds anything but ``iter_NNNNNNN``
            (a path out of the folder included).
    """
    tracker = os.path.join(load_dir, "latest")
    if not os.path.isfile(tracker):
        return None
    try:
        with open(tracker, "rb") as f:
            raw = f.read(256)
        name = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        name = None
    if name is None or not ITER_NAME.fullmatch(name):
        raise CheckpointError(f"{tracker}: holds {raw[:40]!r}, not a checkpoint name "
                              "iter_NNNNNNN of this folder")
    return name


def latest_checkpoint(load_dir: str) -> str:
    """Folder of the newest complete checkpoint under ``load_dir`` (raises ``CheckpointError``).

    ``latest`` must name an ``iter_NNNNNNN`` folder inside ``load_dir`` (not a link out of
    it). When a save that replaced that folder was interrupted between its two renames (see
    ``durable.replace_dir``), the old copy ``iter_NNNNNNN.replaced`` is used.
    """
    name = latest_name(load_dir)
    tracker = os.path.join(load_dir, "latest")
    if name is None:
        raise CheckpointError(f"{tracker}: not found (no complete checkpoint in {load_dir})")
    path = os.path.join(load_dir, name)
    old = replaced_path(path)
    if old is not None and os.path.isfile(os.path.join(old, META_NAME)):
        path = old
    root = os.path.realpath(load_dir)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise CheckpointError(f"{path}: a link out of {load_dir}; a checkpoint must be a "
                              "folder inside it")
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
    """The ``lrattn.json`` of a checkpoint folder, after ``check_no_code`` of its files."""
    file = os.path.join(path, META_NAME)
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    check_no_code(path)
    return meta


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch's distributed-checkpoint ``.metadata``: only its own classes, torch
    dtypes and ``torch.Size``; any other global is refused before it is imported."""

    def find_class(self, module: str, name: str):
        if name in _DCP_MODULES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not part of a "
                                     "torch checkpoint's metadata")


def _refuse(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; not loaded (nothing in it was executed)")


def check_no_code(path: str) -> None:
    """Refuse a checkpoint folder whose files would make torch or megatron run code.

    Reads ``.metadata`` with ``_MetadataUnpickler``, checks that every shard file it names
    is a plain file name inside ``path``, reads every byte item of the shards and
    ``common.pt`` with torch's weights-only unpickler. Missing files are left to the
    reader (which reports a torn checkpoint).

    Raises:
        CheckpointError: one line naming the file and what it holds.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    file = os.path.join(path, ".metadata")
    if os.path.isfile(file):
        try:
            with open(file, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise _refuse(file, f"not a torch checkpoint metadata file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
            raise _refuse(file, f"holds a {type(md).__name__}, not torch checkpoint metadata")
        blobs: Dict[str, list] = {}
        for index, info in md.storage_data.items():
            rel = getattr(info, "relative_path", None)
            if (not isinstance(rel, str) or not rel or rel != os.path.basename(rel)
                    or rel in (".", "..")):
                raise _refuse(file, f"names shard file {rel!r} outside the checkpoint folder")
            item = md.state_dict_metadata.get(getattr(index, "fqn", None))
            if isinstance(item, BytesStorageMetadata):
                blobs.setdefault(rel, []).append((index.fqn, info.offset, info.length))
        for rel, items in blobs.items():
            shard = os.path.join(path, rel)
            if not os.path.isfile(shard):
                continue
            with open(shard, "rb") as f:
                for fqn, offset, length in items:
                    f.seek(offset)
                    _weights_only(io.BytesIO(f.read(length)), shard, f"item {fqn}")
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        with open(common, "rb") as f:
            _weights_only(f, common, "it")


def _weights_only(stream, file: str, what: str) -> None:
    try:
        torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in first if "GLOBAL" in ln or "global" in ln),
                      first[0] if first else "")
        raise _refuse(file, f"{what} holds objects other than tensors and plain data "
                            f"({detail[:160]})") from None
    except Exception:  # noqa: BLE001 - a torn item is the reader's error to report
        return


def architecture(args, config, vocab_size: int) -> Dict[str, Any]:
    """What a checkpoint records of the computation it was made for (``ARCH_FLAGS`` plus
    the resolved key rank, bf16, position-embedding parameters and the tokenizer's
    vocabulary size)."""
    arch = {flag: getattr(args, flag, None) for flag in ARCH_FLAGS}
    arch["rank"] = config.key_rank if config.residual != "standard" else None
    arch["bf16"] = bool(config.bf16)
    if arch["position_embedding_type"] == "rope":
        arch["rotary_base"] = getattr(args, "rotary_base", None)
    else:
        arch["max_position_embeddings"] = getattr(args, "max_position_embeddings", None)
    arch["vocab_size"] = int(vocab_size)
    return arch


def _saved_architecture(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint's ``architecture``; for checkpoints written before it was recorded,
    the ``ARCH_FLAGS`` found in its saved arguments (fields it lacks are not compared)."""
    arch = meta.get("architecture")
    if isinstance(arch, dict):
        return arch
    args = meta.get("args") or {}
    return {flag: args[flag] for flag in ARCH_FLAGS if flag in args}


def _differences(saved: Dict[str, Any], current: Dict[str, Any]) -> list:
    return [f"{k}: saved {saved[k]!r}, requested {v!r}" for k, v in current.items()
            if k in saved and saved[k] != v]


def check_compatible(meta: Dict[str, Any], config, path: str,
                     current: Optional[Dict[str, Any]] = None,
                     identity: Optional[Dict[str, Any]] = None) -> None:
    """Refuse, before any tensor is read, a checkpoint made for another computation.

    Args:
        meta: the checkpoint's ``lrattn.json``.
        config: the run's model config (residual mode, key type, rank, N, shape).
        path: the checkpoint folder (named in the message).
        current: the run's ``architecture`` record (every field that changes the
            computation); fields the checkpoint does not record are skipped.
        identity: the run's ``data_identity`` (tokenizer and corpus).

    Raises:
        CheckpointError: one line naming each differing setting, the saved and the
            requested value.
    """
    saved = meta.get("model_settings", {})
    diffs = _differences(saved, model_settings(config))
    if current is not None:
        arch = {k: v for k, v in _saved_architecture(meta).items() if k not in saved}
        diffs += _differences(arch, current)
    if diffs:
        raise CheckpointError(f"{path} was made with other model settings ({'; '.join(diffs)})")
    saved_identity = meta.get("data")
    if identity is not None and isinstance(saved_identity, dict):
        diffs = _differences(saved_identity, identity)
        if diffs:
            raise CheckpointError(f"{path} was trained on other data ({'; '.join(diffs)}); "
                                  "resume with the --data-path, --tokenizer-model and --split "
                                  "it was saved with")


def tokenizer_identity(tokenizer_dir: str) -> str:
    """A digest of a tokenizer folder's files (its vocabulary and merges)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(os.listdir(tokenizer_dir)):
        file = os.path.join(tokenizer_dir, name)
        if os.path.isfile(file) and name.startswith(("tokenizer", "vocab", "merges",
                                                      "special_tokens", "added_tokens")):
            h.update(name.encode() + b"\0")
            with open(file, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def data_identity(prefixes: Sequence[str], weights, split: str, tokenizer_dir: str
                  ) -> Dict[str, Any]:
    """What a checkpoint records of its training data: the tokenizer digest, and per
    dataset its file name and sizes (not its folder: the data may move), the blend weights
    and the split."""
    files = []
    for prefix in prefixes:
        sizes = [os.path.getsize(prefix + ext) if os.path.isfile(prefix + ext) else None
                 for ext in (".bin", ".idx")]
        files.append(f"{os.path.basename(prefix)} ({sizes[0]} + {sizes[1]} bytes)")
    return {"tokenizer": tokenizer_identity(tokenizer_dir), "datasets": files,
            "weights": list(weights) if weights is not None else None, "split": split}


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
