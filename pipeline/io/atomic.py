"""Atomic file writes: everything goes to a temporary name in the same folder, then is renamed.

A crash leaves either the old complete file or nothing, never a truncated shard that a rerun
would mistake for finished work; the temporary files it leaves (``.<name>.<random>.tmp``) are
what :func:`remove_stale_tmp` deletes when the folder's next writer holds its lock.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


# the temporary names this project writes: atomic_path's (8 hex digits), tempfile.mkdtemp's (8 of
# [a-z0-9_]: train/encoders.py), a pid (older versions' .last.pt.<pid>.tmp) and the crash probes' folders
# (pipeline/crashes.py)
TMP_NAME = re.compile(r"\.[^/]+\.(?:[a-z0-9_]{8}|[0-9]+)\.tmp|\.probe-[0-9A-Za-z_-]+\.tmp")


def tmp_name(path: Path) -> Path:
    """A temporary name beside ``path`` (``.<name>.<8 hex>.tmp``: one :func:`remove_stale_tmp` knows)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


_tmp_name = tmp_name


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path; on success it is fsynced and renamed onto ``path``. An OSError of
    the write that names no file, or the temporary one (pyarrow's "[Errno 28] Error writing bytes
    to file"), is raised again naming ``path``: a full disk says which file it stopped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename not in (None, str(tmp)) or e.errno is None:
            raise
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)  # the system's words, not pyarrow's "Error writing bytes..."
        raise OSError(e.errno, os.strerror(e.errno) if full else (e.strerror or str(e)), str(path)) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_stale_tmp(folder: str | Path) -> int:
    """Delete ``.<name>.<random>.tmp`` files (and folders) a killed writer left under ``folder``;
    returns how many. Only names this project writes (:data:`TMP_NAME`), and only for a folder the
    project made (an artifact folder; a run folder carrying its marker, train/run_folder.py) whose
    lock (pipeline/io/lock.py) this process holds: the temporary files of a live writer look the same."""
    n = 0
    for p in Path(folder).rglob(".*.tmp"):
        if not TMP_NAME.fullmatch(p.name) or p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        n += 1
    return n


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)


def write_json_atomic(path: str | Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_parquet_atomic(table: pa.Table, path: str | Path, compression: str = "zstd", if_changed: bool = False) -> None:
    """A zero-row table is written with no row group at all (schema only): ``pq.write_table`` would
    write one row group of 0 rows, which readers that size their batches by the first row group
    (Hugging Face ``datasets``: "BatchSize must be greater than 0") cannot load. ``if_changed``:
    leave an existing file with the same bytes untouched (a rerun with nothing to do rewrites nothing)."""

    def write(where) -> None:
        if table.num_rows == 0:
            pq.ParquetWriter(where, table.schema, compression=compression).close()
        else:
            pq.write_table(table, where, compression=compression)

    path = Path(path)
    if if_changed and path.is_file():
        sink = pa.BufferOutputStream()
        write(sink)
        data = sink.getvalue().to_pybytes()
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return
        write_bytes_atomic(path, data)
        return
    with atomic_path(path) as tmp:
        write(tmp)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(*parts) -> str:
    """Stable hash of JSON-serialisable parts (dict key order does not matter)."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
