"""InfoGround's grounding evaluation (Flickr30k Entities protocol, Gupta et al. 2020, Sec. 3.1).

A phrase's score for a region is the max attention any of its words gives the region; R@1/5/10:
one of the top-k regions has IoU >= ``iou_threshold`` with a ground-truth box of the phrase
(:func:`train.boxes.box_iou`, by default with the reference code's +1-pixel box widths,
``iou_plus_one``); pointing accuracy: the centre of the top region lies in one of the phrase's
boxes. Exact chance levels (uniformly random ranking of the image's regions) go beside every
figure; the held-out L_lang check scores each noun against its stored negatives in context, beside
chance and the prior-only baseline (:func:`prior_wins`: no image, the training captions' noun
counts). Heatmaps of a few captions are saved as PNG.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipeline.loaders.negatives import NegativesReader
from train.boxes import box_iou
from train.data import ParquetMultiJoin
from train.eval.interface import Row
from train.eval.intervals import interval, proportion, wilson

GROUNDING_METRICS = ("r1", "r5", "r10", "pointing_accuracy")


def centre_in(boxes: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """[len(boxes)] True where the box centre lies in some gt box (closed intervals)."""
    cx = (boxes[:, 0] + boxes[:, 2]) / 2
    cy = (boxes[:, 1] + boxes[:, 3]) / 2
    return ((cx[:, None] >= gt[None, :, 0]) & (cx[:, None] <= gt[None, :, 2])
            & (cy[:, None] >= gt[None, :, 1]) & (cy[:, None] <= gt[None, :, 3])).any(1)


def recall_chance(n: int, hits: int, k: int) -> float:
    """P(a uniformly random ranking of n regions puts one of the ``hits`` good ones in its top k)."""
    if hits <= 0:
        return 0.0
    if k >= n:
        return 1.0
    return 1.0 - math.comb(n - hits, k) / math.comb(n, k)


def phrase_outcome(score: np.ndarray, boxes: np.ndarray, gt: np.ndarray, iou_thr: float, plus_one: bool = True) -> dict:
    """Grounding of one phrase: score [R] per region, boxes [R, 4], gt [G, 4]. Hits and chances in 0/1.
    ``plus_one``: integer-pixel IoU (width x1 - x0 + 1, the reference code's) or continuous boxes."""
    order = np.argsort(-score, kind="stable")
    good = box_iou(boxes, gt, plus_one=plus_one).max(1) >= iou_thr
    inside = centre_in(boxes, gt)
    n = len(boxes)
    out = {"pointing_accuracy": float(inside[order[0]]), "pointing_accuracy_chance": float(inside.mean())}
    for k in (1, 5, 10):
        out[f"r{k}"] = float(good[order[:k]].any())
        out[f"r{k}_chance"] = recall_chance(n, int(good.sum()), k)
    return out


def noun_counts(texts, is_noun) -> Counter:
    """The word-frequency prior: occurrences of each noun (lower-cased surface form) among ``texts``
    where ``is_noun`` (the training captions' rows of the negatives artifact's ``words`` table)."""
    return Counter(t.lower() for t, n in zip(texts, is_noun) if n and t)


def prior_wins(noun: str, negatives: list[str], counts: Counter) -> bool:
    """The prior-only scorer of the noun-vs-negatives check: it sees no image and scores each word by
    its training count; the true noun wins only when strictly above every negative (ties: wrong)."""
    c = counts.get(noun.lower(), 0)
    return all(c > counts.get(w.lower(), 0) for w in negatives)


class EvalSet:
    """The phrases of one split with everything needed to ground them (loaded once, in memory:
    evaluation sets are small, Flickr30k Entities val/test = 1K images each)."""

    def __init__(self, images: list[dict], skipped: Counter, n_images_skipped: Counter):
        self.images, self.skipped, self.images_skipped = images, skipped, n_images_skipped

    @property
    def n_phrases(self) -> int:
        return sum(len(c["phrases"]) for im in self.images for c in im["captions"])


def load_eval_set(sids, neg, smp, rr, manifest, prior: Counter | None = None) -> EvalSet:
    """The phrases of the images ``sids`` (sorted) that can be grounded: their ground-truth boxes
    (``samples``' phrases and instances), the word features of their words (``neg``, the negatives
    artifact), the image's regions (``rr``); the rest is counted by reason. With ``prior`` (noun
    counts, :func:`noun_counts`) each held-out noun also gets its prior-only outcome (``noun_prior``)."""
    skipped: Counter = Counter()
    img_skipped: Counter = Counter()
    if "phrases" not in smp.tables():
        return EvalSet([], Counter({"no_phrases_table": 1}), img_skipped)
    phrases = ParquetMultiJoin(smp, "phrases", ["caption_id", "start", "end", "text", "instance_ids"], cache_files=8)
    instances = ParquetMultiJoin(smp, "instances", ["instance_id", "box"], cache_files=8) \
        if "instances" in smp.tables() else None
    words = ParquetMultiJoin(neg, "words", ["caption_id", "word_index", "start", "end", "text"], cache_files=8)
    nreader = NegativesReader(neg.dir)
    cands = ParquetMultiJoin(neg, "negatives", ["caption_id", "word_index", "noun", "candidates"], cache_files=8) \
        if prior is not None else None
    images_tbl = smp.read("samples", ["sample_id", "image", "width", "height"]).to_pydict()
    from pipeline.loaders.samples import image_resolver

    resolve = image_resolver(smp.dir, manifest)  # samples.image is relative to the dataset root
    img_path = dict(zip(images_tbl["sample_id"], map(resolve, images_tbl["image"])))
    images = []
    for sid in sids:
        ph = phrases.lookup(sid)
        if not ph or not ph["caption_id"]:
            img_skipped["no_phrases"] += 1
            continue
        n_ph = len(ph["caption_id"])
        R = rr.n_regions(sid)
        if not R:
            skipped["no_regions" if R == 0 else "no_regions_entry"] += n_ph
            continue
        feats = nreader.get(sid)
        if feats is None:
            skipped["no_word_features"] += n_ph
            continue
        reg_s = rr.get(sid, ("boxes.npy", "features.npy", "image_size.npy"))
        inst = instances.lookup(sid) if instances is not None else None
        ibox = {int(i): np.asarray(b, np.float64) for i, b in zip(inst["instance_id"], inst["box"])} if inst else {}
        wt = words.lookup(sid) or {"caption_id": [], "word_index": [], "start": [], "end": [], "text": []}
        span = {(int(c), int(w)): (int(a), int(b), t) for c, w, a, b, t in
                zip(wt["caption_id"], wt["word_index"], wt["start"], wt["end"], wt["text"])}
        caps = {}
        for cid, st, en, text, iids in zip(ph["caption_id"], ph["start"], ph["end"], ph["text"], ph["instance_ids"]):
            gt = [ibox[int(i)] for i in (iids or []) if int(i) in ibox]
            if not gt:
                skipped["no_box"] += 1
                continue
            rows = [r for r in np.nonzero(feats.word_caption_id == cid)[0]
                    if (int(cid), int(feats.word_index[r])) in span
                    and span[(int(cid), int(feats.word_index[r]))][0] >= st
                    and span[(int(cid), int(feats.word_index[r]))][1] <= en]
            if not rows:
                skipped["no_word_features"] += 1
                continue
            c = caps.setdefault(int(cid), {"caption_id": int(cid), "phrases": []})
            c["phrases"].append({"text": text, "rows": np.asarray(rows, np.int64), "gt": np.stack(gt)})
        # held-out L_lang check: each noun with stored negatives against them, in its context
        nouns, noun_prior = [], []
        row_of = {(int(c), int(w)): r for r, (c, w) in enumerate(zip(feats.word_caption_id, feats.word_index))}
        texts = {}
        if cands is not None:
            ct = cands.lookup(sid) or {"caption_id": [], "word_index": [], "noun": [], "candidates": []}
            texts = {(int(c), int(w)): (n, list(k or [])) for c, w, n, k in
                     zip(ct["caption_id"], ct["word_index"], ct["noun"], ct["candidates"])}
        if feats.neg_features is not None:
            for j, (c, w, cnt) in enumerate(zip(feats.neg_caption_id, feats.neg_word_index, feats.neg_count)):
                valid = np.asarray(feats.neg_valid[j][: int(cnt)], bool)
                if cnt > 0 and valid.any() and (int(c), int(w)) in row_of:
                    nouns.append((row_of[(int(c), int(w))], feats.neg_features[j, : int(cnt)][valid].astype(np.float32)))
                    if cands is not None:
                        if (int(c), int(w)) not in texts:
                            raise ValueError(f"infoground: {neg.dir}: sample {sid} caption {int(c)} word {int(w)} has "
                                             "negative features but no row in the negatives table")
                        noun, cl = texts[(int(c), int(w))]
                        noun_prior.append(float(prior_wins(noun, [cl[i] for i in np.nonzero(valid)[0]], prior)))
        if not caps:
            continue
        images.append({"nouns": nouns, "noun_prior": noun_prior, "sample_id": sid, "boxes": reg_s["boxes"].astype(np.float64),
                       "features": reg_s["features"], "words": feats.word_features,  # float16 until used
                       "word_text": [span.get((int(c), int(w)), (0, 0, "?"))[2]
                                     for c, w in zip(feats.word_caption_id, feats.word_index)],
                       "word_caption": feats.word_caption_id, "captions": list(caps.values()),
                       "image": img_path.get(sid), "image_size": reg_s.get("image_size")})
    return EvalSet(images, skipped, img_skipped)


@torch.no_grad()
def ground(model, es: EvalSet, device, cfg, heat_dir: Path | None = None) -> dict:
    """Grounding figures (percent) and their exact chance over the phrases of ``es`` (``cfg``: the
    job's ``max_regions``, ``iou_threshold``, ``iou_plus_one``, ``heatmaps``); heatmaps go to
    ``heat_dir``. With the eval set's prior outcomes, ``noun_vs_negatives_prior`` too."""
    was = model.training
    model.eval()
    dev = device
    sums: dict[str, float] = {}
    items: dict[str, list] = {}  # per-item 0/1 outcomes and their images: the intervals resample images
    n = n_nouns = 0
    heat_left = cfg.heatmaps if heat_dir is not None else 0
    for im in es.images:
        R = len(im["boxes"]) if cfg.max_regions is None else min(len(im["boxes"]), cfg.max_regions)
        rf = torch.from_numpy(im["features"][:R].astype(np.float32)).to(dev)[None]
        rmask = torch.ones(1, R, dtype=torch.bool, device=dev)
        k, v = model.regions(rf, rmask)
        w = torch.from_numpy(im["words"].astype(np.float32)).to(dev)
        q, vw = model.words(w, None)
        _, att = model.attention_all(q, vw, k, v, rmask)  # [W, 1, R]
        att = att[:, 0].cpu().numpy()
        boxes = im["boxes"][:R]
        for row, negs in im["nouns"]:
            x = torch.cat([w[row : row + 1], torch.from_numpy(negs).to(dev)])
            qn, vn = model.words(x, None)
            phi_n, _ = model.attention_all(qn, vn, k, v, rmask)
            phi_n = phi_n[:, 0]
            sums["noun_vs_negatives"] = sums.get("noun_vs_negatives", 0.0) + float(phi_n[0] > phi_n[1:].max())
            items.setdefault("noun_vs_negatives", []).append((float(phi_n[0] > phi_n[1:].max()), im["sample_id"]))
            sums["noun_vs_negatives_chance"] = sums.get("noun_vs_negatives_chance", 0.0) + 1.0 / len(x)
            n_nouns += 1
        if im.get("noun_prior"):
            sums["noun_vs_negatives_prior"] = sums.get("noun_vs_negatives_prior", 0.0) + sum(im["noun_prior"])
            items.setdefault("noun_vs_negatives_prior", []).extend((float(x), im["sample_id"]) for x in im["noun_prior"])
        for cap in im["captions"]:
            for ph in cap["phrases"]:
                score = att[ph["rows"]].max(0)
                o = phrase_outcome(score, boxes, ph["gt"], cfg.iou_threshold, cfg.iou_plus_one)
                for key, val in o.items():
                    sums[key] = sums.get(key, 0.0) + val
                    if not key.endswith("_chance"):
                        items.setdefault(key, []).append((float(val), im["sample_id"]))
                n += 1
            if heat_left > 0:
                heat_left -= 1
                try:
                    save_heatmap(heat_dir / f"heatmap_{im['sample_id']}_{cap['caption_id']}.png", im, cap, att, boxes)
                except Exception as e:  # a figure must never fail an evaluation
                    print(f"infoground: heatmap of caption {cap['caption_id']} not saved: {e}", file=sys.stderr)
    model.train(was)
    out = {key: 100.0 * val / (n_nouns if key.startswith("noun_vs") else n) for key, val in sums.items()
           if (n_nouns if key.startswith("noun_vs") else n)}
    out["phrases"] = n
    out["nouns"] = n_nouns
    out["skipped"] = int(sum(es.skipped.values()))
    out["skip_reasons"] = dict(es.skipped)
    out["items"] = {k: (np.array([v for v, _ in xs]), np.array([i for _, i in xs])) for k, xs in items.items()}
    return out


def ground_frozen(es: EvalSet, text_embed, cfg) -> dict:
    """Zero-shot grounding by the frozen CLIP whose joint space the regions' features are in (the
    ``clip-pool:`` regions): each phrase scores every region by the cosine of the region's feature and
    the phrase's CLIP text embedding (``text_embed``: texts -> float [N, P]); the same phrases, images,
    regions (``max_regions``) and outcome rules as :func:`ground`, in the same order."""
    texts = sorted({ph["text"] for im in es.images for c in im["captions"] for ph in c["phrases"]})
    emb = np.asarray(text_embed(texts), np.float64) if texts else np.zeros((0, 1))
    emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    of = dict(zip(texts, emb))
    sums: dict[str, float] = {}
    items: dict[str, list] = {}
    n = 0
    for im in es.images:
        R = len(im["boxes"]) if cfg.max_regions is None else min(len(im["boxes"]), cfg.max_regions)
        f = im["features"][:R].astype(np.float64)
        f /= np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        for cap in im["captions"]:
            for ph in cap["phrases"]:
                o = phrase_outcome(f @ of[ph["text"]], im["boxes"][:R], ph["gt"], cfg.iou_threshold, cfg.iou_plus_one)
                for key, val in o.items():
                    sums[key] = sums.get(key, 0.0) + val
                    if not key.endswith("_chance"):
                        items.setdefault(key, []).append((float(val), im["sample_id"]))
                n += 1
    out = {key: 100.0 * val / n for key, val in sums.items()} if n else {}
    out.update(phrases=n, skipped=int(sum(es.skipped.values())), skip_reasons=dict(es.skipped),
               items={k: (np.array([v for v, _ in xs]), np.array([i for _, i in xs])) for k, xs in items.items()})
    return out


def split_figures(name: str, g: dict) -> dict:
    """:func:`ground`'s figures of one split as flat ``<name>_<metric>`` (and ``_chance``) entries."""
    res = {}
    for key in (*GROUNDING_METRICS, "noun_vs_negatives"):
        if key in g:
            res[f"{name}_{key}"] = g[key]
            res[f"{name}_{key}_chance"] = g[f"{key}_chance"]
    if "noun_vs_negatives_prior" in g:
        res[f"{name}_noun_vs_negatives_prior"] = g["noun_vs_negatives_prior"]
    res[f"{name}_phrases"] = g["phrases"]
    res[f"{name}_nouns"] = g["nouns"]
    res[f"{name}_skipped"] = g["skipped"]
    return res


def grounding_rows(g: dict, bench: str, subset: str, frozen: dict | str | None = None) -> list:
    """:func:`ground`'s figures as harness rows of benchmark ``bench``. Every figure is a share of
    phrases (nouns) with a 0/1 outcome, several per image: its interval is Wilson's on the effective
    n of items clustered by image (:mod:`train.eval.intervals`), from ``g["items"]`` (kept as the row's
    estimate); figures given without their items (old results) get Wilson's over independent items.
    ``frozen``: :func:`ground_frozen`'s figures on the same phrases, added as ``<metric>[frozen]``
    baseline rows; a string instead says why there are none (in the result rows' notes)."""
    names = {"r1": "R@1", "r5": "R@5", "r10": "R@10", "pointing_accuracy": "pointing accuracy"}

    def row(fig: dict, key: str, metric: str, n: int, chance: float, note: str, **kw) -> Row:
        per = fig.get("items") or {}
        r = Row(bench, subset, metric, fig[key], n, chance, unit="%", note=note, **kw)
        if key in per and len(per[key][0]) == n:
            r.est = proportion(per[key][0] > 0.5, per[key][1])
            return r.with_ci(interval(r.est, 100.0))
        return r.with_ci(wilson(round(fig[key] * n / 100.0), n))

    why = f"; no frozen CLIP baseline: {frozen}" if isinstance(frozen, str) else ""
    rows = []
    for k in GROUNDING_METRICS:
        rows.append(row(g, k, names[k], g["phrases"], g[f"{k}_chance"], "phrase score = max attention over its "
                        "noun/adjective words; chance: random region ranking" + why,
                        skipped=g["skipped"], skip_reasons=g["skip_reasons"]))
        if isinstance(frozen, dict) and k in frozen:
            if frozen["phrases"] != g["phrases"]:
                raise ValueError(f"{bench}: the frozen CLIP grounded {frozen['phrases']} phrases, the model {g['phrases']}")
            rows.append(row(frozen, k, f"{names[k]}[frozen]", g["phrases"], g[f"{k}_chance"],
                            "zero-shot grounding by the frozen CLIP: the region whose (clip-pool) feature has the "
                            "highest cosine with the phrase's CLIP text embedding", skipped=g["skipped"],
                            skip_reasons=g["skip_reasons"], baseline_for=f"{subset}/{names[k]}"))
    if g.get("nouns"):
        rows.append(row(g, "noun_vs_negatives", "noun vs its negatives", g["nouns"], g["noun_vs_negatives_chance"],
                        "phi of the true noun above all its stored negatives in context (held-out L_lang); "
                        "chance 1/(1+negatives) per noun"))
        if "noun_vs_negatives_prior" in g:
            rows.append(row(g, "noun_vs_negatives_prior", "noun vs its negatives[prior]", g["nouns"],
                            g["noun_vs_negatives_chance"], "baseline without the image: the true noun's count in the "
                            "training captions above every negative's (ties wrong)",
                            baseline_for=f"{subset}/noun vs its negatives"))
    return rows


def save_heatmap(path: Path, im: dict, cap: dict, att: np.ndarray, boxes: np.ndarray) -> None:
    """The image (or a grey canvas of its size) with each phrase's attention painted over its boxes
    (sum of box indicators weighted by the phrase score) and the ground-truth boxes outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    W, H = (int(im["image_size"][0]), int(im["image_size"][1])) if im.get("image_size") is not None else (
        int(boxes[:, 2].max() + 1), int(boxes[:, 3].max() + 1))
    img = None
    if im.get("image") and "::" not in str(im["image"]):
        try:
            from PIL import Image

            img = np.asarray(Image.open(im["image"]).convert("RGB"))
        except Exception:
            img = None
    if img is None:
        img = np.full((H, W, 3), 200, np.uint8)
    ph = cap["phrases"][:4]
    fig, axes = plt.subplots(1, len(ph), figsize=(3.2 * len(ph), 3.4), squeeze=False)
    for ax, p in zip(axes[0], ph):
        score = att[p["rows"]].max(0)
        heat = np.zeros((H, W), np.float64)
        for s, b in zip(score, boxes):
            x0, y0, x1, y1 = [int(round(c)) for c in b]
            heat[max(0, y0):max(0, y1), max(0, x0):max(0, x1)] += s
        ax.imshow(img, extent=(0, W, H, 0))
        ax.imshow(heat, cmap="jet", alpha=0.5, extent=(0, W, H, 0), vmin=0, vmax=max(1e-9, heat.max()))
        for g in p["gt"]:
            ax.add_patch(plt.Rectangle((g[0], g[1]), g[2] - g[0], g[3] - g[1], fill=False, ec="lime", lw=2))
        top = boxes[int(np.argmax(score))]
        ax.add_patch(plt.Rectangle((top[0], top[1]), top[2] - top[0], top[3] - top[1], fill=False, ec="red", lw=1.5, ls="--"))
        ax.set_title(p["text"][:30], fontsize=8)
        ax.axis("off")
    fig.suptitle(f"sample {im['sample_id']} caption {cap['caption_id']} (green: truth, red: top region)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
