"""Checkpoint integrity without training: what ``checkpoint_io`` refuses before torch or
megatron read a file, the one-writer lock, atomic replacement of a folder, pruning, the
compatibility record, and disk errors of the writer mapped to one line.

A real (tiny) distributed checkpoint is written once per module by ``dist_checkpointing``
in one process; the hostile variants are copies of it.
"""
from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tmpfs
from megatron_lrattn.training.checkpoint_io import (
    CheckpointError,
    check_compatible,
    check_no_code,
    latest_checkpoint,
    read_meta,
)


class _Payload:
    """Unpickling this runs ``touch MARKER`` (what a hostile file would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def dcp(tmp_path_factory):
    """A --save folder with one complete torch_dist checkpoint (tensors, a byte item,
    common.pt) and its lrattn.json."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from helpers import model_parallel_1x1

    root = tmp_path_factory.mktemp("ckpt")
    ckpt = root / "iter_0000002"
    ckpt.mkdir()
    with model_parallel_1x1():
        state = {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).view(3, 4)),
            "obj": ShardedObject("obj", {"step": 3, "names": ["a", "b"]}, (1,), (0,),
                                 replica_id=0),
            "plain": {"lr": 0.1},
        }
        dist_checkpointing.save(state, str(ckpt))
    (ckpt / "lrattn.json").write_text(json.dumps(
        {"iteration": 2, "consumed_samples": 8, "model_settings": {"residual": "standard"},
         "args": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128}}))
    (root / "latest").write_text("iter_0000002\n")
    return root


def _copy(dcp, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(dcp, dst)
    return dst


def test_a_real_checkpoint_passes(dcp):
    path = latest_checkpoint(str(dcp))
    assert read_meta(path)["iteration"] == 2


@pytest.mark.parametrize("where", ["prepended", "replaced"])
def test_pickle_payload_in_metadata_never_runs(dcp, tmp_path, where):
    root = _copy(dcp, tmp_path)
    marker = tmp_path / "PWNED"
    md = root / "iter_0000002" / ".metadata"
    payload = pickle.dumps(_Payload(marker))
    md.write_bytes(payload + md.read_bytes() if where == "prepended" else payload)
    with pytest.raises(CheckpointError, match=r"\.metadata: not a torch checkpoint metadata "
                                              r"file \(refers to posix\.system"):
        read_meta(str(root / "iter_0000002"))
    assert not marker.exists()


def test_pickle_payload_in_a_shard_byte_item_and_common_pt_never_runs(dcp, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = _copy(dcp, tmp_path)
    ckpt = root / "iter_0000002"
    marker = tmp_path / "PWNED"
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata))
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    shard = ckpt / info.relative_path
    data = shard.read_bytes()
    shard.write_bytes(data[:info.offset] + buf.getvalue() + data[info.offset + info.length:])
    info.length = len(buf.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="holds objects other than tensors"):
        check_no_code(str(ckpt))
    torch.save(_Payload(marker), ckpt / "common.pt")
    with pytest.raises(CheckpointError, match="holds objects other than tensors"):
        check_no_code(str(ckpt))
    assert not marker.exists()


def test_shard_paths_and_latest_must_stay_inside_the_folder(dcp, tmp_path):
    root = _copy(dcp, tmp_path)
    ckpt = root / "iter_0000002"
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        read_meta(str(ckpt))
    for bad in ("../elsewhere", "/etc", "iter_0000002/../../x", "iter_2"):
        (root / "latest").write_text(bad + "\n")
        with pytest.raises(CheckpointError, match="not a checkpoint name"):
            latest_checkpoint(str(root))
    outside = tmp_path / "outside"
    shutil.copytree(dcp / "iter_0000002", outside)
    (root / "iter_0000009").symlink_to(outside)
    (root / "latest").write_text("iter_0000009\n")
    with pytest.raises(CheckpointError, match="a link out of"):
        latest_checkpoint(str(root))


def test_replace_dir_is_atomic_and_the_fallback_leaves_a_loadable_copy(tmp_path):
    from megatron_lrattn.training import durable

    final, new = tmp_path / "iter_0000001", tmp_path / "iter_0000001.tmp"
    final.mkdir()
    (final / "lrattn.json").write_text('{"v": "old"}')
    new.mkdir()
    (new / "lrattn.json").write_text('{"v": "new"}')
    durable.replace_dir(str(new), str(final))
    assert json.loads((final / "lrattn.json").read_text())["v"] == "new" and not new.exists()

    # Without an atomic exchange: a crash between the two renames leaves NAME.replaced,
    # and `latest` still resolves to a complete checkpoint.
    new.mkdir()
    (new / "lrattn.json").write_text('{"v": "newer"}')
    real_replace = os.replace

    def crash_on_second(src, dst):
        if src == str(new):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    (tmp_path / "latest").write_text("iter_0000001\n")
    os.replace, saved = crash_on_second, os.replace
    try:
        with pytest.raises(KeyboardInterrupt):
            durable.replace_dir(str(new), str(final), exchange=lambda a, b: False)
    finally:
        os.replace = saved
    assert not final.exists()
    path = latest_checkpoint(str(tmp_path))
    assert path.endswith("iter_0000001.replaced")
    assert json.loads(Path(path, "lrattn.json").read_text())["v"] == "new"


