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
context length). Batches come from the training loop's resumable
stream (:class:`pipeline.io.shards.ShardStream`): deterministic per (seed, epoch), resumable at a batch index,
split across DataLoader workers by batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.io import shards
from pipeline.io.artifacts import Artifact
from pipeline.io.shards import ShardStream, copy_into, fits_in_memory
from pipeline.io.wds import iter_shard
from pipeline.visual_tokens.graph import TOKEN_IMAGE, TOKEN_INTANGIBLE, TOKEN_TANGIBLE

TOKEN_PAD = 3


def iter_samples(path: str | Path, fields=None) -> Iterator[dict]:
    yield from iter_shard(path, fields)


def shard_paths(artifact: str | Path | Artifact) -> list[Path]:
    art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    return art.files("shards")


# the fields a trainer reads (read_shard(fields=...)); boxes/masks/triplets/meta only with graph=True
TRAIN_FIELDS = ("tangible", "intangible", "image_feature", "ranks")


def read_shard(path: str | Path, fields=TRAIN_FIELDS, lazy: bool = False) -> Iterator[dict]:
    """Cheap per-sample dicts ``{"sample_id", field: array}`` (names without ``.npy``/``.json``)
    through the shared WebDataset reader of :mod:`pipeline.io.shards` (kept memory maps,
    or with ``lazy=True`` one ``pread`` per member and the large arrays read straight into the
    batch). JSON members (``meta``, ``masks``) come only with ``fields=None``; this is what
    :class:`pipeline.io.shards.ShardStream` iterates."""
    yield from shards.read_shard(path, fields=fields, lazy=lazy)


def _norm(s: dict) -> dict:
    """Accept both sample forms: :func:`iter_samples` (``tangible.npy``, ``meta.json``) and
    :func:`read_shard` (``tangible``, ``meta``, ``sample_id``)."""
    if "sample_id" in s and "tangible.npy" not in s:
        return s
    out = {k.rsplit(".", 1)[0]: v for k, v in s.items() if k != "__key__"}
    out["sample_id"] = int(s["meta.json"]["sample_id"]) if "meta.json" in s else int(s["__key__"])
    return out


def n_tokens(s: dict, intangible: bool = True) -> tuple[int, int, int]:
    """(V, U, T = 1 + V + U) of a sample (either form) from the array shapes only (no read);
    ``intangible=False``: U counted as 0 (the tangible-only ablation)."""
    s = _norm(s)
    v = int(s["tangible"].shape[0]) if len(s["tangible"].shape) == 2 else 0
    u = int(s["intangible"].shape[0]) if intangible and len(s["intangible"].shape) == 2 else 0
    return v, u, 1 + v + u


