"""Read `visual_tokens` shards into padded batches for a trainer (Visual Token Encoder, relation head).

Usage::

    from pipeline.loaders.visual_tokens import VisualTokenBatches
    for batch in VisualTokenBatches("runs/demo/visual_tokens", batch_size=64, context_length=77):
        batch["tokens"]       # float16 [B, L, d]  position 0 = zeros (the image feature's slot),
                              #                    then V tangible, then U intangible, then zeros
        batch["image_feature"]# float16 [B, D_I]   to be projected into slot 0 by the trainer (paper: 3-layer MLP)
        batch["type_ids"]     # int64   [B, L]     0 image feature, 1 tangible, 2 intangible, 3 padding
        batch["ranks"]        # uint8   [B, L, L]  attention ranks 0..7, zero on padding
        batch["pad_mask"]     # bool    [B, L]     True at padding
        batch["sample_id"]    # int64   [B]

With ``graph=True`` the batch also carries what the relation head trains on:
``tangible`` [B, Vmax, d], ``boxes`` [B, Vmax, 4], ``n_tangible`` [B], ``image_size`` [B, 2]
(h, w) and ``triplets`` (list of [E, 3] int64 tensors with predicate *vocabulary* indices).

L = ``context_length`` (default 77, the paper's; shards never hold more than their stage's
context length). Shards are split across DataLoader workers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.io.artifacts import Artifact
from pipeline.io.wds import iter_shard
from pipeline.visual_tokens.graph import TOKEN_IMAGE, TOKEN_INTANGIBLE, TOKEN_TANGIBLE

TOKEN_PAD = 3


def iter_samples(path: str | Path, fields=None) -> Iterator[dict]:
    yield from iter_shard(path, fields)


def shard_paths(artifact: str | Path | Artifact) -> list[Path]:
    art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    return art.files("shards")


def collate(samples: list[dict], context_length: int = 77, graph: bool = False) -> dict:
    import torch

    B = len(samples)
    d = next((s["tangible.npy"].shape[1] for s in samples if s["tangible.npy"].ndim == 2 and s["tangible.npy"].shape[1]), None)
    if d is None:
        d = next((s["intangible.npy"].shape[1] for s in samples if s["intangible.npy"].ndim == 2 and s["intangible.npy"].shape[1]), 1)
    L = context_length
    tokens = np.zeros((B, L, d), dtype=np.float16)
    types = np.full((B, L), TOKEN_PAD, dtype=np.int64)
    ranks = np.zeros((B, L, L), dtype=np.uint8)
    feats = np.stack([s["image_feature.npy"] for s in samples]).astype(np.float16)
    for i, s in enumerate(samples):
        v = s["tangible.npy"].reshape(-1, d)
        u = s["intangible.npy"].reshape(-1, d)
        T = 1 + len(v) + len(u)
        if T > L:
            raise ValueError(f"sample {s['meta.json']['sample_id']} has {T} tokens > context_length {L}")
        tokens[i, 1 : 1 + len(v)] = v
        tokens[i, 1 + len(v) : T] = u
        types[i, 0] = TOKEN_IMAGE
        types[i, 1 : 1 + len(v)] = TOKEN_TANGIBLE
        types[i, 1 + len(v) : T] = TOKEN_INTANGIBLE
        ranks[i, :T, :T] = s["ranks.npy"]
    out = {
        "tokens": torch.from_numpy(tokens),
        "image_feature": torch.from_numpy(feats),
        "type_ids": torch.from_numpy(types),
        "ranks": torch.from_numpy(ranks),
        "pad_mask": torch.from_numpy(types == TOKEN_PAD),
        "sample_id": torch.tensor([s["meta.json"]["sample_id"] for s in samples], dtype=torch.int64),
    }
    if graph:
        vmax = max(1, max(len(s["tangible.npy"]) for s in samples))
        tang = np.zeros((B, vmax, d), dtype=np.float32)
        boxes = np.zeros((B, vmax, 4), dtype=np.float32)
        trips = []
        for i, s in enumerate(samples):
            v = s["tangible.npy"].reshape(-1, d)
            tang[i, : len(v)] = v
            boxes[i, : len(v)] = s["boxes.npy"].reshape(-1, 4)
            t = s["triplets.npy"].reshape(-1, 3).astype(np.int64)
            pid = np.asarray(s["meta.json"]["predicate_ids"], dtype=np.int64)
            if len(t):
                t = np.stack([t[:, 0], t[:, 1], pid[t[:, 2]]], axis=1)
            trips.append(torch.from_numpy(t))
        out.update(
            tangible=torch.from_numpy(tang),
            boxes=torch.from_numpy(boxes),
            n_tangible=torch.tensor([len(s["tangible.npy"]) for s in samples], dtype=torch.int64),
            image_size=torch.tensor([[s["meta.json"]["height"], s["meta.json"]["width"]] for s in samples], dtype=torch.int64),
            triplets=trips,
        )
    return out


def load_samples(artifact, sample_ids=None) -> list[dict]:
    """Every sample of the artifact (optionally only ``sample_ids``) as decoded field dicts."""
    want = None if sample_ids is None else set(int(x) for x in sample_ids)
    out = []
    for p in shard_paths(artifact):
        for s in iter_samples(p):
            if want is None or s["meta.json"]["sample_id"] in want:
                out.append(s)
    return out


class VisualTokenBatches:
    """Iterable of padded batches; also a ``torch.utils.data.IterableDataset`` when torch is present."""

    def __new__(cls, *args, **kwargs):
        import torch

        class _Impl(torch.utils.data.IterableDataset):
            def __init__(self, artifact, batch_size=64, context_length=77, shuffle=False, seed=0, graph=False, drop_last=False):
                super().__init__()
                self.paths = shard_paths(artifact)
                self.batch_size, self.context_length = batch_size, context_length
                self.shuffle, self.seed, self.graph, self.drop_last = shuffle, seed, graph, drop_last
                self.epoch = 0

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                paths = list(self.paths)
                rng = random.Random(self.seed + self.epoch)
                if self.shuffle:
                    rng.shuffle(paths)
                if info is not None:
                    paths = paths[info.id :: info.num_workers]
                buf = []
                for p in paths:
                    samples = list(iter_samples(p))
                    if self.shuffle:
                        rng.shuffle(samples)
                    for s in samples:
                        buf.append(s)
                        if len(buf) == self.batch_size:
                            yield collate(buf, self.context_length, self.graph)
                            buf = []
                if buf and not self.drop_last:
                    yield collate(buf, self.context_length, self.graph)
                self.epoch += 1

        return _Impl(*args, **kwargs)
