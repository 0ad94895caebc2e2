"""One writer per ``--save`` folder: a lock file held for the life of the run.

``SAVE/.lrattn-writer.lock`` holds ``pid host start-time`` of the run that writes the folder
and is ``flock``-ed by it (the kernel drops an flock when its process dies, also on
SIGKILL). A second run that finds the lock held is refused before it writes anything. A
lock file left by a dead process of this host (its flock is free) is stale: it is taken
over with a warning naming the dead process. A lock file of another host whose flock is
free cannot be judged from here (the owner may run on a file system without shared
locks): the run is refused with the command that clears it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from typing import Optional

from megatron_lrattn.training.checkpoint_io import CheckpointError

logger = logging.getLogger(__name__)

LOCK_NAME = ".lrattn-writer.lock"


class SaveFolderLocked(CheckpointError):
    """Another run writes the folder (or left a lock that cannot be judged)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(text: str):
    parts = text.split()
    try:
        return int(parts[0]), parts[1], " ".join(parts[2:])
    except (IndexError, ValueError):
        return None, None, ""


class SaveFolderLock:
    """The writer lock of ``save_dir`` (created if missing).

    Args:
        save_dir: the ``--save`` folder.

    Use ``acquire()`` at start and ``release()`` at the end (or as a context manager).
    """

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.fd: Optional[int] = None
        self.created: list = []

    def acquire(self) -> "SaveFolderLock":
        """Take the lock or raise ``SaveFolderLocked`` (one line: who holds it, what to do)."""
        where = os.path.abspath(self.save_dir)
        while not os.path.exists(where):
            self.created.append(where)
            where = os.path.dirname(where)
        os.makedirs(self.save_dir, exist_ok=True)
        while True:
            fd = self._open_locked()
            # The holder removes the file when it releases: a lock on the removed file is
            # no lock, try again on the new one.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            pid, host, since = _owner(os.pread(fd, 4096, 0).decode(errors="replace"))
            here = socket.gethostname()
            if pid is not None and pid != os.getpid():
                if host != here:
                    raise SaveFolderLocked(
                        f"--save {self.save_dir}: locked by pid {pid} on host {host} (since "
                        f"{since}), which cannot be checked from {here}; if that run has "
                        f"ended, remove the lock: rm {self.path}")
                if _alive(pid):
                    logger.warning("%s: named pid %d, which is alive but holds no lock (a "
                                   "reused pid); taking the lock", self.path, pid)
                else:
                    logger.warning("%s: stale lock of pid %d (not running since %s); taking "
                                   "it over", self.path, pid, since)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {here} {stamp}\n".encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._remove_created()
            raise
        self.fd = fd
        return self

    def _open_locked(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SaveFolderLocked(f"--save {self.save_dir}: cannot lock {self.path} "
                                       f"({e.strerror})") from None
            pid, host, since = _owner(text)
            who = (f"pid {pid} on {host}" + (f" since {since}" if since else "")) if pid \
                else "another process"
            raise SaveFolderLocked(
                f"--save {self.save_dir}: another run writes this folder ({who}); wait for "
                "it to end or choose another --save folder") from None
        return fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent); folders the lock created
        are removed again while they are empty (a run refused at start leaves nothing)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self.created:
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.created = []

    def __enter__(self) -> "SaveFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
