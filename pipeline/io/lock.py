"""One writer per folder: an exclusive ``flock`` on ``<folder>/_lock``.

The stages lock the artifact folder they write (pipeline/io/artifacts.py), the trainer the run
folder it trains in (train/loop.py). ``flock`` belongs to the open file: the kernel drops it when
the holder exits for any reason, kill -9 included. The file's text (pid, host, start time) names
the holder in the message a second writer gets, and is cleared on release, so text found under a
free lock is the trace of a holder that died: the lock is taken, with a note naming it.

One case keeps a dead process's lock held: a child it forked without exec (a DataLoader worker, a
multiprocessing fork) inherited the descriptor and outlives it. When the text names a process of
this host that is gone, the lock file is replaced (the orphan keeps the old, unlinked one) and the
note says so.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

LOCK_NAME = "_lock"

_HOLDER = re.compile(r"pid (\d+) on (\S+)")

# Locks this process holds, by folder (re-entrant within one process: a stage that failed in a
# test and is run again in the same process takes its own lock again).
_HELD: dict[str, int] = {}


class FolderBusy(RuntimeError):
    """Another live process holds the folder's lock; the message names it (pid, host, since)."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_text(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip()


def _gone(holder: str) -> bool:
    """``holder`` names a process of this host that no longer exists."""
    m = _HOLDER.match(holder)
    return bool(m) and m.group(2) == socket.gethostname() and not pid_alive(int(m.group(1)))


def _is_file_at(fd: int, path: Path) -> bool:
    """The open file ``fd`` is still the one at ``path`` (no other process replaced it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def lock_folder(folder: str | os.PathLike, doing: str = "written",
                note: Callable[[str], None] | None = None) -> bool:
    """Take ``<folder>/_lock`` or raise :class:`FolderBusy`: "<folder> is being <doing> by another
    run (pid N on HOST since T); wait for it to finish or stop it".

    Returns True when taken now, False when this process already holds it. ``note`` receives the
    one line saying that the lock of a dead holder was taken over (default: the ``pipeline`` log).
    """
    key = str(Path(folder).resolve())
    if key in _HELD:
        return False
    path = Path(folder) / LOCK_NAME
    taken_over = ""
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd) or "another process"
            if not taken_over and _gone(holder) and _is_file_at(fd, path):
                os.close(fd)
                path.unlink(missing_ok=True)  # the orphan that holds it keeps the unlinked file
                taken_over = f"{holder}, which is no longer running (a process it forked still held the lock)"
                continue
            os.close(fd)
            raise FolderBusy(f"{folder} is being {doing} by another run ({holder}); wait for it to finish or stop it") from None
        if not _is_file_at(fd, path):  # another process replaced the file between open and flock
            os.close(fd)
            continue
        left = _holder_text(fd)
        if left and not taken_over:
            taken_over = f"{left}, which ended without releasing it"
        os.ftruncate(fd, 0)
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}".encode(), 0)
        _HELD[key] = fd
        if taken_over:
            (note or logging.getLogger("pipeline").warning)(f"{folder}: took over the lock of {taken_over}")
        return True
    raise FolderBusy(f"{folder}: its lock file {path} keeps being replaced by another process")


def unlock_folder(folder: str | os.PathLike | None = None) -> None:
    """Release the lock on ``folder`` (or every folder lock this process holds), clearing its text."""
    keys = list(_HELD) if folder is None else [str(Path(folder).resolve())]
    for key in keys:
        fd = _HELD.pop(key, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a clean release leaves no holder behind to report
            os.close(fd)  # closing the only descriptor releases the flock
