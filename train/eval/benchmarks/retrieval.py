"""Image-text retrieval on a Karpathy split: ``dataset_coco.json`` / ``dataset_flickr30k.json``
(``{"images": [{"filename", "filepath", "split", "cocoid"?, "sentences": [{"raw"}...]}]}``).
``spec.split`` (default ``test``: the 5K COCO test images of ConceptOT G.4, the 1K Flickr30k test
images); ``restval`` images count as training (``split: train`` includes them). Each item is one
image with its captions as pairs [(image, caption_k), ...]; the harness scores them through the
job's ``retrieval_scores`` and computes R@K itself (``BenchData.kind == "retrieval"``). Image key:
``filename`` (``COCO_val2014_000000391895.jpg`` matches SugarCrepe-style ``000000391895.jpg`` and
source id ``391895`` through the COCO id).
"""

from __future__ import annotations

from pathlib import Path

from train.eval.benchmarks._common import BenchmarkError, Rows, karpathy_split_images, load_json
from train.eval.interface import BenchData, Item, Pair


def read(spec) -> BenchData:
    path = Path(spec.path)
    split = spec.split or "test"
    data = load_json(path, "Karpathy split JSON")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise BenchmarkError(f"Karpathy split JSON {path}: expected an object with an 'images' list")
    rows = Rows(path, "Karpathy split JSON")
    total = 0
    for n, im, key in karpathy_split_images(data, split, rows):
        total += 1
        if key is None:
            continue
        caps = [s.get("raw") if isinstance(s, dict) else s for s in im.get("sentences") or []]
        caps = [c.strip() for c in caps if isinstance(c, str) and c.strip()]
        if not caps:
            rows.bad(f"images[{n}]", "no non-empty sentence")
            continue
        sentids = [s.get("sentid") for s in im.get("sentences") or [] if isinstance(s, dict)]
        rows.items.append(Item([Pair(key, c) for c in caps], subset=split, key=key,
                               meta={"sentids": sentids, "cocoid": im.get("cocoid")}))
    rows.done()
    if not total:
        raise BenchmarkError(f"Karpathy split JSON {path}: no image in split {split!r}")
    return BenchData(spec.name, rows.items, kind="retrieval", score=_not_pairwise, skipped=dict(rows.skipped),
                     source=f"{path} (split {split})", total=total)


def _not_pairwise(items, scores):
    raise TypeError("retrieval benchmarks are scored by the harness through the job's retrieval_scores (R@K), "
                    "not through BenchData.score")
