"""relation-encoder's labels: the corpus's ground-truth scene graphs put on the segmenter's predicted instances.

A ``visual_tokens`` artifact holds, per image, the instances the manifest's segmenter predicted (their
tangible tokens, boxes and masks, ``masks.json``); the samples artifact holds the ground truth: the
``instances`` table (one mask per ground-truth instance) and the ``relations`` table (subject instance id,
object instance id, predicate). RAM is trained on PSG the same way: the scene graph is annotated on
instances, the model sees the instances a segmenter finds.

Matching (:func:`match_instances`): the IoU of every predicted mask with every ground-truth mask of the image
(pixels in both / pixels in either); a one-to-one assignment maximising the summed IoU over the pairs with
IoU >= ``iou_threshold`` (``train.relation_encoder.match_iou``, default 0.5, the usual "a detection is right"
level: at or above one half, no predicted mask can be the match of two ground-truth instances that do not
overlap each other), found by ``scipy.optimize.linear_sum_assignment`` on the IoU with the pairs below the
threshold set to 0 (a pair at 0 is never kept). A ground-truth instance without a partner has no predicted
instance; a predicted instance without one is a background or duplicate segment: it takes part in every
image's candidates (its pairs' targets are all 0), as a false segment does at inference.

Labels (:func:`graph_labels`): each ground-truth relation whose subject and object both have a partner becomes
the triplet (partner of subject, partner of object, predicate in the artifact's vocabulary), the predicate
mapped by the artifact's own ``predicate_map`` (:class:`pipeline.visual_tokens.predicates.PredicateMapper`,
``~p`` swaps subject and object) through :func:`pipeline.models.relations.scores_from_relations`, the code the
stage's ``annotations`` predictor uses. A relation with an unmatched end is *lost* (counted: the held-out
recall of the job is the recall of the matched relations, RAM's training recall; what the testbed's
predicted scene graph recovers of *all* its relations is measured by ``benchmarks/relation_graphs.py``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def mask_iou(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """[P, G] IoU of boolean masks pred [P, H, W] and gt [G, H, W] (0 where the union is empty)."""
    p = np.asarray(pred, dtype=bool).reshape(len(pred), -1).astype(np.float32)
    g = np.asarray(gt, dtype=bool).reshape(len(gt), -1).astype(np.float32)
    inter = p @ g.T
    union = p.sum(1)[:, None] + g.sum(1)[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / np.maximum(union, 1), 0.0)


def match_instances(pred: np.ndarray, gt: np.ndarray, iou_threshold: float = 0.5) -> np.ndarray:
    """[G] index of the predicted mask matched to each ground-truth mask, -1 for none (module doc): one to one,
    IoU >= ``iou_threshold``, the summed IoU of the kept pairs maximal."""
    from scipy.optimize import linear_sum_assignment

    out = np.full(len(gt), -1, dtype=np.int64)
    if len(pred) == 0 or len(gt) == 0:
        return out
    iou = mask_iou(pred, gt)
    w = np.where(iou >= iou_threshold, iou, 0.0)
    rows, cols = linear_sum_assignment(w, maximize=True)
    keep = w[rows, cols] > 0
    out[cols[keep]] = rows[keep]
    return out


@dataclass
class LabelStats:
    """What the matching did to the ground truth, summed over images."""

    images: int = 0
    gt_instances: int = 0
    matched_instances: int = 0
    pred_instances: int = 0
    relations: int = 0            # ground-truth relations of the images
    unmapped: int = 0             # their predicate is not in the vocabulary (nor mapped into it)
    lost: int = 0                 # an end (subject or object) without a predicted partner
    triplets: int = 0             # labels kept (distinct (subject, object, predicate) on predicted instances)
    by_split: dict = field(default_factory=dict)

    def add(self, other: "LabelStats") -> None:
        for k in ("images", "gt_instances", "matched_instances", "pred_instances", "relations", "unmapped", "lost",
                  "triplets"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("images", "gt_instances", "matched_instances", "pred_instances",
                                           "relations", "unmapped", "lost", "triplets")}
        mapped = self.relations - self.unmapped
        d["relations_kept_fraction"] = round((mapped - self.lost) / mapped, 6) if mapped else None
        d["instances_matched_fraction"] = round(self.matched_instances / self.gt_instances, 6) if self.gt_instances else None
        return d


def graph_labels(pred_masks: np.ndarray, gt_rows: list[dict], rel_rows: list[dict], vocab_size: int, mapper,
                 iou_threshold: float) -> tuple[np.ndarray, LabelStats, np.ndarray]:
    """(triplets [E, 3] int64 (subject, object in the predicted instances, vocabulary id), stats, match [G]) of one
    image: ``gt_rows`` its ground-truth instances (``instance_id``, ``box``, ``mask_rle``), ``rel_rows`` its
    relations (``subject``, ``object``, ``predicate``: instance ids)."""
    from pipeline.models.relations import scores_from_relations
    from pipeline.models.segmenter import annotation_masks

    h, w = pred_masks.shape[1:] if pred_masks.ndim == 3 else (0, 0)
    gt_rows = sorted(gt_rows, key=lambda r: r["instance_id"])
    gt_masks, _ = annotation_masks(gt_rows, h, w) if gt_rows else (np.zeros((0, h, w), bool), None)
    match = match_instances(pred_masks, gt_masks, iou_threshold)
    partner = {int(r["instance_id"]): int(m) for r, m in zip(gt_rows, match) if m >= 0}
    st = LabelStats(images=1, gt_instances=len(gt_rows), matched_instances=int((match >= 0).sum()),
                    pred_instances=len(pred_masks), relations=len(rel_rows))
    mapped = [r for r in rel_rows if mapper(r["predicate"]) is not None]
    st.unmapped = len(rel_rows) - len(mapped)
    kept = [r for r in mapped if int(r["subject"]) in partner and int(r["object"]) in partner]
    st.lost = len(mapped) - len(kept)
    scores, _ = scores_from_relations(len(pred_masks), vocab_size, [partner[int(r["subject"])] for r in kept],
                                      [partner[int(r["object"])] for r in kept], [r["predicate"] for r in kept], mapper)
    trip = np.argwhere(scores > 0).astype(np.int64).reshape(-1, 3)
    st.triplets = len(trip)
    return trip, st, match


def ground_truth_by_sample(samples_dir: str | Path) -> tuple[dict, dict]:
    """({sample_id: [instance rows]}, {sample_id: [relation rows]}) of a samples artifact; ValueError (one line)
    when it has no ``instances`` or ``relations`` table (a dataset without scene graphs cannot label relations)."""
    from pipeline.io.artifacts import Artifact

    art = Artifact(samples_dir)
    missing = [t for t in ("instances", "relations") if t not in art.tables()]
    if missing:
        raise ValueError(f"{samples_dir}: the samples artifact has no {' / '.join(missing)} table: the relation "
                         "encoder's labels are the dataset's scene graphs (the generated corpus has them)")
    inst: dict[int, list] = defaultdict(list)
    t = art.read("instances", ["sample_id", "instance_id", "box", "mask_rle"])
    for sid, iid, box, rle in zip(*(t[c].to_pylist() for c in ("sample_id", "instance_id", "box", "mask_rle"))):
        inst[int(sid)].append({"instance_id": int(iid), "box": box, "mask_rle": json.loads(rle) if isinstance(rle, str) else rle})
    rels: dict[int, list] = defaultdict(list)
    t = art.read("relations", ["sample_id", "subject", "object", "predicate"])
    for sid, s, o, p in zip(*(t[c].to_pylist() for c in ("sample_id", "subject", "object", "predicate"))):
        rels[int(sid)].append({"subject": int(s), "object": int(o), "predicate": str(p)})
    return inst, rels


def load_labelled_graphs(tokens_dir: str | Path, samples_dir: str | Path, iou_threshold: float):
    """([(sample_id, tangible [V, d] f32, box features [V, 8], triplets [E, 3])], the tokens' manifest, {sample_id:
    LabelStats}): the items relation-head's model and loss take (train/jobs/relation_head/batches.py), with the
    triplets from the samples' scene graphs through the matching (module doc), not the artifact's own."""
    from pipeline.io.artifacts import Artifact
    from pipeline.loaders.visual_tokens import iter_samples
    from pipeline.masks import rle_decode
    from pipeline.models.relations import box_features
    from pipeline.visual_tokens.predicates import PredicateMapper

    art = Artifact(tokens_dir)
    vocab = art.manifest.get("predicates") or []
    mapper = PredicateMapper(vocab, (art.manifest.get("parameters") or {}).get("predicate_map") or {})
    inst, rels = ground_truth_by_sample(samples_dir)
    items, stats = [], {}
    for p in art.files("shards"):
        for s in iter_samples(p, fields=["tangible.npy", "boxes.npy", "masks.json", "meta.json"]):
            meta = s["meta.json"]
            sid, hw = int(meta["sample_id"]), (int(meta["height"]), int(meta["width"]))
            rles = s["masks.json"]
            masks = np.stack([rle_decode(r) for r in rles]) if rles else np.zeros((0, *hw), bool)
            trip, st, _ = graph_labels(masks, inst.get(sid, []), rels.get(sid, []), len(vocab), mapper, iou_threshold)
            tang = s["tangible.npy"].astype(np.float32)
            items.append((sid, tang, box_features(s["boxes.npy"], hw), trip))
            stats[sid] = st
    return items, art.manifest, stats
