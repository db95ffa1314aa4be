"""Read the ``regions`` artifact (extract-regions: boxes + ROI features per image).

Streaming (``iter``) or random access by ``sample_id`` (``get``: views of the shard's kept
read-only map at offsets from a member index built once, so a trainer can join regions to another
artifact's samples by sample_id without holding the artifact in memory)::

    reader = RegionsReader("runs/demo/regions")
    reader.feature_dim                # D, from _manifest.json dims (not a constant)
    reader.n_regions(sample_id)       # R (0: the detector found nothing; None: not in the artifact)
    r = reader.get(sample_id)         # {"sample_id", "boxes" f32 [R,4], "features" f16 [R,D],
                                      #  "scores" f32 [R], "image_size" i32 [2] (w, h), "instance_ids"?}
    b = collate_regions([r, ...])     # padded: features float32 [B,Rmax,D], boxes [B,Rmax,4], mask bool [B,Rmax]
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import npy_view, shard_map

FIELDS = ("boxes.npy", "features.npy", "scores.npy", "image_size.npy", "instance_ids.npy")


def _decode(mm, name: str, off: int, size: int):
    """A field of a mapped shard: .npy as a read-only view of the map, .json parsed, else bytes."""
    if name.endswith(".npy"):
        return npy_view(mm, off, size)
    if name.endswith(".json"):
        return json.loads(bytes(mm[off : off + size]))
    return bytes(mm[off : off + size])


def iter_shard_mapped(path: str | Path, fields: Iterable[str] | None = None) -> Iterator[dict]:
    """:func:`pipeline.io.wds.iter_shard` through the kept read-only map of the shard and its
    parsed member table (:func:`pipeline.io.shards.shard_map`): no tarfile parsing, arrays
    are views of the map (copy before writing)."""
    wanted = set(fields) if fields is not None else None
    mm, members = shard_map(path)
    cur: dict | None = None
    for name, off, size in members:
        key, _, field = name.partition(".")
        if cur is None or cur["__key__"] != key:
            if cur is not None:
                yield cur
            cur = {"__key__": key}
        if wanted is None or field in wanted:
            cur[field] = _decode(mm, field, off, size)
    if cur is not None:
        yield cur


def _to_sample(sample_id: int, rec: dict, wanted: Sequence[str] = FIELDS) -> dict:
    """One sample's record; of boxes.npy and features.npy, those ``wanted`` must be there (a reader asking
    for the boxes alone, as the segmenter's measurement does, is not refused for the features it left out)."""
    out = {"sample_id": int(sample_id)}
    for name in FIELDS:
        if name in rec:
            out[name[:-4]] = rec[name]
    if any(n in wanted and n not in rec for n in ("boxes.npy", "features.npy")):
        raise ValueError(f"regions sample {sample_id}: missing boxes.npy or features.npy")
    if "boxes" in out and "features" in out and len(out["boxes"]) != len(out["features"]):
        raise ValueError(f"regions sample {sample_id}: {len(out['boxes'])} boxes but {len(out['features'])} feature rows")
    return out


class RegionsReader:
    """The feature shards of a ``regions`` artifact."""

    def __init__(self, path: str | Path | Artifact):
        self.artifact = path if isinstance(path, Artifact) else Artifact(path)
        if self.artifact.name != "regions":
            raise ValueError(f"{self.artifact.dir}: artifact {self.artifact.name!r} is not a regions artifact")
        self.shards = [str(p) for p in self.artifact.files("shards")]
        dims = self.artifact.manifest.get("dims", {}) or {}
        self._dim = dims.get("feature_dim")
        self.max_boxes = dims.get("max_boxes")
        self.backend = self.artifact.manifest.get("backend")
        self._index: dict[int, dict[str, tuple[str, int, int]]] | None = None
        self._counts: dict[int, int] | None = None

    @property
    def feature_dim(self) -> int:
        if self._dim is None:  # an older manifest without dims: the first sample's width
            first = next(iter(self), None)
            if first is None:
                raise ValueError(f"{self.artifact.dir}: regions artifact holds no samples")
            self._dim = int(first["features"].shape[1])
        return int(self._dim)

    def __iter__(self) -> Iterator[dict]:
        for shard in self.shards:
            for rec in iter_shard_mapped(shard):
                yield _to_sample(int(rec["__key__"]), rec)

    def _build_index(self) -> None:
        """Member offsets per sample and its region count (from the boxes.npy header)."""
        index: dict[int, dict[str, tuple[str, int, int]]] = {}
        counts: dict[int, int] = {}
        for shard in self.shards:
            mm, members = shard_map(shard)
            for name, off, size in members:
                key, _, field = name.partition(".")
                sid = int(key)
                index.setdefault(sid, {})[field] = (shard, off, size)
                if field == "boxes.npy":
                    counts[sid] = int(npy_view(mm, off, size).shape[0])
        self._index, self._counts = index, counts

    def sample_ids(self) -> np.ndarray:
        if self._index is None:
            self._build_index()
        return np.asarray(sorted(self._index), dtype=np.int64)

    def n_regions(self, sample_id: int) -> int | None:
        if self._counts is None:
            self._build_index()
        return self._counts.get(int(sample_id))

    def get(self, sample_id: int, fields: Sequence[str] = FIELDS) -> dict | None:
        if self._index is None:
            self._build_index()
        members = self._index.get(int(sample_id))
        if members is None:
            return None
        rec = {}
        for name in fields:
            if name in members:
                shard, off, size = members[name]
                rec[name] = _decode(shard_map(shard)[0], name, off, size)
        return _to_sample(sample_id, rec, fields)


def collate_regions(samples: Sequence[dict], max_regions: int | None = None) -> dict[str, np.ndarray]:
    """Pad regions of several images: features float32 [B, Rmax, D], boxes float32 [B, Rmax, 4],
    mask bool [B, Rmax] (True = a real region). ``max_regions`` keeps the first (top-scoring) ones."""
    n = [len(s["boxes"]) if max_regions is None else min(len(s["boxes"]), max_regions) for s in samples]
    R = max(1, max(n) if n else 1)
    D = int(samples[0]["features"].shape[1]) if samples else 0
    feats = np.zeros((len(samples), R, D), np.float32)
    boxes = np.zeros((len(samples), R, 4), np.float32)
    mask = np.zeros((len(samples), R), bool)
    for i, (s, k) in enumerate(zip(samples, n)):
        feats[i, :k] = s["features"][:k]
        boxes[i, :k] = s["boxes"][:k]
        mask[i, :k] = True
    return {"features": feats, "boxes": boxes, "mask": mask,
            "sample_id": np.asarray([s["sample_id"] for s in samples], np.int64)}

