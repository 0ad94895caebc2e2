"""Crash-safe file-system steps shared by checkpoints and every tool that writes a folder.

Each output is written under a temporary name, flushed to disk and renamed into place, so
a crash at any point leaves either the old complete output or the new complete one under
the final name, never a half-written one. A folder that already exists is replaced by an
atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``); where the file system refuses
that, the old folder is first renamed to ``NAME.replaced`` and removed only after the new
one is in place (``replaced_path`` lets a reader find it after a crash in between).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
from typing import Iterator, Optional

REPLACED_SUFFIX = ".replaced"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_DISK_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_DISK_WORDS = {os.strerror(e): e for e in _DISK_ERRNOS}
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def write_durably(path: str, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it (the caller renames it into place)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """fsync a folder, so that renames inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: write ``path.tmp``, fsync, rename,
    fsync the folder. A symbolic link is followed (its target is replaced); a path that is
    not a regular file (``/dev/null``, a FIFO, ``/dev/stdout``) is written through, never
    renamed over (as root a rename would replace the device itself)."""
    path = os.path.realpath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            f.write(text)
        return
    tmp = path + ".tmp"
    write_durably(tmp, text)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_dir(tmp: str, final: str, *, exchange=_exchange) -> None:
    """Move the complete folder ``tmp`` to ``final``, replacing a folder that is there.

    At every instant ``final`` is either the old complete folder or the new one (the
    exchange), or, where the file system cannot exchange, the old one waits as
    ``final.replaced`` until the new one is in place (see ``replaced_path``).
    """
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.lexists(final):
        os.replace(tmp, final)
    elif exchange(tmp, final):
        shutil.rmtree(tmp)
    else:
        old = final + REPLACED_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        fsync_dir(parent)
        os.replace(tmp, final)
        fsync_dir(parent)
        shutil.rmtree(old)
    fsync_dir(parent)


def replaced_path(final: str) -> Optional[str]:
    """The old copy of ``final`` left by a crash inside ``replace_dir``'s fallback, if any."""
    old = final + REPLACED_SUFFIX
    return old if not os.path.lexists(final) and os.path.isdir(old) else None


def disk_error(e: BaseException) -> Optional[OSError]:
    """The file-system error behind ``e`` (disk full, I/O, quota, read-only, permissions),
    looked for in its cause/context chain, in torch's ``CheckpointException`` per-rank
    failures and, where a writer process passed only text on, in the message."""
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f if isinstance(f, BaseException) else getattr(f, "exc", None))
                text = str(f)
                err = _errno_in_text(text)
                if err is not None:
                    return err
        todo += [cur.__cause__, cur.__context__]
        err = _errno_in_text(str(cur))
        if err is not None:
            return err
    return None


def probe_disk(folder: str, size: int = 1 << 20) -> Optional[OSError]:
    """Write and fsync a probe file of ``size`` bytes in ``folder`` (then remove it): the OS
    error a writer met (a full disk, an I/O error) when it reported none of its own, else
    None."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".lrattn_space_probe_", dir=folder)
    except OSError as e:
        return e
    try:
        os.write(fd, b"\0" * size)
        os.fsync(fd)
        return None
    except OSError as e:
        return e
    finally:
        os.close(fd)
        os.unlink(probe)


def _errno_in_text(text: str) -> Optional[OSError]:
    if "unexpected pos" in text:
        # torch's zip writer (torch.save, the checkpoint writer's workers) reports a short
        # write -- a disk that filled up or failed -- this way, without the OS error.
        return OSError(errno.EIO, "short write: the disk filled up or failed")
    m = _ERRNO_TEXT.search(text)
    if m and int(m.group(1)) in _DISK_ERRNOS:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    for words, code in _DISK_WORDS.items():
        if words in text:
            return OSError(code, words)
    return None


def check_output_parent(flag: str, path: str) -> None:
    """Refuse an output path whose nearest existing parent is not a writable folder (a
    probe file is created and removed: the check also holds for root on a read-only file
    system).

    Raises:
        ValueError: one line naming the flag and the folder.
    """
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".lrattn_write_test_", dir=parent)
    except OSError as e:
        raise ValueError(f"{flag}: {parent} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def output_dir(final: str) -> Iterator[str]:
    """Write a folder atomically: yields a temporary sibling ``final.tmp-PID`` to write
    into; on success it replaces ``final`` (``replace_dir``), on any error it is removed
    and ``final`` is left as it was."""
    final = os.path.abspath(final)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.makedirs(tmp)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
