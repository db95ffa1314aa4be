"""Karpathy split JSON (``dataset_coco.json`` / ``dataset_flickr30k.json`` style)::

    {"images": [{"filepath": "val2014", "filename": "...jpg", "split": "test",
                 "cocoid": 391895, "imgid": 0, "sentences": [{"raw": "...", ...}]}]}

``source_id`` is ``cocoid`` when present, else ``imgid``, else the file name. Image path:
``<images>/<filepath>/<filename>`` (``filepath`` optional). Records keep the file's split value;
the ``split`` filter keeps exactly that split, except that ``"train"`` also keeps ``"restval"``
(the usual Karpathy convention: restval images are training images). File order is kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from pipeline.readers.base import (
    MISSING_IMAGE_FIELD,
    ReaderError,
    SourceRecord,
    abspath,
    add_caption,
    finish,
    inside_root,
    load_json,
)


def split_matches(record_split: str, wanted: str | None) -> bool:
    if not wanted:
        return True
    return record_split == wanted or (wanted == "train" and record_split == "restval")


def read_karpathy(captions: str | Path, images: str | Path | None = None, split: str | None = None) -> Iterator[SourceRecord]:
    p = abspath(captions)
    data = load_json(p, "Karpathy split JSON")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ReaderError(f"Karpathy split JSON {p}: expected an object with an 'images' list")
    root = abspath(images) if images else None
    for n, im in enumerate(data["images"]):
        if not isinstance(im, dict):
            raise ReaderError(f"Karpathy split JSON {p}: images[{n}] is not an object")
        rec_split = str(im.get("split") or "train")
        if not split_matches(rec_split, split):
            continue
        sid = im.get("cocoid", im.get("imgid", im.get("filename")))
        rec = SourceRecord(source_id=str(sid if sid is not None else n), image=None, captions=[], split=rec_split)
        fn = im.get("filename")
        if not fn:
            rec.problems.append((None, MISSING_IMAGE_FIELD))
        elif root is not None:
            rec.image, outside = inside_root(root, f"{im['filepath']}/{fn}" if im.get("filepath") else fn)
            if outside:
                rec.problems.append((None, outside))
        for s in im.get("sentences") or []:
            add_caption(rec, s.get("raw") if isinstance(s, dict) else s)
        yield finish(rec)
