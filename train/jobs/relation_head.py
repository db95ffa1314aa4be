"""`relation-head`: the Relate-Anything-style relation classifier used by extract-visual-tokens.

Reads a ``visual_tokens`` artifact extracted with ``relations: annotations`` (so its triplets are
the dataset's scene graphs, e.g. the generated dataset's, mapped into the predicate vocabulary)
and learns ``pipeline.models.relations.RelationHead``: per image, the tangible tokens (+ boxes)
-> sigmoid score of every (subject, object, predicate). Loss: binary cross-entropy over every
valid (subject != object, non-padding) entry, as RAM trains (``loss_type='bce'``).

Evaluation is RAM's ``get_recall_N``: per held-out image, the K highest-scoring
(subject, object, predicate) triples are compared with the ground-truth triplets;
recall@K = hits / |ground truth|, averaged over images that have ground truth. *Chance* is the
expected recall of a uniformly random ranking of the same N = V (V - 1) C candidates,
min(K, N) / N per image, averaged the same way.

Split: an image is held out when ``hash(sample_id) mod 1000 < 1000 * val_fraction`` (stable
across runs and shard layouts). The relation head's inputs are small (V x width per image), so
the job holds them in memory.

The checkpoint (``torch.save`` dict) holds ``state_dict``, the head's ``config``, the
``predicates`` vocabulary and the ``embedding`` settings of the artifact it was trained on (the
stage refuses to use it on other embeddings), ``metrics`` and ``provenance``; point
``models.relation_head`` at it and set ``stages.extract_visual_tokens.relations: learned``.

The shared trainer loop (``train/loop.py``) was not available when this job was written, so it
carries a minimal loop of its own: AdamW, linear warmup + cosine decay, gradient clipping,
metrics as JSON lines, evaluation every ``eval_every`` epochs, checkpoint at the end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
from pydantic import Field

from pipeline.config import Section

NAME = "relation-head"
READS = ["visual_tokens"]


class Config(Section):
    artifact: str = Field("visual_tokens", description="visual_tokens artifact (folder under the manifest's output, or a path)")
    output: str | None = Field(None, description="checkpoint path; default <output>/train/relation-head/relation_head.pt")
    epochs: int = Field(40, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    width: int = Field(256, ge=8, description="transformer width (RAM: 768, BERT; smaller here)")
    layers: int = Field(2, ge=1, description="transformer layers (RAM: 2)")
    heads: int = Field(4, ge=1)
    cls_dim: int = Field(64, ge=1, description="per-predicate bilinear width (RAM: 512)")
    use_boxes: bool = Field(True, description="append 8 normalised box numbers to each instance (not in RAM)")
    dropout: float = Field(0.1, ge=0, lt=1)
    val_fraction: float = Field(0.2, ge=0, lt=1)
    recall_k: list[int] = Field(default_factory=lambda: [20, 50, 100])
    eval_every: int = Field(10, ge=1)
    seed: int = 0
    threads: int = Field(1, ge=1, description="torch threads (1 is fastest for this small model on a shared CPU)")


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
        out[f"recall@{k}"] = float(np.mean(res[k])) if res[k] else float("nan")
        out[f"chance_recall@{k}"] = float(np.mean(chance[k])) if chance[k] else float("nan")
    return out


def _artifact_dir(manifest, cfg: Config) -> Path:
    p = Path(cfg.artifact)
    return p if p.is_absolute() or p.exists() and (p / "_manifest.json").exists() else Path(manifest.output) / cfg.artifact


def run(manifest, cfg: Config, log=print) -> dict:
    """Train, evaluate on the held-out images, write the checkpoint; returns the metrics."""
    import torch

    from pipeline.models.relations import build_relation_head

    torch.set_num_threads(cfg.threads)
    art_dir = _artifact_dir(manifest, cfg)
    items, art_man = load_graphs(art_dir)
    vocab = art_man.get("predicates")
    if not vocab:
        raise ValueError(f"{art_dir}: no predicate vocabulary in _manifest.json (not a visual_tokens artifact?)")
    if art_man.get("parameters", {}).get("relations") != "annotations":
        log(f"warning: {art_dir} was extracted with relations={art_man.get('parameters', {}).get('relations')!r}, not ground-truth annotations")
    items = [it for it in items if len(it[1]) > 0]
    if not items:
        raise ValueError(f"{art_dir}: no image with instances")
    d = items[0][1].shape[1]
    train_items = [it for it in items if not _held_out(it[0], cfg.val_fraction)]
    val_items = [it for it in items if _held_out(it[0], cfg.val_fraction)]
    head_cfg = dict(in_dim=d, width=cfg.width, layers=cfg.layers, heads=cfg.heads, cls_dim=cfg.cls_dim,
                    n_predicates=len(vocab), use_boxes=cfg.use_boxes, dropout=cfg.dropout)  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = build_relation_head(**head_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(train_items) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs

    def lr_at(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        p = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    out_path = Path(cfg.output) if cfg.output else Path(manifest.output) / "train" / "relation-head" / "relation_head.pt"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path = out_path.with_suffix(".metrics.jsonl")
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    step = 0
    with metrics_path.open("w") as mf:
        for epoch in range(cfg.epochs):
            model.train()
            order = rng.permutation(len(train_items))
            losses = []
            for s in range(0, len(order), cfg.batch_size):
                emb, box, pad, tgt = _collate([train_items[i] for i in order[s : s + cfg.batch_size]], len(vocab), d)
                logits = model(emb, box, pad)
                valid = torch.isfinite(logits)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[valid], tgt[valid])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
                step += 1
                losses.append(loss.item())
            rec = {"epoch": epoch + 1, "step": step, "loss": float(np.mean(losses)), "lr": sched.get_last_lr()[0], "seconds": round(time.perf_counter() - t0, 2)}
            if val_items and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
                rec.update({f"val_{k}": v for k, v in evaluate_model(model, val_items, len(vocab), d, cfg.recall_k).items()})
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
    final = evaluate_model(model, val_items, len(vocab), d, cfg.recall_k) if val_items else {}
    train_m = evaluate_model(model, train_items, len(vocab), d, cfg.recall_k)
    metrics = {"val": final, "train": train_m, "train_images": len(train_items), "val_images": len(val_items), "seconds": round(time.perf_counter() - t0, 2)}
    ck = {
        "state_dict": model.state_dict(),
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
    tmp = out_path.with_suffix(".tmp")
    torch.save(ck, tmp)
    tmp.replace(out_path)
    log(f"relation-head: checkpoint {out_path}; held-out {json.dumps(final)}")
    return {"checkpoint": str(out_path), **metrics}


def evaluate(manifest, cfg: Config, checkpoint: str, log=print) -> dict:
    """Recall@K of a checkpoint on the held-out images of the configured artifact."""
    import torch

    from pipeline.models.relations import load_relation_checkpoint

    torch.set_num_threads(cfg.threads)
    model, ck = load_relation_checkpoint(checkpoint)
    items, art_man = load_graphs(_artifact_dir(manifest, cfg))
    if list(art_man.get("predicates", [])) != list(ck["predicates"]):
        raise ValueError("checkpoint and artifact use different predicate vocabularies")
    val = [it for it in items if len(it[1]) and _held_out(it[0], cfg.val_fraction)]
    m = evaluate_model(model, val, len(ck["predicates"]), ck["config"]["in_dim"], cfg.recall_k)
    log(f"relation-head eval: {json.dumps(m)}")
    return m
