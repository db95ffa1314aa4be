"""Scene-graph JSON, format ``vlpipe-scene-graph/1`` (written by the generated dataset; easy to
produce from Visual Genome or a relation predictor)::

    {"format": "vlpipe-scene-graph/1",
     "predicates": ["left of", ...],                      # informational
     "images": [
       {"image_id": 1,                                    # the COCO image id
        "relations": [{"subject": 11, "object": 12, "predicate": "left of"}],   # instance ids =
        "phrases": [{"caption_id": 7, "start": 0, "end": 12,                    # COCO annotation ids
                     "text": "a red circle", "instance_ids": [11]}]}]}

``phrases`` is optional: it grounds spans of COCO captions (``caption_id`` = caption annotation id,
``[start, end)`` character offsets) in instances, which COCO captions JSON itself cannot express.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.readers.base import Phrase, ReaderError, Relation, SourceRecord, abspath, load_json

FORMAT = "vlpipe-scene-graph/1"


def load_scene_graphs(path: str | Path) -> dict[int, dict]:
    p = abspath(path)
    data = load_json(p, "scene graphs")
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("images"), list):
        raise ReaderError(f"scene graphs {p}: expected {{'format': '{FORMAT}', 'images': [...]}}")
    out: dict[int, dict] = {}
    for entry in data["images"]:
        try:
            out[int(entry["image_id"])] = entry
        except (KeyError, TypeError, ValueError):
            raise ReaderError(f"scene graphs {p}: an image entry has no integer image_id") from None
    return out


def attach_scene_graphs(rec: SourceRecord, entry: dict, caption_index: dict[int, int]) -> None:
    ids = {i.id for i in rec.instances}
    for r in entry.get("relations", []):
        s, o = int(r["subject"]), int(r["object"])
        if ids and (s not in ids or o not in ids):
            rec.problems.append((None, f"relation refers to unknown instance ({s}, {o})"))
            continue
        rec.relations.append(Relation(subject=s, object=o, predicate=str(r["predicate"])))
    for ph in entry.get("phrases", []):
        idx = caption_index.get(int(ph["caption_id"]))
        if idx is None:
            continue  # phrase of a caption that is not in this captions file (e.g. filtered)
        start, end = int(ph["start"]), int(ph["end"])
        text = rec.captions[idx][start:end]
        if text != ph.get("text", text):
            rec.problems.append((idx, f"phrase span {start}:{end} does not match {ph.get('text')!r}"))
            continue
        rec.phrases.append(
            Phrase(caption_index=idx, start=start, end=end, text=text,
                   instance_ids=[int(i) for i in ph.get("instance_ids", [])])
        )