def collate(samples: list[dict], context_length: int = 77, graph: bool = False, *, pad_to: str = "context",
            intangible: bool = True) -> dict:
    """Padded batch (keys in the module docstring) from samples of :func:`iter_samples` or
    :func:`read_shard` (numpy arrays or lazy ``FileArray`` handles, read straight into the batch).

    ``pad_to="context"``: L = ``context_length`` (the paper's fixed 77); ``"batch"``: L = the
    batch's largest T (the same result under the padding mask, less work). ``intangible=False``
    drops the U tokens and their rank rows/columns (tangible-only ablation). A sample with
    T > ``context_length`` is a ValueError naming it (trainers filter such samples first)."""
    import torch

    samples = [_norm(s) for s in samples]
    B = len(samples)
    sizes = [n_tokens(s, intangible) for s in samples]
    for s, (_, _, T) in zip(samples, sizes):
        if T > context_length:
            raise ValueError(f"sample {s['sample_id']} has {T} tokens > context_length {context_length}")
    d = next((int(s["tangible"].shape[1]) for s in samples if len(s["tangible"].shape) == 2 and s["tangible"].shape[1]), None)
    if d is None:
        d = next((int(s["intangible"].shape[1]) for s in samples if len(s["intangible"].shape) == 2 and s["intangible"].shape[1]), 1)
    L = context_length if pad_to == "context" else max(T for _, _, T in sizes)
    tokens = np.zeros((B, L, d), dtype=np.float16)
    types = np.full((B, L), TOKEN_PAD, dtype=np.int64)
    ranks = np.zeros((B, L, L), dtype=np.uint8)
    feats = np.stack([np.asarray(s["image_feature"]) for s in samples]).astype(np.float16)
    for i, (s, (V, U, T)) in enumerate(zip(samples, sizes)):
        if V:
            copy_into(tokens[i, 1 : 1 + V], s["tangible"])
        if U:
            copy_into(tokens[i, 1 + V : T], s["intangible"])
        types[i, 0] = TOKEN_IMAGE
        types[i, 1 : 1 + V] = TOKEN_TANGIBLE
        types[i, 1 + V : T] = TOKEN_INTANGIBLE
        ranks[i, :T, :T] = np.asarray(s["ranks"])[:T, :T]  # (I, V, U) order: dropping U keeps the I+V block
    out = {
        "tokens": torch.from_numpy(tokens),
        "image_feature": torch.from_numpy(feats),
        "type_ids": torch.from_numpy(types),
        "ranks": torch.from_numpy(ranks),
        "pad_mask": torch.from_numpy(types == TOKEN_PAD),
        "sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
    }
    if graph:
        vmax = max(1, max(V for V, _, _ in sizes))
        tang = np.zeros((B, vmax, d), dtype=np.float32)
        boxes = np.zeros((B, vmax, 4), dtype=np.float32)
        trips = []
        for i, (s, (V, _, _)) in enumerate(zip(samples, sizes)):
            tang[i, :V] = np.asarray(s["tangible"]).reshape(-1, d)
            boxes[i, :V] = np.asarray(s["boxes"]).reshape(-1, 4)
            t = np.asarray(s["triplets"]).reshape(-1, 3).astype(np.int64)
            pid = np.asarray(s["meta"]["predicate_ids"], dtype=np.int64)
            if len(t):
                t = np.stack([t[:, 0], t[:, 1], pid[t[:, 2]]], axis=1)
            trips.append(torch.from_numpy(t))
        out.update(
            tangible=torch.from_numpy(tang),
            boxes=torch.from_numpy(boxes),
            n_tangible=torch.tensor([V for V, _, _ in sizes], dtype=torch.int64),
            image_size=torch.tensor([[s["meta"]["height"], s["meta"]["width"]] for s in samples], dtype=torch.int64),
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


def _fits(s: dict, context_length: int) -> bool:
    return n_tokens(s)[2] <= context_length


def _collate_fn(samples, rng, context_length=77, graph=False):
    return collate(samples, context_length, graph)


def VisualTokenBatches(artifact, batch_size: int = 64, context_length: int = 77, shuffle: bool = False, seed: int = 0,
                       graph: bool = False, drop_last: bool = False, shuffle_buffer: int = 512, lazy: bool | None = None):
    """Padded batches through the training loop's resumable stream (:class:`pipeline.io.shards.ShardStream`,
    a ``torch.utils.data.IterableDataset``): the batch sequence is a pure function of (seed, epoch);
    ``.set_position(epoch, start)`` resumes at a batch index; DataLoader workers split batches
    (same sequence for any number of workers). Samples with more than ``context_length`` tokens are
    skipped (trainers count them; the stage never writes any)."""
    import functools

    paths = [str(p) for p in shard_paths(artifact)]
    lazy = (not fits_in_memory(paths)) if lazy is None else lazy
    read = functools.partial(read_shard, fields=None if graph else TRAIN_FIELDS, lazy=lazy)
    return ShardStream(paths, read, functools.partial(_collate_fn, context_length=context_length, graph=graph),
                       batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, drop_last=drop_last,
                       keep=functools.partial(_fits, context_length=context_length))
