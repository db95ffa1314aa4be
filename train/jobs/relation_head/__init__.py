"""`relation-head`: the Relate-Anything-style relation classifier used by extract-visual-tokens.

Reads a ``visual_tokens`` artifact extracted with ``relations: annotations`` (so its triplets are
the dataset's scene graphs, e.g. the generated dataset's, mapped into the predicate vocabulary)
and learns ``pipeline.models.relations.RelationHead``: per image, the tangible tokens (+ boxes)
-> sigmoid score of every (subject, object, predicate). Loss: binary cross-entropy over every
valid (subject != object, non-padding) entry, as RAM trains (``loss_type='bce'``).

Evaluation is RAM's ``get_recall_N``: per held-out image, the K highest-scoring
(subject, object, predicate) triples are compared with the ground-truth triplets;
recall@K = hits / |ground truth|, averaged over images that have ground truth, in percent. *Chance* is the
expected recall of a uniformly random ranking of the same N = V (V - 1) C candidates,
min(K, N) / N per image, averaged the same way.

The relation head's inputs are small (V x width per image), so the job holds them in memory.

Training runs in the shared loop (``train/loop.py``: AdamW, warmup + cosine, clipping,
checkpoints and exact resume, metrics.jsonl). Split: the samples artifact's ``split`` column
(``train_splits`` / ``eval_splits``); without one, ``val_fraction`` of the ids by hash.

After the final evaluation the job exports ``<run_dir>/relation_head.pt`` (tensors + plain data, loaded with ``weights_only=True``; a dict:
``state_dict``, the head's ``config``, the ``predicates`` vocabulary and the ``embedding``
settings of the artifact it was trained on -- the stage refuses it on other embeddings --,
``metrics``, ``provenance``). Point ``models.relation_head`` at it and set
``stages.extract_visual_tokens.relations: learned``::

    pipeline run extract-visual-tokens -m manifests/demo.yaml      # demo: relations = annotations
    train run relation-head -m manifests/demo.yaml
    pipeline run extract-visual-tokens -m manifests/demo.yaml \
        --set stages.extract_visual_tokens.relations=learned \
        --set models.relation_head=runs/demo/train/relation-head/default/relation_head.pt
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from pydantic import Field

from train.config import TrainerConfig

NAME = "relation-head"
READS = ["visual_tokens"]


class Config(TrainerConfig):
    # loop options (train/config.py) with this job's defaults
    epochs: float = Field(40.0, gt=0)
    batch_size: int = Field(32, ge=2)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    warmup_frac: float = Field(0.05, ge=0, le=1)
    threads: int | None = Field(1, ge=1, description="torch threads (1 is fastest for this small model on a shared CPU)")
    # job options
    artifact: str = Field("visual_tokens", description="visual_tokens artifact (folder under the manifest's output, or a path)")
    samples_artifact: str = Field("samples", description="where the train/val/test split of each sample is read")
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    val_fraction: float = Field(0.2, ge=0, lt=1, description="held-out fraction by sample-id hash when the samples have no split")
    width: int = Field(256, ge=8, description="transformer width (RAM: 768, BERT; smaller here)")
    layers: int = Field(2, ge=1, description="transformer layers (RAM: 2)")
    heads: int = Field(4, ge=1)
    cls_dim: int = Field(64, ge=1, description="per-predicate bilinear width (RAM: 512)")
    use_boxes: bool = Field(True, description="append 8 normalised box numbers to each instance (not in RAM)")
    dropout: float = Field(0.1, ge=0, lt=1)
    recall_k: list[int] = Field(default_factory=lambda: [20, 50, 100])


def _held_out(sample_id: int, frac: float) -> bool:
    return ((int(sample_id) * 2654435761) % 2**32) % 1000 < int(round(1000 * frac))


def load_graphs(artifact_dir: str | Path):
    """[(sample_id, tangible [V, d] f32, box features [V, 8], triplets [E, 3] vocab ids)], manifest."""
    from pipeline.io.artifacts import Artifact
    from pipeline.loaders.visual_tokens import iter_samples
    from pipeline.models.relations import box_features

    art = Artifact(artifact_dir)
    items = []
    for p in art.files("shards"):
        for s in iter_samples(p, fields=["tangible.npy", "boxes.npy", "triplets.npy", "meta.json"]):
            meta = s["meta.json"]
            t = s["triplets.npy"].reshape(-1, 3).astype(np.int64)
            pid = np.asarray(meta["predicate_ids"], dtype=np.int64)
            trip = np.stack([t[:, 0], t[:, 1], pid[t[:, 2]]], axis=1) if len(t) else np.zeros((0, 3), np.int64)
            tang = s["tangible.npy"].astype(np.float32)
            items.append((meta["sample_id"], tang, box_features(s["boxes.npy"], (meta["height"], meta["width"])), trip))
    return items, art.manifest


def _collate(items, n_pred: int, d: int):
    import torch

    B = len(items)
    vmax = max(1, max(len(it[1]) for it in items))
    emb = torch.zeros(B, vmax, d)
    box = torch.zeros(B, vmax, 8)
    pad = torch.ones(B, vmax, dtype=torch.bool)
    tgt = torch.zeros(B, vmax, vmax, n_pred)
    for i, (_, t, b, trip) in enumerate(items):
        v = len(t)
        emb[i, :v] = torch.from_numpy(t.reshape(v, d))
        box[i, :v] = torch.from_numpy(b)
        pad[i, :v] = False
        if len(trip):
            tr = torch.from_numpy(trip)
            tgt[i, tr[:, 0], tr[:, 1], tr[:, 2]] = 1.0
    return emb, box, pad, tgt


def recall_at_k(probs: np.ndarray, trip: np.ndarray, k: int) -> tuple[float, float] | None:
    """RAM's recall@K for one image: probs [V, V, C] (diagonal ignored), ground truth [E, 3].
    Returns (recall, chance recall) or None when the image has no ground truth."""
    if len(trip) == 0:
        return None
    v, _, c = probs.shape
    valid = ~np.eye(v, dtype=bool)[..., None].repeat(c, 2)
    flat = np.where(valid, probs, -np.inf).reshape(-1)
    n = int(valid.sum())
    top = np.argsort(-flat, kind="stable")[: min(k, n)]
    gt = set(np.ravel_multi_index((trip[:, 0], trip[:, 1], trip[:, 2]), probs.shape).tolist())
    hits = len(gt.intersection(top.tolist()))
    return hits / len(gt), min(k, n) / n


def evaluate_model(model, items, n_pred: int, d: int, ks: list[int], batch_size: int = 64) -> dict:
    import torch

    model.eval()
    res = {k: [] for k in ks}
    chance = {k: [] for k in ks}
    with torch.no_grad():
        for s in range(0, len(items), batch_size):
            chunk = items[s : s + batch_size]
            emb, box, pad, _ = _collate(chunk, n_pred, d)
            probs = torch.sigmoid(model(emb, box, pad)).numpy()
            for i, it in enumerate(chunk):
                v = len(it[1])
                for k in ks:
                    r = recall_at_k(probs[i, :v, :v], it[3], k)
                    if r is not None:
                        res[k].append(r[0])
                        chance[k].append(r[1])
    out = {"images": len(res[ks[0]])}
    for k in ks:
        # percentages, as every other job and the evaluation harness report recalls
        out[f"recall@{k}"] = 100.0 * float(np.mean(res[k])) if res[k] else float("nan")
        out[f"chance_recall@{k}"] = 100.0 * float(np.mean(chance[k])) if chance[k] else float("nan")
    return out


def _artifact_dir(manifest, name: str) -> Path | str:
    from pipeline.io.storage import resolve_under

    return resolve_under(manifest.output, name)


def _split(manifest, cfg: Config, sample_ids: list[int]) -> tuple[set[int], set[int]]:
    """(train ids, held-out ids): the samples artifact's split column, else a stable id hash."""
    import polars as pl

    from pipeline.io.artifacts import Artifact, ArtifactMissing

    try:
        df = Artifact(_artifact_dir(manifest, cfg.samples_artifact)).scan("samples").select("sample_id", "split").collect()
        split = dict(zip(df["sample_id"].to_list(), df["split"].to_list()))
    except (ArtifactMissing, KeyError, pl.exceptions.PolarsError):
        split = {}
    if split and any(split.get(i) in cfg.eval_splits for i in sample_ids):
        return {i for i in sample_ids if split.get(i) in cfg.train_splits}, {i for i in sample_ids if split.get(i) in cfg.eval_splits}
    held = {i for i in sample_ids if _held_out(i, cfg.val_fraction)}
    return set(sample_ids) - held, held


