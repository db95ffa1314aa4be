"""SVO-Probes (Hendricks & Nematzadeh 2021), ``svo_probes.csv`` of google-deepmind/svo_probes:
columns ``sentence, pos_triplet, neg_triplet, pos_url, neg_url, pos_image_id, neg_image_id,
subj_neg, verb_neg, obj_neg`` (an unnamed index column first is allowed). The negatives are images:
each row gives the pairs (pos image, sentence) and (neg image, sentence); correct when the positive
image scores strictly higher (chance 50 %). Image keys: ``pos_image_id`` / ``neg_image_id`` (images
are downloaded from the urls and usually saved as ``<image_id>.jpg``; ``options.image_ext`` adds an
extension to the key, default none: ids match by stem). Rows: accuracy for the subject, verb and
object negatives (``subj_neg`` / ``verb_neg`` / ``obj_neg`` true) and pooled ``all``.
"""

from __future__ import annotations

import csv
from pathlib import Path

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, group_rows, item_images, not_lfs_pointer,
                                           pooled_row, tied_at_top)
from train.eval.interface import BenchData, Item, Pair, Row

NEG_COLUMNS = {"subj_neg": "subject", "verb_neg": "verb", "obj_neg": "object"}
REQUIRED = ("sentence", "pos_image_id", "neg_image_id")


def _true(v) -> bool:
    return str(v).strip().lower() in {"true", "1", "yes", "t"}


def read(spec) -> BenchData:
    path = Path(spec.path)
    if path.is_dir():
        path = path / "svo_probes.csv"
    ext = str((spec.options or {}).get("image_ext", ""))
    not_lfs_pointer(path, "SVO-Probes file")
    try:
        fh = path.open(newline="", encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise BenchmarkError(f"SVO-Probes file {path}: file not found") from None
    with fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        gone = [c for c in REQUIRED if c not in cols]
        if gone:
            raise BenchmarkError(f"SVO-Probes file {path}: no column(s) {', '.join(gone)} (header: {', '.join(cols) or 'empty'})")
        rows = Rows(path, "SVO-Probes file")
        total = 0
        for n, rec in enumerate(reader, start=2):  # line numbers, the header is line 1
            total += 1
            vals = {c: (rec.get(c) or "").strip() for c in REQUIRED}
            empty = [c for c, v in vals.items() if not v]
            if empty:
                rows.bad(f"line {n}", "empty " + ", ".join(repr(c) for c in empty))
                continue
            kinds = [name for col, name in NEG_COLUMNS.items() if _true(rec.get(col, ""))]
            subset = kinds[0] if len(kinds) == 1 else ("+".join(kinds) if kinds else "unlabelled")
            pos, neg = vals["pos_image_id"] + ext, vals["neg_image_id"] + ext
            rows.items.append(Item([Pair(pos, vals["sentence"]), Pair(neg, vals["sentence"])], subset=subset, key=f"line {n}"))
        rows.done()
    return BenchData(spec.name, rows.items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc),
                     skipped=dict(rows.skipped), source=str(path), total=total)


def score(name: str, items, scores) -> list[Row]:
    correct = correct_vector(items, scores)
    subsets = [it.subset for it in items]
    order = ["subject", "verb", "object"] + sorted(set(subsets) - {"subject", "verb", "object"})
    img = item_images(items)
    ties = tied_at_top(scores)
    return (group_rows(name, subsets, correct, 0.5, order=order, images=img, ties=ties)
            + [pooled_row(name, "all", correct, 0.5, images=img, ties=ties)])
