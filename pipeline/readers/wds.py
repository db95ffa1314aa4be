"""img2dataset-style WebDataset tars: ``<key>.jpg|.jpeg|.png|.webp`` + ``<key>.txt`` (+ ``<key>.json``).

``path`` is a folder (every ``*.tar`` in it, sorted by name), a glob, or one tar file. Shards must
be uncompressed, as img2dataset and WebDataset write them, because images are later read by offset.
Members of a sample are grouped by WebDataset's key rule (member name up to the first dot of its
base name) and must be adjacent, as WebDataset writers produce them. ``source_id`` is the key
(a key seen again in a later shard is flagged ``duplicate key``). The caption is the ``.txt``
content (stripped); without a ``.txt``, the ``caption`` field of the ``.json`` is used; its ``url``
(img2dataset writes one) is the ``split_key`` for ``dataset.splits``, else the key. Images stay
in the tar: ``image`` is ``"<abs tar>::<member>"`` (see ``readers.images.open_image``).
Tars are read header by header, so image bytes are skipped, not loaded. ``path`` may be a URL
(``s3://bucket/shards/`` or ``s3://bucket/shards/*.tar``): tars are then read through fsspec by
ranges, and ``image`` is ``"s3://bucket/shards/x.tar::<member>"``.

User-supplied tars are untrusted: nothing is ever extracted to disk (member names are only keys,
so ``../`` or absolute names cannot reach outside anything), links and other non-file members are
ignored, and a sample with a member larger than ``max_member_bytes`` (manifest
``dataset.max_member_bytes``, 64 MB) is rejected without reading that member.
"""
from __future__ import annotations

import glob
import json
import tarfile
from pathlib import Path
from typing import Iterator

from pipeline.readers.base import MISSING_IMAGE_FIELD, ReaderError, SourceRecord, abspath, add_caption, finish
from pipeline.readers.images import tar_ref

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def shard_paths(path: str | Path) -> list[Path]:
    s = str(path)
    from pipeline.io import storage

    if storage.is_remote(s) and any(ch in s for ch in "*?["):  # s3://bucket/shards/*.tar
        found = [storage.UrlPath(u) for u in storage.glob_urls(s)]
    elif any(ch in s for ch in "*?["):
        found = [abspath(f) for f in sorted(glob.glob(s))]
    else:
        p = abspath(s)
        if p.is_dir():
            found = sorted(p.glob("*.tar"))  # a URL folder: listed through fsspec
        elif p.is_file():
            found = [p]
        else:
            raise ReaderError(f"WebDataset {p}: no such file or folder")
    if not found:
        raise ReaderError(f"WebDataset {path}: no .tar shards found")
    return found


def split_key(name: str) -> tuple[str, str]:
    d, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


DEFAULT_MAX_MEMBER_BYTES = 64 * 1024**2


