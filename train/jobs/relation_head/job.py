"""The `relation-head` job's lifecycle (see train/jobs/relation_head/__init__.py): BCE over every
valid (subject, object, predicate) entry, RAM's recall@K, and the export the stage loads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.models.relations import build_relation_head
from train.config import TrainerConfig
from train.job import Job, Splits, open_artifact, resolve_artifact
from train.jobs.relation_head.batches import collate, load_graphs
from train.jobs.relation_head.metrics import PredicatePrior, evaluate_model, recall_rows


def _held_out(sample_id: int, frac: float) -> bool:
    return ((int(sample_id) * 2654435761) % 2**32) % 1000 < int(round(1000 * frac))


def split_ids(manifest, cfg: TrainerConfig, sample_ids: list[int]) -> tuple[set[int], set[int]]:
    """(train ids, held-out ids): the samples artifact's split column where it puts some of them in
    ``eval_splits``, else ``val_fraction`` of the ids by hash."""
    rec = Splits.of_manifest(manifest, cfg.samples_artifact).recorded(sample_ids)
    if any(r in cfg.eval_splits for r in rec):
        return ({i for i, r in zip(sample_ids, rec) if r in cfg.train_splits},
                {i for i, r in zip(sample_ids, rec) if r in cfg.eval_splits})
    held = {i for i in sample_ids if _held_out(i, cfg.val_fraction)}
    return set(sample_ids) - held, held


def shuffle_graphs(items: list, seed: int) -> list:
    """The control: each item's triplets taken from another item with the same instance count (a fixed permutation
    per count, seeded by ``seed``), their subject and object indices relabelled by a random permutation of the
    item's instances; tokens and boxes stay.

    The relabelling matters where instances come in an order that the tokens and boxes show: a segmenter's masks
    sorted by score or area put the large objects first in every image, so a donated graph's (0, 1) pair would still
    land on this image's two largest objects, and the head would learn from the sizes which pairs the generator's
    graphs relate. It did: without it the control scored recall@1 23.4 against chance 11.72 on pixels.yaml's
    predicted instances; with it 8.6 [5.8, 11.8] (docs/jobs/relation-head.md, "Why the relabelling")."""
    rng = np.random.default_rng([int(seed), 2027])
    by_v: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        by_v.setdefault(len(it[1]), []).append(i)
    out = list(items)
    for v in sorted(by_v):
        idx = by_v[v]
        perm = rng.permutation(len(idx))
        for a, b in zip(idx, perm):
            sid, tang, box, _ = items[a]
            trip = np.array(items[idx[b]][3], copy=True)
            if len(trip):
                relabel = rng.permutation(v)
                trip[:, :2] = relabel[trip[:, :2]]
            out[a] = (sid, tang, box, trip)
    return out


def export_checkpoint(path: Path, model, head_cfg: dict, vocab: list[str], art_man: dict, art_dir: Path, cfg: TrainerConfig,
                      metrics: dict, provenance: dict | None = None) -> None:
    """The file ``models.relation_head`` points at (what the stage's ``learned`` backend loads); ``provenance``:
    more of what trained it (relation-encoder: the corpus, its labels)."""
    ck = {
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "config": head_cfg,
        "predicates": list(vocab),
        "embedding": art_man.get("embedding", {}),
        "metrics": metrics,
        "provenance": {
            "artifact": str(art_dir),
            "artifact_fingerprint": art_man.get("fingerprint"),
            "trained_on_random_features": bool(art_man.get("random_weights")),
            "job_config": cfg.model_dump(mode="json"),
            **(provenance or {}),
        },
    }
    from pipeline.io.checkpoint import save_checkpoint_file

    save_checkpoint_file(path, ck)  # tensors + plain data: loads with weights_only=True


@dataclass
class Labelled:
    """What :meth:`RelationHeadJob.load_items` gives: the items (sample_id, tangible, box features, triplets), the
    artifact's manifest, where the triplets come from (``artifact`` or ``matched``), the relations option the artifact
    was extracted with, and for ``matched`` what the mask matching kept per sample."""

    items: list
    manifest: dict
    source: str
    artifact_relations: str | None
    stats: dict | None = None


class RelationHeadJob(Job):
    NAME = "relation-head"  # train.jobs.relation_head.NAME (not imported: the package imports this module)

    def __init__(self, cfg: TrainerConfig, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.art_dir = resolve_artifact(manifest, self.cfg.artifact)
        open_artifact(manifest, self.cfg.artifact, "visual_tokens", self.NAME)  # missing: one line naming the stage
        lab = self.load_items()
        items, self.art_man, self.label_source = lab.items, lab.manifest, lab.source
        self.vocab = self.art_man.get("predicates")
        if not self.vocab:
            raise ValueError(f"{self.art_dir}: no predicate vocabulary in _manifest.json (not a visual_tokens artifact?)")
        items = [it for it in items if len(it[1]) > 0]
        if not items:
            raise ValueError(f"{self.art_dir}: no image with instances")
        self.d = items[0][1].shape[1]
        tr, ev = split_ids(manifest, cfg, [it[0] for it in items])
        self.train_graphs = [it for it in items if it[0] in tr]
        self.eval_items = [it for it in items if it[0] in ev]
        # the image-blind ranking (chance): before the control's shuffle, which keeps it (graphs move within a count)
        self.pred_rank = PredicatePrior(self.train_graphs, len(self.vocab), mode=self.cfg.chance_prior)
        self.label_stats = self.matched_label_stats(lab) if lab.source == "matched" else None
        if self.cfg.control == "shuffled":
            self.train_graphs = shuffle_graphs(self.train_graphs, self.cfg.seed)
        # Job.train_items is the training split's size (what --workers' preflight compares with the workers)
        self.train_items = len(self.train_graphs)
        self.head_cfg = dict(in_dim=self.d, width=self.cfg.width, layers=self.cfg.layers, heads=self.cfg.heads, cls_dim=self.cfg.cls_dim,
                             n_predicates=len(self.vocab), use_boxes=self.cfg.use_boxes, dropout=self.cfg.dropout,
                             unit_tokens=self.cfg.unit_tokens)  # fmt: skip
        self.export_path = Path(run_dir) / "relation_head.pt"

    def load_items(self) -> Labelled:
        """The items and where their triplets come from (:class:`Labelled`). The triplets are the labels
        and the held-out truth: the artifact's own (``labels: artifact``; the dataset's scene graphs when it was
        extracted with ``relations: annotations``) or the samples' scene graphs matched to its instances (``labels:
        matched``, relation-encoder's labels); ``auto`` takes the artifact's own only when they are annotations."""
        from pipeline.io.artifacts import Artifact

        rel = (Artifact(self.art_dir).manifest.get("parameters") or {}).get("relations")
        mode = self.cfg.labels if self.cfg.labels != "auto" else ("artifact" if rel == "annotations" else "matched")
        if mode == "matched":
            from train.jobs.relation_encoder.labels import load_labelled_graphs

            open_artifact(self.manifest, self.cfg.samples_artifact, "samples", self.NAME)
            items, man, stats = load_labelled_graphs(
                self.art_dir, resolve_artifact(self.manifest, self.cfg.samples_artifact), self.cfg.match_iou)
            return Labelled(items, man, mode, rel, stats)
        items, man = load_graphs(self.art_dir)
        if rel != "annotations":
            print(f"warning: {self.art_dir} was extracted with relations={rel!r}, not ground-truth annotations: "
                  "labels: artifact learns and scores those predicted triplets")
        return Labelled(items, man, mode, rel)

    def matched_label_stats(self, lab: Labelled) -> dict:
        """labels: matched: what the mask matching kept, summed over the training and the held-out images (printed
        once; relation-encoder writes it to relation_labels.json and its export's provenance)."""
        from train.jobs.relation_encoder.labels import LabelStats

        out = {}
        for name, part in (("train", self.train_graphs), ("held_out", self.eval_items)):
            total = LabelStats()
            for it in part:
                total.add(lab.stats[it[0]])
            out[name] = total.as_dict()
        kept = out["train"]["relations_kept_fraction"]
        print(f"{self.NAME}: labels: the samples' scene graphs on the instances of {self.art_dir} (relations="
              f"{lab.artifact_relations!r}): {out['train']['triplets']} triplets on {len(self.train_graphs)} training "
              f"images ({'-' if kept is None else f'{100 * kept:.1f}%'} of their mapped relations kept by the matching "
              f"at IoU >= {self.cfg.match_iou})")
        return out

    def build_model(self):
        return build_relation_head(**self.head_cfg)

    def batches_per_epoch(self):
        return self.steps_per_epoch(math.ceil(len(self.train_graphs) / self.cfg.batch_size))

    def batches(self, epoch, start):
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train_graphs))
        for b in self.rank_batches(math.ceil(len(self.train_graphs) / self.cfg.batch_size), start):
            chunk = [self.train_graphs[i] for i in order[b * self.cfg.batch_size : (b + 1) * self.cfg.batch_size]]
            yield tuple(t.to(self.device) for t in collate(chunk, len(self.vocab), self.d))

    def loss(self, model, batch):
        emb, box, pad, tgt = batch
        logits = model(emb, box, pad)
        valid = torch.isfinite(logits)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits[valid], tgt[valid]), {}

    def job_metrics(self, model, out_dir) -> list:
        """Held-out recall@k (``recall_k``) with chance and a bootstrap interval over images."""
        model = model.cpu()
        try:
            return recall_rows(model, self.eval_items, len(self.vocab), self.d, self.cfg.recall_k, self.pred_rank,
                               baselines=self.baselines(), benchmark=self.NAME, vocab=self.vocab)
        finally:
            model.to(self.device)

    def baselines(self) -> dict:
        """{"boxes-only": (a classifier of the box geometry alone, trained here on the training split, note)}
        (train/jobs/relation_head/boxes_only.py); trained once per job, seeded by the job's seed."""
        if self.cfg.boxes_only_steps <= 0:
            return {}
        if getattr(self, "_boxes_only", None) is None:
            from train.jobs.relation_head.boxes_only import train_boxes_only

            self._boxes_only = train_boxes_only(self.train_graphs, len(self.vocab), self.d, self.cfg.seed,
                                                self.cfg.boxes_only_steps)
        return {"boxes-only": (self._boxes_only, "boxes-only classifier (MLP on the pair's 24 box numbers, no visual "
                               f"tokens; {self.cfg.boxes_only_steps} Adam steps on the training split)")}

    def export(self, model, metrics: dict) -> None:
        """Write the checkpoint the stage loads (``relation_head.pt`` in the run folder)."""
        export_checkpoint(self.export_path, model, self.head_cfg, self.vocab, self.art_man, self.art_dir, self.cfg, metrics)

    def evaluate(self, model, out_dir):
        model = model.cpu()
        ks, n_pred, rank = self.cfg.recall_k, len(self.vocab), self.pred_rank
        res = {f"val_{k}": v for k, v in evaluate_model(model, self.eval_items, n_pred, self.d, ks, rank).items()}
        res.update({f"train_{k}": v for k, v in evaluate_model(model, self.train_graphs, n_pred, self.d, ks[:1], rank).items()})
        model.to(self.device)
        out_dir = Path(out_dir)
        if out_dir.name == "final":  # the loop's final evaluation: export the trained model for the stage
            self.export(model, res)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "relation_head_metrics.json").write_text(json.dumps(res, indent=1))
        return res
