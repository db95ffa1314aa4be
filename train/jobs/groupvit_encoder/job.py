"""The `groupvit-encoder` job (see train/jobs/groupvit_encoder/__init__.py): the clip-encoder job's data, loss and
rows on a GroupViTModel, plus the group-to-instance-mask IoU against the one-group and random baselines."""

from __future__ import annotations

import numpy as np
import torch

from train.encoders import export_dir, export_folder
from train.eval.interface import Row
from train.eval.intervals import mean_interval
from train.jobs.clip_encoder.job import ClipEncoderJob
from train.jobs.clip_encoder.metrics import _norm, summary

BENCH = "groupvit-encoder"


def groupvit_config(cfg, tok):
    from transformers import GroupViTConfig

    if sum(cfg.depths) != cfg.vision_layers or len(cfg.depths) != 3 or len(cfg.group_tokens) != 2:
        raise ValueError(f"groupvit-encoder: depths {cfg.depths} (three stages) must sum to vision_layers {cfg.vision_layers}, "
                         f"and group_tokens {cfg.group_tokens} name the first two stages' groups")
    g1, g2 = cfg.group_tokens
    text = dict(hidden_size=cfg.text_width, intermediate_size=cfg.mlp_ratio * cfg.text_width, num_hidden_layers=cfg.text_layers,
                num_attention_heads=cfg.heads, max_position_embeddings=77, vocab_size=len(tok),
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=cfg.vision_width, intermediate_size=cfg.mlp_ratio * cfg.vision_width, depths=list(cfg.depths),
                  num_hidden_layers=cfg.vision_layers, num_group_tokens=[g1, g2, 0], num_output_groups=[g1, g2, g2],
                  num_attention_heads=cfg.heads, image_size=cfg.image_size, patch_size=cfg.patch_size)
    return GroupViTConfig(text_config=text, vision_config=vision, projection_dim=cfg.projection_dim,
                          projection_intermediate_dim=cfg.projection_intermediate_dim)


def caption_nouns(text: str) -> list[str]:
    """The shape nouns a caption names (singular; plurals mapped back), in order of first mention."""
    import re

    from pipeline.synthetic.scene import PLURALS, SHAPES

    word = {s: s for s in SHAPES} | {p: s for s, p in PLURALS.items()}
    return list(dict.fromkeys(word[w] for w in re.findall(r"[a-z]+", text.lower()) if w in word))


