"""SugarCrepe-format compositionality: read the benchmark's JSON files as published, pairwise
accuracy = fraction of (image, caption, negative_caption) triples where the positive scores higher.

File format (``<dir>/<kind>.json``, kinds such as swap_att, replace_rel, add_obj)::

    {"0": {"filename": "000000565045.jpg", "caption": "...", "negative_caption": "..."}, ...}
"""

from __future__ import annotations

import json
from pathlib import Path


def read_sugarcrepe(dirs) -> dict[str, list[dict]]:
    """{kind: [{"filename", "caption", "negative_caption"}, ...]} from every ``*.json`` in ``dirs``
    (a kind found in several folders is merged). Files that are not SugarCrepe-shaped are skipped."""
    out: dict[str, list[dict]] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.json")):
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            rows = data.values() if isinstance(data, dict) else data if isinstance(data, list) else []
            good = [
                {"filename": str(r["filename"]), "caption": str(r["caption"]), "negative_caption": str(r["negative_caption"])}
                for r in rows
                if isinstance(r, dict) and {"filename", "caption", "negative_caption"} <= set(r)
            ]
            if good:
                out.setdefault(f.stem, []).extend(good)
    return out


def pairwise_accuracy(pos_scores, neg_scores) -> float:
    """100 * mean(pos > neg), strict: a tie counts as wrong, as in SugarCrepe's own evaluation and the
    harness (train/eval/benchmarks/sugarcrepe.py), so a constant scorer scores 0, not 50."""
    import torch

    pos = torch.as_tensor(pos_scores, dtype=torch.float64)
    neg = torch.as_tensor(neg_scores, dtype=torch.float64)
    if pos.numel() == 0:
        return float("nan")
    return float(100 * (pos > neg).double().mean())
