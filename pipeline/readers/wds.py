"""img2dataset-style WebDataset tars: ``<key>.jpg|.jpeg|.png|.webp`` + ``<key>.txt`` (+ ``<key>.json``).

``path`` is a folder (every ``*.tar`` in it, sorted by name), a glob, or one tar file. Shards must
be uncompressed, as img2dataset and WebDataset write them, because images are later read by offset.
Members of a sample are grouped by WebDataset's key rule (member name up to the first dot of its
base name) and must be adjacent, as WebDataset writers produce them. ``source_id`` is the key
(a key seen again in a later shard is flagged ``duplicate key``). The caption is the ``.txt``
content (stripped); without a ``.txt``, the ``caption`` field of the ``.json`` is used. Images stay
in the tar: ``image`` is ``"<abs tar>::<member>"`` (see ``readers.images.open_image``).
Tars are read header by header, so image bytes are skipped, not loaded.

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
    if any(ch in s for ch in "*?["):
        found = [abspath(f) for f in sorted(glob.glob(s))]
    else:
        p = abspath(s)
        if p.is_dir():
            found = sorted(p.glob("*.tar"))
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
    if "txt" in members:
        add_caption(rec, members["txt"][1].strip())
    elif "json" in members:
        try:
            meta = json.loads(members["json"][1].decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError:
            meta = None
            rec.problems.append((None, "sample .json is not valid JSON"))
        if isinstance(meta, dict) and meta.get("caption") is not None:
            add_caption(rec, meta["caption"])
    return finish(rec)


def read_webdataset(path: str | Path, split: str | None = None, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> Iterator[SourceRecord]:
    seen: dict[str, Path] = {}
    for tar in shard_paths(path):
        try:
            with tarfile.open(tar, "r:") as tf:  # uncompressed only: images are read by offset
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


def _dedupe(rec: SourceRecord, seen: dict[str, Path], tar: Path) -> SourceRecord:
    if rec.source_id in seen:
        rec.problems.append((None, f"duplicate key {rec.source_id!r} (also in {seen[rec.source_id].name})"))
    else:
        seen[rec.source_id] = tar
    return rec
