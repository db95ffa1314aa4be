"""Read the `image_groups` artifact (frozen GroupViT groups, :mod:`pipeline.stages.extract_image_groups`).

:class:`ImageGroups` indexes every sample of the artifact's shards once (sample_id -> shard,
position) and gathers the ``groups`` arrays [K, d] of any set of sample ids into one float32
batch. The arrays are read-only views into kept memory maps of the shards
(:func:`pipeline.io.shards.read_shard`), so a gather copies each byte once and an artifact larger
than RAM is paged by the OS rather than loaded.

Usage::

    ig = ImageGroups("runs/demo/image_groups")
    ig.sample_ids            # int64 [N], sorted
    ig.gather([3, 7, 9])     # float32 [3, K, d] (field "groups"; also "groups_projected", "image_embed", "assign")
    ig.dims                  # {"n_groups": K, "group_dim": d, ...} from the artifact manifest
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import read_shard

FIELDS = ("groups", "groups_projected", "image_embed", "assign")


class ImageGroups:
    def __init__(self, artifact: str | Path | Artifact, fields: Iterable[str] = ("groups",)):
        self.art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
        self.fields = tuple(fields)
        bad = [f for f in self.fields if f not in FIELDS]
        if bad:
            raise ValueError(f"image_groups has no field(s) {bad}; it has {list(FIELDS)}")
        self.dims = dict(self.art.manifest.get("dims", {}))
        self._views: dict[str, list[np.ndarray]] = {f: [] for f in self.fields}
        ids: list[int] = []
        for shard in self.art.files("shards"):
            for s in read_shard(shard, fields=self.fields):
                missing = [f for f in self.fields if f not in s]
                if missing:
                    raise ValueError(f"{shard}: sample {s['sample_id']} has no {missing[0]}.npy")
                ids.append(int(s["sample_id"]))
                for f in self.fields:
                    self._views[f].append(s[f])
        if not ids:
            raise ValueError(f"{self.art.dir}: the image_groups artifact holds no samples")
        order = np.argsort(np.asarray(ids, np.int64), kind="stable")
        self.sample_ids = np.asarray(ids, np.int64)[order]
        if len(np.unique(self.sample_ids)) != len(self.sample_ids):
            raise ValueError(f"{self.art.dir}: duplicate sample ids across shards")
        self._views = {f: [v[i] for i in order] for f, v in self._views.items()}
        first = self._views[self.fields[0]][0]
        self.shape = {f: tuple(self._views[f][0].shape) for f in self.fields}
        self.n_groups, self.group_dim = (first.shape if self.fields[0] == "groups" else (None, None))

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __contains__(self, sample_id: int) -> bool:
        i = np.searchsorted(self.sample_ids, sample_id)
        return bool(i < len(self.sample_ids) and self.sample_ids[i] == sample_id)

    def rows(self, sample_ids: Sequence[int]) -> np.ndarray:
        """Row of each sample id; a KeyError naming the first id the artifact does not hold."""
        sids = np.asarray(sample_ids, np.int64)
        pos = np.searchsorted(self.sample_ids, sids).clip(0, max(0, len(self.sample_ids) - 1))
        bad = self.sample_ids[pos] != sids
        if bad.any():
            raise KeyError(f"sample {int(sids[bad][0])} is not in the image_groups artifact {self.art.dir}")
        return pos

    def gather(self, sample_ids: Sequence[int], field: str = "groups", rows: np.ndarray | None = None) -> np.ndarray:
        """float32 [B, *shape] of ``field`` for these samples (one copy: views -> batch array)."""
        r = self.rows(sample_ids) if rows is None else rows
        views = self._views[field]
        out = np.empty((len(r), *self.shape[field]), np.float32)
        for j, i in enumerate(r):
            out[j] = views[i]
        return out
