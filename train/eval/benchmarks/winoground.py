"""Winoground (Thrush et al. 2022), a local copy of the Hugging Face dataset ``facebook/winoground``:
``data/examples.jsonl`` (+ ``data/images.zip`` unpacked to ``images/``). One JSON object a line::

    {"id": 0, "image_0": "ex_0_img_0", "image_1": "ex_0_img_1", "caption_0": "an old person kisses a
     young person", "caption_1": "a young person kisses an old person", "tag": "...",
     "secondary_tag": "...", "num_main_preds": 1, "collapsed_tag": "Object"}

``spec.path``: ``examples.jsonl`` or its folder. The image keys are ``image_0`` / ``image_1`` (file
stems, e.g. ``ex_0_img_0`` for ``images/ex_0_img_0.png``). Pairs per item, in this order:
(i0, c0), (i1, c0), (i0, c1), (i1, c1). Winoground's own definitions, all strict:

* text score: s(c0, i0) > s(c1, i0) and s(c1, i1) > s(c0, i1)  (chance 25 %)
* image score: s(c0, i0) > s(c0, i1) and s(c1, i1) > s(c1, i0)  (chance 25 %)
* group score: both (chance 16.67 %: 4 of the 24 orderings of four distinct scores)

The chance of a row is computed for the items it scores (:func:`item_chance`): the expected score of a
scorer that gives every distinct (image, caption) pair an independent random score. An item whose four
pairs are distinct has the published 25 / 25 / 16.67 %; one whose two images or two captions are the
same (a generated file can hold such pairs) has tied pairs, which strict scoring counts as wrong: 0.

Rows: the three scores for ``all`` and per ``collapsed_tag`` (Object / Relation / Both).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train.eval.benchmarks._common import BenchmarkError, Rows, not_lfs_pointer, text_field, with_ties
from train.eval.interface import BenchData, Item, Pair, Row
from train.eval.intervals import interval, proportion

CHANCE = {"text": 25.0, "image": 25.0, "group": 100.0 / 6.0}


def read(spec) -> BenchData:
    path = Path(spec.path)
    if path.is_dir():
        cand = [path / "examples.jsonl", path / "data" / "examples.jsonl"]
        path = next((c for c in cand if c.is_file()), cand[0])
    not_lfs_pointer(path, "Winoground file")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise BenchmarkError(f"Winoground file {path}: file not found") from None
    rows = Rows(path, "Winoground file")
    total = 0
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        total += 1
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rows.bad(f"line {n}", f"not valid JSON ({e.msg})")
            continue
        fields = ("image_0", "image_1", "caption_0", "caption_1")
        vals = {f: text_field(rec, f) for f in fields}
        gone = [f for f, v in vals.items() if v is None]
        if gone:
            rows.bad(f"line {n}", "missing or empty " + ", ".join(repr(g) for g in gone))
            continue
        i0, i1, c0, c1 = (vals[f] for f in fields)
        tag = text_field(rec, "collapsed_tag") or "untagged"
        rows.items.append(Item([Pair(i0, c0), Pair(i1, c0), Pair(i0, c1), Pair(i1, c1)], subset=tag,
                               key=str(rec.get("id", n - 1))))
    rows.done()
    if not total:
        raise BenchmarkError(f"Winoground file {path}: no examples")
    return BenchData(spec.name, rows.items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc),
                     skipped=dict(rows.skipped), source=str(path), total=total)


def item_scores(s) -> tuple[bool, bool, bool]:
    """(text, image, group) correctness of one item from its four pair scores
    [(i0, c0), (i1, c0), (i0, c1), (i1, c1)]."""
    c0_i0, c0_i1, c1_i0, c1_i1 = (float(x) for x in s)
    text = c0_i0 > c1_i0 and c1_i1 > c0_i1
    image = c0_i0 > c0_i1 and c1_i1 > c1_i0
    return text, image, text and image


def item_chance(item) -> tuple[float, float, float]:
    """(text, image, group) chance in % of one item: a random score per distinct (image, caption) pair."""
    (i0, c0), (i1, _), _, _ = ((p.image, p.text) for p in item.pairs)
    c1 = item.pairs[2].text
    if i0 == i1 or c0 == c1:  # two of the four pairs are one pair: its scores tie, and a tie is wrong
        return 0.0, 0.0, 0.0
    return CHANCE["text"], CHANCE["image"], CHANCE["group"]


def score(name: str, items, scores) -> list[Row]:
    if len(items) != len(scores):
        raise ValueError(f"score: {len(items)} items but {len(scores)} score arrays")
    res = np.array([item_scores(s) for s in scores], dtype=bool).reshape(-1, 3)
    tied = np.array([item_ties(s) for s in scores], dtype=bool).reshape(-1, 3)
    tags = np.array([it.subset for it in items])
    chance = np.array([item_chance(it) for it in items], dtype=np.float64).reshape(-1, 3)
    out = []
    for subset in ["all"] + sorted(set(tags.tolist())):
        sel = np.ones(len(items), bool) if subset == "all" else tags == subset
        for j, metric in enumerate(("text", "image", "group")):
            est = proportion(res[sel, j])  # per item (a frozen baseline's rows pair with these, train.eval.paired)
            row = Row(name, subset, f"{metric}_score", 100.0 * est.value, int(sel.sum()),
                      float(chance[sel, j].mean()), est=est).with_ci(interval(est, 100.0))
            out.append(with_ties(row, tied[sel, j], where="in a comparison"))
    return out


def item_ties(s) -> tuple[bool, bool, bool]:
    """(text, image, group): one of the comparisons the score needs is an exact tie (scored wrong)."""
    c0_i0, c0_i1, c1_i0, c1_i1 = (float(x) for x in s)
    text = c0_i0 == c1_i0 or c1_i1 == c0_i1
    image = c0_i0 == c0_i1 or c1_i1 == c1_i0
    return text, image, text or image
