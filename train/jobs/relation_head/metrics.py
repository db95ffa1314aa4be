"""relation-head evaluation: RAM's recall@K of the top-scoring (subject, object, predicate) triples,
with two reference levels beside it, as a dict for the loop and as harness rows (:func:`recall_rows`,
with a bootstrap interval over images):

* ``chance`` (the rows' chance column): the expected recall of the best ranking that ignores the
  image but for its number of instances V: the predicates in the order of their training frequency,
  over all training graphs or among those of images with V instances, whichever scores the higher
  mean on the images scored (:class:`PredicatePrior`, ``chance_prior``; ``global`` alone was the
  chance before 2026-11-29), every ordered pair of the image tied within a predicate (pairs in random
  order). A model that has learned only the predicates' frequencies at each instance count (what the
  ``control: shuffled`` run keeps: it permutes graphs within an instance count) reaches it; a model
  that reads the tokens and boxes goes above it. Per image (P = V (V - 1) ordered pairs), the
  predicate of frequency rank b fills ranks [b P, (b + 1) P), so a ground-truth triple of it is
  among the top K with probability clip((K - b P) / P, 0, 1).
* ``random`` (``chance_random_recall@K`` in the dict): a uniformly random ranking of the same
  N = V (V - 1) C candidates, min(K, N) / N per image (the floor; the prior ranking is above it).
"""

from __future__ import annotations

import numpy as np
import torch

from train.eval.interface import NoScorableItems, Row
from train.eval.intervals import interval, mean
from train.jobs.relation_head.batches import collate


def predicate_order(items, n_pred: int) -> np.ndarray:
    """[C] frequency rank of each predicate over ``items``' ground-truth triples (0 = most frequent;
    ties by vocabulary index)."""
    counts = np.zeros(n_pred, np.int64)
    for it in items:
        if len(it[3]):
            np.add.at(counts, it[3][:, 2], 1)
    order = np.argsort(-counts, kind="stable")
    rank = np.empty(n_pred, np.int64)
    rank[order] = np.arange(n_pred)
    return rank


class PredicatePrior:
    """The chance ranking's predicate order: :func:`predicate_order` of all the training graphs (``global_rank``), or
    per instance count, of the training graphs of images with V instances (the global order for a V no training graph
    with a triple has). ``mode``: ``global``, ``instance_count``, or ``strongest`` (the default): per K, whichever of
    the two scores the higher mean expected recall on the images scored (:func:`prior_lists`).

    Why by count: the shuffled control keeps each image's instance count and the predicates' frequencies at that
    count, and a head can tell the count (it attends over the V tokens, and the boxes shrink as V grows), so the global
    order was not the best a head without the image's content can do; on pixels.yaml's predicted instances the
    control's boxes-only classifier beat it (recall@3 51.0 against 37.5). Why the stronger of the two: with few
    training images per count the order estimated at each count is noisy and can score below the global one (the
    reduced oracle testbed's 360 training images: 9.4 / 30.0 / 45.6 against 10.6 / 33.3 / 51.1), and chance is the
    strongest of the no-learning rankings, never a weaker one. Both are image-blind, so taking the higher can only
    raise the bar."""

    def __init__(self, items, n_pred: int, mode: str = "strongest"):
        if mode not in ("strongest", "instance_count", "global"):
            raise ValueError(f"chance prior {mode!r}: expected strongest, instance_count or global")
        self.mode = mode
        self.global_rank = predicate_order(items, n_pred)
        groups: dict[int, list] = {}
        for it in items:
            groups.setdefault(len(it[1]), []).append(it)
        self.by_count = {v: predicate_order(g, n_pred) for v, g in groups.items() if any(len(it[3]) for it in g)}

    def rank(self, v: int) -> np.ndarray:
        """The order at ``v`` instances (``global`` mode: the global order)."""
        return self.global_rank if self.mode == "global" else self.by_count.get(int(v), self.global_rank)

    def candidates(self) -> list:
        """The image-blind orders this prior chooses from: ``strongest``: the global and the by-count one (as a
        :class:`PredicatePrior` in ``instance_count`` mode); else itself."""
        if self.mode != "strongest":
            return [self]
        import copy

        by_count = copy.copy(self)
        by_count.mode = "instance_count"
        return [self.global_rank, by_count]


