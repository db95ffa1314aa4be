"""The `sam-segmenter` job's lifecycle (see train/jobs/sam_segmenter/__init__.py): the corpus's training images
and instance masks, SAM's prompted training (point / box, error-region points, mask feedback, multimask
minimum loss), the held-out AMG measurement and the SAM-folder export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train.encoders import export_dir, export_folder, load_corpus
from train.job import Job
from train.jobs.sam_segmenter.losses import iou_loss, mask_iou, mask_loss
from train.jobs.sam_segmenter.masks import decode_masks
from train.jobs.sam_segmenter.prompts import error_points, first_prompts


class SamSegmenterJob(Job):
    NAME = "sam-segmenter"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.corpus = c = load_corpus(manifest, cfg.samples_artifact, self.NAME)
        if not c.masks:
            raise ValueError(f"{self.NAME}: {cfg.samples_artifact} has no instance masks (its `instances` table): "
                             "the segmenter trains on them; ingest a dataset with instances (pipeline run ingest --corpus)")
        has = np.asarray([int(s) in c.masks for s in c.sample_ids])
        self.train_idx = np.nonzero(np.isin(c.splits, cfg.train_splits) & has)[0]
        self.eval_idx = np.nonzero(np.isin(c.splits, cfg.eval_splits))[0][: cfg.eval_images]
        if len(self.train_idx) < 2:
            raise ValueError(f"{self.NAME}: {len(self.train_idx)} training images with instance masks in splits "
                             f"{cfg.train_splits} of {cfg.samples_artifact}; at least 2 are needed")
        if not len(self.eval_idx):
            raise ValueError(f"{self.NAME}: no held-out images in splits {cfg.eval_splits} of {cfg.samples_artifact}")
        self.export_path = export_dir(manifest, "sam", "none", cfg.export_dir)
        self._images: dict[int, np.ndarray] = {}
        self._masks: dict[int, tuple] = {}

    # --- data: each image decoded once, its masks kept bit-packed -------------------------------------
    def image(self, i: int) -> np.ndarray:
        if i not in self._images:
            from pipeline.readers.images import open_image

            self._images[i] = np.asarray(open_image(self.corpus.images[i]).convert("RGB"))
        return self._images[i]

    def gt_masks(self, i: int) -> np.ndarray:
        """bool [K, H, W] ground-truth instance masks of corpus row ``i`` at the image's size."""
        if i not in self._masks:
            hw = self.image(i).shape[:2]
            m = decode_masks(self.corpus.masks.get(int(self.corpus.sample_ids[i]), []), hw,
                             f"sample {int(self.corpus.sample_ids[i])}")
            self._masks[i] = (np.packbits(m.reshape(len(m), -1), axis=1), m.shape)
        packed, shape = self._masks[i]
        return np.unpackbits(packed, axis=1, count=int(np.prod(shape[1:]))).reshape(shape).astype(bool)

    def model_input(self, i: int) -> tuple[torch.Tensor, np.ndarray]:
        """(uint8 [h, w, 3] image resized as SamModel.encode resizes it (longest side -> img_size), its masks
        resized the same way, nearest)."""
        from segment_anything.utils.transforms import ResizeLongestSide

        im, m = self.image(i), self.gt_masks(i)
        if max(im.shape[:2]) == self.cfg.img_size:
            return torch.from_numpy(im), m
        im = ResizeLongestSide(self.cfg.img_size).apply_image(im)
        mt = F.interpolate(torch.from_numpy(m)[:, None].float(), size=im.shape[:2], mode="nearest")[:, 0] > 0.5
        return torch.from_numpy(im), mt.numpy()

    def build_model(self):
        from pipeline.models.sam_checkpoint import build_sam

        torch.manual_seed(self.cfg.seed)
        return build_sam(self.cfg.architecture()).train()

    def batches_per_epoch(self):
        B = self.fit_batch(len(self.train_idx), "images")
        return self.steps_per_epoch(len(self.train_idx) // B)

    def batches(self, epoch, start):
        cfg, B = self.cfg, self.train_batch or self.fit_batch(len(self.train_idx), "images")
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(self.train_idx))
        for b in self.rank_batches(len(self.train_idx) // B, start):
            rng = np.random.default_rng([cfg.seed, epoch, b, 7])
            ims, masks = [], []
            for j in order[b * B : (b + 1) * B]:
                im, m = self.model_input(int(self.train_idx[j]))
                if len(m) > cfg.max_masks:
                    m = m[np.sort(rng.choice(len(m), cfg.max_masks, replace=False))]
                ims.append(im)
                masks.append(m)
            yield {"images": ims, "masks": masks, "seed": [cfg.seed, epoch, b]}

    # --- SAM's prompted training ----------------------------------------------------------------------
    def loss(self, model, batch):
        cfg = self.cfg
        x = torch.stack([model.preprocess(im.to(self.device).permute(2, 0, 1)[None].float())[0] for im in batch["images"]])
        emb = model.image_encoder(x)
        pe = model.prompt_encoder.get_dense_pe()
        rng = np.random.default_rng(batch["seed"])
        terms: list[dict] = []
        for b, gt_np in enumerate(batch["masks"]):
            if not len(gt_np):
                continue
            first = first_prompts(gt_np, rng, cfg.box_prob, cfg.box_noise_frac, cfg.box_noise_max)
            for box in (False, True):
                idx = np.nonzero(first["is_box"] == box)[0]
                if len(idx):
                    terms += self.rounds(model, emb[b : b + 1], pe, gt_np[idx], first, idx, box, rng)
        if not terms:  # a batch without instances: nothing to learn from, a zero loss that keeps the graph
            return emb.sum() * 0.0, {}
        n = sum(t["n"] for t in terms)
        mask_l = sum(t["mask"] for t in terms) / n
        iou_l = sum(t["iou_mse"] for t in terms) / n
        last = [t for t in terms if t["round"] == max(u["round"] for u in terms)]
        metrics = {"mask_loss": float(mask_l.detach()), "iou_mse": float(iou_l.detach()),
                   "iou_first": sum(t["iou"] for t in terms if t["round"] == 0) / sum(t["n"] for t in terms if t["round"] == 0),
                   "iou_last": sum(t["iou"] for t in last) / sum(t["n"] for t in last)}
        return mask_l + cfg.iou_weight * iou_l, metrics

    def rounds(self, model, e, pe, gt_np, first, idx, box: bool, rng) -> list[dict]:
        """The prompt rounds of the masks ``idx`` of one image whose first prompt is a box (``box``) or a
        point; per round the summed loss of its masks, the IoU head's summed error and the selected masks' IoU."""
        cfg = self.cfg
        n = len(idx)
        gt = torch.from_numpy(gt_np).to(self.device)[:, None]  # [n, 1, h, w]
        h, w = gt_np.shape[1:]
        pts = first["points"][idx] if not box else np.zeros((n, 0, 2), np.float32)
        lab = np.ones((n, 1), np.int64) if not box else np.zeros((n, 0), np.int64)
        boxes = torch.as_tensor(first["boxes"][idx], device=self.device) if box else None
        mask_in, out = None, []
        for r in range(1 + cfg.point_rounds + cfg.mask_only_rounds):
            if 1 <= r <= cfg.point_rounds:
                p, l = error_points(pred, gt_np, rng)
                pts, lab = np.concatenate([pts, p[:, None]], 1), np.concatenate([lab, l[:, None]], 1)
            points = (torch.as_tensor(pts, device=self.device), torch.as_tensor(lab, device=self.device)) if pts.shape[1] else None
            sparse, dense = model.prompt_encoder(points=points, boxes=boxes, masks=mask_in if cfg.mask_prompt else None)
            multi = r == 0 and not box  # one point: ambiguous, the three outputs (SAM)
            low, iou = model.mask_decoder(image_embeddings=e, image_pe=pe, sparse_prompt_embeddings=sparse,
                                          dense_prompt_embeddings=dense, multimask_output=multi)
            logits = F.interpolate(low, (cfg.img_size, cfg.img_size), mode="bilinear", align_corners=False)[..., :h, :w]
            ml = mask_loss(logits, gt, cfg.focal_weight, cfg.dice_weight, cfg.focal_alpha, cfg.focal_gamma)  # [n, k]
            sel = ml.detach().argmin(1)  # the least-loss output of a multimask prompt (k = 1 otherwise)
            rows = torch.arange(n, device=self.device)
            chosen = logits[rows, sel]
            out.append({"round": r, "n": n, "mask": ml[rows, sel].sum(), "iou_mse": iou_loss(iou, logits, gt).mean(1).sum(),
                        "iou": float(mask_iou(chosen.detach(), gt[:, 0]).sum())})
            mask_in = low[rows, sel][:, None].detach()
            pred = (chosen.detach() > 0).cpu().numpy()
        return out

    # --- evaluation: the export through the stage's loader and AMG ------------------------------------
    def evaluate(self, model, out_dir):
        """The model written as a SAM folder under ``out_dir`` and measured through the stage's loader and AMG;
        the final one then exported (``export_path``) with the metrics in its training.json."""
        from train.jobs.sam_segmenter.measure import measure_corpus

        out_dir = Path(out_dir)
        prov = {"job": self.NAME, "config": self.cfg.model_dump(mode="json"), "random_weights": False,
                "trained_on": {"samples_artifact": str(self.cfg.samples_artifact), "splits": list(self.cfg.train_splits),
                               "images": int(len(self.train_idx))},
                "run_dir": str(self.run_dir)}
        res = self.export(model, out_dir / "sam", prov)
        res.update(measure_corpus(self, str(out_dir / "sam")))
        if out_dir.name == "final":
            prov["metrics"] = {k: v for k, v in res.items() if isinstance(v, (int, float))}
            res.update(self.export(model, self.export_path, prov, say=True))
        (out_dir / "sam_segmenter_metrics.json").write_text(json.dumps(res, indent=1))
        return res

    def export(self, model, folder: Path, prov: dict, say: bool = False) -> dict:
        """The SAM folder, then its round trip: loaded by pipeline.models.sam.load_sam, every tensor equal."""
        from pipeline.models.sam import load_sam
        from pipeline.models.sam_checkpoint import write_sam_folder

        arch = self.cfg.architecture()
        wrote = export_folder(folder, model, provenance=prov, write=lambda d: write_sam_folder(d, model, arch))
        loaded, _, rec = load_sam(str(folder))
        mine = model.state_dict()
        worst = max(float((v.float() - mine[k].detach().cpu().float()).abs().max()) if v.numel() else 0.0
                    for k, v in loaded.state_dict().items())
        if say:
            print(f"{self.NAME}: {'exported' if wrote else 'unchanged (the same weights)'} {folder} (loaded through "
                  f"load_sam: largest weight difference {worst:g}, random_weights {rec['random_weights']})")
        return {"export_max_abs_weight_diff": worst}
