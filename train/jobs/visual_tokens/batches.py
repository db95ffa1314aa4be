"""visual-tokens batches: the joined visual_tokens + clip_tokens samples collated into the
encoder's inputs (token sequence, rank matrix, types) and the captions' frozen text tokens, and
the shuffled-ranks control's permutation."""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeline.io.shards import copy_into
from pipeline.loaders.visual_tokens import collate as vt_collate

TEXT_FIELDS = ("text_tokens", "text_mask", "text_embed", "caption_ids")


def shuffle_ranks(ranks: np.ndarray, T: int, seed: int, sample_id: int) -> np.ndarray:
    """The shuffled-ranks control: the [T, T] rank block permuted over its non-image tokens
    (rows and columns together) by a permutation fixed per (seed, sample_id)."""
    perm = np.random.default_rng([int(seed), int(sample_id), 7]).permutation(T - 1) + 1
    idx = np.concatenate([[0], perm])
    out = ranks.copy()
    out[:T, :T] = ranks[np.ix_(idx, idx)]
    return out


def collate_batch(samples: list[dict], rng: random.Random | None, *, opts: dict, captions: str = "random") -> dict:
    """A training / evaluation batch from joined samples (module-level: DataLoader workers pickle
    it). ``captions``: ``random`` (one per image, drawn with ``rng``), ``first`` or ``all``
    (``caption_sample`` then maps each caption row to its image row)."""
    variant = opts["variant"]
    if variant == "vit":
        p0 = samples[0]["patch_tokens"]
        patches = np.empty((len(samples), *p0.shape), p0.dtype)
        for i, s in enumerate(samples):
            copy_into(patches[i], s["patch_tokens"])
        batch = {"patch_tokens": torch.from_numpy(patches),
                 "sample_id": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.int64)}
    else:
        batch = vt_collate(samples, opts["context_length"], pad_to=opts["pad_to"], intangible=variant != "tangible-only")
        if variant == "shuffled-ranks":
            r = batch["ranks"].numpy().copy()
            for i, s in enumerate(samples):
                T = int((~batch["pad_mask"][i]).sum())
                r[i] = shuffle_ranks(r[i], T, opts["seed"], int(s["sample_id"]))
            batch["ranks"] = torch.from_numpy(r)
    if "caption_ids" in samples[0]:
        batch.update(collate_text(samples, rng, captions))
    return batch


def collate_text(samples: list[dict], rng: random.Random | None, captions: str) -> dict:
    picks = []  # (sample row, caption row, valid tokens)
    for i, s in enumerate(samples):
        c = int(s["caption_ids"].shape[0])
        lengths = np.asarray(s["text_mask"]).sum(axis=1)
        js = range(c) if captions == "all" else [0 if captions == "first" else (rng or random).randrange(c)]
        picks.extend((i, j, int(lengths[j])) for j in js)
    t0 = samples[0]["text_tokens"]
    m = max((n for _, _, n in picks), default=1)
    tokens = np.zeros((len(picks), m, t0.shape[-1]), t0.dtype)
    for r, (i, j, n) in enumerate(picks):
        if n:
            copy_into(tokens[r, :n], samples[i]["text_tokens"], j, n)
    lengths = torch.tensor([n for _, _, n in picks], dtype=torch.int64)
    out = {"text_tokens": torch.from_numpy(tokens), "text_mask": torch.arange(m)[None, :] < lengths[:, None],
           "text_embed": torch.from_numpy(np.stack([np.asarray(samples[i]["text_embed"][j]) for i, j, _ in picks])),
           "caption_id": torch.tensor([int(samples[i]["caption_ids"][j]) for i, j, _ in picks], dtype=torch.int64)}
    if captions == "all":
        out["caption_sample"] = torch.tensor([i for i, _, _ in picks], dtype=torch.int64)
    return out
