"""Read the `concept_tokens` artifact (:mod:`pipeline.stages.encode_concepts`): frozen CLIP
encodings of the C3 concept vocabulary, gathered by concept id into padded batches, and the
concepts' full membership (which samples contain which concept) as a vectorised lookup.

The ``.npy`` arrays are memory-mapped (``np.load(mmap_mode="r")``): a batch reads only its rows.

Usage::

    ct = ConceptTokens("runs/demo/concept_tokens")
    rows = ct.rows(concept_ids)          # int64, -1 where a concept has no encoding (min_df)
    b = ct.gather(rows)                  # tokens f16 [B, M_b, d_t], mask bool [B, M_b], pooled f16 [B, P]
    m = ct.membership(sample_ids)        # Membership over these samples (contains(c, s) vectorised)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.errors import describe_exception
from pipeline.io.artifacts import Artifact, ArtifactMissing, CorruptArtifact


class ConceptTokensMissing(FileNotFoundError):
    pass


def open_artifact(path: str | Path) -> Artifact:
    try:
        return Artifact(path)
    except ArtifactMissing:
        raise ConceptTokensMissing(
            f"{path}: no concept encodings (no finished concept_tokens artifact): run `pipeline run encode-concepts "
            f"--manifest <manifest>` after mine-concepts") from None


class Membership:
    """``contains(concept_ids, sample_ids)`` for arrays of any (broadcast) shape, by binary search in
    one sorted int64 key array (concept_id << 32 | sample index): 8 bytes per (concept, sample)."""

    def __init__(self, concept_ids: np.ndarray, sample_ids: np.ndarray, all_sample_ids: np.ndarray):
        self.sids = np.unique(np.asarray(all_sample_ids, np.int64))
        pos = np.searchsorted(self.sids, sample_ids)
        ok = (pos < len(self.sids)) & (self.sids[np.minimum(pos, len(self.sids) - 1)] == sample_ids) if len(self.sids) else np.zeros(len(sample_ids), bool)
        self.keys = np.unique((np.asarray(concept_ids, np.int64)[ok] << 32) | pos[ok].astype(np.int64))

    def _sidx(self, sample_ids) -> tuple[np.ndarray, np.ndarray]:
        s = np.asarray(sample_ids, np.int64)
        pos = np.searchsorted(self.sids, s)
        ok = (pos < len(self.sids)) & (self.sids[np.minimum(pos, max(0, len(self.sids) - 1))] == s) if len(self.sids) else np.zeros(s.shape, bool)
        return pos, ok

    def contains(self, concept_ids, sample_ids) -> np.ndarray:
        c, s = np.broadcast_arrays(np.asarray(concept_ids, np.int64), np.asarray(sample_ids, np.int64))
        pos, ok = self._sidx(s)
        q = (c << 32) | pos.astype(np.int64)
        at = np.searchsorted(self.keys, q)
        hit = at < len(self.keys)
        hit[hit] = self.keys[at[hit]] == q[hit]
        return hit & ok

    def members_of(self, concept_id: int) -> np.ndarray:
        lo = np.searchsorted(self.keys, np.int64(concept_id) << 32)
        hi = np.searchsorted(self.keys, (np.int64(concept_id) + 1) << 32)
        return self.sids[(self.keys[lo:hi] & 0xFFFFFFFF).astype(np.int64)]


class ConceptTokens:
    """The encoded concepts of a `concept_tokens` artifact (see the module docstring)."""

    def __init__(self, path: str | Path | Artifact):
        self.art = path if isinstance(path, Artifact) else open_artifact(path)
        m = self.art.manifest
        self.pooled_only = bool(m.get("pooled_only", False))
        idx_files = self.art.files("index") if "index" in self.art.tables() else []
        units = [Path(f).stem.split("index-", 1)[1] for f in idx_files]
        parts = [pq.read_table(f, columns=["concept_id", "n_tokens"]) for f in idx_files]
        self.concept_ids = np.concatenate([p["concept_id"].to_numpy() for p in parts]) if parts else np.zeros(0, np.int64)
        self.n_tokens = np.concatenate([p["n_tokens"].to_numpy() for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        if len(self.concept_ids) == 0:
            raise ValueError(f"{self.art.dir}: the concept_tokens artifact encodes no concept (empty vocabulary): mine "
                             "concepts shared by two samples first, or lower stages.encode_concepts.min_df")
        self.order = np.argsort(self.concept_ids, kind="stable")
        self.sorted_ids = self.concept_ids[self.order]
        self.offsets = np.concatenate([[0], np.cumsum([p.num_rows for p in parts])]).astype(np.int64)
        self.pooled = self._arrays("pooled", units)
        self.tokens = None if self.pooled_only else self._arrays("tokens", units)
        self.P = int(self.pooled[0].shape[1])
        self.d_t = int(self.tokens[0].shape[2]) if self.tokens else int(m.get("dims", {}).get("text_dim", 0))
        self.M = int(self.n_tokens.max()) if not self.pooled_only else 0
        self.clip_record = m.get("models", {}).get("clip", {})
        self.max_tokens = int(m.get("parameters", {}).get("max_tokens", 16))

    def _arrays(self, table: str, units: list[str]) -> list[np.ndarray]:
        """The unit's ``<table>-<unit>.npy`` arrays, memory-mapped, in ``units`` order: through
        :meth:`Artifact.files`, so each is checked against the size and sha256 _manifest.json
        records before a byte of it is used; one that numpy cannot read is named too."""
        files = {Path(f).stem.split(f"{table}-", 1)[1]: Path(f) for f in self.art.files(table)} \
            if table in self.art.tables() else {}
        out = []
        for u in units:
            f = files.get(u)
            if f is None:
                raise CorruptArtifact(f"{self.art.local / table / f'{table}-{u}.npy'}: not recorded in _manifest.json "
                                      f"(unit {u} has an index but no {table}); run `pipeline verify --fix "
                                      f"{self.art.location}`, then `pipeline run encode-concepts`")
            try:
                out.append(np.load(f, mmap_mode="r"))
            except (OSError, ValueError) as e:
                raise CorruptArtifact(f"{f}: not a readable .npy array ({describe_exception(e, 160)}); "
                                      f"run `pipeline verify --fix {self.art.location}`, then `pipeline run encode-concepts`") from None
        return out

    def __len__(self) -> int:
        return len(self.concept_ids)

    def rows(self, concept_ids) -> np.ndarray:
        """Row of each concept id (into this artifact's arrays), -1 where it is not encoded."""
        c = np.asarray(concept_ids, np.int64)
        at = np.searchsorted(self.sorted_ids, c)
        atc = np.minimum(at, len(self.sorted_ids) - 1)
        ok = self.sorted_ids[atc] == c
        return np.where(ok, self.order[atc], -1)

    def _gather(self, arrays: list, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        unit = np.searchsorted(self.offsets, rows, side="right") - 1
        first = arrays[0]
        shape = (len(rows),) + ((width,) + first.shape[2:] if width is not None else first.shape[1:])
        out = np.zeros(shape, first.dtype)
        for u in np.unique(unit):
            sel = np.nonzero(unit == u)[0]
            local = rows[sel] - self.offsets[u]
            order = np.argsort(local, kind="stable")  # ascending reads from the map
            a = arrays[u]
            src = a[local[order]] if width is None else a[local[order], : min(width, a.shape[1])]
            if width is None:
                out[sel[order]] = src
            else:
                out[sel[order], : src.shape[1]] = src
        return out

    def gather(self, rows) -> dict[str, np.ndarray]:
        """``pooled`` float16 [B, P]; unless pooled_only, ``tokens`` float16 [B, M_b, d_t] and ``mask``
        bool [B, M_b] (M_b = the longest of these concepts)."""
        rows = np.asarray(rows, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError("concept row out of range (a concept without an encoding)")
        out = {"pooled": self._gather(self.pooled, rows)}
        if self.tokens is not None:
            n = self.n_tokens[rows]
            Mb = int(n.max()) if len(n) else 1
            out["tokens"] = self._gather(self.tokens, rows, Mb)
            out["mask"] = np.arange(Mb)[None, :] < n[:, None]
        return out

    def membership(self, all_sample_ids) -> Membership:
        if "membership" not in self.art.tables():
            raise ValueError(f"{self.art.dir}: no membership table (stages.encode_concepts.membership was off); the C3 "
                             "trainer needs it to reject false negatives")
        t = pq.read_table(self.art.files("membership")[0]) if len(self.art.files("membership")) == 1 else self.art.read("membership")
        return Membership(t["concept_id"].to_numpy(), t["sample_id"].to_numpy(), all_sample_ids)

    def bytes_per_concept(self) -> dict[str, float]:
        """On-disk bytes per encoded concept: tokens, pooled, index (measured from the files)."""
        out = {}
        for table in ("tokens", "pooled", "index", "membership"):
            if table in self.art.tables():
                out[table] = sum(Path(f).stat().st_size for f in self.art.files(table)) / len(self)
        return out
