"""visual-tokens batches: the joined visual_tokens + clip_tokens samples collated into the
encoder's inputs (token sequence, rank matrix, types) and the captions' frozen text tokens, and
the shuffled-ranks control's permutation."""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeline.io.shards import copy_into
from pipeline.loaders.clip_tokens import collate_captions
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
    """The captions' cached CLIP text tokens, as the clip_tokens loader pads them (at least one slot)."""
    return collate_captions(samples, captions, rng, min_len=1)
