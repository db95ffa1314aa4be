"""Flickr30k Entities: ``<path>/Sentences/<id>.txt``, ``<path>/Annotations/<id>.xml`` and images
in ``<images>`` (default ``<path>/images``) named ``<id>.jpg``.

Sentences: one caption per line, phrases marked ``[/EN#18/people A man]`` (an entity may carry
several types, ``/EN#5/people/other``). The markup is removed; each phrase becomes a
:class:`Phrase` whose span indexes the cleaned caption. Annotations: every ``<object>`` with a
``<bndbox>`` becomes one :class:`Instance` (ids 0, 1, ... in file order); it names one or more
entity ids, and a phrase links to all boxes of its entity. ``nobndbox``/``scene`` entities have no
box, so their phrases have empty ``instance_ids``. If ``train.txt``/``val.txt``/``test.txt`` (the
official id lists) are in ``<path>``, they set the split; ``split`` then filters.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

from pipeline.readers.base import (
    Instance,
    Phrase,
    ReaderError,
    SourceRecord,
    abspath,
    add_caption,
    finish,
    inside_root,
    natural_key,
    read_bytes,
)

_PHRASE = re.compile(r"\[/EN#(\d+)((?:/[^\s\]]*)*)\s+([^\[\]]*)\]")


def parse_sentence(line: str) -> tuple[str, list[tuple[int, int, str, int, str]]]:
    """Markup line -> (clean caption, [(start, end, text, entity_id, first type)])."""
    out: list[str] = []
    spans = []
    pos = 0  # length of the cleaned text so far
    last = 0
    for m in _PHRASE.finditer(line):
        before = line[last:m.start()]
        out.append(before)
        pos += len(before)
        text = m.group(3).strip()
        types = [t for t in m.group(2).split("/") if t]
        spans.append((pos, pos + len(text), text, int(m.group(1)), types[0] if types else ""))
        out.append(text)
        pos += len(text)
        last = m.end()
    out.append(line[last:])
    clean = "".join(out)
    # stray brackets would mean malformed markup; keep the text but a phrase could be missing
    return clean, spans


def parse_annotation(path: Path) -> tuple[list[tuple[list[int], tuple[float, float, float, float]]], tuple[int, int] | None]:
    try:
        root = ET.fromstring(read_bytes(path, "Flickr30k Entities annotation"))
    except ET.ParseError as e:
        raise ReaderError(f"Flickr30k Entities annotation {path}: not valid XML ({e})") from None
    size = None
    w, h = root.findtext("size/width"), root.findtext("size/height")
    if w and h:
        size = (int(float(h)), int(float(w)))
    boxes = []
    for obj in root.iter("object"):
        bb = obj.find("bndbox")
        if bb is None:
            continue
        names = [int(n.text) for n in obj.findall("name") if n.text and n.text.strip().isdigit()]
        try:
            box = tuple(float(bb.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
        except (TypeError, ValueError):
            raise ReaderError(f"Flickr30k Entities annotation {path}: bad bndbox") from None
        boxes.append((names, box))
    return boxes, size


def _split_lists(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in ("train", "val", "test"):
        f = root / f"{s}.txt"
        if f.is_file():
            for line in f.read_text().split():
                out[line.strip()] = s
    return out


def read_flickr30k_entities(path: str | Path, images: str | Path | None = None, split: str | None = None) -> Iterator[SourceRecord]:
    root = abspath(path)
    sent_dir = root / "Sentences"
    ann_dir = root / "Annotations"
    if not sent_dir.is_dir():
        raise ReaderError(f"Flickr30k Entities {root}: no Sentences/ folder")
    img_root = abspath(images) if images else root / "images"
    splits = _split_lists(root)
    ids = sorted((f.stem for f in sent_dir.glob("*.txt")), key=natural_key)
    for sid in ids:
        rec_split = splits.get(sid, "train")
        if split and splits and rec_split != split:
            continue
        image, outside = inside_root(img_root, f"{sid}.jpg")  # a Sentences/ file may be a symlink name
        rec = SourceRecord(source_id=sid, image=image, captions=[], split=rec_split)
        if outside:
            rec.problems.append((None, outside))
        ann_file = ann_dir / f"{sid}.xml"
        boxes = parse_annotation(ann_file)[0] if ann_file.is_file() else []
        by_entity: dict[int, list[int]] = {}
        for box_id, (names, _) in enumerate(boxes):
            for n in names:
                by_entity.setdefault(n, []).append(box_id)
        entity_type: dict[int, str] = {}
        raw_lines = read_bytes(sent_dir / f"{sid}.txt", "Flickr30k Entities sentences").split(b"\n")
        if raw_lines and raw_lines[-1] == b"":
            raw_lines.pop()  # the final newline ends the last caption; it does not start an empty one
        for raw in raw_lines:
            idx = len(rec.captions)
            add_caption(rec, raw.rstrip(b"\r"))
            marked = rec.captions[idx]
            clean, spans = parse_sentence(marked)
            rec.captions[idx] = clean
            for start, end, text, ent, etype in spans:
                entity_type.setdefault(ent, etype)
                rec.phrases.append(Phrase(idx, start, end, text, list(by_entity.get(ent, []))))
        for box_id, (names, box) in enumerate(boxes):
            cat = next((entity_type[n] for n in names if n in entity_type), "")
            rec.instances.append(
                Instance(id=box_id, box=box, category=cat or "entity",
                         attributes={"entity_ids": ",".join(str(n) for n in names)})
            )
        yield finish(rec)
