"""Phrase discovery (text-groups Sec. 4.4): token groups against gold groundable phrases.

For one caption with word tokens 0..n-1 (SOT/EOT excluded), a discovered segmentation
``labels`` [n] (group of each token, the argmax over groups of the grouping attention) and gold
phrases (token index ranges, from character spans through the tokenizer's offsets):

* IoU(group g, phrase p) = |g n p| / |(g u p) n A|, A = the tokens inside any gold phrase (the
  paper's union "does not count the tokens which were not annotated");
* Hungarian matching (scipy ``linear_sum_assignment``) maximising the summed IoU pairs the
  non-empty groups with the phrases (min(#groups, #phrases) pairs);
* per matched pair: IoU, precision |g n p| / |g n A|, recall |g n p| / |p|, F1 (0 when P + R = 0);
  averaged over the caption's pairs, then over captions (Sec. 4.4: "first average every metric for
  the text input and then report the average over all examples").

Reported on all scored captions and on those with >= 2 gold phrases (with one phrase, a single
group covering the caption scores tIoU = 1 under the union rule).

Baselines (:func:`baseline_labels`): ``random`` (each token to one of K groups, uniformly),
``one-group`` (everything in one group), ``chunks`` (K contiguous chunks of equal length) and the
clusterings of the paper's Table 4 (``kmeans``, ``spectral``, ``meanshift``; scikit-learn, 4
clusters where the method takes a number) over token features (the trained `vanilla` model's).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from train.eval.intervals import interval, mean

METRICS = ("tIoU", "P", "R", "F1")


def caption_scores(labels: np.ndarray, phrases: Sequence[tuple[int, int]]) -> tuple[float, float, float, float]:
    """(tIoU, precision, recall, F1) of one caption, as fractions (see the module docstring).
    ``labels`` int [n] group id per word token; ``phrases`` [(a, b)] token ranges [a, b)."""
    labels = np.asarray(labels)
    n = len(labels)
    if n == 0 or not phrases:
        raise ValueError("a caption needs tokens and at least one gold phrase")
    P = np.zeros((len(phrases), n), bool)
    for i, (a, b) in enumerate(phrases):
        P[i, a:b] = True
    groups = np.unique(labels)
    G = labels[None, :] == groups[:, None]  # [g, n]
    A = P.any(0)
    inter = G.astype(np.int64) @ P.T.astype(np.int64)  # [g, p]
    g_in_a = (G & A).sum(1)
    p_size = P.sum(1)
    union = g_in_a[:, None] + p_size[None, :] - inter
    iou = inter / np.maximum(union, 1)
    r, c = linear_sum_assignment(iou, maximize=True)
    it = inter[r, c]
    prec = np.where(g_in_a[r] > 0, it / np.maximum(g_in_a[r], 1), 0.0)
    rec = it / p_size[c]
    f1 = np.where(prec + rec > 0, 2 * prec * rec / np.maximum(prec + rec, 1e-12), 0.0)
    return float(iou[r, c].mean()), float(prec.mean()), float(rec.mean()), float(f1.mean())


@dataclass
class GoldCaptions:
    """Captions ready for scoring: word-token count and gold token ranges of each, and the skips."""

    caption_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    n_tokens: list[int] = field(default_factory=list)
    phrases: list[list[tuple[int, int]]] = field(default_factory=list)
    images: list[int] = field(default_factory=list)  # each caption's image (the intervals resample images)
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    phrases_dropped: int = 0

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


def gold_captions(tok, captions: Sequence[tuple[int, str]], spans: dict[int, list[tuple[int, int]]],
                  max_len: int = 77, limit: int | None = None, image_of: dict[int, int] | None = None) -> GoldCaptions:
    """Tokenise captions and map their gold character spans onto word-token ranges.

    ``captions`` [(caption_id, text)], ``spans`` {caption_id: [(start, end)]} (characters).
    Counted skips: ``no_gold_phrase`` (the caption has no phrase row), ``empty_after_tokenisation``,
    ``no_phrase_inside_tokens`` (every phrase of the caption falls outside the kept tokens); a
    phrase outside the kept tokens (past a truncation at ``max_len``, or a bad span) is dropped and
    counted in ``phrases_dropped``; captions cut at ``max_len`` are counted in ``truncated``.
    ``image_of`` {caption_id: sample_id}: each kept caption's image (default: the caption itself)."""
    from train.jobs.text_groups.tokenizer import char_span_to_tokens, encode

    out = GoldCaptions()
    with_spans = [(c, t) for c, t in captions if spans.get(c)]
    out.skip("no_gold_phrase", len(captions) - len(with_spans))
    if limit is not None and len(with_spans) > limit:
        out.skip("over_max_captions", len(with_spans) - limit)
        with_spans = with_spans[:limit]
    if not with_spans:
        return out
    enc = encode(tok, [t for _, t in with_spans], max_len)
    out.truncated = enc.truncated
    for i, (cid, text) in enumerate(with_spans):
        if enc.lengths[i] == 0:
            out.skip("empty_after_tokenisation")
            continue
        off = enc.offsets[i]
        ranges = []
        for s, e in spans[cid]:
            r = char_span_to_tokens(off, int(s), int(e)) if 0 <= s < e <= len(text) else None
            if r is None:
                out.phrases_dropped += 1
            else:
                ranges.append(r)
        if not ranges:
            out.skip("no_phrase_inside_tokens")
            continue
        out.caption_ids.append(int(cid))
        out.texts.append(text)
        out.n_tokens.append(len(off))
        out.phrases.append(sorted(set(ranges)))
        out.images.append(int(image_of.get(int(cid), -1 - int(cid))) if image_of else -1 - int(cid))
    return out


