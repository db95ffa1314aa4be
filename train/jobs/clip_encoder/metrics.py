"""clip-encoder evaluation on held-out images: retrieval R@1 both ways, zero-shot colour and shape, each
beside its chance level with a 95% interval, and the export's exactness through the pipeline's adapter.

The training-time embeddings are the model's own ``get_image_features`` / ``get_text_features`` (the
Hugging Face API); the exactness check loads the exported folder with :func:`pipeline.models.clip.load_clip`
and encodes with the adapter's ``encode_images`` / ``encode_texts``, the code every stage runs.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.synthetic.scene import COLOR_NAMES, SHAPES
from train.eval.interface import NoScorableItems, Row
from train.eval.intervals import mean_interval, wilson_of

BENCH = "clip-encoder"


def _pooled(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def encode_texts(model, tokens, texts: list[str], chunk: int = 256) -> np.ndarray:
    """float32 [T, P] projected text embeddings (``get_text_features``), not normalised."""
    out = []
    dev = next(model.parameters()).device
    for s in range(0, len(texts), chunk):
        enc = tokens(texts[s : s + chunk])
        out.append(_pooled(model.get_text_features(input_ids=enc["input_ids"].to(dev),
                                                   attention_mask=enc["attention_mask"].to(dev))).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, model.config.projection_dim), np.float32)


@torch.no_grad()
def heldout_embeddings(model, pixel_values: torch.Tensor, sample_ids: np.ndarray, corpus, tokens, chunk: int = 256) -> dict:
    """The training-time model's pooled embeddings of the held-out images and of all their captions."""
    dev = next(model.parameters()).device
    img = torch.cat([_pooled(model.get_image_features(pixel_values=pixel_values[s : s + chunk].to(dev))).float().cpu()
                     for s in range(0, len(pixel_values), chunk)]).numpy()
    cap_ids, cap_sample, texts = corpus.captions_of(sample_ids)
    return {"sample_ids": np.asarray(sample_ids, np.int64), "image_embed": img, "caption_ids": cap_ids,
            "caption_sample": cap_sample, "text_embed": encode_texts(model, tokens, texts)}