def test_resave_of_an_existing_iteration_replaces_it_atomically(tmp_path, monkeypatch):
    """Before: the old folder was deleted, then the new one renamed; a crash in between
    left `latest` naming nothing. Now the folder is swapped in one step."""
    from megatron_lrattn.training import checkpoint, durable

    for n in (1, 2):
        d = tmp_path / f"iter_000000{n}"
        d.mkdir()
        (d / "lrattn.json").write_text(json.dumps({"v": "old"}))
    (tmp_path / "latest").write_text("iter_0000002\n")
    (tmp_path / "iter_0000002.tmp").mkdir()
    calls = []
    real = durable.replace_dir

    def watched(tmp, final, **kw):
        calls.append((tmp, final))
        assert os.path.isfile(os.path.join(final, "lrattn.json"))  # old one still there
        real(tmp, final, **kw)

    monkeypatch.setattr(checkpoint, "replace_dir", watched)
    checkpoint._finalize_save(str(tmp_path), "iter_0000002", {"iteration": 2, "v": "new"}, 1)
    assert calls and json.loads((tmp_path / "iter_0000002" / "lrattn.json").read_text())["v"] == "new"
    assert (tmp_path / "latest").read_text() == "iter_0000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest"]


def test_prune_removes_leftover_deleting_folders_and_keeps_all_without_latest(tmp_path):
    from megatron_lrattn.training.checkpoint import prune_checkpoints

    for i in (1, 2, 3):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / "lrattn.json").write_text("{}")
    assert prune_checkpoints(str(tmp_path), 1) == []  # no latest: nothing is deleted
    (tmp_path / "iter_0000000.deleting").mkdir()
    (tmp_path / "latest").write_text("iter_0000003\n")
    assert prune_checkpoints(str(tmp_path), 1) == ["iter_0000001", "iter_0000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "latest"]


def test_writer_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path):
    from megatron_lrattn.training.save_lock import LOCK_NAME, SaveFolderLock, SaveFolderLocked

    save = tmp_path / "new" / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron_lrattn.training.save_lock "
         "import SaveFolderLock; SaveFolderLock(sys.argv[1]).acquire(); print('held', "
         "flush=True); time.sleep(60)", str(save)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SaveFolderLocked, match=rf"another run writes this folder \(pid "
                                                   rf"{holder.pid} on "):
            SaveFolderLock(str(save)).acquire()
    finally:
        holder.kill()
        holder.wait()
    # The holder died (SIGKILL): its lock file stays, its flock is gone -> stale, taken over.
    assert (save / LOCK_NAME).read_text().startswith(f"{holder.pid} ")
    lock = SaveFolderLock(str(save)).acquire()
    assert (save / LOCK_NAME).read_text().startswith(f"{os.getpid()} ")
    lock.release()
    assert not (save / LOCK_NAME).exists()
    # A lock file of another host cannot be judged: refused with how to clear it.
    (save / LOCK_NAME).write_text("4242 some-other-host 2026-01-01T00:00:00\n")
    with pytest.raises(SaveFolderLocked, match=rf"rm {save / LOCK_NAME}"):
        SaveFolderLock(str(save)).acquire()
    # A lock refused or released leaves no folder it created.
    fresh = tmp_path / "a" / "b"
    SaveFolderLock(str(fresh)).acquire().release()
    assert not (tmp_path / "a").exists()