def baseline_labels(method: str, n: int, k: int, rng: np.random.Generator, feats: np.ndarray | None = None) -> np.ndarray:
    """Group labels [n] of one caption's word tokens for a baseline (see the module docstring)."""
    if method == "random":
        return rng.integers(0, k, n)
    if method == "one-group":
        return np.zeros(n, np.int64)
    if method == "chunks":
        out = np.empty(n, np.int64)
        for g, idx in enumerate(np.array_split(np.arange(n), k)):
            out[idx] = g
        return out
    if feats is None:
        raise ValueError(f"baseline {method} needs token features")
    c = min(k, n)
    if c <= 1:
        return np.zeros(n, np.int64)
    x = np.asarray(feats, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "kmeans":
            from sklearn.cluster import KMeans

            return KMeans(n_clusters=c, n_init=4, random_state=int(rng.integers(1 << 30))).fit_predict(x)
        if method == "spectral":
            from sklearn.cluster import SpectralClustering

            xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
            aff = np.exp(xn @ xn.T - 1.0)  # RBF on unit vectors: exp(-|a-b|^2 / 2), positive and symmetric
            try:
                return SpectralClustering(n_clusters=c, affinity="precomputed",
                                          random_state=int(rng.integers(1 << 30))).fit_predict(aff)
            except Exception:  # a degenerate affinity (identical tokens): one group
                return np.zeros(n, np.int64)
        if method == "meanshift":
            from sklearn.cluster import MeanShift, estimate_bandwidth

            bw = estimate_bandwidth(x, quantile=0.3) if n > 2 else 0.0
            return MeanShift(bandwidth=bw if bw > 0 else None).fit_predict(x)
    raise ValueError(f"unknown baseline {method!r}")


def score_labels(all_labels: Sequence[np.ndarray], gold: GoldCaptions) -> dict[str, dict[str, float]]:
    """{subset: {metric: mean over captions, "<metric>_ci": its 95% interval (a cluster bootstrap over
    the captions' images, ``gold.images``), "n": captions}} for subsets ``all`` and ``ge2_phrases``.
    Metrics: tIoU as a fraction; P, R, F1 in percent."""
    per = np.array([caption_scores(lab, ph) for lab, ph in zip(all_labels, gold.phrases)], np.float64).reshape(-1, 4)
    many = np.array([len(ph) >= 2 for ph in gold.phrases], bool)
    out = {}
    for subset, sel in (("all", np.ones(len(per), bool)), ("ge2_phrases", many)):
        if not sel.any():
            out[subset] = {"n": 0}
            continue
        m = per[sel].mean(0)
        out[subset] = {"tIoU": float(m[0]), "P": 100 * float(m[1]), "R": 100 * float(m[2]), "F1": 100 * float(m[3]),
                       "n": int(sel.sum())}
        for j, metric in enumerate(METRICS):
            img = np.asarray(gold.images)[sel] if len(gold.images) == len(per) else None
            est = mean(per[sel, j], img)  # per caption, clustered by image: every method on the same captions
            out[subset][f"{metric}_est"] = est
            out[subset][f"{metric}_ci"] = interval(est, 1.0 if metric == "tIoU" else 100.0)
    return out
