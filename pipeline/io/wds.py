"""WebDataset shards: plain POSIX tars whose members are ``<key>.<field>.<ext>``.

Written with :mod:`tarfile` rather than ``webdataset.TarWriter`` so that a shard's bytes depend
only on its content (mtime, owner and member order are fixed), which makes reruns byte-identical
and sha256s in ``_manifest.json`` meaningful. The files read back with ``webdataset.WebDataset``.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from pipeline.io.atomic import atomic_path


def encode_field(name: str, value) -> bytes:
    """Encode by extension: ``.npy`` arrays, ``.json`` objects, ``.txt`` strings, raw bytes."""
    if name.endswith(".npy"):
        buf = io.BytesIO()
        np.save(buf, np.asarray(value), allow_pickle=False)
        return buf.getvalue()
    if name.endswith(".json"):
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    if name.endswith(".txt"):
        return str(value).encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"field {name!r}: cannot encode {type(value).__name__}; use .npy/.json/.txt or bytes")


def decode_field(name: str, data: bytes):
    if name.endswith(".npy"):
        return np.load(io.BytesIO(data), allow_pickle=False)
    if name.endswith(".json"):
        return json.loads(data)
    if name.endswith(".txt"):
        return data.decode("utf-8")
    return data


def sample_key(sample_id: int) -> str:
    return f"{int(sample_id):012d}"


class ShardWriter:
    """Write one tar shard atomically: ``with ShardWriter(path) as w: w.write(key, fields)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.count = 0
        self._ctx = None
        self._tar: tarfile.TarFile | None = None

    def __enter__(self):
        self._ctx = atomic_path(self.path)
        tmp = self._ctx.__enter__()
        self._tar = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT)
        return self

    def write(self, key: str, fields: dict) -> None:
        if "." in key:
            raise ValueError(f"sample key {key!r} must not contain '.'")
        for name in sorted(fields):
            data = encode_field(name, fields[name])
            info = tarfile.TarInfo(f"{key}.{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._tar.addfile(info, io.BytesIO(data))
        self.count += 1

    def __exit__(self, exc_type, exc, tb):
        self._tar.close()
        return self._ctx.__exit__(exc_type, exc, tb)


def iter_shard(path: str | Path, fields: Iterable[str] | None = None) -> Iterator[dict]:
    """Yield ``{"__key__": key, field: decoded value, ...}`` for each sample, in shard order."""
    wanted = set(fields) if fields is not None else None
    current: dict | None = None
    with tarfile.open(path, "r") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, name = member.name.partition(".")
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key}
            if wanted is None or name in wanted:
                current[name] = decode_field(name, tar.extractfile(member).read())
    if current is not None:
        yield current
