"""Joins: attach other artifacts' data to a stream's samples by ``sample_id``.

A :class:`pipeline.io.shards.ShardStream` walks one artifact's shards; its ``joins`` add what other
artifacts hold for the same sample, reading only what the batch needs (bounded memory, and a pure
function of the sample_id, so the stream stays deterministic and exactly resumable):

* :class:`ParquetJoin`: columns of a Parquet table (one row per sample); tables with several rows
  per sample (phrases, words, instances): :class:`ParquetMultiJoin`;
* :class:`ShardJoin`: the fields of another *shard* artifact's sample, by random access through
  :class:`ShardIndex`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import fits_in_memory, parsed_samples, read_sample, read_shard


class ParquetJoin:
    """Columns of a Parquet table of another artifact, looked up by sample_id.

    The files' sample_id ranges come from the Parquet statistics; lookups load only the covering
    files (``cache_files`` most recently used ones are kept)."""

    def __init__(self, artifact: str | Path | Artifact, table: str, columns: Sequence[str], key: str = "sample_id",
                 cache_files: int = 2, prefix: str = ""):
        art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
        self.files = [str(f) for f in art.files(table)]
        self.columns, self.key, self.prefix = list(columns), key, prefix
        self.ranges = []
        for f in self.files:
            md = pq.ParquetFile(f).metadata
            lo, hi = None, None
            idx = md.schema.to_arrow_schema().get_field_index(key)
            for rg in range(md.num_row_groups):
                st = md.row_group(rg).column(idx).statistics
                if st is None or not st.has_min_max:
                    lo, hi = float("-inf"), float("inf")
                    break
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
            self.ranges.append((lo, hi))
        self.cache: OrderedDict[str, dict] = OrderedDict()
        self.cache_files = cache_files

    def _load(self, f: str) -> dict:
        if f in self.cache:
            self.cache.move_to_end(f)
            return self.cache[f]
        t = pq.read_table(f, columns=[self.key, *self.columns]).to_pydict()
        rows = {k: {c: t[c][i] for c in self.columns} for i, k in enumerate(t[self.key])}
        self.cache[f] = rows
        while len(self.cache) > self.cache_files:
            self.cache.popitem(last=False)
        return rows

    def lookup(self, sample_id: int) -> dict | None:
        for f, (lo, hi) in zip(self.files, self.ranges):
            if lo is not None and lo <= sample_id <= hi:
                row = self._load(f).get(sample_id)
                if row is not None:
                    return {self.prefix + k: v for k, v in row.items()}
        return None

    def __call__(self, sample: dict) -> dict:
        row = self.lookup(int(sample["sample_id"]))
        if row is not None:
            sample.update(row)
        return sample


class ParquetMultiJoin(ParquetJoin):
    """All rows of a Parquet table with a given sample_id (tables with several rows per key:
    ``phrases``, ``words``, ``instances``), as ``{column: list of values}`` in file order.

    Same file selection and cache as :class:`ParquetJoin`; a file is grouped by key once when
    loaded (one stable argsort), so a lookup is a binary search plus one slice per column. A
    sample_id without rows gives empty lists (``lookup`` -> None, ``__call__`` -> empty lists), so a
    caller can count the samples that have none."""

    def _load(self, f: str) -> dict:
        if f in self.cache:
            self.cache.move_to_end(f)
            return self.cache[f]
        t = pq.read_table(f, columns=[self.key, *self.columns])
        keys = t.column(self.key).to_numpy(zero_copy_only=False)
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        uniq, starts = np.unique(sk, return_index=True)
        ends = np.append(starts[1:], len(sk)).astype(np.int64)
        cols = {}
        for c in self.columns:
            vals = t.column(c).to_pylist()
            cols[c] = [vals[i] for i in order]
        entry = {"keys": uniq, "starts": starts, "ends": ends, "cols": cols}
        self.cache[f] = entry
        while len(self.cache) > self.cache_files:
            self.cache.popitem(last=False)
        return entry

    def lookup(self, sample_id: int) -> dict | None:
        out: dict | None = None
        for f, (lo, hi) in zip(self.files, self.ranges):
            if lo is not None and lo <= sample_id <= hi:
                e = self._load(f)
                k = int(np.searchsorted(e["keys"], sample_id))
                if k < len(e["keys"]) and e["keys"][k] == sample_id:
                    a, b = int(e["starts"][k]), int(e["ends"][k])
                    if out is None:
                        out = {self.prefix + c: [] for c in self.columns}
                    for c in self.columns:  # a key may span files: rows of every covering file, in file order
                        out[self.prefix + c].extend(e["cols"][c][a:b])
        return out

    def __call__(self, sample: dict) -> dict:
        row = self.lookup(int(sample["sample_id"]))
        sample.update(row if row is not None else {self.prefix + c: [] for c in self.columns})
        return sample


class ShardIndex:
    """``sample_id -> (shard, position)`` over the WebDataset shards of an artifact, and random
    access to one sample (:func:`pipeline.io.shards.read_sample`, which reads any shard
    ShardWriter wrote: ``clip_tokens``, ``visual_tokens``...).

    Built once from the shards' tar headers (no array is read); about 100 bytes per sample.
    ``lazy=None``: kept memory maps when the shards fit in memory, else one ``pread`` per member
    (see :func:`pipeline.io.shards.fits_in_memory`). A sample_id present in two shards
    is an error (the artifact is inconsistent)."""

    def __init__(self, shards: Sequence[str | Path], lazy: bool | None = None, name: str = ""):
        self.shards = [str(s) for s in shards]
        self.name = name or (str(Path(self.shards[0]).parent) if self.shards else "(no shards)")
        self.lazy = (not fits_in_memory(self.shards)) if lazy is None else bool(lazy)
        ids, where, pos = [], [], []
        for k, p in enumerate(self.shards):
            for j, s in enumerate(read_shard(p, fields=(), lazy=True)):  # headers only
                ids.append(int(s["sample_id"]))
                where.append(k)
                pos.append(j)
        ids_a = np.asarray(ids, np.int64)
        order = np.argsort(ids_a, kind="stable")
        self.ids, self.shard_of, self.pos = ids_a[order], np.asarray(where, np.int64)[order], np.asarray(pos, np.int64)[order]
        dup = np.flatnonzero(self.ids[1:] == self.ids[:-1])
        if len(dup):
            raise ValueError(f"{self.name}: sample_id {int(self.ids[dup[0]])} is in two shards")
        self._parsed: dict[int, list] = {}
        self._items: dict[tuple, list[dict]] = {}
        # sample_id -> (shard, position): a dict lookup per sample (a numpy searchsorted per scalar
        # cost ~10x more); ~100 bytes per sample
        self._where = dict(zip(self.ids.tolist(), zip(self.shard_of.tolist(), self.pos.tolist())))

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, sample_id) -> bool:
        return int(sample_id) in self._where

    def _find(self, sample_id: int) -> tuple[int, int] | None:
        return self._where.get(int(sample_id))

    def _locate(self, sample_id: int) -> tuple[int, int]:
        """(shard, position) of a sample; KeyError naming it when absent."""
        hit = self._find(int(sample_id))
        if hit is None:
            raise KeyError(f"sample {int(sample_id)} is not in {self.name}")
        return hit

    def _shard_samples(self, shard: int) -> list[dict]:
        """Kept maps: a shard's parsed samples (views), parsed once and held here."""
        parsed = self._parsed.get(shard)
        if parsed is None:
            parsed = self._parsed[shard] = parsed_samples(self.shards[shard])
        return parsed

    def read(self, sample_id: int, fields: Iterable[str] | None = None) -> dict:
        """The sample's fields (names without ``.npy``/``.json``; ``None``: all) as
        :func:`pipeline.io.shards.read_shard` yields them; KeyError when absent."""
        shard, pos = self._locate(sample_id)
        if self.lazy:
            return read_sample(self.shards[shard], pos, fields=fields, lazy=True)
        sample = self._shard_samples(shard)[pos]
        if fields is None:
            return dict(sample)
        out = {"sample_id": sample["sample_id"]}
        for f in fields:
            if f in sample:
                out[f] = sample[f]
        return out

    def items(self, sample_id: int, fields: tuple[str, ...] | None, prefix: str = "") -> dict:
        """Kept maps only: ``{prefix + field: view}`` of the sample (no ``__key__``/``sample_id``),
        built once per (shard, fields, prefix) and shared: callers merge it, never mutate it.
        The join's per-sample work is then one dict lookup and one ``dict.update`` (it was a
        field-by-field copy per sample, ~20% of the mapped data path)."""
        shard, pos = self._locate(sample_id)
        key = (shard, fields, prefix)
        table = self._items.get(key)
        if table is None:
            table = self._items[key] = [
                {prefix + k: v for k, v in s.items() if k not in ("__key__", "sample_id") and (fields is None or k in fields)}
                for s in self._shard_samples(shard)]
        return table[pos]