def _make_record(tar: Path, key: str, members: dict[str, tuple[str, bytes | None]], split: str, too_large=()) -> SourceRecord:
    rec = SourceRecord(source_id=key, image=None, captions=[], split=split)
    for problem in too_large:
        rec.problems.append((None, problem))
    img = next((members[e][0] for e in IMAGE_EXTS if e in members), None)
    if img is None:
        rec.problems.append((None, MISSING_IMAGE_FIELD))
    else:
        rec.image = tar_ref(tar, img)
    meta = None
    if "json" in members:
        try:
            meta = json.loads(members["json"][1].decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError:
            if "txt" not in members:
                rec.problems.append((None, "sample .json is not valid JSON"))
    if isinstance(meta, dict) and isinstance(meta.get("url"), str) and meta["url"].strip():
        rec.split_key = meta["url"].strip()  # dataset.splits: the image's source, stable across re-downloads
    if "txt" in members:
        add_caption(rec, members["txt"][1].strip())
    elif isinstance(meta, dict) and meta.get("caption") is not None:
        add_caption(rec, meta["caption"])
    return finish(rec)


class SeenKeys:
    """The keys met so far, in bounded memory per key: 8-byte hashes (blake2b) in a sorted numpy
    array plus a small buffer, with the index of the shard each was first seen in (12 bytes a key
    instead of a Python dict entry: ~12 MB for 1M keys). A 64-bit collision (p ~ 3e-8 at 1M keys)
    would flag a false duplicate."""

    FLUSH = 65536

    def __init__(self):
        import numpy as np

        self._np = np
        self.hashes = np.empty(0, np.uint64)
        self.where = np.empty(0, np.uint32)
        self.buf: dict[int, int] = {}
        self.tars: list[Path] = []

    def __contains__(self, key: str) -> bool:
        return self.first_shard(key) is not None

    def _hash(self, key: str) -> int:
        import hashlib

        return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")

    def first_shard(self, key: str) -> Path | None:
        h = self._hash(key)
        idx = self.buf.get(h)
        if idx is None and len(self.hashes):
            i = int(self._np.searchsorted(self.hashes, self._np.uint64(h)))
            if i < len(self.hashes) and int(self.hashes[i]) == h:
                idx = int(self.where[i])
        return None if idx is None else self.tars[idx]

    def add(self, key: str, tar: Path) -> None:
        if not self.tars or self.tars[-1] != tar:
            self.tars.append(tar)
        self.buf[self._hash(key)] = len(self.tars) - 1
        if len(self.buf) >= self.FLUSH:
            np = self._np
            h = np.fromiter(self.buf.keys(), np.uint64, len(self.buf))
            w = np.fromiter(self.buf.values(), np.uint32, len(self.buf))
            hashes, where = np.concatenate([self.hashes, h]), np.concatenate([self.where, w])
            order = np.argsort(hashes, kind="stable")
            self.hashes, self.where, self.buf = hashes[order], where[order], {}


def read_webdataset(path: str | Path, split: str | None = None, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> Iterator[SourceRecord]:
    seen = SeenKeys()  # bounded per key: a 1M-sample folder costs ~12 MB here, not a dict of strings
    for tar in shard_paths(path):
        try:
            with _open_tar(tar) as tf:  # uncompressed only: images are read by offset
                key = None
                members: dict[str, tuple[str, bytes | None]] = {}
                too_large: list[str] = []
                for m in tf:
                    if not m.isfile():  # links, folders, devices: never followed
                        continue
                    k, ext = split_key(m.name)
                    if k != key and key is not None:
                        yield _dedupe(_make_record(tar, key, members, split or "train", too_large), seen, tar)
                        members, too_large = {}, []
                    key = k
                    if m.size > max_member_bytes:
                        too_large.append(f"member {m.name!r} is {m.size:,} bytes > dataset.max_member_bytes {max_member_bytes:,}")
                        continue
                    # only the small text members are read (into memory); image bytes stay in the tar
                    data = tf.extractfile(m).read() if ext in ("txt", "json") else None
                    members[ext] = (m.name, data)
                if key is not None:
                    yield _dedupe(_make_record(tar, key, members, split or "train", too_large), seen, tar)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise ReaderError(f"WebDataset shard {tar}: unreadable tar ({e})") from None


def _open_tar(tar):
    """A local tar, or a URL's read through fsspec (ranged reads: image bytes are skipped)."""
    from pipeline.io import storage

    if isinstance(tar, storage.UrlPath):
        f = tar.open("rb")
        tf = tarfile.open(fileobj=f, mode="r:")
        close = tf.close

        def closing():
            close()
            f.close()

        tf.close = closing
        return tf
    return tarfile.open(tar, "r:")


def _dedupe(rec: SourceRecord, seen: SeenKeys, tar: Path) -> SourceRecord:
    first = seen.first_shard(rec.source_id)
    if first is not None:
        rec.problems.append((None, f"duplicate key {rec.source_id!r} (also in {first.name})"))
    else:
        seen.add(rec.source_id, tar)
    return rec
