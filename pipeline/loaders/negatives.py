"""Read the ``negatives`` artifact: word features and negative-noun features per sample.

The grounding trainer uses :func:`load_word_features` (or :class:`NegativesReader` for streaming
or random access by ``sample_id``) and :func:`pick_nouns` to choose, reproducibly, the noun
whose negatives a caption uses in a given epoch (the paper samples one noun per caption)::

    reader = NegativesReader("runs/demo/negatives")
    f = reader.get(sample_id)           # SampleFeatures
    f.words[caption_id]                 # (word_index int32 [W], features float16 [W, d])
    f.negatives[(caption_id, word_index)]   # features float16 [k, d] of the k kept negatives
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import shard_map
from pipeline.io.wds import decode_field, iter_shard, sample_key


@dataclass
class SampleFeatures:
    sample_id: int
    word_caption_id: np.ndarray  # int64 [W]
    word_index: np.ndarray  # int32 [W] spaCy token index within the caption
    word_features: np.ndarray  # float16 [W, d]
    neg_caption_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [M]
    neg_word_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [M]
    neg_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [M]
    neg_valid: np.ndarray | None = None  # bool [M, K]
    neg_features: np.ndarray | None = None  # float16 [M, K, d]

    @property
    def words(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for cid in np.unique(self.word_caption_id):
            m = self.word_caption_id == cid
            out[int(cid)] = (self.word_index[m], self.word_features[m])
        return out

    @property
    def negatives(self) -> dict[tuple[int, int], np.ndarray]:
        if self.neg_features is None:
            return {}
        return {
            (int(c), int(w)): self.neg_features[i, : self.neg_count[i]]
            for i, (c, w) in enumerate(zip(self.neg_caption_id, self.neg_word_index))
        }


def _to_features(sample_id: int, rec: dict) -> SampleFeatures:
    wj = rec["words.json"]
    f = SampleFeatures(
        int(sample_id),
        np.asarray(wj["caption_id"], np.int64),
        np.asarray(wj["word_index"], np.int32),
        rec["words.npy"],
    )
    if "negs.npy" in rec:
        nj = rec["negs.json"]
        f.neg_caption_id = np.asarray(nj["caption_id"], np.int64)
        f.neg_word_index = np.asarray(nj["word_index"], np.int32)
        f.neg_count = np.asarray(nj["count"], np.int32)
        f.neg_valid = np.asarray(nj["valid"], bool)
        f.neg_features = rec["negs.npy"]
    return f


class NegativesReader:
    """Streaming (``iter``) or random access (``get``) over the feature shards of the artifact."""

    FIELDS = ("words.npy", "words.json", "negs.npy", "negs.json")

    def __init__(self, path: str | Path):
        self.artifact = Artifact(path)
        self.shards = self.artifact.files("shards")
        self._index: dict[str, dict[str, tuple[Path, int, int]]] | None = None

    def negatives(self) -> pl.DataFrame:
        return self.artifact.scan("negatives").collect()

    def words(self) -> pl.DataFrame:
        return self.artifact.scan("words").collect()

    def __iter__(self) -> Iterator[SampleFeatures]:
        for shard in self.shards:
            for rec in iter_shard(shard):
                yield _to_features(int(rec["__key__"]), rec)

    def _build_index(self) -> None:
        index: dict[str, dict[str, tuple[Path, int, int]]] = {}
        for shard in self.shards:
            for mname, off, size in shard_map(shard)[1]:  # the shard's tar index (kept map)
                key, _, name = mname.partition(".")
                index.setdefault(key, {})[name] = (shard, off, size)
        self._index = index

    def get(self, sample_id: int) -> SampleFeatures | None:
        if self._index is None:
            self._build_index()
        members = self._index.get(sample_key(sample_id))
        if members is None:
            return None
        rec = {}
        for name, (shard, off, size) in members.items():
            rec[name] = decode_field(name, bytes(shard_map(shard)[0][off : off + size]))
        return _to_features(sample_id, rec)


def load_word_features(path: str | Path, sample_ids=None) -> dict[int, SampleFeatures]:
    """All (or the given samples') word and negative features of a ``negatives`` artifact."""
    reader = NegativesReader(path)
    if sample_ids is None:
        return {f.sample_id: f for f in reader}
    out = {}
    for s in sample_ids:
        f = reader.get(int(s))
        if f is not None:
            out[int(s)] = f
    return out


def pick_nouns(negatives: pl.DataFrame, seed: int, epoch: int = 0, require_features: bool = True) -> pl.DataFrame:
    """One noun row per caption, chosen uniformly at random and reproducibly for (seed, epoch).

    With ``require_features`` only nouns whose negatives have in-context features are eligible.
    """
    df = negatives
    if require_features:
        df = df.filter(pl.col("feature_row") >= 0)
    rng = np.random.default_rng([int(seed), int(epoch)])
    df = df.with_columns(pl.Series("_r", rng.random(df.height)))
    return df.sort(["caption_id", "_r"]).unique("caption_id", keep="first", maintain_order=True).drop("_r")
