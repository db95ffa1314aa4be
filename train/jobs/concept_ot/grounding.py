"""concept-ot's Sec. 2.6 evaluations: weak grounding (a phrase heatmap thresholded into a box,
scored against the dataset's boxes) and the phrase-heatmap figures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from train.boxes import box_iou_rows
from train.eval.interface import NoScorableItems, Row
from train.eval.intervals import mean_interval, wilson_of
from train.jobs.concept_ot.boxes import heatmap_boxes, random_patch_boxes
from train.jobs.concept_ot.model import ConceptOTModel
from train.jobs.concept_ot.scoring import _cat_feats


@torch.no_grad()
def grounding_rows(job, model: ConceptOTModel) -> list:
    """Sec. 2.6 weak grounding: for every phrase of the eval images that the samples artifact
    links to ground-truth boxes (``phrases`` + ``instances`` tables: the generated dataset,
    Flickr30k Entities), the phrase heatmap h_i(J) over the tokens of the phrase's character span
    is thresholded (``box_threshold`` x its max) and the patch envelope is the predicted box; the
    ground truth is the union box of the phrase's instances (Flickr30k Entities' merged-box
    convention). Rows: accuracy@IoU0.5 (%) and mean IoU (fraction), chance = the whole-image box
    (the note gives a uniformly random patch-aligned box too). [] when the dataset has no phrases
    or the variant has no heatmap (global-only)."""
    if job.cfg.variant == "global-only" or job.samples is None:
        return []
    tables = job.samples.tables()
    if "phrases" not in tables or "instances" not in tables:
        return []
    import polars as pl

    t = job._table()
    ev = t["ids"][t["eval"]]
    ph = job.samples.scan("phrases").filter(pl.col("sample_id").is_in(ev.tolist())).sort(
        ["sample_id", "caption_id", "start"]).collect()
    if ph.height == 0:
        return []
    skipped: dict[str, int] = {}
    total = ph.height
    has_inst = ph["instance_ids"].list.len() > 0
    if int((~has_inst).sum()):
        skipped["no_box"] = int((~has_inst).sum())
    ph = ph.filter(has_inst)
    if ph.height > job.cfg.grounding_max_phrases:
        skipped["over_grounding_max_phrases"] = ph.height - job.cfg.grounding_max_phrases
        ph = ph.head(job.cfg.grounding_max_phrases)
    inst = job.samples.scan("instances").select("sample_id", "instance_id", "box").filter(
        pl.col("sample_id").is_in(ph["sample_id"].unique().to_list())).collect()
    box_of = {(int(a), int(b)): np.asarray(c, np.float64) for a, b, c in inst.iter_rows()}
    u_sid = np.unique(ph["sample_id"].to_numpy())
    arr = job._read_images(u_sid, fields=("patch_tokens", "text_tokens", "text_mask", "caption_ids", "token_offsets"))
    row_of = {int(s): k for k, s in enumerate(u_sid.tolist())}
    # per phrase: (image row, caption tokens, token weights, gt box)
    pi, toks, weights, gts, psid = [], [], [], [], []
    for sid, cid, st, en, insts in ph.select("sample_id", "caption_id", "start", "end", "instance_ids").iter_rows():
        r = row_of[int(sid)]
        cl = np.asarray(arr["caption_ids"][r]).tolist()
        if int(cid) not in cl:
            skipped["caption_not_in_clip_tokens"] = skipped.get("caption_not_in_clip_tokens", 0) + 1
            continue
        j = cl.index(int(cid))
        m = np.asarray(arr["text_mask"][r][j], bool)
        offs = np.asarray(arr["token_offsets"][r][j])[: int(m.sum())]
        w = _span_mask(offs, int(st), int(en))
        bx = [box_of.get((int(sid), int(i))) for i in insts]
        bx = [b for b in bx if b is not None and len(b) == 4]
        if not w.any():
            skipped["phrase_tokens_truncated"] = skipped.get("phrase_tokens_truncated", 0) + 1
            continue
        if not bx:
            skipped["no_box"] = skipped.get("no_box", 0) + 1
            continue
        b = np.stack(bx)
        pi.append(r)
        psid.append(int(sid))
        toks.append(torch.from_numpy(np.array(arr["text_tokens"][r][j][: int(m.sum())])).float())
        weights.append(torch.from_numpy(w.astype(np.float32)))
        gts.append([b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max()])
    if not pi:
        raise NoScorableItems(f"grounding: 0 of {total} phrases of the eval images could be scored ({skipped})")
    side = int(round(math.sqrt(job.n_patches)))
    dev = job.device
    pt = torch.from_numpy(np.asarray(arr["patch_tokens"]))
    img = _cat_feats([model.image_features(pt[s:s + 64].to(dev)) for s in range(0, len(pt), 64)])
    heat = []
    ch = max(1, job.cfg.eval_pairs_chunk // 4)
    for s in range(0, len(pi), ch):
        tk = torch.nn.utils.rnn.pad_sequence(toks[s:s + ch], batch_first=True)
        mk = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks[s:s + ch]],
                                             batch_first=True)
        W = torch.nn.utils.rnn.pad_sequence(weights[s:s + ch], batch_first=True)
        txt = model.text_features(tk.to(dev), mk.to(dev))
        n = len(toks[s:s + ch])
        heat.append(model.phrase_heatmaps(img, txt, torch.tensor(pi[s:s + ch], device=dev),
                                          torch.arange(n, device=dev), W.to(dev)).float().cpu().numpy())
    H = np.concatenate(heat)
    wh = job._image_sizes(np.asarray(psid))
    gt = np.asarray(gts, np.float64)
    pred = heatmap_boxes(H, wh[:, 0], wh[:, 1], side, job.cfg.box_threshold)
    iou = box_iou_rows(pred, gt)
    whole = box_iou_rows(np.stack([np.zeros(len(wh)), np.zeros(len(wh)), wh[:, 0], wh[:, 1]], 1), gt)
    rnd = box_iou_rows(random_patch_boxes(len(wh), wh[:, 0], wh[:, 1], side, seed=0), gt)
    n, nsk = len(iou), sum(skipped.values())
    note = (f"chance: the whole-image box; a random patch-aligned box scores {100 * float((rnd >= 0.5).mean()):.1f}% "
            f"/ mean IoU {float(rnd.mean()):.3f}; threshold {job.cfg.box_threshold} x max, patch envelope")
    return [Row("grounding", "all", "acc@IoU0.5", 100 * float((iou >= 0.5).mean()), n, 100 * float((whole >= 0.5).mean()),
                nsk, dict(skipped), "%", note).with_ci(wilson_of(iou >= 0.5, clusters=np.asarray(psid))),
            Row("grounding", "all", "mean_IoU", float(iou.mean()), n, float(whole.mean()), nsk, dict(skipped),
                "fraction", note).with_ci(mean_interval(iou, clusters=np.asarray(psid)))]


def save_heatmaps(job, model: ConceptOTModel, samples: list[dict], E: dict, out_dir: Path) -> None:
    """Phrase heatmaps h_i(J) (Sec. 2.6), one PNG per image: the first caption's phrases (the
    dataset's spans where it has them, else its words) over the image."""
    if job.cfg.variant == "global-only":
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts, images, spans = {}, {}, {}
    if job.samples is not None:
        import polars as pl

        cids = [int(s["caption_ids"][0]) for s in samples]
        if "captions" in job.samples.tables():
            for cid, text in job.samples.scan("captions").select("caption_id", "text").filter(
                    pl.col("caption_id").is_in(cids)).collect().iter_rows():
                texts[int(cid)] = text
        sids = [int(s["sample_id"]) for s in samples]
        for sid, im in job.samples.scan("samples").select("sample_id", "image").filter(
                pl.col("sample_id").is_in(sids)).collect().iter_rows():
            images[int(sid)] = im
        if "phrases" in job.samples.tables():  # the dataset's phrase spans, where it has them
            for cid, st, en in job.samples.scan("phrases").select("caption_id", "start", "end").filter(
                    pl.col("caption_id").is_in(cids)).sort(["caption_id", "start"]).collect().iter_rows():
                spans.setdefault(int(cid), []).append((int(st), int(en)))
    side = int(round(math.sqrt(job.n_patches)))
    first_cap = {int(c): k for k, c in enumerate(E["caption_id"].tolist())}
    for k, s in enumerate(samples):
        cid = int(s["caption_ids"][0])
        t = first_cap[cid]
        text = texts.get(cid, "")
        offs = np.asarray(s["token_offsets"])[0] if "token_offsets" in s else None
        n_valid = int(E["txt"]["mask"][t].sum())
        groups = (_span_groups(text, offs, n_valid, spans[cid]) if cid in spans and offs is not None
                  else _word_groups(text, offs, n_valid))[:4]
        if not groups:
            continue
        fig, axes = plt.subplots(1, len(groups) + 1, figsize=(3 * (len(groups) + 1), 3.2))
        pil = None
        try:
            from pipeline.readers.images import open_image

            from pipeline.loaders.samples import image_resolver

            ref = image_resolver(job.samples.dir, job.manifest)(images.get(int(s["sample_id"])))
            pil = open_image(ref).convert("RGB") if ref else None
        except Exception:
            pil = None
        axes[0].set_title("image", fontsize=8)
        if pil is not None:
            axes[0].imshow(pil)
        axes[0].axis("off")
        for ax, (word, idx) in zip(axes[1:], groups):
            w = torch.zeros(E["txt"]["mask"].shape[1])
            w[idx] = 1
            h = model.phrase_heatmap(E["img"], E["txt"], k, t, w.to(job.device)).float().cpu()
            if h.numel() != side * side:
                continue
            hm = h.view(side, side).numpy()
            if pil is not None:
                ax.imshow(pil)
                ax.imshow(hm, cmap="jet", alpha=0.5, extent=(0, pil.width, pil.height, 0))
            else:
                ax.imshow(hm, cmap="jet")
            ax.set_title(f'"{word}"', fontsize=8)
            ax.axis("off")
        fig.suptitle(f"{job.cfg.variant}: {text[:80]}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"heatmap_{int(s['sample_id'])}.png", dpi=80)
        plt.close(fig)


def _span_mask(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """bool [M]: the (non-special) tokens whose character span [a, b) overlaps [start, end)."""
    o = np.asarray(offsets)
    return (o[:, 1] > o[:, 0]) & (o[:, 0] < end) & (o[:, 1] > start)


def _span_groups(text: str, offsets, n_valid: int, spans) -> list[tuple[str, list[int]]]:
    """Token indices of each phrase span (start, end) of the caption: the tokens whose character
    spans overlap it (Sec. 2.6 phrases, as the dataset marks them)."""
    o = np.asarray(offsets)[:n_valid]
    out = []
    for a, b in spans:
        idx = np.flatnonzero(_span_mask(o, a, b)).tolist()
        if idx:
            out.append((text[a:b], idx))
    return out


def _word_groups(text: str, offsets, n_valid: int) -> list[tuple[str, list[int]]]:
    """Token indices of each whitespace word of the caption (from the tokens' character spans);
    without offsets, every non-special token is its own group."""
    if offsets is None or not text:
        return [(f"tok{j}", [j]) for j in range(1, max(1, n_valid - 1))]
    words: dict[tuple[int, int], list[int]] = {}
    spans = []
    pos = 0
    for w in text.split():
        st = text.index(w, pos)
        spans.append((st, st + len(w)))
        pos = st + len(w)
    for j in range(min(n_valid, len(offsets))):
        a, b = int(offsets[j][0]), int(offsets[j][1])
        if a == b:
            continue
        for sp in spans:
            if sp[0] <= a < sp[1]:
                words.setdefault(sp, []).append(j)
                break
    stop = {"a", "an", "the", "of", "and", "is", "are", "with", "to", "in", "on", "at", "its", "there"}
    out = [(text[a:b].strip(".,"), idx) for (a, b), idx in sorted(words.items())]
    return [x for x in out if x[0].lower() not in stop]
