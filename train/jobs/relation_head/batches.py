"""relation-head data: the scene graphs of a ``visual_tokens`` artifact (tangible tokens, box
features, ground-truth triplets in vocabulary ids), held in memory, and their padded batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


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


def collate(items, n_pred: int, d: int):
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
