"""Reading the files of a training run folder (``config.json``, ``eval/<tag>/results.parquet``,
``eval/<tag>/metrics.json``) for tables across runs: `train compare` (plain, ``--over-seeds``,
``--paper``) and the report's training section. A file that cannot be read raises
:class:`CorruptRunFile`, one line naming it; those readers skip that run folder, name it, and go on
with the others.
"""

from __future__ import annotations

import errno
import json
import stat
from pathlib import Path
from typing import Any

LFS_POINTER = b"version https://git-lfs.github.com/spec"

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


class CorruptRunFile(ValueError):
    """A file of a run folder that is not readable (the message names it and the problem)."""


def _why(e: BaseException) -> str:
    from pipeline.errors import describe_exception

    return describe_exception(e, 160)


def not_regular(path: str | Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file (a FIFO, a socket, a device, a
    folder: reading one could block forever or never end), else ``None``."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return None
    return next((what for test, what in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")


def require_regular(path: str | Path, error=None) -> None:
    """Raise ``error`` (default :class:`CorruptRunFile`) in one line when ``path`` exists and is not
    a regular file: it is never opened."""
    what = not_regular(path)
    if what is not None:
        raise (error or CorruptRunFile)(f"{path}: is {what}, not a regular file: it is not read; remove it "
                                        "(the run writes it again)")


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def unwritable(e: BaseException) -> bool:
    """``e`` is the refusal of a write: permission denied, or a read-only file system."""
    return isinstance(e, OSError) and e.errno in _UNWRITABLE


def unwritable_line(folder: str | Path, e: OSError, fix: str = "make it writable or choose another folder") -> str:
    """One line for a folder (a run's, an output's) that cannot be written: the folder, the system's
    words, the file the write stopped at, the fix."""
    at = f" at {e.filename}" if e.filename and str(e.filename) != str(folder) else ""
    return f"{folder}: cannot write there ({e.strerror or type(e).__name__}{at}): {fix}"


def lfs_pointer(data: bytes) -> bool:
    """``data`` is a Git LFS pointer file (what a clone without `git lfs pull` holds)."""
    return data.startswith(LFS_POINTER)


def read_checked_bytes(path: str | Path, name: str | None = None, error=CorruptRunFile,
                       unreadable: str = "cannot be read") -> bytes:
    """The bytes of ``path``, refused in one line (``error``, naming ``name`` or the path) when it is not
    a regular file (a FIFO, a device: never opened), cannot be read, or is a Git LFS pointer. The one
    place a run file, a grid or a state file is read from disk."""
    name = name or str(path)
    what = not_regular(path)
    if what is not None:
        raise error(f"{name}: is {what}, not a regular file" + ("" if name != str(path) else
                    ": it is not read; remove it (the run writes it again)"))
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{name}: {unreadable} ({_why(e)})") from None
    if lfs_pointer(data):
        raise error(f"{name}: is a Git LFS pointer, not the file: fetch it with `git lfs pull`")
    return data


def read_json_file(path: str | Path) -> Any:
    """The JSON value in ``path`` (UTF-8); a Git LFS pointer or a file that is not regular is named as one."""
    data = read_checked_bytes(path, unreadable="corrupt or unreadable JSON")
    try:
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptRunFile(f"{path}: corrupt or unreadable JSON ({_why(e)})") from None


def read_parquet_file(path: str | Path, columns: list[str] | None = None):
    """The table in ``path`` (a pyarrow Table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    require_regular(path)
    try:
        with open(path, "rb") as f:
            if lfs_pointer(f.read(len(LFS_POINTER))):
                raise CorruptRunFile(f"{path}: is a Git LFS pointer, not the file: fetch it with `git lfs pull`")
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise CorruptRunFile(f"{path}: corrupt or unreadable Parquet file ({_why(e)})") from None


def read_config_file(path: str | Path) -> dict:
    """A run's ``config.json``: a JSON object of training options (anything else is corrupt)."""
    stored = read_json_file(path)
    if not isinstance(stored, dict):
        raise CorruptRunFile(f"{path}: expected a JSON object of training options, got {type(stored).__name__}")
    return stored


# the harness table's columns a reader of results needs (train/eval/harness.py writes them)
RESULT_KEYS = ("benchmark", "subset", "metric", "value")


def read_results_file(path: str | Path):
    """A results.parquet written by the evaluation harness (a pyarrow Table): one of another schema (a
    column missing, ``value`` not numbers) raises :class:`CorruptRunFile` naming the file and column."""
    import pyarrow.types as pt

    table = read_parquet_file(path)
    missing = [c for c in RESULT_KEYS if c not in table.column_names]
    if missing:
        raise CorruptRunFile(f"{path}: not a results table of `train eval` (no column {', '.join(missing)}); "
                             "evaluate the run again with `train eval`")
    vt = table.schema.field("value").type
    if not (pt.is_integer(vt) or pt.is_floating(vt) or pt.is_null(vt) or pt.is_decimal(vt)):
        raise CorruptRunFile(f"{path}: column value holds {vt}, not numbers: not a results table of `train eval`; "
                             "evaluate the run again with `train eval`")
    return table


def skipped_line(errors: list[str]) -> str:
    """The note a table across runs ends with: the run folders it skipped and why."""
    return f"skipped {len(errors)} run folder(s) with a corrupt file: " + "; ".join(errors) if errors else ""