def multi_label_loss(image_embeds: torch.Tensor, prompt_embeds: torch.Tensor, labels: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """GroupViT's multi-label contrastive loss (Xu et al. 2022, Sec. 3.2) of normalised ``image_embeds`` [B, D] and
    ``prompt_embeds`` [P, D] with 0/1 ``labels`` [B, P]: -log of the positives' share of the softmax, image -> prompts
    (the images with a positive) plus prompts -> images (every prompt has one), each averaged."""
    logits = scale * image_embeds @ prompt_embeds.T
    pos = labels.bool()
    has = pos.any(1)
    i2p = torch.logsumexp(logits[has], 1) - torch.logsumexp(logits[has].masked_fill(~pos[has], float("-inf")), 1)
    p2i = torch.logsumexp(logits.T, 1) - torch.logsumexp(logits.T.masked_fill(~pos.T, float("-inf")), 1)
    return i2p.mean() + p2i.mean()


def best_ious(labels: np.ndarray, masks: list[np.ndarray], k: int) -> np.ndarray:
    """Per instance mask, the best IoU over the segments of ``labels`` (an int map of the mask's size, values < k)."""
    out = []
    for m in masks:
        inter = np.bincount(labels[m], minlength=k).astype(np.float64)
        size = np.bincount(labels.reshape(-1), minlength=k).astype(np.float64)
        out.append(float(np.max(inter / np.maximum(size + m.sum() - inter, 1))))
    return np.asarray(out)


def upsample(grid_labels: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour upsampling of a [h, w] patch-label grid to ``shape`` (the image's pixels)."""
    h, w = grid_labels.shape
    ys = np.minimum((np.arange(shape[0]) * h) // shape[0], h - 1)
    xs = np.minimum((np.arange(shape[1]) * w) // shape[1], w - 1)
    return grid_labels[ys][:, xs]


def grid_labels(side: int, k: int) -> np.ndarray:
    """A fixed grid of ``k`` blocks over a [side, side] patch grid (rows: the largest divisor of k up to sqrt(k))."""
    r = max(d for d in range(1, int(np.sqrt(k)) + 1) if k % d == 0)
    c = k // r
    ys, xs = np.mgrid[0:side, 0:side]
    return (ys * r // side) * c + (xs * c // side)


def kmeans_labels(x: np.ndarray, k: int, seed: int, iters: int = 20) -> np.ndarray:
    """Lloyd's k-means of the rows of ``x`` [N, D] into ``k`` clusters (k-means++ seeding, ``seed``): labels [N]."""
    rng = np.random.default_rng(seed)
    k = min(k, len(x))
    cent = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d = ((x[:, None] - np.asarray(cent)[None]) ** 2).sum(-1).min(1)
        cent.append(x[rng.choice(len(x), p=d / d.sum())] if d.sum() > 0 else x[rng.integers(len(x))])
    cent = np.asarray(cent, np.float64)
    for _ in range(iters):
        lab = ((x[:, None] - cent[None]) ** 2).sum(-1).argmin(1)
        new = np.asarray([x[lab == j].mean(0) if (lab == j).any() else cent[j] for j in range(k)])
        if np.allclose(new, cent):
            break
        cent = new
    return ((x[:, None] - cent[None]) ** 2).sum(-1).argmin(1)


def patch_colours(pixels: np.ndarray, side: int) -> np.ndarray:
    """The mean of each channel over each patch of a [C, H, W] image cut into side x side patches: [side * side, C]."""
    C, H, W = pixels.shape
    ph, pw = H // side, W // side
    return pixels[:, : ph * side, : pw * side].reshape(C, side, ph, side, pw).mean((2, 4)).reshape(C, -1).T


# the no-learning partitions beside the model's groups: (key, label of the row's subset, description)
NO_LEARNING = [("one_group", "one group", "the whole image as the only segment"),
               ("random", "random", "each patch given to one of the K groups at random (seeded)"),
               ("grid", "grid", "a fixed grid of K blocks of patches"),
               ("kmeans", "kmeans", "k-means (K clusters, seeded) on the patches' mean colours")]


def paired_vs_partitions(g: dict) -> dict:
    """The model's group-to-mask IoU minus each no-learning partition's on the same images, with the paired 95% interval
    (train.eval.intervals.paired_difference: the images resampled together): ``group_mask_iou_minus_<key>`` and its
    ``_low`` / ``_high``. Grouping forms where the interval against the strongest partition is above 0."""
    from train.eval import intervals

    out = {}
    for key, _, _ in NO_LEARNING:
        d, lo, hi = intervals.paired_difference(intervals.mean(g["model"]), intervals.mean(g[key]))
        out |= {f"group_mask_iou_minus_{key}": d, f"group_mask_iou_minus_{key}_low": lo, f"group_mask_iou_minus_{key}_high": hi}
    return out


class GroupViTEncoderJob(ClipEncoderJob):
    NAME = "groupvit-encoder"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.export_path = export_dir(manifest, "groupvit", cfg.control, cfg.export_dir)  # EXPORT of the package

    def build_model(self):
        from transformers import GroupViTModel

        torch.manual_seed(self.cfg.seed)
        return GroupViTModel(groupvit_config(self.cfg, self.tokenizer))

    def batches(self, epoch, start):
        """The clip-encoder job's batches; with ``multi_label`` each also carries the prompts of its captions' nouns."""
        for batch in super().batches(epoch, start):
            if self.cfg.multi_label:
                texts = self.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
                nouns = [caption_nouns(t) for t in texts]
                vocab = sorted({n for ns in nouns for n in ns})
                if vocab:
                    enc = self.tokens([f"a photo of a {n}." for n in vocab])
                    labels = torch.tensor([[n in ns for n in vocab] for ns in nouns], dtype=torch.bool)
                    batch = {**batch, "prompt_ids": enc["input_ids"].to(self.device),
                             "prompt_mask": enc["attention_mask"].to(self.device), "prompt_labels": labels.to(self.device)}
            yield batch

    def loss(self, model, batch):
        if "prompt_ids" not in batch:
            return super().loss(model, batch)
        out = model(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    return_loss=True)
        prompts = model.get_text_features(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"])
        prompts = getattr(prompts, "pooler_output", prompts)
        ml = multi_label_loss(out.image_embeds, prompts / prompts.norm(dim=-1, keepdim=True), batch["prompt_labels"],
                              model.logit_scale.exp())
        return out.loss + ml, {"logit_scale": float(model.logit_scale.detach().exp()), "multi_label_loss": float(ml.detach())}

    @torch.no_grad()
    def group_ious(self, model) -> dict:
        """Per held-out image with instance masks: the mean best IoU of its instances for the model's groups, one
        group, and a seeded random assignment of the patches to the same number of groups."""
        from pipeline.masks import rle_decode
        from pipeline.models.groupvit import encode_groups

        row, pv = self.pixels
        c = self.corpus
        rng = np.random.default_rng([self.cfg.seed, 5151])
        res = {"model": [], **{k: [] for k, _, _ in NO_LEARNING}}
        skipped = 0
        for s in range(0, len(self.eval_idx), 128):
            idx = self.eval_idx[s : s + 128]
            out = encode_groups(model, pv[[row[int(i)] for i in idx]].to(self.device))
            assign = out["assign"].float().cpu().numpy()  # [B, K, N]
            K, N = assign.shape[1], assign.shape[2]
            side = int(round(np.sqrt(N)))
            for b, i in enumerate(idx):
                rles = c.masks.get(int(c.sample_ids[i]), [])
                if not rles:
                    skipped += 1
                    continue
                masks = [rle_decode(r) for r in rles]
                shape = masks[0].shape
                lab = upsample(assign[b].argmax(0).reshape(side, side), shape)
                rnd = upsample(rng.integers(0, K, size=(side, side)), shape)
                res["model"].append(best_ious(lab, masks, K).mean())
                res["random"].append(best_ious(rnd, masks, K).mean())
                res["one_group"].append(best_ious(np.zeros(shape, np.int64), masks, 1).mean())
                res["grid"].append(best_ious(upsample(grid_labels(side, K), shape), masks, K).mean())
                cols = patch_colours(pv[row[int(i)]].float().numpy(), side)
                km = kmeans_labels(cols.astype(np.float64), K, self.cfg.seed + int(i)).reshape(side, side)
                res["kmeans"].append(best_ious(upsample(km, shape), masks, K).mean())
        return {k: np.asarray(v) for k, v in res.items()} | {"skipped": skipped, "groups": K}

    def job_metrics(self, model, out_dir) -> list:
        rows = [Row(BENCH, r.subset, r.metric, r.value, r.n, r.chance, r.skipped, r.skip_reasons, r.unit, r.note,
                    r.ci_low, r.ci_high) for r in super().job_metrics(model, out_dir)]
        g = self.group_ious(model)
        if len(g["model"]):
            from train.eval import intervals

            base = {k: float(g[k].mean()) for k, _, _ in NO_LEARNING}
            skip = {"no_instance_masks": g["skipped"]} if g["skipped"] else {}
            rows.append(Row(BENCH, "held_out", "group_mask_iou", float(g["model"].mean()), len(g["model"]),
                            max(base["one_group"], base["random"]), g["skipped"], skip, "fraction",
                            f"per instance the best IoU over the {g['groups']} final groups' hard patch assignment, mean per "
                            "image; chance: the better of one group and random patches; the grid and k-means partitions are "
                            "the baseline rows beside it; bootstrap over images", est=intervals.mean(g["model"]))
                        .with_ci(mean_interval(g["model"])))
            for key, label, what in NO_LEARNING:  # the same images, one value each: intervals clustered by image
                rows.append(Row(BENCH, "held_out", f"group_mask_iou_{key}", base[key], len(g[key]), None, g["skipped"], skip,
                                "fraction", f"no-learning partition: {what}; the same images and scoring as group_mask_iou",
                                baseline_for="held_out/group_mask_iou", est=intervals.mean(g[key]))
                            .with_ci(mean_interval(g[key])))
        return rows

    def evaluate(self, model, out_dir):
        from pathlib import Path

        out_dir = Path(out_dir)
        emb = self.heldout(model)
        res = summary(emb, self.corpus, self.tokens, model)
        g = self.group_ious(model)
        if len(g["model"]):
            res.update({"group_mask_iou": float(g["model"].mean()), "group_mask_iou_one_group": float(g["one_group"].mean()),
                        "group_mask_iou_random": float(g["random"].mean()), "group_mask_iou_grid": float(g["grid"].mean()),
                        "group_mask_iou_kmeans": float(g["kmeans"].mean()),
                        "group_mask_iou_chance": float(max(g["one_group"].mean(), g["random"].mean()))})
            res.update(paired_vs_partitions(g))
        if out_dir.name == "final":
            res.update(self.export(model, emb, res, out_dir))
        out_dir.mkdir(parents=True, exist_ok=True)
        import json

        (out_dir / "groupvit_encoder_metrics.json").write_text(json.dumps(res, indent=1))
        return res

    def export(self, model, emb: dict, res: dict, out_dir) -> dict:
        """The hub-layout folder, then its image embeddings through ``pipeline.models.groupvit`` (the stage's adapter)."""
        from pipeline.models.groupvit import encode_groups, load_groupvit
        from pipeline.readers.images import open_image

        prov = {"job": self.NAME, "config": self.cfg.model_dump(mode="json"), "tokenizer": self.tok_record,
                "trained_on": {"samples_artifact": str(self.cfg.samples_artifact), "splits": list(self.cfg.train_splits),
                               "images": int(len(self.train_idx))},
                "run_dir": str(self.run_dir), "metrics": {k: v for k, v in res.items() if isinstance(v, (int, float))}}
        wrote = export_folder(self.export_path, model, self.processor, self.tokenizer, provenance=prov)
        np.savez(self.run_dir / "heldout_embeddings.npz", sample_ids=emb["sample_ids"], image_embed=emb["image_embed"],
                 caption_ids=emb["caption_ids"], text_embed=emb["text_embed"])
        m, proc, _ = load_groupvit(str(self.export_path))
        refs = [self.corpus.images[i] for i in self.eval_idx[:64]]
        a = encode_groups(m, proc(images=[open_image(r) for r in refs], return_tensors="pt")["pixel_values"])["image_embed"]
        cos = (_norm(a.float().numpy()) * _norm(emb["image_embed"][: len(refs)])).sum(1)
        print(f"{self.NAME}: {'exported' if wrote else 'unchanged (the same weights)'} {self.export_path} "
              f"(adapter vs training-time image embeddings: min cosine {cos.min():.6f})")
        return {"export_min_cos_image": float(cos.min()), "export_checked_images": int(len(cos))}