def export_checkpoint(path: Path, model, head_cfg: dict, vocab: list[str], art_man: dict, art_dir: Path, cfg: Config, metrics: dict) -> None:
    """The file ``models.relation_head`` points at (what the stage's ``learned`` backend loads)."""
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
        },
    }
    from pipeline.io.checkpoint import save_checkpoint_file

    save_checkpoint_file(path, ck)  # tensors + plain data: loads with weights_only=True


def make_job(cfg: Config, manifest, run_dir, device):
    import torch

    from pipeline.models.relations import build_relation_head
    from train.job import Job

    class RelationHeadJob(Job):
        NAME = NAME

        def __init__(self):
            super().__init__(cfg, manifest, run_dir, device)
            self.art_dir = _artifact_dir(manifest, cfg.artifact)
            items, self.art_man = load_graphs(self.art_dir)
            self.vocab = self.art_man.get("predicates")
            if not self.vocab:
                raise ValueError(f"{self.art_dir}: no predicate vocabulary in _manifest.json (not a visual_tokens artifact?)")
            rel = self.art_man.get("parameters", {}).get("relations")
            if rel != "annotations":
                print(f"warning: {self.art_dir} was extracted with relations={rel!r}, not ground-truth annotations")
            items = [it for it in items if len(it[1]) > 0]
            if not items:
                raise ValueError(f"{self.art_dir}: no image with instances")
            self.d = items[0][1].shape[1]
            tr, ev = _split(manifest, cfg, [it[0] for it in items])
            self.train_items = [it for it in items if it[0] in tr]
            self.eval_items = [it for it in items if it[0] in ev]
            self.head_cfg = dict(in_dim=self.d, width=cfg.width, layers=cfg.layers, heads=cfg.heads, cls_dim=cfg.cls_dim,
                                 n_predicates=len(self.vocab), use_boxes=cfg.use_boxes, dropout=cfg.dropout)  # fmt: skip
            self.export_path = Path(run_dir) / "relation_head.pt"

        def build_model(self):
            return build_relation_head(**self.head_cfg)

        def batches_per_epoch(self):
            return math.ceil(len(self.train_items) / cfg.batch_size)

        def batches(self, epoch, start):
            order = np.random.default_rng([cfg.seed, epoch]).permutation(len(self.train_items))
            for b in range(start, self.batches_per_epoch()):
                chunk = [self.train_items[i] for i in order[b * cfg.batch_size : (b + 1) * cfg.batch_size]]
                yield tuple(t.to(self.device) for t in _collate(chunk, len(self.vocab), self.d))

        def loss(self, model, batch):
            emb, box, pad, tgt = batch
            logits = model(emb, box, pad)
            valid = torch.isfinite(logits)
            return torch.nn.functional.binary_cross_entropy_with_logits(logits[valid], tgt[valid]), {}

        def evaluate(self, model, out_dir):
            model = model.cpu()
            res = {f"val_{k}": v for k, v in evaluate_model(model, self.eval_items, len(self.vocab), self.d, cfg.recall_k).items()}
            res.update({f"train_{k}": v for k, v in evaluate_model(model, self.train_items, len(self.vocab), self.d, cfg.recall_k[:1]).items()})
            model.to(self.device)
            out_dir = Path(out_dir)
            if out_dir.name == "final":  # the loop's final evaluation: export the trained model for the stage
                export_checkpoint(self.export_path, model, self.head_cfg, self.vocab, self.art_man, self.art_dir, cfg, res)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "relation_head_metrics.json").write_text(json.dumps(res, indent=1))
            return res

    return RelationHeadJob()
