"""relation-head evaluation: RAM's recall@K of the top-scoring (subject, object, predicate) triples,
with the recall of a uniformly random ranking beside it, as a dict for the loop and as harness rows
(:func:`recall_rows`, with a bootstrap interval over images)."""

from __future__ import annotations

import numpy as np
import torch

from train.eval.interface import NoScorableItems, Row
from train.eval.intervals import mean_interval
from train.jobs.relation_head.batches import collate


def recall_at_k(probs: np.ndarray, trip: np.ndarray, k: int) -> tuple[float, float] | None:
    """RAM's recall@K for one image: probs [V, V, C] (diagonal ignored), ground truth [E, 3].
    Returns (recall, chance recall) or None when the image has no ground truth."""
    if len(trip) == 0:
        return None
    v, _, c = probs.shape
    valid = ~np.eye(v, dtype=bool)[..., None].repeat(c, 2)
    flat = np.where(valid, probs, -np.inf).reshape(-1)
    n = int(valid.sum())
    top = np.argsort(-flat, kind="stable")[: min(k, n)]
    gt = set(np.ravel_multi_index((trip[:, 0], trip[:, 1], trip[:, 2]), probs.shape).tolist())
    hits = len(gt.intersection(top.tolist()))
    return hits / len(gt), min(k, n) / n


def per_image_recall(model, items, n_pred: int, d: int, ks: list[int],
                     batch_size: int = 64) -> tuple[dict[int, list], dict[int, list]]:
    """({k: recall of each image with ground truth}, {k: its chance recall}), fractions."""
    model.eval()
    res = {k: [] for k in ks}
    chance = {k: [] for k in ks}
    with torch.no_grad():
        for s in range(0, len(items), batch_size):
            chunk = items[s : s + batch_size]
            emb, box, pad, _ = collate(chunk, n_pred, d)
            probs = torch.sigmoid(model(emb, box, pad)).numpy()
            for i, it in enumerate(chunk):
                v = len(it[1])
                for k in ks:
                    r = recall_at_k(probs[i, :v, :v], it[3], k)
                    if r is not None:
                        res[k].append(r[0])
                        chance[k].append(r[1])
    return res, chance


def evaluate_model(model, items, n_pred: int, d: int, ks: list[int], batch_size: int = 64) -> dict:
    res, chance = per_image_recall(model, items, n_pred, d, ks, batch_size)
    out = {"images": len(res[ks[0]])}
    for k in ks:
        # percentages, as every other job and the evaluation harness report recalls
        out[f"recall@{k}"] = 100.0 * float(np.mean(res[k])) if res[k] else float("nan")
        out[f"chance_recall@{k}"] = 100.0 * float(np.mean(chance[k])) if chance[k] else float("nan")
    return out


def recall_rows(model, items, n_pred: int, d: int, ks: list[int], batch_size: int = 64) -> list[Row]:
    """recall@k of ``items`` (percent) per k, the random ranking's recall as chance, a 95% bootstrap
    interval over images; images without a ground-truth triple are counted as skipped."""
    res, chance = per_image_recall(model, items, n_pred, d, ks, batch_size)
    n = len(res[ks[0]])
    skipped = len(items) - n
    if n == 0:
        raise NoScorableItems(f"relation-head: none of the {len(items)} held-out images has a ground-truth relation")
    reasons = {"no_ground_truth_relation": skipped} if skipped else {}
    rows = []
    for k in ks:
        rows.append(Row("relation-head", "held_out", f"recall@{k}", 100.0 * float(np.mean(res[k])), n,
                        100.0 * float(np.mean(chance[k])), skipped, reasons, "%",
                        "RAM recall@K of (subject, object, predicate) triples; chance: a random ranking")
                    .with_ci(mean_interval(res[k], 100.0)))
    return rows