def prior_lists(graphs: list[tuple[np.ndarray, int]], ks: list[int], pred_rank) -> dict[int, list[float]]:
    """{k: the image-blind prior's expected recall of each (triplets, V) in ``graphs``}: ``pred_rank`` a [C] rank or
    a :class:`PredicatePrior`; in its ``strongest`` mode, per k, the global or the by-count order, whichever has the
    higher mean over ``graphs`` (ties: the global)."""
    orders = pred_rank.candidates() if isinstance(pred_rank, PredicatePrior) else [pred_rank]
    out = {}
    for k in ks:
        lists = [[prior_recall(t, v, k, order) for t, v in graphs] for order in orders]
        out[k] = max(lists, key=lambda x: float(np.mean(x)) if x else 0.0)  # the first of equals: the global order
    return out


def prior_recall(trip: np.ndarray, v: int, k: int, pred_rank) -> float:
    """Expected recall@k of the image-blind ranking (predicates by ``pred_rank``: a [C] rank, or a
    :class:`PredicatePrior` giving the rank at V instances; pairs tied)."""
    p = v * (v - 1)
    rank = pred_rank.rank(v) if isinstance(pred_rank, PredicatePrior) else pred_rank
    b = rank[trip[:, 2]].astype(np.float64)
    return float(np.mean(np.clip((k - b * p) / p, 0.0, 1.0)))


def _prior_words(pred_rank) -> str:
    mode = pred_rank.mode if isinstance(pred_rank, PredicatePrior) else "global"
    return {"global": "", "instance_count": " at the image's instance count",
            "strongest": ", overall or at the image's instance count, whichever scores higher"}[mode]


def recall_at_k(probs: np.ndarray, trip: np.ndarray, k: int) -> tuple[float, float] | None:
    """RAM's recall@K for one image: probs [V, V, C] (diagonal ignored), ground truth [E, 3].
    Returns (recall, random-ranking recall) or None when the image has no ground truth."""
    if len(trip) == 0:
        return None
    v, _, c = probs.shape
    n = v * (v - 1) * c
    hit = top_k_hits(probs, np.unique(trip, axis=0), k)  # each distinct ground-truth triple counted once
    return int(hit.sum()) / len(hit), min(k, n) / n


def per_image_recall(model, items, n_pred: int, d: int, ks: list[int], pred_rank: np.ndarray,
                     batch_size: int = 64) -> tuple[dict, dict, dict]:
    """({k: recall of each image with ground truth}, {k: its random-ranking recall},
    {k: its image-blind prior recall}), fractions."""
    res, rand, graphs, _ = recall_pass(model, items, n_pred, d, ks, batch_size)
    return res, rand, prior_lists(graphs, ks, pred_rank)


def recall_pass(model, items, n_pred: int, d: int, ks: list[int], batch_size: int = 64) -> tuple[dict, dict, list, dict]:
    """One pass of ``model`` over ``items``: ({k: recall of each image with ground truth}, {k: its random-ranking
    recall}, [(triplets, V)] of those images for the prior, :func:`per_predicate_recall`'s dict), so that the
    image-level and the per-predicate rows score the held-out images once."""
    res = {k: [] for k in ks}
    rand = {k: [] for k in ks}
    per = {k: {} for k in ks}
    graphs = []
    for it, probs in _scored(model, items, n_pred, d, batch_size):
        graphs.append((it[3], len(it[1])))
        trip = np.unique(it[3], axis=0)  # each distinct ground-truth triple counted once
        v, _, c = probs.shape
        n = v * (v - 1) * c  # the candidates (recall_at_k's random ranking)
        for k in ks:
            hit = top_k_hits(probs, trip, k)
            res[k].append(int(hit.sum()) / len(hit))
            rand[k].append(min(k, n) / n)
            for p in np.unique(trip[:, 2]).tolist():  # each predicate of the image (not c, the vocabulary's size)
                vals, ids = per[k].setdefault(int(p), ([], []))
                vals.append(float(hit[trip[:, 2] == p].mean()))
                ids.append(it[0])
    return res, rand, graphs, per


def _scored(model, items, n_pred: int, d: int, batch_size: int = 64):
    """(item, sigmoid scores [V, V, C]) of each item that has a ground-truth triple, in the items' order."""
    model.eval()
    with torch.no_grad():
        for s in range(0, len(items), batch_size):
            chunk = items[s : s + batch_size]
            emb, box, pad, _ = collate(chunk, n_pred, d)
            probs = torch.sigmoid(model(emb, box, pad)).numpy()
            for i, it in enumerate(chunk):
                if len(it[3]):
                    v = len(it[1])
                    yield it, probs[i, :v, :v]


