"""Read `clip_tokens` shards back into padded training batches (ConceptOT trainer side).

Shard fields are documented in :mod:`pipeline.stages.extract_clip_tokens`; the shards are read
through :mod:`pipeline.io.shards` (kept memory maps, or ``pread`` straight into the batch, one copy
per byte either way). Batches come from a :class:`pipeline.io.shards.ShardStream`::

    from pipeline.io.shards import ShardStream, loader
    from pipeline.loaders import clip_tokens

    shards = clip_tokens.shard_paths("runs/demo/clip_tokens")
    stream = ShardStream(shards, clip_tokens.shard_reader(shards),
                         lambda samples, rng: clip_tokens.collate(samples, "random", rng), batch_size=64)
    for batch in loader(stream.set_position(epoch=0), num_workers=2):
        batch["patch_tokens"]  # torch.float16 [B, N, d_v]

Batch keys (torch tensors), ``captions="random"`` or ``"first"`` (one caption per image):

    sample_id     int64   [B]
    patch_tokens  float16 [B, N, d_v]
    image_embed   float16 [B, P]
    caption_id    int64   [B]
    text_tokens   float16 [B, M, d_t]   M = longest valid length in the batch, zero padded
    text_mask     bool    [B, M]
    text_embed    float16 [B, P]

With one caption per image, images without captions must be left out of the stream
(``keep=lambda s: s["caption_ids"].shape[0] > 0``).

``captions="all"``: every caption of every image; text keys then have C_total rows and
``caption_sample`` int64 [C_total] gives each caption's row in the image part of the batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from pipeline.io import shards
from pipeline.io.artifacts import Artifact
from pipeline.io.shards import copy_into, materialize

DEFAULT_FIELDS = ("patch_tokens", "image_embed", "text_tokens", "text_mask", "text_embed", "caption_ids")


def read_shard(path: str | Path, fields: Iterable[str] | None = DEFAULT_FIELDS, lazy: bool = False) -> Iterator[dict]:
    """:func:`pipeline.io.shards.read_shard` of a clip_tokens shard, the fields :func:`collate`
    needs by default."""
    return shards.read_shard(path, fields, lazy)


def read_sample(path: str | Path, position: int, fields: Iterable[str] | None = DEFAULT_FIELDS,
                lazy: bool = False) -> dict:
    """:func:`pipeline.io.shards.read_sample` of a clip_tokens shard, the fields :func:`collate`
    needs by default."""
    return shards.read_sample(path, position, fields, lazy)


def shard_reader(paths: Iterable[str | Path], mapped: bool | None = None):
    """:func:`read_shard` for these shards: kept maps when they fit in memory (``mapped=None``)."""
    return shards.shard_reader(paths, mapped, fields=DEFAULT_FIELDS)


def shard_paths(artifact: str | Path | Artifact) -> list[Path]:
    art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    return art.files("shards")


def collate(samples: list[dict], captions: str = "random", rng: random.Random | None = None) -> dict[str, torch.Tensor]:
    """Padded batch from per-sample dicts (see the module docstring for keys and shapes); sample
    arrays may be numpy arrays or lazy :class:`FileArray` handles."""
    if captions not in ("random", "first", "all"):
        raise ValueError(f"captions must be random, first or all, got {captions!r}")
    b = len(samples)
    p0 = samples[0]["patch_tokens"]
    patches = np.empty((b, *p0.shape), p0.dtype)
    for i, s in enumerate(samples):
        copy_into(patches[i], s["patch_tokens"])
    batch = {
        "sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
        "patch_tokens": torch.from_numpy(patches),
        "image_embed": torch.from_numpy(np.stack([materialize(s["image_embed"]) for s in samples])),
    }
    batch.update(collate_captions(samples, captions, rng))
    return batch


def collate_captions(samples: list[dict], captions: str = "random", rng: random.Random | None = None,
                     min_len: int = 0) -> dict[str, torch.Tensor]:
    """The caption side of a batch: per sample its first, one random (``rng``) or all captions;
    ``text_tokens`` [P, M, d] padded to the longest (at least ``min_len``), ``text_mask``,
    ``text_embed`` [P, D], ``caption_id`` [P] and, for ``all``, ``caption_sample`` [P] (the row of
    each caption's sample). Token arrays are copied once, from maps or files, into the batch."""
    picks: list[tuple[int, int, int]] = []  # (sample row, caption row, valid tokens)
    for i, s in enumerate(samples):
        c = int(s["caption_ids"].shape[0])
        lengths = np.asarray(s["text_mask"]).sum(axis=1)
        js = range(c) if captions == "all" else [0 if captions == "first" else (rng or random).randrange(c)]
        picks.extend((i, j, int(lengths[j])) for j in js)
    t0 = samples[0]["text_tokens"]
    m = max((n for _, _, n in picks), default=min_len)
    tokens = np.zeros((len(picks), m, t0.shape[-1]), t0.dtype)
    for r, (i, j, n) in enumerate(picks):
        if n:
            copy_into(tokens[r, :n], samples[i]["text_tokens"], j, n)
    lengths = torch.tensor([n for _, _, n in picks], dtype=torch.int64)
    if picks:
        embed = torch.from_numpy(np.stack([np.asarray(samples[i]["text_embed"][j]) for i, j, _ in picks]))
    else:
        embed = torch.zeros((0, samples[0]["text_embed"].shape[-1]), dtype=torch.float16)
    out = {"text_tokens": torch.from_numpy(tokens), "text_mask": torch.arange(m)[None, :] < lengths[:, None],
           "text_embed": embed,
           "caption_id": torch.tensor([int(samples[i]["caption_ids"][j]) for i, j, _ in picks], dtype=torch.int64)}
    if captions == "all":
        out["caption_sample"] = torch.tensor([i for i, _, _ in picks], dtype=torch.int64)
    return out


def sample_index(shards: list[str | Path], where: str = "clip_tokens") -> dict[str, np.ndarray]:
    """Every sample of the shards, sorted by id, from one pass over their headers: ``ids`` int64,
    ``shard`` int32 (index into ``shards``), ``pos`` int64 (position in its shard), ``ncap`` int64
    (captions). A sample_id stored twice is an error naming it."""
    ids, sh, pos, ncap = [], [], [], []
    for k, path in enumerate(shards):
        for p, s in enumerate(read_shard(path, fields=("caption_ids",), lazy=True)):
            ids.append(int(s["sample_id"]))
            sh.append(k)
            pos.append(p)
            ncap.append(int(np.asarray(s["caption_ids"]).shape[0]))
    ids_a = np.asarray(ids, np.int64)
    order = np.argsort(ids_a, kind="stable")
    ids_a = ids_a[order]
    if ids_a.size > 1 and (np.diff(ids_a) == 0).any():
        raise ValueError(f"{where}: sample_id {int(ids_a[1:][np.diff(ids_a) == 0][0])} occurs more than once")
    return {"ids": ids_a, "shard": np.asarray(sh, np.int32)[order], "pos": np.asarray(pos, np.int64)[order],
            "ncap": np.asarray(ncap, np.int64)[order]}

