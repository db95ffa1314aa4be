"""Streaming, deterministic, resumable batches over artifact shards.

:class:`ShardStream` turns a list of shards into batches:

* shard order is shuffled per epoch and samples pass through a seeded shuffle buffer of
  ``shuffle_buffer`` samples, so memory is bounded by the buffer (plus one shard's headers), not
  by the dataset; the sequence of batches is a pure function of (seed, epoch);
* ``start`` skips the first batches of an epoch without collating them (resume at the exact data
  position: with lazy shard readers such as :func:`pipeline.loaders.clip_tokens.read_shard`, a
  skipped sample costs a header parse, no array read);
* with ``num_workers`` DataLoader workers, every worker walks the same cheap sample stream and
  collates (reads the large arrays of) only the batches ``start + w, start + w + n, ...``, so the
  DataLoader's round-robin yields exactly the single-process batch sequence, for any number of
  workers;
* ``joins`` attach columns of other artifacts by ``sample_id`` (:class:`ParquetJoin`; tables with
  several rows per sample, e.g. phrases, words, instances: :class:`ParquetMultiJoin`), reading
  only the Parquet files whose sample_id range covers the batch (bounded memory).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from pipeline.io.artifacts import Artifact
from pipeline.loaders import buffer_shuffle


def epoch_rng(seed: int, epoch: int, salt: int = 0) -> random.Random:
    return random.Random((int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(salt))


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
        import numpy as np

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
        import numpy as np

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


class ShardStream(torch.utils.data.IterableDataset):
    """Deterministic batches over shards (see the module docstring).

    ``read_shard(shard) -> Iterator[dict]`` yields cheap per-sample dicts with ``sample_id``;
    ``collate(samples, rng) -> batch`` builds the batch (``rng`` is seeded by (seed, epoch, batch
    index), e.g. for picking one of several captions). ``keep(sample) -> bool`` filters (a split).
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read_shard: Callable[[Any], Iterator[dict]],
        collate: Callable[[list[dict], random.Random], Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        shuffle_buffer: int = 512,
        seed: int = 0,
        drop_last: bool = True,
        keep: Callable[[dict], bool] | None = None,
        joins: Sequence[Callable[[dict], dict]] = (),
    ):
        super().__init__()
        self.shards = list(shards)
        self.read_shard, self.collate = read_shard, collate
        self.batch_size, self.shuffle, self.shuffle_buffer = int(batch_size), shuffle, int(shuffle_buffer)
        self.seed, self.drop_last, self.keep, self.joins = seed, drop_last, keep, list(joins)
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, start: int = 0) -> "ShardStream":
        self.epoch, self.start = int(epoch), int(start)
        return self

    def _samples(self, rng: random.Random) -> Iterator[dict]:
        shards = list(self.shards)
        if self.shuffle:
            rng.shuffle(shards)
        for sh in shards:
            for s in self.read_shard(sh):
                if self.keep is None or self.keep(s):
                    yield s

    def _stream(self) -> Iterator[dict]:
        """The epoch's (filtered, shuffled) sample stream."""
        rng = epoch_rng(self.seed, self.epoch)
        stream = self._samples(rng)
        if self.shuffle:
            stream = buffer_shuffle(stream, self.shuffle_buffer, rng)
        return stream

    def _batches(self) -> Iterator[tuple[int, Any]]:
        """(batch index, payload) for the epoch; the payload is turned into samples by :meth:`_load`
        only for the batches this worker collates (subclasses compose batches differently)."""
        stream = self._stream()
        buf: list[dict] = []
        b = 0
        for s in stream:
            buf.append(s)
            if len(buf) == self.batch_size:
                yield b, buf
                b += 1
                buf = []
        if buf and not self.drop_last:
            yield b, buf

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for b, payload in self._batches():
            if b < self.start or (b - self.start) % nw != wid:
                continue
            samples = self._load(payload)
            for j in self.joins:
                samples = [j(s) for s in samples]
            yield self._finish(self.collate(samples, epoch_rng(self.seed, self.epoch, salt=b + 1)), payload)

    def _load(self, payload) -> list[dict]:
        return payload

    def _finish(self, batch, payload):
        return batch

    def count_batches(self) -> int:
        """Batches per epoch (walks the cheap sample stream once)."""
        n = sum(1 for sh in self.shards for s in self.read_shard(sh) if self.keep is None or self.keep(s))
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def loader(stream: ShardStream, num_workers: int = 0) -> Iterable[Any]:
    """Iterate ``stream`` in-process or through a DataLoader with ``num_workers`` workers (same
    batch sequence either way)."""
    if num_workers <= 0:
        return iter(stream)
    return iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers, in_order=True,
                                            persistent_workers=False))


# --------------------------------------------------------------------------- shard-to-shard join
class ShardIndex:
    """``sample_id -> (shard, position)`` over the WebDataset shards of an artifact, and random
    access to one sample (:func:`pipeline.loaders.clip_tokens.read_sample`, which reads any shard
    ShardWriter wrote: ``clip_tokens``, ``visual_tokens``...).

    Built once from the shards' tar headers (no array is read); about 100 bytes per sample.
    ``lazy=None``: kept memory maps when the shards fit in memory, else one ``pread`` per member
    (see :func:`pipeline.loaders.clip_tokens.fits_in_memory`). A sample_id present in two shards
    is an error (the artifact is inconsistent)."""

    def __init__(self, shards: Sequence[str | Path], lazy: bool | None = None, name: str = ""):
        import numpy as np

        from pipeline.loaders.clip_tokens import fits_in_memory, read_shard

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
            from pipeline.loaders.clip_tokens import _parsed

            parsed = self._parsed[shard] = _parsed(self.shards[shard])
        return parsed

    def read(self, sample_id: int, fields: Iterable[str] | None = None) -> dict:
        """The sample's fields (names without ``.npy``/``.json``; ``None``: all) as
        :func:`pipeline.loaders.clip_tokens.read_shard` yields them; KeyError when absent."""
        from pipeline.loaders.clip_tokens import read_sample

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
