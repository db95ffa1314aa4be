"""How much of a dataset's ground-truth scene graphs a ``visual_tokens`` artifact's predicted scene graphs recover.

The artifact's triplets (subject, object, predicate) are on its predicted instances; the ground truth is on the
samples artifact's instances. Each image's predicted masks are matched to its ground-truth masks exactly as the
relation encoder's labels are (:func:`train.jobs.relation_encoder.labels.match_instances`: one to one, IoU >=
``iou``), and the ground-truth relations mapped into the artifact's vocabulary by its own ``predicate_map``
(distinct (subject, object, predicate) triples; a relation whose predicate the vocabulary cannot hold is left out
and counted). Then:

* a predicted triplet is **correct** when its subject and object are matched to ground-truth instances i and j and
  (i, j, predicate) is a ground-truth triple; **precision** = correct / predicted triplets;
* a ground-truth triple is **recovered** when a predicted triplet is that triple on the matched instances;
  **recall** = recovered / ground-truth triples, *all* of them: a relation whose instance the segmenter missed
  counts as missed.

Both are shares of items clustered by image (:func:`train.eval.intervals.proportion` with the image as cluster:
Wilson on the effective n). Beside the artifact's own graphs, the same instances' graphs from the stage's
``geometric`` predictor (:class:`pipeline.models.relations.GeometricRelations` and the stage's graph rules,
:func:`pipeline.visual_tokens.graph.build_graph`, at the artifact's threshold and context length): what the
stage with ``relations: geometric`` writes for these instances. Recall of the two is over the same ground-truth
triples, so its paired difference (:func:`train.eval.intervals.paired_difference`) resamples the same images for
both; precision is over different triplets and is compared by its intervals only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _image_scores(pred_trip: set, gt: set, match: np.ndarray, gt_ids: list[int]) -> tuple[list[int], list[int]]:
    """(correct flag of each predicted triplet, recovered flag of each ground-truth triple) of one image."""
    back = {int(p): gt_ids[g] for g, p in enumerate(match) if p >= 0}  # predicted index -> ground-truth instance id
    on_gt = {(back[a], back[b], c) for a, b, c in pred_trip if a in back and b in back}
    correct = [int(a in back and b in back and (back[a], back[b], c) in gt) for a, b, c in sorted(pred_trip)]
    return correct, [int(t in on_gt) for t in sorted(gt)]


def graph_scores(tokens_dir: str | Path, samples_dir: str | Path, iou: float = 0.5) -> dict:
    """{"artifact": ..., "geometric": ...}, each {"correct": [flags], "correct_image": [ids], "recovered": [flags],
    "gt_image": [ids]} over every image of the artifact, plus {"stats": counts} (module doc)."""
    from pipeline.io.artifacts import Artifact
    from pipeline.loaders.visual_tokens import iter_samples
    from pipeline.masks import rle_decode
    from pipeline.models.relations import GeometricRelations
    from pipeline.models.segmenter import Segmentation, annotation_masks
    from pipeline.visual_tokens.graph import build_graph
    from pipeline.visual_tokens.predicates import PredicateMapper
    from train.jobs.relation_encoder.labels import ground_truth_by_sample, match_instances

    art = Artifact(tokens_dir)
    vocab = art.manifest.get("predicates") or []
    params = art.manifest.get("parameters") or {}
    mapper = PredicateMapper(vocab, params.get("predicate_map") or {})
    geo = GeometricRelations(vocab, mapper)
    inst, rels = ground_truth_by_sample(samples_dir)
    out = {k: {"correct": [], "correct_image": [], "recovered": [], "gt_image": []} for k in ("artifact", "geometric")}
    stats = {"images": 0, "gt_relations": 0, "unmapped": 0, "gt_triples": 0, "gt_instances": 0, "matched_instances": 0,
             "pred_instances": 0, "relations_on_predicted": params.get("relations")}
    fields = ["boxes.npy", "masks.json", "triplets.npy", "meta.json"]
    for p in art.files("shards"):
        for s in iter_samples(p, fields=fields):
            meta = s["meta.json"]
            sid, hw = int(meta["sample_id"]), (int(meta["height"]), int(meta["width"]))
            rles = s["masks.json"]
            masks = np.stack([rle_decode(r) for r in rles]) if rles else np.zeros((0, *hw), bool)
            rows = sorted(inst.get(sid, []), key=lambda r: r["instance_id"])
            gt_masks, _ = annotation_masks(rows, *hw) if rows else (np.zeros((0, *hw), bool), None)
            match = match_instances(masks, gt_masks, iou)
            gt = set()
            for r in rels.get(sid, []):
                m = mapper(r["predicate"])
                stats["unmapped"] += m is None
                if m is not None:
                    s_, o_ = (r["object"], r["subject"]) if m[1] else (r["subject"], r["object"])
                    if s_ != o_:
                        gt.add((int(s_), int(o_), int(m[0])))
            stats["images"] += 1
            stats["gt_relations"] += len(rels.get(sid, []))
            stats["gt_triples"] += len(gt)
            stats["gt_instances"] += len(rows)
            stats["matched_instances"] += int((match >= 0).sum())
            stats["pred_instances"] += len(masks)
            pid = np.asarray(meta["predicate_ids"], np.int64)
            t = s["triplets.npy"].reshape(-1, 3).astype(np.int64)
            graphs = {"artifact": {(int(a), int(b), int(pid[u])) for a, b, u in t}}
            boxes = s["boxes.npy"].reshape(-1, 4).astype(np.float32)
            seg = Segmentation(masks=masks, boxes=boxes, scores=np.asarray(meta["instance_scores"], np.float32),
                               embeddings=np.zeros((len(masks), 0), np.float32), image_feature=np.zeros(0, np.float32),
                               instance_ids=np.full(len(masks), -1, np.int64))
            scores, _ = geo.predict(seg, image_size=hw)
            g = build_graph(seg.scores, scores, boxes, threshold=params.get("relation_threshold", 0.05),
                            context=params.get("context_length", 77), max_per_pair=params.get("max_predicates_per_pair"))
            k = g.keep
            graphs["geometric"] = {(int(k[a]), int(k[b]), int(g.predicates[u])) for a, b, u in g.triplets}
            gt_ids = [int(r["instance_id"]) for r in rows]
            for name, trip in graphs.items():
                correct, recovered = _image_scores(trip, gt, match, gt_ids)
                o = out[name]
                o["correct"] += correct
                o["correct_image"] += [sid] * len(correct)
                o["recovered"] += recovered
                o["gt_image"] += [sid] * len(recovered)
    out["stats"] = stats
    return out


def summary(scores: dict) -> dict:
    """{predictor: {precision, its interval, recall, its interval, counts}} in percent, and the recall's paired
    difference (artifact - geometric) with its 95% interval, images resampled together."""
    from train.eval.intervals import interval, paired_difference, proportion

    res = {}
    ests = {}
    for name in ("artifact", "geometric"):
        o = scores[name]
        pe = proportion(o["correct"], o["correct_image"])
        re = ests[name] = proportion(o["recovered"], o["gt_image"])
        res[name] = {"predicted": len(o["correct"]), "correct": int(sum(o["correct"])),
                     "precision": 100.0 * pe.value if pe.n else float("nan"), "precision_ci": list(interval(pe, 100.0)),
                     "gt_triples": len(o["recovered"]), "recovered": int(sum(o["recovered"])),
                     "recall": 100.0 * re.value if re.n else float("nan"), "recall_ci": list(interval(re, 100.0))}
    d, lo, hi = paired_difference(ests["artifact"], ests["geometric"], 100.0) if ests["artifact"].n else (float("nan"),) * 3
    res["recall_diff"] = {"diff": d, "ci": [lo, hi]}
    res["stats"] = scores["stats"]
    return res
