"""CC3M-style TSV: one ``caption<TAB>url-or-path`` row per image.

A header row is recognised when its cells name the columns (``caption`` and one of ``url``,
``image``, ``path``, ``file``, ``filepath``, in either order); without one, the order is caption
then image. ``source_id`` is the 0-based data-row number (blank lines skipped, not counted).
Relative paths resolve against ``images`` (default: the TSV's folder); ``file://`` URLs become
paths; ``s3://`` / ``gs://`` references are kept (read through fsspec, pipeline/io/storage.py).
http(s) URLs are not fetched (offline pipeline): the record keeps its caption, image None and a
problem saying so -- download with img2dataset and use ``kind: webdataset`` instead.
Each row is decoded on its own so one non-UTF-8 caption does not stop the file. ``split_key`` (for
``dataset.splits``) is the image reference as written: rows naming one image share its split.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

from pipeline.readers.base import (
    MISSING_IMAGE_FIELD,
    SourceRecord,
    abspath,
    add_caption,
    finish,
    inside_root,
    read_bytes,
)

_IMAGE_COLS = ("url", "image", "path", "file", "filepath", "image_path", "file_name", "filename")
URL_NOT_FETCHED = "image is a remote URL (not fetched offline)"


def resolve_image(ref: str, root: Path) -> tuple[str | None, str | None]:
    ref = ref.strip()
    if not ref:
        return None, MISSING_IMAGE_FIELD
    scheme = urlparse(ref).scheme.lower()
    if scheme in ("http", "https", "ftp"):
        return None, URL_NOT_FETCHED
    if scheme == "file":
        ref = unquote(urlparse(ref).path)
    # object storage (s3://, gs://: read through fsspec, pipeline/io/storage.py), an absolute path or
    # one relative to the root: all must lie inside the root
    return inside_root(root, ref)


def _header(cells: list[str]) -> tuple[int, int] | None:
    low = [c.strip().lower() for c in cells]
    if "caption" in low:
        img = next((i for i, c in enumerate(low) if c in _IMAGE_COLS), None)
        if img is not None:
            return low.index("caption"), img
    return None


def read_cc3m_tsv(captions: str | Path, images: str | Path | None = None, split: str | None = None) -> Iterator[SourceRecord]:
    p = abspath(captions)
    data = read_bytes(p, "CC3M TSV")
    root = abspath(images) if images else p.parent
    cap_col, img_col = 0, 1
    row = 0
    first = True
    for raw in io.BytesIO(data):  # line by line: no list of every line beside the file's bytes (CC3M: 3.3M rows)
        raw = raw.rstrip(b"\r\n")
        if not raw.strip():
            continue
        cells = raw.split(b"\t")
        if first:
            first = False
            hdr = _header([c.decode("utf-8", errors="replace") for c in cells])
            if hdr is not None:
                cap_col, img_col = hdr
                continue
        rec = SourceRecord(source_id=str(row), image=None, captions=[], split=split or "train")
        row += 1
        if len(cells) <= max(cap_col, img_col):
            # keep what there is so the row shows up in errors.parquet with its text
            add_caption(rec, cells[0])
            rec.problems.append((None, f"malformed row: expected {max(cap_col, img_col) + 1} tab-separated columns, got {len(cells)}"))
            yield rec
            continue
        add_caption(rec, cells[cap_col])
        image_ref = cells[img_col].decode("utf-8", errors="replace")
        rec.split_key = image_ref.strip() or None  # dataset.splits: the image as written, not the row number
        rec.image, problem = resolve_image(image_ref, root)
        if problem:
            rec.problems.append((None, problem))
        yield finish(rec)
