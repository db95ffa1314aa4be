"""Image side of the C3 job: the image store, random access to any sample's cached CLIP image
features (patch tokens, pooled embedding, a caption's text states for ITM). The training triplets
built on it are in :mod:`train.jobs.c3.batches`.
"""

from __future__ import annotations

import sys

import numpy as np

from pipeline.io.shards import fits_in_memory
from pipeline.loaders.clip_tokens import read_sample, read_shard, sample_index


class ImageStore:
    """sample_id -> (shard, position) of a `clip_tokens` artifact, and batched reads of
    ``patch_tokens`` / ``image_embed`` (and one caption's text states for ITM).

    ``mode="memory"`` copies the features of ``preload`` sample ids into two contiguous arrays
    (the in-memory reference); ``"random"`` reads each batch's samples by random access
    (:func:`pipeline.loaders.clip_tokens.read_sample`, lazy ``pread`` when the shards do not fit in
    RAM, the kept map otherwise).

    ``zeroed`` (``control: images_zeroed``): :meth:`get` returns zeros of the same shapes for every
    image, in training, evaluation and scoring alike, so a model can use only the texts."""

    def __init__(self, shards: list[str], mode: str = "auto", zeroed: bool = False):
        self.zeroed = zeroed
        self.shards = list(shards)
        ix = sample_index(self.shards)
        self.sids, self.shard_of = ix["ids"], ix["shard"]
        self.pos_of, self.n_captions = ix["pos"].astype(np.int32), ix["ncap"].astype(np.int32)
        self.lazy = not fits_in_memory(self.shards)
        self.mode = ("memory" if not self.lazy else "random") if mode == "auto" else mode
        self._mem_rows: np.ndarray | None = None
        first = read_sample(self.shards[0], 0, fields=("patch_tokens", "image_embed"), lazy=True) if self.shards else None
        if first is None:
            raise ValueError("clip_tokens: no samples")
        self.N, self.d_v = np.asarray(first["patch_tokens"]).shape
        self.P = int(np.asarray(first["image_embed"]).shape[0])

    def index(self, sample_ids) -> np.ndarray:
        """Row of each sample id in this store, -1 where the artifact does not hold it."""
        s = np.asarray(sample_ids, np.int64)
        at = np.searchsorted(self.sids, s)
        atc = np.minimum(at, max(0, len(self.sids) - 1))
        return np.where((len(self.sids) > 0) & (self.sids[atc] == s), atc, -1)

    def preload(self, sample_ids) -> None:
        """memory mode: hold these samples' features in two arrays (read shard by shard)."""
        if self.mode != "memory" or self.zeroed:
            return
        rows = np.unique(self.index(sample_ids))
        rows = rows[rows >= 0]
        self._patches = np.zeros((len(rows), self.N, self.d_v), np.float16)
        self._embed = np.zeros((len(rows), self.P), np.float16)
        self._mem_rows = np.full(len(self.sids), -1, np.int64)
        self._mem_rows[rows] = np.arange(len(rows))
        for k, p in enumerate(self.shards):
            want = rows[self.shard_of[rows] == k]
            if len(want) == 0:
                continue
            pos = {int(self.pos_of[r]): int(self._mem_rows[r]) for r in want}
            for q, s in enumerate(read_shard(p, fields=("patch_tokens", "image_embed"), lazy=False)):
                m = pos.get(q)
                if m is not None:
                    self._patches[m] = s["patch_tokens"]
                    self._embed[m] = s["image_embed"]

    def get(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(patch_tokens float16 [n, N, d_v], image_embed float16 [n, P]) of store rows."""
        rows = np.asarray(rows, np.int64)
        if self.zeroed:
            return np.zeros((len(rows), self.N, self.d_v), np.float16), np.zeros((len(rows), self.P), np.float16)
        if self._mem_rows is not None:
            m = self._mem_rows[rows]
            if (m >= 0).all():
                return self._patches[m], self._embed[m]
        patches = np.empty((len(rows), self.N, self.d_v), np.float16)
        embed = np.empty((len(rows), self.P), np.float16)
        # in shard order, ascending positions: sequential reads of the page cache / disk
        for k in np.lexsort((self.pos_of[rows], self.shard_of[rows])):
            r = rows[k]
            s = read_sample(self.shards[self.shard_of[r]], int(self.pos_of[r]), fields=("patch_tokens", "image_embed"),
                            lazy=self.lazy)
            pt = s["patch_tokens"]
            if hasattr(pt, "read_into"):
                pt.read_into(patches[k])  # pread straight into the batch row
            else:
                patches[k] = pt
            embed[k] = s["image_embed"]
        return patches, embed

    def caption(self, row: int, which: int) -> dict[str, np.ndarray]:
        """Caption ``which`` of a sample: text_tokens [m, d_t] (valid part), text_embed [P]."""
        s = read_sample(self.shards[self.shard_of[row]], int(self.pos_of[row]),
                        fields=("text_tokens", "text_mask", "text_embed"), lazy=False)
        mask = np.asarray(s["text_mask"][which])
        return {"tokens": np.asarray(s["text_tokens"][which])[mask], "pooled": np.asarray(s["text_embed"][which])}


def log(msg: str) -> None:
    print(f"c3: {msg}", file=sys.stderr)
