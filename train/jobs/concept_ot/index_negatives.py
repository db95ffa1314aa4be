"""Dataset-level hard negatives from the `index` artifact, used to compose training batches.

ConceptOT's Algorithm 2 mines its K_h hard negatives inside a random mini-batch. With a
dataset-wide hard-negative index (`pipeline run build-index`, :mod:`pipeline.stages.build_index`),
a batch can instead be *composed* so that each sample meets some of its hardest negatives of the
whole dataset; the in-batch mining and the loss stay exactly as they are.

Pieces (usable by any job that reads WebDataset shards through :class:`pipeline.io.shards.ShardStream`):

:class:`SampleTable`
    sample_id -> (shard, position in the shard) for every sample of the shards, plus whether the
    sample may enter a training batch (``keep``: training split, has captions). Three numpy
    arrays sorted by sample_id and a flag: int64 + int32 + int32 + bool = 17 bytes per sample
    (1.7 MB per 100k samples), built by one walk over the shard headers.

:class:`IndexNeighbours`
    For every sample, its *index neighbours*: the union of (A) the owners (sample_id) of its
    first ``top`` hard-negative captions (``image_negatives``) and (B) its first ``top``
    hard-negative images (``caption_negatives`` of all its captions, merged by score, each image
    once), interleaved A0, B0, A1, B1, ..., without duplicates, without the sample itself and
    without samples the table does not keep (val/test splits: the index spans every split, and
    an evaluation sample must never enter a training batch). Stored as int32 table rows,
    [n, 2 * top], -1 padded: 8 * top bytes per sample (64 B at top = 8). The index lists are read
    one Parquet file at a time, only their first ``top`` entries.

:class:`IndexNeighbourStream`
    A :class:`ShardStream` whose batches are composed as: seeds from the same seeded, shuffled
    sample stream; after each of the first ``batch_size // (1 + m)`` seeds of a batch, ``m`` of
    its index neighbours drawn uniformly without replacement (``random.sample``, one rng per
    epoch) from those not already in the batch; any remaining slots (neighbours missing or
    already present) are filled by further seeds from the stream, which bring no neighbours. A
    stream sample already in the batch (it came as a neighbour) is not added twice. An epoch is
    one pass of the stream as seeds (a sample can also appear as someone's neighbour), the last
    incomplete batch is dropped, and the batch sequence is a pure function of (seed, epoch):
    ``set_position(epoch, start)`` yields exactly the batches >= start, in process or through
    DataLoader workers (every worker walks the same cheap id sequence and reads the arrays of
    only its own batches; a neighbour's arrays are read by random access, lazily or through the
    kept map, :func:`pipeline.loaders.clip_tokens.read_sample`). Batches get two extra keys:
    ``seed_mask`` bool [B] (the seeds that brought neighbours) and ``index_neighbours`` int64
    [B, 2 * top] (each row's neighbour sample ids, -1 padded; also attachable in plain batch
    mode with :meth:`IndexNeighbours.attach`).

:func:`index_hits`
    Per anchor row, how many of its mined in-batch negatives are its index neighbours.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import ShardStream, epoch_rng

NEIGHBOUR_SALT = -1  # rng salt of the neighbour draws (ShardStream's per-batch salts are >= 1)


class IndexMissing(FileNotFoundError):
    pass


def require_index(index_dir: str | Path, hint: str = "") -> Path:
    """``index_dir`` if it holds a finished `index` artifact, else :class:`IndexMissing` saying how
    to build it (``hint``: what else the caller can do)."""
    from pipeline.io import storage

    index_dir = storage.location(index_dir)
    there = (storage.Remote(index_dir).size("_manifest.json") is not None if storage.is_remote(index_dir)
             else (index_dir / "_manifest.json").is_file())
    if not there:
        raise IndexMissing(
            f"the index artifact {index_dir} does not exist (no _manifest.json): run "
            f"`pipeline run build-index --manifest <manifest>` (or enable stages.build_index and run "
            f"`pipeline run all`) first{hint}")
    return index_dir


class SampleTable:
    """sample_id -> (shard, position) and a keep flag, for every sample of ``shards``."""

    def __init__(self, shards: Sequence[Any], read_shard: Callable[[Any], Iterator[dict]],
                 keep: Callable[[dict], bool] | None = None):
        ids, sh, pos, ok = [], [], [], []
        for k, path in enumerate(shards):
            for p, s in enumerate(read_shard(path)):
                ids.append(int(s["sample_id"]))
                sh.append(k)
                pos.append(p)
                ok.append(True if keep is None else bool(keep(s)))
        ids_a = np.asarray(ids, np.int64)
        order = np.argsort(ids_a, kind="stable")
        self.ids = ids_a[order]
        if self.ids.size > 1 and (np.diff(self.ids) == 0).any():
            dup = int(self.ids[1:][np.diff(self.ids) == 0][0])
            raise ValueError(f"sample_id {dup} occurs more than once in the shards")
        self.shard = np.asarray(sh, np.int32)[order]
        self.pos = np.asarray(pos, np.int32)[order]
        self.ok = np.asarray(ok, bool)[order]

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.shard.nbytes + self.pos.nbytes + self.ok.nbytes

    def rows(self, sample_ids) -> np.ndarray:
        """Table rows of ``sample_ids`` (int64), -1 where an id is not in the shards."""
        q = np.asarray(sample_ids, np.int64)
        if self.ids.size == 0:
            return np.full(q.shape, -1, np.int64)
        i = np.searchsorted(self.ids, q)
        ic = np.minimum(i, self.ids.size - 1)
        return np.where((i < self.ids.size) & (self.ids[ic] == q), ic, -1)


def _sliced(table, column: str, top: int) -> np.ndarray:
    """[rows, top] int/float array of the first ``top`` entries of a list column (-1 / nan pad)."""
    col = table.column(column).combine_chunks()
    flat = pc.list_slice(col, 0, top, return_fixed_size_list=True).flatten()
    if column == "scores":
        arr = np.asarray(flat.fill_null(float("nan")), np.float32)
    else:
        arr = np.asarray(flat.fill_null(-1), np.int64)
    return arr.reshape(len(table), top)


class IndexNeighbours:
    """Each sample's index neighbours (see the module docstring), as rows of ``table``."""

    def __init__(self, index_dir: str | Path, table: SampleTable, top: int = 8, *, max_missing: float = 0.5,
                 log: Callable[[str], None] | None = None):
        log = log or (lambda msg: print(msg, file=sys.stderr))
        index_dir = require_index(index_dir)
        art = Artifact(index_dir)
        for t in ("image_negatives", "caption_negatives"):
            if t not in art.tables():
                raise ValueError(f"{index_dir}: not a build-index artifact (no {t} table; it has {art.tables()})")
        self.table, self.top = table, int(top)
        n, T = len(table), self.top
        # (B) hard images per caption -> per owner, merged by score
        cap_ids, cap_owner, own, img, sco = [], [], [], [], []
        for f in art.files("caption_negatives"):
            t = pq.read_table(f, columns=["caption_id", "sample_id", "image_ids", "scores"])
            cid = np.asarray(t.column("caption_id"), np.int64)
            sid = np.asarray(t.column("sample_id"), np.int64)
            cap_ids.append(cid)
            cap_owner.append(sid)
            own.append(np.repeat(table.rows(sid), T))
            img.append(table.rows(_sliced(t, "image_ids", T)).reshape(-1))
            sco.append(_sliced(t, "scores", T).reshape(-1))
        cap_ids_a = np.concatenate(cap_ids) if cap_ids else np.zeros(0, np.int64)
        cap_owner_a = np.concatenate(cap_owner) if cap_owner else np.zeros(0, np.int64)
        o = np.concatenate(own) if own else np.zeros(0, np.int64)
        im = np.concatenate(img) if img else np.zeros(0, np.int64)
        sc = np.concatenate(sco) if sco else np.zeros(0, np.float32)
        valid = (o >= 0) & (im >= 0)
        o, im, sc = o[valid], im[valid], np.nan_to_num(sc[valid], nan=-np.inf)
        B = np.full((n, T), -1, np.int64)
        if o.size:
            order = np.lexsort((-sc, im, o))  # by owner, image, best score first
            o, im, sc = o[order], im[order], sc[order]
            first = np.ones(o.size, bool)
            first[1:] = (o[1:] != o[:-1]) | (im[1:] != im[:-1])
            o, im, sc = o[first], im[first], sc[first]
            order = np.lexsort((-sc, o))  # by owner, best score first
            o, im = o[order], im[order]
            starts = np.flatnonzero(np.r_[True, o[1:] != o[:-1]])
            rank = np.arange(o.size) - np.repeat(starts, np.diff(np.r_[starts, o.size]))
            keep = rank < T
            B[o[keep], rank[keep]] = im[keep]
        # (A) owners of the hard captions per image
        corder = np.argsort(cap_ids_a, kind="stable")
        cap_sorted, owner_sorted = cap_ids_a[corder], cap_owner_a[corder]
        A = np.full((n, T), -1, np.int64)
        n_index, n_missing = 0, 0
        for f in art.files("image_negatives"):
            t = pq.read_table(f, columns=["sample_id", "caption_ids"])
            sid = np.asarray(t.column("sample_id"), np.int64)
            rows = table.rows(sid)
            n_index += sid.size
            n_missing += int((rows < 0).sum())
            caps = _sliced(t, "caption_ids", T)
            if cap_sorted.size:
                i = np.minimum(np.searchsorted(cap_sorted, caps), cap_sorted.size - 1)
                owners = np.where((caps >= 0) & (cap_sorted[i] == caps), owner_sorted[i], -1)
            else:
                owners = np.full(caps.shape, -1, np.int64)
            nb = table.rows(owners)
            nb[owners < 0] = -1
            A[rows[rows >= 0]] = nb[rows >= 0]
        self.index_images, self.skipped_ids = n_index, n_missing
        if n_index == 0 or n_missing > max_missing * n_index:
            raise ValueError(
                f"{index_dir} was built for a different clip_tokens artifact: {n_missing} of its {n_index} image "
                f"ids are not in the training shards; rebuild it (`pipeline run build-index --force`)")
        if n_missing:
            log(f"index neighbours: {n_missing} of {n_index} image ids of {index_dir} are not in the clip_tokens "
                f"shards (skipped)")
        # interleave A0, B0, A1, B1, ...; drop -1, self, samples the table does not keep, duplicates
        x = np.stack([A, B], axis=2).reshape(n, 2 * T)
        good = x >= 0
        good &= x != np.arange(n)[:, None]
        good &= table.ok[np.where(good, x, 0)]
        for j in range(1, 2 * T):
            good[:, j] &= ~((x[:, :j] == x[:, j:j + 1]) & good[:, :j]).any(1)
        x = np.where(good, x, -1)
        order = np.argsort(~good, axis=1, kind="stable")
        self.rows = np.take_along_axis(x, order, axis=1).astype(np.int32)
        self.count = good.sum(1).astype(np.int32)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.count.nbytes

    def of_row(self, r: int) -> np.ndarray:
        return self.rows[r, : self.count[r]]

    def of_id(self, sample_id: int) -> np.ndarray:
        """Table rows of the neighbours of ``sample_id`` (empty when unknown)."""
        r = int(self.table.rows([sample_id])[0])
        return self.rows[r, : self.count[r]] if r >= 0 else self.rows[0, :0]

    def neighbour_ids(self, sample_ids) -> torch.Tensor:
        """int64 [B, 2 * top]: each sample's neighbour sample ids, -1 padded."""
        r = self.table.rows(np.asarray(sample_ids, np.int64).reshape(-1))
        x = np.full((r.size, self.rows.shape[1]), -1, np.int64)
        known = r >= 0
        nb = self.rows[r[known]].astype(np.int64)
        x[known] = np.where(nb >= 0, self.table.ids[np.maximum(nb, 0)], -1)
        return torch.from_numpy(x)

    def attach(self, batch: dict) -> dict:
        """Add ``index_neighbours`` to a collated batch that has ``sample_id``."""
        batch["index_neighbours"] = self.neighbour_ids(batch["sample_id"].numpy())
        return batch


