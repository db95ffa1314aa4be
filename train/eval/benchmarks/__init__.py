"""Benchmark readers, one module per published format, and their scorers.

``read_benchmark(spec) -> BenchData`` reads one ``eval.benchmarks`` entry
(:class:`pipeline.config.BenchmarkSpec`: name, format, path, images, image_map, split, max_items,
subsets, options) with the reader ``FORMATS[spec.format]``. Every reader keeps the benchmark's own
image keys in ``Pair.image`` (matched to samples by :class:`train.eval.images.ImageMatcher`), counts
malformed rows in ``BenchData.skipped`` with their reason, and raises :class:`BenchmarkError` (one
line naming the file and the row) when a file has no usable row at all. ``BenchData.score(items,
scores)`` returns one :class:`~train.eval.interface.Row` per subset and metric plus ``all``, values
and chance levels in percent, ``n`` = items scored.

After reading, ``spec.subsets`` keeps the items whose subset equals a listed name or starts / ends
with it as a ``/``-separated part (``Attribute`` keeps ``Attribute/color/vg``), and
``spec.max_items`` keeps a seeded random subset (``options.seed``, default 0) in file order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from train.eval.benchmarks import aro, foil, retrieval, sugarcrepe, svo_probes, valse, vl_checklist, winoground
from train.eval.benchmarks._common import BenchmarkError
from train.eval.interface import BenchData

__all__ = ["FORMATS", "FORMAT_HELP", "BenchmarkError", "read_benchmark", "select"]

FORMATS: dict[str, Callable] = {
    "sugarcrepe": sugarcrepe.read,
    "aro_vg_relation": aro.read_vg_relation,
    "aro_vg_attribution": aro.read_vg_attribution,
    "aro_order": aro.read_order,
    "winoground": winoground.read,
    "valse": valse.read,
    "vl_checklist": vl_checklist.read,
    "svo_probes": svo_probes.read,
    "foil": foil.read,
    "retrieval": retrieval.read,
}


FORMAT_HELP: dict[str, str] = {  # one line per format, for `train eval --formats`
    "sugarcrepe": "SugarCrepe JSON (RAIVNLab/sugar-crepe data/<kind>.json) or HF SugarCrepe_<kind> parquet; pos > neg",
    "aro_vg_relation": "ARO visual_genome_relation.json; true > false caption on the bbox crop; macro over relations",
    "aro_vg_attribution": "ARO visual_genome_attribution.json; macro over attribute pairs with >= options.min_count (25)",
    "aro_order": "COCO/Flickr-Order from a Karpathy JSON (split, default test): caption vs its 4 ARO shuffles",
    "winoground": "Winoground examples.jsonl: text / image / group scores",
    "valse": "VALSE data/*.json pieces (mturk.caption >= 2): caption > foil per piece and phenomenon",
    "vl_checklist": "VL-CheckList corpus/ YAMLs + data JSON: POS > NEG; Attribute / Object / Relation averages",
    "svo_probes": "SVO-Probes svo_probes.csv: positive image > negative image for the sentence",
    "foil": "FOIL-COCO foilv1.0_test_2017.json: original caption > foil",
    "retrieval": "Karpathy dataset_coco.json / dataset_flickr30k.json split (default test): R@K by the harness",
}


def _wanted(subset: str, names: list[str]) -> bool:
    parts = subset.split("/")
    return any(subset == s or subset.startswith(s + "/") or subset.endswith("/" + s) or s in parts for s in names)


def select(data: BenchData, subsets: list[str] | None = None, max_items: int | None = None, seed: int = 0) -> BenchData:
    """Keep the items of ``subsets`` and at most ``max_items`` of them (seeded, file order kept);
    the left-out items are not skips (they were not asked for) and are not counted."""
    items = data.items
    if subsets:
        items = [it for it in items if _wanted(it.subset, list(subsets))]
        if not items:
            have = sorted({it.subset for it in data.items})
            raise BenchmarkError(f"{data.name}: no item in subsets {', '.join(subsets)} (subsets: {', '.join(have[:12])}"
                                 f"{' ...' if len(have) > 12 else ''})")
    if max_items is not None and len(items) > max_items:
        keep = np.sort(np.random.default_rng(seed).choice(len(items), int(max_items), replace=False))
        items = [items[k] for k in keep]
    data.items = items
    return data


def read_benchmark(spec) -> BenchData:
    """Read ``spec`` (a BenchmarkSpec or anything with its attributes) in its published format."""
    fmt = str(spec.format).lower()
    if fmt not in FORMATS:
        raise BenchmarkError(f"eval.benchmarks {spec.name}: unknown format {spec.format!r} (known: {', '.join(FORMATS)})")
    data = FORMATS[fmt](spec)
    opts = getattr(spec, "options", None) or {}
    return select(data, getattr(spec, "subsets", None), getattr(spec, "max_items", None), int(opts.get("seed", 0)))