class ShardJoin:
    """Attach the fields of another *shard* artifact's sample with the same ``sample_id`` (e.g.
    ``visual_tokens`` samples + their ``clip_tokens``: both artifacts are WebDataset shards, with
    different shard sizes and orders). A ``ShardStream`` join: it is a pure function of the
    sample_id, so the stream stays deterministic and resumable (exact) and the DataLoader workers
    only read the samples of the batches they collate (random access through :class:`ShardIndex`;
    memory: the index plus the batch).

    Samples missing from the other artifact cannot be joined: filter them before batching with
    :meth:`keep` (``ShardStream(keep=...)``), which counts them in ``missing`` (the first pass,
    e.g. ``count_batches``, sees them all); joining one raises a KeyError naming it.
    ``fields``: the other artifact's fields to attach (``None``: all); ``prefix`` renames them."""

    def __init__(self, shards: Sequence[str | Path], fields: Iterable[str] | None, prefix: str = "",
                 lazy: bool | None = None, name: str = ""):
        self.index = ShardIndex(shards, lazy=lazy, name=name)
        self.fields = None if fields is None else tuple(fields)
        self.prefix = prefix
        self.missing: set[int] = set()

    def keep(self, sample: dict) -> bool:
        sid = int(sample["sample_id"])
        if sid in self.index:
            return True
        self.missing.add(sid)
        return False

    def __call__(self, sample: dict) -> dict:
        sid = int(sample["sample_id"])
        if not self.index.lazy:  # kept maps: the sample's (prefixed) fields, prepared once per shard
            sample.update(self.index.items(sid, self.fields, self.prefix))
            return sample
        other = self.index.read(sid, self.fields)
        for k, v in other.items():
            if k not in ("__key__", "sample_id"):
                sample[self.prefix + k] = v
        return sample