def index_hits(sample_id: torch.Tensor, neg: torch.Tensor, valid: torch.Tensor,
               neighbours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor row: (hits, mined) — how many of its mined negatives ``neg`` [B, K] (batch rows,
    ``valid`` [B, K]) are index neighbours of it (``neighbours`` [B, L] sample ids, -1 pad), and
    how many were mined. One [B, K, L] comparison: cheap."""
    sid = sample_id.to(neg.device)[neg]  # [B, K] sample ids of the mined rows
    nb = neighbours.to(neg.device)
    hit = ((sid[..., None] == nb[:, None, :]) & (nb[:, None, :] >= 0)).any(-1) & valid
    return hit.sum(1), valid.sum(1)


class IndexNeighbourStream(ShardStream):
    """Batches of seeds + their index neighbours (see the module docstring)."""

    def __init__(self, shards: Sequence[Any], read_shard: Callable[[Any], Iterator[dict]],
                 collate: Callable[[list[dict], random.Random], Any], batch_size: int, *,
                 neighbours: IndexNeighbours, m: int = 1, read_sample: Callable[[Any, int], dict], **kw):
        kw["drop_last"] = True
        super().__init__(shards, read_shard, collate, batch_size, **kw)
        if m < 1:
            raise ValueError("m (index neighbours per seed) must be >= 1")
        self.nb, self.m, self.read_sample = neighbours, int(m), read_sample
        self.n_seeds = max(1, self.batch_size // (1 + self.m))

    def _batches(self) -> Iterator[tuple[int, tuple[list, list[bool]]]]:
        """(batch index, (entries, seed flags)): an entry is a stream sample (dict) or a table row
        (int) of a neighbour, read only when the batch is collated (:meth:`_load`)."""
        pick = epoch_rng(self.seed, self.epoch, salt=NEIGHBOUR_SALT)
        stream = self._stream()
        ids, B = self.nb.table.ids, self.batch_size
        entries: list = []
        flags: list[bool] = []
        present: set[int] = set()
        seeds, b = 0, 0
        for s in stream:
            sid = int(s["sample_id"])
            if sid in present:  # already here as a neighbour
                continue
            entries.append(s)
            present.add(sid)
            flags.append(seeds < self.n_seeds)
            if seeds < self.n_seeds:
                seeds += 1
                cands = [int(r) for r in self.nb.of_id(sid) if int(ids[r]) not in present]
                k = min(self.m, len(cands), B - len(entries))
                for r in pick.sample(cands, k) if k > 0 else ():
                    entries.append(r)
                    present.add(int(ids[r]))
                    flags.append(False)
            if len(entries) == B:
                yield b, (entries, flags)
                b += 1
                entries, flags, present, seeds = [], [], set(), 0

    def _materialize(self, e) -> dict:
        if isinstance(e, dict):
            return e
        t = self.nb.table
        return self.read_sample(self.shards[int(t.shard[e])], int(t.pos[e]))

    def _load(self, payload) -> list[dict]:
        return [self._materialize(e) for e in payload[0]]

    def _finish(self, batch, payload):
        if isinstance(batch, dict):
            batch["seed_mask"] = torch.tensor(payload[1], dtype=torch.bool)
            self.nb.attach(batch)
        return batch

    def count_batches(self) -> int:
        """Batches per epoch (composes the epoch's id sequence once; no array is read)."""
        return sum(1 for _ in self._batches())

    def batch_ids(self) -> list[list[int]]:
        """The epoch's batches (from ``start``) as sample ids (what a test or a report needs)."""
        t = self.nb.table
        return [[int(e["sample_id"]) if isinstance(e, dict) else int(t.ids[e]) for e in entries]
                for b, (entries, _) in self._batches() if b >= self.start]