def _norm(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def retrieval(emb: dict) -> dict:
    """Per-item hits of i2t R@1 (per image) and t2i R@1 (per caption), with their chance levels."""
    I, T = _norm(emb["image_embed"]), _norm(emb["text_embed"])
    sids, cap_s = emb["sample_ids"], emb["caption_sample"]
    if not len(sids) or not len(cap_s):
        raise NoScorableItems(f"{BENCH}: no held-out image or caption to score")
    sim = I @ T.T
    i2t = cap_s[sim.argmax(1)] == sids
    per_img = np.asarray([(cap_s == s).sum() for s in sids], np.float64)
    t2i = sids[sim.argmax(0)] == cap_s
    return {"i2t": i2t, "i2t_chance": per_img / len(cap_s), "t2i": t2i, "t2i_chance": 1.0 / len(sids),
            "t2i_image": cap_s}


def zero_shot(emb: dict, corpus, tokens, model, kind: str) -> dict:
    """Per-image hits of the zero-shot probe ``kind`` (colour | shape) over the images with ground truth."""
    names, truth = (COLOR_NAMES, corpus.colors) if kind == "colour" else (SHAPES, corpus.shapes)
    prompts = [f"a {n} shape" for n in names] if kind == "colour" else [f"a {n}" for n in names]
    P = _norm(encode_texts(model, tokens, prompts))
    keep = np.asarray([bool(truth.get(int(s))) for s in emb["sample_ids"]])
    I = _norm(emb["image_embed"][keep])
    pred = (I @ P.T).argmax(1)
    gt = [truth[int(s)] for s in emb["sample_ids"][keep]]
    hits = np.asarray([names[p] in g for p, g in zip(pred, gt)])
    chance = np.asarray([len(g & set(names)) / len(names) for g in gt], np.float64)
    return {"hits": hits, "chance": chance, "skipped": int((~keep).sum()), "prompts": prompts}


def summary(emb: dict, corpus, tokens, model) -> dict:
    """The loop's metrics dict (percent), each with its ``<metric>_chance``."""
    r = retrieval(emb)
    out = {"images": int(len(emb["sample_ids"])), "captions": int(len(emb["caption_ids"])),
           "i2t_R@1": 100.0 * r["i2t"].mean(), "i2t_R@1_chance": 100.0 * r["i2t_chance"].mean(),
           "t2i_R@1": 100.0 * r["t2i"].mean(), "t2i_R@1_chance": 100.0 * r["t2i_chance"]}
    for kind in ("colour", "shape"):
        z = zero_shot(emb, corpus, tokens, model, kind)
        if len(z["hits"]):
            out[f"zeroshot_{kind}"] = 100.0 * z["hits"].mean()
            out[f"zeroshot_{kind}_chance"] = 100.0 * z["chance"].mean()
    return out


def clip_rows(emb: dict, corpus, tokens, model) -> list[Row]:
    """The harness rows (eval/final/results.parquet): held-out retrieval and zero-shot probes."""
    r = retrieval(emb)
    n_img, n_cap = len(emb["sample_ids"]), len(emb["caption_ids"])
    per_img_t2i = np.asarray([r["t2i"][r["t2i_image"] == s].mean() for s in emb["sample_ids"] if (r["t2i_image"] == s).any()])
    rows = [
        Row(BENCH, "held_out", "i2t_R@1", 100.0 * r["i2t"].mean(), n_img, 100.0 * r["i2t_chance"].mean(),
            note=f"each held-out image against all {n_cap} held-out captions; Wilson interval over images").with_ci(wilson_of(r["i2t"])),
        Row(BENCH, "held_out", "t2i_R@1", 100.0 * r["t2i"].mean(), n_cap, 100.0 * r["t2i_chance"],
            note=f"each held-out caption against all {n_img} held-out images; interval: bootstrap over images")
        .with_ci(mean_interval(per_img_t2i, 100.0)),
    ]
    for kind in ("colour", "shape"):
        z = zero_shot(emb, corpus, tokens, model, kind)
        if not len(z["hits"]):
            continue
        rows.append(Row(BENCH, "held_out", f"zeroshot_{kind}", 100.0 * z["hits"].mean(), len(z["hits"]),
                        100.0 * z["chance"].mean(), z["skipped"], {"no_ground_truth_objects": z["skipped"]} if z["skipped"] else {},
                        note=f"top prompt of {len(z['prompts'])} ('{z['prompts'][0]}', ...) names one of the image's objects; "
                        "chance: the share of prompts that do; Wilson interval over images").with_ci(wilson_of(z["hits"])))
    return rows


def exactness(folder: str, image_refs: list[str], image_embed: np.ndarray, texts: list[str], text_embed: np.ndarray,
              max_tokens: int) -> dict:
    """Minimum cosine between the training-time embeddings and the ones the pipeline's adapter computes from
    the exported ``folder`` (load_clip -> preprocess_images -> encode_images; encode_texts)."""
    from pipeline.models.clip import encode_images, encode_texts as adapter_texts, load_clip, preprocess_images
    from pipeline.readers.images import open_image

    model, processor, tok, _ = load_clip(folder)
    a_img = encode_images(model, preprocess_images(processor, [open_image(r) for r in image_refs]))["image_embed"].float().numpy()
    a_txt = adapter_texts(model, tok, texts, max_tokens)["text_embed"].float().numpy()
    ci = (_norm(a_img) * _norm(image_embed)).sum(1)
    ct = (_norm(a_txt) * _norm(text_embed)).sum(1)
    return {"export_min_cos_image": float(ci.min()), "export_min_cos_text": float(ct.min()),
            "export_checked_images": int(len(ci)), "export_checked_texts": int(len(ct))}