def top_k_hits(probs: np.ndarray, trip: np.ndarray, k: int) -> np.ndarray:
    """[E] bool: each ground-truth triple among the image's ``k`` highest-scoring (subject, object, predicate)
    triples (the ranking of :func:`recall_at_k`; its recall is the mean of this over the distinct triples)."""
    v, _, c = probs.shape
    valid = ~np.eye(v, dtype=bool)[..., None].repeat(c, 2)
    top = np.argsort(-np.where(valid, probs, -np.inf).reshape(-1), kind="stable")[: min(k, int(valid.sum()))]
    return np.isin(np.ravel_multi_index((trip[:, 0], trip[:, 1], trip[:, 2]), probs.shape), top)


def per_predicate_recall(model, items, n_pred: int, d: int, ks: list[int], batch_size: int = 64) -> dict:
    """{k: {predicate id: ([recall@k over that predicate's ground-truth triples] per image that has one, [the
    images' sample ids])}}: the per-predicate recall of the scene-graph literature's mean recall mR@K (Chen et al.
    2019, Tang et al. 2019): a predicate's hits among its own triples in the image's top K, averaged over the images
    that have it, so that a rare predicate counts as much as a frequent one in the mean."""
    return recall_pass(model, items, n_pred, d, ks, batch_size)[3]


def prior_per_predicate(items, ks: list[int], pred_rank) -> dict:
    """{k: {predicate id: [the image-blind ranking's expected recall of that predicate's triples] per image that has
    one}}, in :func:`per_predicate_recall`'s order; ``strongest``: per k, the global or the by-count order, whichever
    has the higher mean recall over the predicates (one ranking for all of them, as a model has)."""
    graphs = [(np.unique(it[3], axis=0), len(it[1])) for it in items if len(it[3])]
    orders = pred_rank.candidates() if isinstance(pred_rank, PredicatePrior) else [pred_rank]
    out = {}
    for k in ks:
        per_order = []
        for order in orders:
            per: dict[int, list[float]] = {}
            for trip, v in graphs:
                for c in np.unique(trip[:, 2]).tolist():
                    per.setdefault(int(c), []).append(prior_recall(trip[trip[:, 2] == c], v, k, order))
            per_order.append(per)
        # the first of equals: the global order
        out[k] = max(per_order, key=lambda per: float(np.mean([np.mean(x) for x in per.values()])) if per else 0.0)
    return out


def evaluate_model(model, items, n_pred: int, d: int, ks: list[int], pred_rank: np.ndarray, batch_size: int = 64) -> dict:
    res, rand, prior = per_image_recall(model, items, n_pred, d, ks, pred_rank, batch_size)
    out = {"images": len(res[ks[0]])}
    for k in ks:
        # percentages, as every other job and the evaluation harness report recalls
        out[f"recall@{k}"] = 100.0 * float(np.mean(res[k])) if res[k] else float("nan")
        out[f"chance_recall@{k}"] = 100.0 * float(np.mean(prior[k])) if prior[k] else float("nan")
        out[f"chance_random_recall@{k}"] = 100.0 * float(np.mean(rand[k])) if rand[k] else float("nan")
    return out


def recall_interval(est) -> tuple[float, float]:
    """The 95% interval (percent) of a mean of per-image recalls: the cluster bootstrap
    (:func:`train.eval.intervals.interval`); where every image scored the same (a predicate no image recalls at
    K = 1, or every one), the bootstrap has nothing to resample and would give a zero-width interval, so each image
    is one observation of that rate (Wilson on the images, as the proportions' path does at 0 or all hits)."""
    from train.eval.intervals import n_clusters, wilson_n

    if est.n and float(np.ptp(est.y)) == 0.0 and len(set(est.group.tolist())) == 1:
        return wilson_n(est.value, n_clusters(est), 100.0)
    return interval(est, 100.0)