def test_compatibility_names_every_setting_and_skips_fields_old_checkpoints_lack():
    from types import SimpleNamespace

    config = SimpleNamespace(residual="lr_attnres", key_type="sliced", key_rank=16,
                             num_blocks=4, num_layers=2, hidden_size=64)
    settings = {"residual": "lr_attnres", "key": "sliced", "rank": 16, "num_blocks": 4,
                "num_layers": 2, "hidden_size": 64}
    arch = {"ffn_hidden_size": 128, "num_query_groups": 4, "swiglu": True, "vocab_size": 4096,
            "bf16": False, "normalization": "RMSNorm"}
    meta = {"model_settings": settings, "architecture": arch,
            "data": {"tokenizer": "abc", "datasets": ["x (1 + 2 bytes)"], "split": "98,2,0"}}
    check_compatible(meta, config, "p", dict(arch), dict(meta["data"]))
    for field, value in (("ffn_hidden_size", 96), ("vocab_size", 8000), ("swiglu", False),
                         ("bf16", True), ("num_query_groups", 2)):
        with pytest.raises(CheckpointError) as e:
            check_compatible(meta, config, "p", dict(arch, **{field: value}))
        assert str(e.value) == (f"p was made with other model settings ({field}: saved "
                                f"{arch[field]!r}, requested {value!r})")
    with pytest.raises(CheckpointError, match=r"trained on other data \(tokenizer: saved 'abc', "
                                              r"requested 'def'\)"):
        check_compatible(meta, config, "p", dict(arch), dict(meta["data"], tokenizer="def"))
    # A checkpoint written before `architecture` and `data` were recorded: the fields its
    # saved args hold are compared, the rest skipped.
    old = {"model_settings": settings, "args": {"ffn_hidden_size": 128}}
    check_compatible(old, config, "p", dict(arch, vocab_size=1, bf16=True), {"tokenizer": "z"})
    with pytest.raises(CheckpointError, match="ffn_hidden_size: saved 128, requested 96"):
        check_compatible(old, config, "p", dict(arch, ffn_hidden_size=96))


def test_disk_errors_are_found_behind_torch_and_megatron_wrappers(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_lrattn.training.durable import disk_error

    wrapped = CheckpointException("write failed", {0: OSError(errno.ENOSPC, "No space left")})
    assert disk_error(wrapped).errno == errno.ENOSPC
    text_only = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . "
                             "unexpected pos 704 vs 598")
    assert disk_error(text_only).errno == errno.EIO
    assert disk_error(RuntimeError("[Errno 5] Input/output error")).errno == errno.EIO
    assert disk_error(ValueError("a bad shape")) is None


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        yield disk


def test_a_real_full_disk_during_a_save_is_one_line_and_leaves_no_tmp(small_disk):
    """A real 256 KiB tmpfs: the torch writer fails with ENOSPC (or a short write that
    carries no OS error); the save ends in one CheckpointError and removes its .tmp."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from helpers import model_parallel_1x1
    from megatron_lrattn.training import checkpoint

    class _Opt:
        def sharded_state_dict(self, model_sd, metadata=None):
            return {}

    class _Sched:
        def state_dict(self):
            return {}

    class _Model(torch.nn.Module):
        def sharded_state_dict(self):
            return {"w": ShardedTensor.from_rank_offsets("w", torch.randn(512, 512))}

    from types import SimpleNamespace

    config = SimpleNamespace(residual="standard", key_type="sliced", key_rank=None,
                             num_blocks=1, num_layers=1, hidden_size=512)
    with model_parallel_1x1(), pytest.raises(CheckpointError) as e:
        checkpoint.save_checkpoint(str(small_disk), 1, [_Model()], _Opt(), _Sched(), config, 0)
    message = str(e.value)
    assert "\n" not in message and "iter_0000001.tmp: checkpoint save failed (" in message
    assert "no earlier checkpoint" in message
    assert os.listdir(small_disk) == []


@pytest.mark.slow
def test_resume_with_other_settings_is_one_line_through_the_cli(tmp_path):
    """``lrattn-pretrain --load`` of a checkpoint made with another vocabulary or FFN width
    stops before any tensor is read, in one line naming the setting and both values, and
    leaves the checkpoint as it was."""
    from helpers import cli_env

    base = [sys.executable, "-m", "megatron_lrattn.cli.pretrain", "--preset", "tiny",
            "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--no-progress", "--mock-data", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--cache-dir", str(tmp_path / "cache")]
    env = cli_env(tmp_path / "cache")
    ckpt = tmp_path / "A"
    made = subprocess.run(base + ["--vocab-size", "4096", "--save", str(ckpt)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    before = sorted(p.name for p in ckpt.rglob("*"))
    for flags, needle in ((["--vocab-size", "8192"], "vocab_size: saved 4096, requested 8192"),
                          (["--vocab-size", "4096", "--ffn-hidden-size", "256"],
                           "ffn_hidden_size: saved 352, requested 256")):
        run = subprocess.run(base + ["--train-iters", "3", "--load", str(ckpt), "--save",
                                     str(ckpt)] + flags,
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("lrattn-pretrain: error: ") and needle in last, last
        assert sorted(p.name for p in ckpt.rglob("*")) == before
