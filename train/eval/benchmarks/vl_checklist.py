"""VL-CheckList (Zhao et al. 2022), om-ai-lab/VL-CheckList as published: YAML corpus configs under
``corpus/[v1/]<Category>/<type...>/<corpus>.yaml``::

    ANNO_PATH: "vl-checklist/data/Attribute/vg/color.json"
    IMG_ROOT: "vg/"
    TYPE: "TUPLE_JSON"

pointing at JSON lists of ``[image_path, {"POS": [texts], "NEG": [texts]}]``. ``spec.path``: the
``corpus`` folder (every YAML below it) or one YAML. ``ANNO_PATH`` is resolved as given (absolute),
else against the YAML's folder and each folder above it, else the current directory (the original
reads it relative to the working directory, the folder holding ``corpus/`` and ``data/``). A config
whose data file is not there is skipped and counted under the reason ``config skipped, data file not
found: <path>``, the path it belongs at (beside the ``corpus`` folder); none there is an error.
Image key: ``IMG_ROOT/image_path`` (matched by file name / stem / id). As the toolkit's ITC
evaluation: correct when s(image, POS[0]) > s(image, NEG[0]) (strict); chance 50 %.

Rows: accuracy per config (subset ``<Category>/<type...>/<corpus>``, pooled over its items), per
type (``<Category>/<type...>``: mean over its corpora), per category (``Attribute``, ``Object``,
``Relation``: mean over its types, the averages C3 and the VL-CheckList paper report), and ``all``:
``macro_accuracy`` (mean of the categories) and ``accuracy`` (pooled).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, files_in, group_rows, item_images, load_json,
                                           macro_row, not_lfs_pointer, pooled_row, tied_at_top)
from train.eval.interface import BenchData, Item, Pair, Row

CATEGORIES = ("Attribute", "Object", "Relation")


def _yaml(path: Path) -> dict:
    import yaml

    not_lfs_pointer(path, "VL-CheckList config")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise BenchmarkError(f"VL-CheckList config {path}: cannot read ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or not cfg.get("ANNO_PATH"):
        raise BenchmarkError(f"VL-CheckList config {path}: no ANNO_PATH")
    return cfg


def _resolve(anno: str, yaml_path: Path) -> Path:
    """The data file's path; where none is found, where it belongs: beside the ``corpus`` folder the
    YAML is in (the toolkit's layout, ``corpus/`` and ``data/`` side by side), else beside the YAML."""
    p = Path(anno)
    if p.is_absolute():
        return p
    for base in [yaml_path.parent, *yaml_path.parent.parents, Path.cwd()]:
        if (base / p).is_file():
            return base / p
    corpus = next((d for d in yaml_path.parents if d.name == "corpus"), None)
    return (corpus.parent if corpus else yaml_path.parent) / p


def _leaf(yaml_path: Path, root: Path) -> str:
    """``Attribute/color/vg`` from ``<root>/[v1/]Attribute/color/vg.yaml``."""
    try:
        parts = list(yaml_path.relative_to(root).with_suffix("").parts)
    except ValueError:
        parts = list(yaml_path.with_suffix("").parts)
    for k, p in enumerate(parts):
        if p in CATEGORIES:
            return "/".join(parts[k:])
    return "/".join(parts[-3:])


def read(spec) -> BenchData:
    root = Path(spec.path)
    configs = files_in(root, ["*.yaml", "*.yml"], "VL-CheckList")
    if root.is_file():
        root = root.parent
    items: list[Item] = []
    skipped: Counter = Counter()
    total = 0
    absent: list[str] = []
    for y in configs:
        cfg = _yaml(y)
        leaf = _leaf(y, root)
        anno = _resolve(str(cfg["ANNO_PATH"]), y)
        if not anno.exists():
            skipped[f"config skipped, data file not found: {anno}"] += 1
            absent.append(str(anno))
            continue
        data = load_json(anno, f"VL-CheckList data (from {y.name})")
        if not isinstance(data, list):
            raise BenchmarkError(f"VL-CheckList data {anno}: expected a list of [image, {{POS, NEG}}], got {type(data).__name__}")
        img_root = str(cfg.get("IMG_ROOT") or "")
        rows = Rows(anno, "VL-CheckList data")
        for n, rec in enumerate(data):
            total += 1
            if not (isinstance(rec, (list, tuple)) and len(rec) == 2 and isinstance(rec[0], str) and isinstance(rec[1], dict)):
                rows.bad(n, "expected [image_path, {'POS': [...], 'NEG': [...]}]")
                continue
            img, texts = rec
            pos, neg = texts.get("POS"), texts.get("NEG")
            if not (isinstance(pos, list) and pos and isinstance(pos[0], str) and pos[0].strip()):
                rows.bad(n, "POS is not a non-empty list of texts")
                continue
            if not (isinstance(neg, list) and neg and isinstance(neg[0], str) and neg[0].strip()):
                rows.bad(n, "NEG is not a non-empty list of texts")
                continue
            key = (img_root.rstrip("/") + "/" + img.lstrip("/")) if img_root else img
            items.append(Item([Pair(key, pos[0].strip()), Pair(key, neg[0].strip())], subset=leaf, key=f"{leaf}/{n}"))
            rows.items.append(items[-1])
        rows.done()
        skipped.update(rows.skipped)
    if len(absent) == len(configs):
        more = f" (and {len(absent) - 1} other configs' data files)" if len(absent) > 1 else ""
        raise BenchmarkError(f"VL-CheckList data {absent[0]}: file not found{more}; ANNO_PATH is read beside the corpus folder")
    return BenchData(spec.name, items, kind="pairwise", score=lambda it, sc: score(spec.name, it, sc),
                     skipped=dict(skipped), source=f"{len(configs)} configs under {root}", total=total)


def score(name: str, items, scores) -> list[Row]:
    correct = correct_vector(items, scores)
    img = item_images(items)
    ties = tied_at_top(scores)
    leaves = group_rows(name, [it.subset for it in items], correct, 0.5, images=img, ties=ties)
    out = list(leaves)
    by_type: dict[str, list[Row]] = {}
    for r in leaves:
        by_type.setdefault(r.subset.rsplit("/", 1)[0] if "/" in r.subset else r.subset, []).append(r)
    types = []
    for t, rs in sorted(by_type.items()):
        row = macro_row(name, t, rs, metric="accuracy", note=f"mean over {len(rs)} corpora")
        types.append(row)
    out += [t for t in types if t.subset not in CATEGORIES]  # a type named like its category is only the category row
    cats = []
    for c in CATEGORIES:
        rs = [t for t in types if t.subset == c or t.subset.startswith(c + "/")]
        if rs:
            cats.append(macro_row(name, c, rs, metric="accuracy", note=f"mean over {len(rs)} type(s)"))
    out += cats
    if cats:
        out.append(macro_row(name, "all", cats, note="mean of the Attribute / Object / Relation averages present"))
    out.append(pooled_row(name, "all", correct, 0.5, note="pooled over every item", images=img, ties=ties))
    return out
