"""FOIL-COCO (Shekhar et al. 2017), ``foilv1.0_test_2017.json`` (and ``..._train_2017.json``), COCO
caption layout::

    {"images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg", ...}],
     "annotations": [{"image_id": 391895, "id": 7, "caption": "...", "foil": false,
                      "target_word": "...", "foil_word": "ORIG", "foil_id": ...}, ...]}

An original caption and its foils share the annotation ``id`` (``foil`` false / true). Each foil
becomes one item: pairs (image, original caption), (image, foil caption), correct when the original
scores strictly higher (chance 50 %). The image key is the image's ``file_name`` (COCO val2014; the
matcher also accepts the plain COCO id). A foil without its original is skipped (``no original
caption``). Rows: pooled ``all`` and per ``target_word -> foil_word`` super-category only when
``options.per_target: true``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, group_rows, item_images, load_json, pooled_row,
                                           tied_at_top)
from train.eval.interface import BenchData, Item, Pair, Row


def read(spec) -> BenchData:
    path = Path(spec.path)
    if path.is_dir():
        path = path / "foilv1.0_test_2017.json"
    data = load_json(path, "FOIL file")
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise BenchmarkError(f"FOIL file {path}: expected a COCO-style object with an 'annotations' list")
    files = {}
    for im in data.get("images") or []:
        if isinstance(im, dict) and "id" in im and im.get("file_name"):
            files[im["id"]] = str(im["file_name"])
    rows = Rows(path, "FOIL file")
    originals: dict = {}
    foils = []
    for n, a in enumerate(data["annotations"]):
        if not isinstance(a, dict) or "id" not in a or "image_id" not in a or "foil" not in a:
            rows.bad(f"annotations[{n}]", "needs 'id', 'image_id', 'foil'")
            continue
        cap = a.get("caption")
        if not isinstance(cap, str) or not cap.strip():
            rows.bad(f"annotations[{n}]", "missing or empty 'caption'")
            continue
        if a["foil"] in (True, 1, "true", "True"):
            foils.append((n, a))
        else:
            originals.setdefault(a["id"], a)
    skipped = Counter()
    per_target = bool((spec.options or {}).get("per_target", False))
    for n, a in foils:
        o = originals.get(a["id"])
        if o is None:
            skipped["no original caption"] += 1
            continue
        img = files.get(a["image_id"], str(a["image_id"]))
        subset = f"{a.get('target_word', '?')}->{a.get('foil_word', '?')}" if per_target else "all"
        rows.items.append(Item([Pair(img, o["caption"].strip()), Pair(img, a["caption"].strip())], subset=subset,
                               key=str(a.get("foil_id", n))))
    rows.done()
    if not foils and not rows.first_bad:
        raise BenchmarkError(f"FOIL file {path}: no foil captions (annotations with foil: true)")
    skipped.update(rows.skipped)
    return BenchData(spec.name, rows.items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc),
                     skipped=dict(skipped), source=str(path), total=len(foils))


def score(name: str, items, scores) -> list[Row]:
    correct = correct_vector(items, scores)
    subsets = [it.subset for it in items]
    img = item_images(items)
    ties = tied_at_top(scores)
    rows = [r for r in group_rows(name, subsets, correct, 0.5, images=img, ties=ties) if r.subset != "all"]
    return rows + [pooled_row(name, "all", correct, 0.5, images=img, ties=ties)]
