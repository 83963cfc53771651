"""Publishing a finished checkpoint in one atomic step, and the lock that serialises saves.

The files of a save go to ``.<name>.hp-dcp-partial`` next to the target. Publishing is one
rename: onto a missing target with ``rename(2)``, onto an existing checkpoint with
``renameat2(RENAME_EXCHANGE)``, which swaps the two directories atomically, so the path always
holds a complete checkpoint (the previous one, then the new one); the previous one, now at the
staging name, is moved aside and deleted. Where the kernel or file system cannot exchange, the
old directory is renamed aside first (a short window without a checkpoint, logged).

Saves to one path take ``.<name>.hp-dcp-lock``: an ``flock`` held for the whole save (released by
the kernel when the process dies) and a record of the owner's host and pid, for the messages.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from hp_dcp._files import fsync_dir
from hp_dcp.errors import ConcurrentSaveError

__all__ = ["SaveLock", "exchange_dirs", "lock_file", "publish", "recover_leftovers", "retired_dir"]

_log = logging.getLogger("hp_dcp.storage")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def lock_file(target: Path) -> Path:
    """The lock file of saves into ``target``."""
    return target.parent / f".{target.name}.hp-dcp-lock"


def retired_dir(target: Path) -> Path:
    """Where the replaced checkpoint waits for deletion."""
    return target.parent / f".{target.name}.hp-dcp-old"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SaveLock:
    """The lock of one save into ``target``: ``flock`` plus an owner record (host, pid).

    Args:
        target: the checkpoint directory.
        save_id: the save taking the lock (recorded for messages).
    """

    def __init__(self, target: Path, save_id: str) -> None:
        self.path = lock_file(target)
        self._save_id = save_id
        self._file: IO[str] | None = None

    def _owner(self) -> dict[str, object]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                return data
        return {}

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            ConcurrentSaveError: another live process holds it (its host and pid are named).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            f = self.path.open("a+")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                owner = self._owner()
                raise ConcurrentSaveError(
                    f"another save into {self.path.parent} is in progress (lock {self.path} held "
                    f"by host {owner.get('host', '?')} pid {owner.get('pid', '?')}, save "
                    f"{owner.get('save_id', '?')}); wait for it or save to another path"
                ) from None
            # The holder may have removed the file between our open and our flock: retry then.
            try:
                same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        self._report_stale(self._owner())
        f.seek(0)
        f.truncate()
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "save_id": self._save_id,
            "since": time.time(),
        }
        f.write(json.dumps(record))
        f.flush()
        self._file = f

    def _report_stale(self, owner: dict[str, object]) -> None:
        if not owner:
            return
        pid, host = owner.get("pid"), owner.get("host")
        dead = isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid)
        _log.warning(
            "hp-dcp: taking over the stale lock %s left by host %s pid %s (%s)",
            self.path,
            host,
            pid,
            "that process is dead" if dead else "it no longer holds the lock",
        )

    def release(self) -> None:
        """Release the lock and remove the lock file (no-op when not held)."""
        f, self._file = self._file, None
        if f is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        f.close()

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._file is not None


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically; ``False`` where the platform cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), str(b))


def publish(staging: Path, target: Path, sync: bool) -> None:
    """Put the complete checkpoint at ``staging`` at ``target`` in one rename."""
    if not target.exists():
        staging.rename(target)
        if sync:
            fsync_dir(target.parent)
        return
    retired = retired_dir(target)
    if retired.exists():
        shutil.rmtree(retired)
    if exchange_dirs(staging, target):
        if sync:
            fsync_dir(target.parent)
        staging.rename(retired)  # the previous checkpoint, now at the staging name
    else:
        _log.warning(
            "hp-dcp: this file system cannot exchange directories atomically; replacing %s "
            "with two renames (the previous checkpoint stays at %s until the second one)",
            target,
            retired,
        )
        target.rename(retired)
        staging.rename(target)
    if sync:
        fsync_dir(target.parent)
    shutil.rmtree(retired, ignore_errors=True)


def recover_leftovers(
    target: Path,
    staging: Path,
    saved_at: Callable[[Path], int | None],
    sync: bool,
    publish_fn: Callable[[Path, Path, bool], None] = publish,
) -> None:
    """Inspect what an interrupted save left next to ``target`` (called under the lock).

    ``saved_at(dir)`` returns the save time recorded in a complete checkpoint, ``None`` for an
    incomplete one. A complete staging directory newer than ``target`` (or with no target) is
    published; an older one is the previous checkpoint of an interrupted exchange and is
    removed, as is an incomplete one. A retired directory is put back if ``target`` is missing.
    ``publish_fn`` publishes (the writer's: in place when ``target`` holds other files).
    """
    retired = retired_dir(target)
    if retired.is_dir() and not target.exists() and saved_at(retired) is not None:
        _log.warning("hp-dcp: restoring the previous checkpoint %s to %s", retired, target)
        retired.rename(target)
    if retired.exists():
        _log.warning("hp-dcp: removing the replaced checkpoint %s left by a save", retired)
        shutil.rmtree(retired)
    if not staging.exists():
        return
    new = saved_at(staging)
    if new is None:
        _log.warning(
            "hp-dcp: removing %s, the incomplete directory of an interrupted save", staging
        )
        shutil.rmtree(staging)
        return
    old = saved_at(target) if target.is_dir() else None
    if old is None or new > old:
        _log.warning(
            "hp-dcp: recovered %s, a complete save interrupted before it was published; it is "
            "now at %s",
            staging,
            target,
        )
        publish_fn(staging, target, sync)
    else:
        _log.warning(
            "hp-dcp: removing %s, a previous checkpoint left by an interrupted replacement",
            staging,
        )
        shutil.rmtree(staging)
