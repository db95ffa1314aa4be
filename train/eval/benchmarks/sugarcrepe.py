"""SugarCrepe (Hsieh et al. 2023), as published.

Layouts read:

* the JSON files of RAIVNLab/sugar-crepe (``data/<kind>.json``; kinds ``add_att add_obj replace_att
  replace_obj replace_rel swap_att swap_obj``; an early release named the object kinds ``*_ent``,
  read as ``*_obj``)::

      {"0": {"filename": "000000565045.jpg", "caption": "...", "negative_caption": "..."}, ...}

  ``spec.path``: the ``data`` folder, one file (``options.kind`` names its kind when the file name
  does not), or a glob. Images are COCO val2017 (the file name is
  the key; it matches Karpathy ``COCO_val2014_...`` names through the COCO id).
* the Hugging Face copies ``HuggingFaceM4/SugarCrepe_<kind>`` (``data/test-*.parquet``; columns
  ``image`` {bytes, path}, ``tested_labels`` = [caption, negative_caption] in that order,
  ``true_label``). The kind comes from the ``SugarCrepe_<kind>`` folder name (or
  ``options.kind``); the image key is ``image.path`` when the parquet carries it, else
  ``<kind>/<row>`` (give ``image_map`` then).

Scoring: an item is correct when s(image, caption) > s(image, negative) strictly (a tie is wrong,
as in the original evaluation, which counts ``pos > neg``); chance 50 %. Rows: accuracy per kind;
``all`` = the triple-count-weighted mean over replace_obj/att/rel and swap_obj/att (the five kinds
ConceptOT's Table 3 averages, i.e. accuracy pooled over their triples); ``add`` = the same over
add_obj/att, reported separately.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, group_rows, item_images, load_json,
                                           missing, not_lfs_pointer, pooled_row, tie_note)
from train.eval.interface import BenchData, Item, Pair

KINDS = ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att"]
MAIN = KINDS[:5]
ADD = KINDS[5:]


def kind_of(name: str) -> str:
    k = name.lower().replace("-", "_")
    k = re.sub(r"_ent$", "_obj", k)
    return k


def _read_json(path: Path, kind: str | None, rows_out: list[Rows]) -> list[Item]:
    kind = kind_of(kind or path.stem)
    data = load_json(path, "SugarCrepe file")
    if isinstance(data, dict):
        entries = list(data.items())
    elif isinstance(data, list):
        entries = list(enumerate(data))
    else:
        raise BenchmarkError(f"SugarCrepe file {path}: expected an object of rows keyed by index, got {type(data).__name__}")
    rows = Rows(path, "SugarCrepe file")
    for key, rec in entries:
        problem = missing(rec, ("filename", "caption", "negative_caption"))
        if problem:
            rows.bad(key, problem)
            continue
        rows.items.append(Item([Pair(rec["filename"].strip(), rec["caption"].strip()),
                                Pair(rec["filename"].strip(), rec["negative_caption"].strip())],
                               subset=kind, key=f"{kind}/{key}"))
    rows.done()
    rows_out.append(rows)
    return rows.items


def _read_parquet(path: Path, options: dict, rows_out: list[Rows]) -> list[Item]:
    import pyarrow.parquet as pq

    kind = options.get("kind")
    if not kind:
        for part in reversed(path.parts):
            m = re.match(r"(?i)sugarcrepe_(\w+)$", part)
            if m:
                kind = m.group(1)
                break
    if not kind:
        raise BenchmarkError(f"SugarCrepe parquet {path}: cannot tell the kind (expected a SugarCrepe_<kind> folder, "
                             "or set options.kind)")
    kind = kind_of(kind)
    not_lfs_pointer(path, "SugarCrepe parquet")
    try:
        cols = pq.read_schema(path).names
        want = ["tested_labels"] + (["image.path"] if "image" in cols else [])
        tab = pq.read_table(path, columns=[c for c in want if c.split(".")[0] in cols])  # image.path only, not the bytes
    except Exception as e:  # pyarrow raises several types for a bad file
        raise BenchmarkError(f"SugarCrepe parquet {path}: cannot read ({type(e).__name__}: {e})") from None
    if "tested_labels" not in tab.column_names:
        raise BenchmarkError(f"SugarCrepe parquet {path}: no 'tested_labels' column (columns: {', '.join(cols)})")
    labels = tab.column("tested_labels").to_pylist()
    paths = tab.column("path").to_pylist() if "path" in tab.column_names else [None] * len(labels)
    rows = Rows(path, "SugarCrepe parquet")
    for n, (lab, p) in enumerate(zip(labels, paths)):
        if not isinstance(lab, list) or len(lab) != 2 or not all(isinstance(t, str) and t.strip() for t in lab):
            rows.bad(n, "tested_labels is not [caption, negative_caption]")
            continue
        key = p if isinstance(p, str) and p.strip() else f"{kind}/{n}"
        rows.items.append(Item([Pair(key, lab[0].strip()), Pair(key, lab[1].strip())], subset=kind, key=f"{kind}/{n}"))
    rows.done()
    rows_out.append(rows)
    return rows.items


def read(spec) -> BenchData:
    from train.eval.benchmarks._common import files_in

    path = Path(spec.path)
    files = files_in(path, ["*.json", "*.parquet"], "SugarCrepe")
    items: list[Item] = []
    parts: list[Rows] = []
    for f in files:
        if f.suffix == ".parquet":
            items += _read_parquet(f, spec.options or {}, parts)
        else:
            kind = (spec.options or {}).get("kind") if path.is_file() else None
            if kind is None and kind_of(f.stem) not in KINDS:
                continue  # not a SugarCrepe kind (e.g. a LICENSE.json next to the data)
            items += _read_json(f, kind, parts)
    if not parts:
        raise BenchmarkError(f"SugarCrepe {path}: no file named after a SugarCrepe kind ({', '.join(KINDS)})")
    skipped = {}
    for r in parts:
        for k, v in r.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    return BenchData(spec.name, items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc), skipped=skipped,
                     source=", ".join(str(f) for f in files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else ""),
                     total=len(items))


def score(name: str, items, scores):
    correct = correct_vector(items, scores)
    kinds = [it.subset for it in items]
    order = KINDS + sorted(set(kinds) - set(KINDS))
    img = np.asarray(item_images(items), dtype=object)
    rows = group_rows(name, kinds, correct, 0.5, order=order, images=img)
    for r in rows:  # a model blind to what a kind changes (word order for the swaps) ties there: say so
        r.note = tie_note([sc for sc, k in zip(scores, kinds) if k == r.subset]).removeprefix("; ")
    main = [k for k, s in enumerate(kinds) if s in MAIN]
    add = [k for k, s in enumerate(kinds) if s in ADD]
    if main:
        rows.append(pooled_row(name, "all", correct[main], 0.5,
                               note="triple-weighted mean over replace_obj/att/rel, swap_obj/att; ties wrong"
                               + tie_note([scores[k] for k in main]), images=img[main]))
    else:
        rows.append(pooled_row(name, "all", correct, 0.5, note="none of the five main kinds present: pooled over all kinds",
                               images=img))
    if add:
        rows.append(pooled_row(name, "add", correct[add], 0.5, note="add_obj/add_att, reported separately", images=img[add]))
    return rows
