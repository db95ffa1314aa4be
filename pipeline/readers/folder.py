"""A folder of images plus a captions file.

``images`` is the folder (searched recursively; ``.jpg .jpeg .png .webp .bmp .gif``). ``captions``
is either

* TSV: ``file<TAB>caption`` per line (optional header ``file<TAB>caption``), or
* JSONL (``.jsonl``/``.json``): one ``{"file": "a.jpg", "caption": "..."}`` object per line
  (``"captions": [...]`` is accepted in place of ``"caption"``).

``file`` is relative to the folder. Several lines for one file give several captions in file order.
Without ``captions``, ``<images>/captions.tsv`` or ``captions.jsonl`` is used if present. Records:
one per image found or named, sorted by relative path (= ``source_id``); an image with no caption
line gets a ``record has no captions`` problem, a caption line for an absent file is kept (ingest
reports the missing image).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from pipeline.readers.base import ReaderError, SourceRecord, abspath, add_caption, finish, inside_root, read_bytes

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    for n, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.rstrip(b"\r")
        if raw.strip():
            yield n, raw


def _parse_captions(p: Path) -> tuple[dict[str, list[bytes | str | None]], list[tuple[int, str]]]:
    data = read_bytes(p, "folder captions")
    caps: dict[str, list] = {}
    bad: list[tuple[int, str]] = []
    jsonl = p.suffix.lower() in (".jsonl", ".json")
    first = True
    for n, raw in _lines(data):
        if jsonl:
            try:
                obj = json.loads(raw.decode("utf-8", errors="surrogateescape"))
            except json.JSONDecodeError as e:
                bad.append((n, f"not valid JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict) or not obj.get("file"):
                bad.append((n, "no 'file' key"))
                continue
            if "captions" in obj and isinstance(obj["captions"], list):
                texts = obj["captions"]
            else:
                texts = [obj.get("caption")]
            caps.setdefault(str(obj["file"]), []).extend(texts)
        else:
            cells = raw.split(b"\t", 1)
            if first and [c.strip().lower() for c in cells] == [b"file", b"caption"]:
                first = False
                continue
            first = False
            if len(cells) != 2:
                bad.append((n, "expected file<TAB>caption"))
                continue
            name = cells[0].decode("utf-8", errors="replace").strip()
            caps.setdefault(name, []).append(cells[1])
    if not caps and bad:
        raise ReaderError(f"folder captions {p}: no usable line (line {bad[0][0]}: {bad[0][1]})")
    return caps, bad


def read_folder(images: str | Path, captions: str | Path | None = None, split: str | None = None) -> Iterator[SourceRecord]:
    root = abspath(images)
    if not root.is_dir():
        raise ReaderError(f"image folder {root}: not a folder")
    if captions is None:
        captions = next((root / n for n in ("captions.tsv", "captions.jsonl") if (root / n).is_file()), None)
        if captions is None:
            raise ReaderError(f"image folder {root}: no captions file given and no captions.tsv/captions.jsonl in it")
    caps, bad = _parse_captions(abspath(captions))
    found = {f.relative_to(root).as_posix() for f in root.rglob("*") if f.suffix.lower() in IMAGE_EXTS and f.is_file()}
    names = sorted(found | {Path(n).as_posix() for n in caps})
    for name in names:
        image, outside = inside_root(root, name)
        rec = SourceRecord(source_id=name, image=image, captions=[], split=split or "train")
        if outside:
            rec.problems.append((None, outside))
        for c in caps.get(name, []):
            add_caption(rec, c)
        yield finish(rec)
    # A line that names no file belongs to no image; it still gets its own (rejected) record so
    # ingest lists it in errors.parquet instead of it vanishing.
    for line_no, reason in bad:
        yield SourceRecord(source_id=f"{Path(str(captions)).name}:{line_no}", image=None, captions=[],
                           split=split or "train", problems=[(None, f"captions file line {line_no}: {reason}")])
