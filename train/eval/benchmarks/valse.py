"""VALSE (Parcalabescu et al. 2022), the ``data/*.json`` pieces of Heidelberg-NLP/VALSE::

    {"actions_test_0": {"dataset": "SWiG", "image_file": "exercising_255.jpg", "caption": "...",
                        "foil": "...", "linguistic_phenomena": "actions",
                        "mturk": {"foil": 0, "caption": 3, "other": 0}, ...}, ...}

Kept, as the README says: only validated items, ``mturk["caption"] >= 2`` (at least two of three
annotators chose the caption and not the foil). The others are not part of the benchmark: they are
neither scored nor counted as skipped, and ``BenchData.source`` says how many were left out. Items
without ``mturk`` are kept only with ``options.keep_unvalidated: true``.
The piece is the file stem; pieces group into the paper's phenomena (existence; plurality;
counting: counting-*; spatial relations: relations; actions: action-replacement, actant-swap;
coreference: coreference-*; foil-it). An item is correct when s(image, caption) > s(image, foil)
strictly (pairwise ranking accuracy, the paper's acc_r for contrastive models); chance 50 %.
Rows: accuracy per piece (subset ``<phenomenon>/<piece>``), per phenomenon (mean over its pieces),
and ``all``: ``macro_accuracy`` (mean over pieces, the paper's average) and ``accuracy`` (pooled).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, files_in, group_rows, item_images, load_json,
                                           macro_row, missing, pooled_row, tied_at_top)
from train.eval.interface import BenchData, Item, Pair, Row

PHENOMENA = {
    "existence": "existence", "plurals": "plurality", "counting": "counting", "relations": "spatial_relations",
    "relation": "spatial_relations", "action": "actions", "actant": "actions", "coreference": "coreference",
    "foil": "foil_it",
}


def phenomenon(piece: str, field: str | None = None) -> str:
    p = piece.lower().replace("_", "-")
    for prefix, name in PHENOMENA.items():
        if p.startswith(prefix):
            return name
    return (field or piece).lower().replace(" ", "_")


def read(spec) -> BenchData:
    opts = spec.options or {}
    keep_unvalidated = bool(opts.get("keep_unvalidated", False))
    files = files_in(Path(spec.path), ["*.json"], "VALSE")
    items: list[Item] = []
    skipped: Counter = Counter()
    total = 0
    left_out: Counter = Counter()
    for f in files:
        data = load_json(f, "VALSE file")
        if not isinstance(data, dict):
            raise BenchmarkError(f"VALSE file {f}: expected an object of items keyed by id, got {type(data).__name__}")
        rows = Rows(f, "VALSE file")
        piece = f.stem
        for key, rec in data.items():
            problem = missing(rec, ("image_file", "caption", "foil"))
            if problem:
                rows.bad(key, problem)
                continue
            mt = rec.get("mturk")
            if isinstance(mt, dict) and "caption" in mt:
                try:
                    ok = int(mt["caption"]) >= 2
                except (TypeError, ValueError):
                    rows.bad(key, "mturk.caption is not a number")
                    continue
                if not ok:
                    rows.filtered["not validated (mturk.caption < 2)"] += 1
                    continue
            elif not keep_unvalidated:
                rows.filtered["no mturk votes"] += 1
                continue
            ph = phenomenon(piece, rec.get("linguistic_phenomena"))
            img = rec["image_file"].strip()
            rows.items.append(Item([Pair(img, rec["caption"].strip()), Pair(img, rec["foil"].strip())],
                                   subset=f"{ph}/{piece}", key=f"{piece}/{key}"))
        if rows.items or rows.first_bad:
            rows.done()
        items += rows.items
        skipped.update(rows.skipped)
        left_out.update(rows.filtered)
        total += len(rows.items) + sum(rows.skipped.values())
    source = ", ".join(str(f) for f in files)
    if left_out:
        source += " (left out as VALSE's README says: " + ", ".join(f"{v} {k}" for k, v in sorted(left_out.items())) + ")"
    return BenchData(spec.name, items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc),
                     skipped=dict(skipped), source=source, total=total)


def score(name: str, items, scores) -> list[Row]:
    correct = correct_vector(items, scores)
    subsets = [it.subset for it in items]
    img = item_images(items)
    ties = tied_at_top(scores)
    pieces = group_rows(name, subsets, correct, 0.5, images=img, ties=ties)
    out = list(pieces)
    by_ph: dict[str, list[Row]] = {}
    for r in pieces:
        by_ph.setdefault(r.subset.split("/", 1)[0], []).append(r)
    for ph, rs in sorted(by_ph.items()):
        out.append(macro_row(name, ph, rs, metric="accuracy", note=f"mean over {len(rs)} piece(s)"))
    out.append(macro_row(name, "all", pieces, note=f"mean over {len(pieces)} pieces"))
    out.append(pooled_row(name, "all", correct, 0.5, note="pooled over every item", images=img, ties=ties))
    return out