def recall_rows(model, items, n_pred: int, d: int, ks: list[int], pred_rank: np.ndarray, batch_size: int = 64,
                baselines: dict | None = None, benchmark: str = "relation-head", vocab: list[str] | None = None) -> list[Row]:
    """recall@k of ``items`` (percent) per k, the image-blind prior ranking's recall as chance, a
    95% bootstrap interval over images; images without a ground-truth triple are counted as skipped.
    ``baselines``: {name: (a model with the head's call signature, note)} scored on the same images,
    each a ``recall@k[name]`` row naming its result row (``baseline_for``). With ``vocab`` (the predicate names),
    also :func:`predicate_rows`: where the recall comes from, predicate by predicate, and its mean mR@K."""
    passes = {name: recall_pass(m, items, n_pred, d, ks, batch_size) for name, m in
              [("", model), *((name, m) for name, (m, _) in (baselines or {}).items())]}  # each model once
    res, rand, graphs, _ = passes[""]
    prior = prior_lists(graphs, ks, pred_rank)
    n = len(res[ks[0]])
    skipped = len(items) - n
    if n == 0:
        raise NoScorableItems(f"{benchmark}: none of the {len(items)} held-out images has a ground-truth relation")
    reasons = {"no_ground_truth_relation": skipped} if skipped else {}
    images = np.array([it[0] for it in items if len(it[3])])  # the images recall_at_k scores, in its order
    rows = []
    base = {name: (passes[name][0], note) for name, (_, note) in (baselines or {}).items()}
    for k in ks:
        est = mean(res[k], images)
        rows.append(Row(benchmark, "held_out", f"recall@{k}", 100.0 * float(np.mean(res[k])), n,
                        100.0 * float(np.mean(prior[k])), skipped, reasons, "%",
                        "RAM recall@K of (subject, object, predicate) triples; chance: the image-blind ranking "
                        f"(predicates by training frequency{_prior_words(pred_rank)}); "
                        f"a random ranking: {100.0 * float(np.mean(rand[k])):.2f}",
                        est=est).with_ci(recall_interval(est)))
        for name, (br, note) in base.items():
            e0 = mean(br[k], images)
            rows.append(Row(benchmark, "held_out", f"recall@{k}[{name}]", 100.0 * float(np.mean(br[k])), n,
                            100.0 * float(np.mean(prior[k])), skipped, reasons, "%", note,
                            baseline_for=f"held_out/recall@{k}", est=e0).with_ci(recall_interval(e0)))
    if vocab is not None:
        rows += predicate_rows(model, items, n_pred, d, ks, pred_rank, vocab, batch_size, baselines, benchmark,
                               per={name: p[3] for name, p in passes.items()})
    return rows


def predicate_rows(model, items, n_pred: int, d: int, ks: list[int], pred_rank, vocab: list[str], batch_size: int = 64,
                   baselines: dict | None = None, benchmark: str = "relation-head", per: dict | None = None) -> list[Row]:
    """Per predicate p of the held-out ground truth, ``recall@k`` in subset ``predicate:<p>`` (its triples' recall,
    over the images that have it), and subset ``held_out`` ``mean_recall@k`` (mR@K: the mean over the predicates,
    its interval over images across all of them, :func:`train.eval.intervals.macro`), chance the image-blind
    ranking's (:func:`prior_per_predicate`), each with the ``baselines``' rows beside it. These say which predicates
    the head reads and where it stands against the boxes-only classifier, predicate by predicate. ``per``: the
    models' :func:`per_predicate_recall` dicts already computed ({"": the model's, name: each baseline's})."""
    from train.eval.intervals import macro

    scored = [it for it in items if len(it[3])]
    prior = prior_per_predicate(scored, ks, pred_rank)
    per = per or {}

    def of(name, m):
        return per[name] if name in per else per_predicate_recall(m, items, n_pred, d, ks, batch_size)

    runs = [("", None, of("", model), "")]
    runs += [(f"[{name}]", name, of(name, m), note) for name, (m, note) in (baselines or {}).items()]
    rows = []
    for k in ks:
        for tag, name, per, note in runs:
            parts = []
            for c in sorted(per[k]):
                vals, ids = per[k][c]
                est = mean(vals, np.asarray(ids))
                parts.append(est)
                subset = "predicate:" + vocab[c].replace("/", "-")
                rows.append(Row(benchmark, subset, f"recall@{k}{tag}", 100.0 * est.value, est.n,
                                100.0 * float(np.mean(prior[k][c])), 0, {}, "%",
                                note or f"recall@{k} of the held-out {vocab[c]!r} triples, over the images that have one",
                                baseline_for=f"{subset}/recall@{k}" if name else "", est=est).with_ci(recall_interval(est)))
            est = macro(parts)
            rows.append(Row(benchmark, "held_out", f"mean_recall@{k}{tag}", 100.0 * est.value, len(scored),
                            100.0 * float(np.mean([np.mean(x) for x in prior[k].values()])), len(items) - len(scored),
                            {"no_ground_truth_relation": len(items) - len(scored)} if len(items) > len(scored) else {},
                            "%", note or f"mR@{k}: the mean over the {len(parts)} held-out predicates of their recall@{k}",
                            baseline_for=f"held_out/mean_recall@{k}" if name else "", est=est).with_ci(recall_interval(est)))
    return rows
