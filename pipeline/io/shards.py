"""Shard I/O: read the WebDataset shards :class:`pipeline.io.wds.ShardWriter` writes, fast, and
stream them as deterministic batches. Every loader in :mod:`pipeline.loaders` stands on this.

Reading (one copy per byte):

* the tar index: member offsets come from the 512-byte USTAR headers, parsed directly (listing a
  1000-sample shard's 8000 members this way took 0.16-0.25 s against 2.1-4.0 s with
  :mod:`tarfile` on the shared test VM, 9-25x); archives with pax/GNU headers go through tarfile;
* ``.npy`` members: headers parsed by ``numpy.lib.format`` (cached, they repeat across samples);
  arrays are read-only views of a kept memory map (:func:`shard_map`), or, with ``lazy=True``,
  the large ones are :class:`FileArray` handles that :func:`copy_into` ``pread``s straight into a
  padded batch (artifacts larger than RAM); :func:`fits_in_memory` picks between the two;
* :func:`read_shard` yields ``{"__key__", "sample_id", field: array}`` per sample,
  :func:`read_sample` one sample by position (random access); a field stored int8 with a
  ``<field>_scale`` companion comes back float16 under its own name (:mod:`pipeline.io.quant`).

Streaming: :class:`ShardStream` turns shards into batches that are a pure function of (seed,
epoch): shard order shuffled per epoch, a seeded :func:`buffer_shuffle` of bounded memory, exact
resume at a batch index, the same batch sequence for any number of DataLoader workers, and
``rank``/``world_size`` for data-parallel training (each rank collates its own disjoint share of
the epoch's batches). :func:`loader` iterates it in-process or through a DataLoader.
"""

from __future__ import annotations

import functools
import io
import json
import mmap
import os
import random
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npformat

from pipeline.io.quant import dequantize_sample, with_scales


@functools.lru_cache(maxsize=4096)
def _npy_header_of(raw: bytes) -> tuple[np.dtype, tuple[int, ...], int, bool, int]:
    """(dtype, shape, element count, fortran order, header length) of a .npy header, parsed by
    ``numpy.lib.format`` (magic, version, header dict). Cached: headers repeat across samples."""
    f = io.BytesIO(raw)
    version = npformat.read_magic(f)
    read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return dtype, shape, int(np.prod(shape)) if shape else 1, bool(fortran), f.tell()


def npy_header(buf, start: int, size: int) -> tuple[np.dtype, tuple[int, ...], int, bool, int]:
    """Header of the .npy stored at ``buf[start:start+size]``; the last item is the data's offset
    from ``start``. numpy pads headers to a multiple of 64 bytes, so the header bytes (the cache
    key) are found by trying 128 bytes (the usual length), then 64-byte steps."""
    n = min(128, size)
    while True:
        try:
            h = _npy_header_of(bytes(buf[start : start + n]))
        except ValueError:  # header longer than n bytes
            if n >= size:
                raise
            n = min(n + 64, size)
            continue
        if h[4] < n:  # a shorter header: key on its exact bytes
            h = _npy_header_of(bytes(buf[start : start + h[4]]))
        return h


def npy_view(buf, start: int, size: int) -> np.ndarray:
    """View of a .npy file stored at ``buf[start:start+size]`` (format 1.0/2.0/3.0 header)."""
    dtype, shape, count, fortran, hlen = npy_header(buf, start, size)
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start + hlen)
    if fortran:
        return arr.reshape(shape[::-1]).T
    return arr.reshape(shape)


_REGULAR, _DIR = (b"0", b"\0"), b"5"


def _ustar(hdr) -> tuple[bytes, str, int]:
    """(typeflag, name with prefix, data size) of a 512-byte USTAR header; the name and size are
    parsed only for regular files and directories (what ShardWriter writes: other typeflags mean
    pax/GNU extension headers, which the callers hand to a generic reader)."""
    typeflag = bytes(hdr[156:157])
    if typeflag not in _REGULAR and typeflag != _DIR:
        return typeflag, "", 0
    name = bytes(hdr[0:100]).split(b"\0", 1)[0].decode()
    if hdr[257:262] == b"ustar" and hdr[345] != 0:
        name = bytes(hdr[345:500]).split(b"\0", 1)[0].decode() + "/" + name
    size = int(bytes(hdr[124:136]).split(b"\0", 1)[0].strip() or b"0", 8)
    return typeflag, name, size


def tar_members(mm, fh) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of the regular files of a tar held in ``mm``.

    Parses the 512-byte USTAR headers directly (what :class:`pipeline.io.wds.ShardWriter` writes),
    ~50x faster than :mod:`tarfile`; archives with pax/GNU extension headers fall back to tarfile."""
    out = []
    pos, end = 0, len(mm)
    while pos + 512 <= end:
        hdr = mm[pos : pos + 512]
        if hdr[0] == 0:  # end-of-archive marker
            break
        typeflag, name, size = _ustar(hdr)
        if typeflag not in _REGULAR and typeflag != _DIR:
            fh.seek(0)
            with tarfile.open(fileobj=fh, mode="r:") as tar:
                return [(m.name, m.offset_data, m.size) for m in tar.getmembers() if m.isfile()]
        if typeflag != _DIR:
            out.append((name, pos + 512, size))
        pos += 512 + (size + 511) // 512 * 512
    return out


class ShardFile:
    """An open shard file descriptor shared by the lazy arrays of its samples."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):
            pass


class FileArray:
    """A C-ordered array stored in a shard, not yet read: ``read()`` it, or let :func:`copy_into`
    ``pread`` its rows directly into the padded batch (one copy from the page cache, no page
    faults on a memory map, no intermediate array)."""

    __slots__ = ("file", "offset", "dtype", "shape")

    def __init__(self, file: ShardFile, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.file, self.offset, self.dtype, self.shape = file, offset, dtype, shape

    def read_into(self, out: np.ndarray, index: int | None = None, rows: int | None = None) -> None:
        """Fill ``out`` with the whole array, or with ``self[index, :rows]`` (C order)."""
        if index is None:
            offset = self.offset
        else:
            offset = self.offset + index * int(np.prod(self.shape[1:])) * self.dtype.itemsize
        want = out.nbytes
        if rows is not None:
            assert out.shape[0] == rows
        got = os.preadv(self.file.fd, [memoryview(out).cast("B")], offset) if want else 0
        if got != want:
            raise OSError(f"{self.file.path}: short read at {offset} ({got} of {want} bytes)")

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.read_into(out)
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)


def materialize(a) -> np.ndarray:
    """``a`` as an array: a :class:`FileArray` is read, anything else returned as it is."""
    return a.read() if isinstance(a, FileArray) else a


_MAPS: dict[str, tuple] = {}  # path -> ((size, mtime), map, members[, parsed samples])


def shard_map(path: str | Path) -> tuple[mmap.mmap, list[tuple[str, int, int]]]:
    """A read-only map of a shard and its member table, kept open for later epochs.

    The first touch of each page of a fresh mapping costs a page fault, and on this class of VM
    that makes a first read of a shard 2-3x slower than copying the same bytes from memory; a
    page that stays mapped is copied at memory speed. So the maps outlive one pass: when the
    artifact fits in RAM, every epoch after the first reads at memory speed. A rewritten shard
    (other size or mtime) is mapped afresh; :func:`close_mappings` drops them all.
    """
    path = str(path)
    st = os.stat(path)
    key = (st.st_size, st.st_mtime_ns)
    hit = _MAPS.get(path)
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        members = tar_members(mm, fh)
    _MAPS[path] = (key, mm, members)
    return mm, members


def fits_in_memory(paths: Iterable[str | Path], fraction: float = 0.5) -> bool:
    """Whether shards this large can stay in the page cache (at most ``fraction`` of available RAM).

    Kept maps pay off only then; an artifact larger than that would be evicted and re-faulted
    every epoch, where a plain ``pread`` per batch is cheaper."""
    import psutil

    total = sum(os.path.getsize(p) for p in paths)
    return total <= fraction * psutil.virtual_memory().available


def shard_reader(paths: Iterable[str | Path], mapped: bool | None = None, fields: Iterable[str] | None = None):
    """:func:`read_shard` of ``fields`` for these shards: kept maps when they fit in memory
    (``mapped=None``), else ``pread`` (``mapped=False``)."""
    paths = list(paths)
    use_maps = fits_in_memory(paths) if mapped is None else mapped
    return functools.partial(read_shard, fields=fields, lazy=not use_maps)


def close_mappings() -> None:
    """Forget every kept shard map (the OS unmaps each once no array views it any more)."""
    _MAPS.clear()
    _SELECTED.clear()


def read_shard(path: str | Path, fields: Iterable[str] | None = None, lazy: bool = False) -> Iterator[dict]:
    """Yield ``{"sample_id": int, field: array, ...}`` per sample (field names without ``.npy``).

    ``lazy=False``: every array is a read-only view into a kept memory map of the shard (see
    :func:`shard_map`; copy to keep it writable). ``lazy=True``: the large fields
    (members over 8 kB) are :class:`FileArray` handles that :func:`copy_into` ``pread``s straight
    into the batch (no map kept: for artifacts much larger than RAM)."""
    wanted = None if fields is None else {f"{f}.npy" for f in with_scales(fields)}
    if lazy:
        for sample in _read_shard_pread(path, wanted):
            yield dequantize_sample(sample)  # int8 tokens come back float16 (pipeline/io/quant.py)
        return
    if wanted is None:
        samples = parsed_samples(path)
    else:
        # the field selection is made once per (mapping, fields) and cached beside the parse
        keep = frozenset({"__key__", "sample_id"} | {w[:-4] for w in wanted})
        samples = _selected(path, keep)
    for sample in samples:
        # A fresh dict per sample: callers may add keys without touching the cached parse.
        yield dequantize_sample(dict(sample))


def _selected(path: str | Path, keep: frozenset) -> list[dict]:
    """The kept map's parsed samples restricted to the ``keep`` keys (cached per mapping)."""
    samples = parsed_samples(path)
    cache = _SELECTED.get(str(path))
    if cache is None or cache[0] is not samples:
        cache = _SELECTED[str(path)] = (samples, {})
    out = cache[1].get(keep)
    if out is None:
        out = cache[1][keep] = [{k: v for k, v in s.items() if k in keep} for s in samples]
    return out


_SELECTED: dict[str, tuple[list, dict]] = {}  # path -> (the parse it selects from, {keep: samples})


def read_sample(path: str | Path, position: int, fields: Iterable[str] | None = None,
                lazy: bool = False) -> dict:
    """The ``position``-th sample of a shard (random access, e.g. an index neighbour), in the form
    :func:`read_shard` yields it. ``lazy=False``: views into the kept map (the shard's headers are
    parsed once per mapping); ``lazy=True``: one pass over the tar headers per shard is cached
    (8 bytes per sample), then only this sample's members are read, big arrays as
    :class:`FileArray`."""
    wanted = None if fields is None else {f"{f}.npy" for f in with_scales(fields)}
    offsets = None
    if lazy:
        st = os.stat(path)
        offsets = _sample_offsets(str(path), st.st_size, st.st_mtime_ns)
    if offsets is None:  # mapped, or a tar with pax/GNU headers (the generic reader's case)
        sample = parsed_samples(path)[position]
        keep = None if wanted is None else {"__key__", "sample_id"} | {w[:-4] for w in wanted}
        return dequantize_sample(dict(sample) if keep is None else {k: v for k, v in sample.items() if k in keep})
    return dequantize_sample(next(_read_shard_pread(path, wanted, start=int(offsets[position]), first_only=True)))


@functools.lru_cache(maxsize=256)
def _sample_offsets(path: str, size: int, mtime_ns: int) -> np.ndarray | None:
    """Byte offset of each sample's first tar header, in shard order (size/mtime: cache key);
    None for archives with pax/GNU extension headers."""
    out, last = [], None
    with open(path, "rb") as fh:
        fd = fh.fileno()
        pos = 0
        while pos + 512 <= size:
            hdr = os.pread(fd, 512, pos)
            if hdr[0] == 0:
                break
            typeflag, name, n = _ustar(hdr)
            if typeflag not in _REGULAR and typeflag != _DIR:
                return None
            if typeflag in _REGULAR:
                key = name.partition(".")[0]
                if key != last:
                    out.append(pos)
                    last = key
            pos += 512 + (n + 511) // 512 * 512
    return np.asarray(out, np.int64)


def parsed_samples(path: str | Path) -> list[dict]:
    """Every sample of a kept map as views (parsed once per mapping, like the map itself)."""
    mm, members = shard_map(path)
    entry = _MAPS[str(path)]
    if len(entry) == 4:
        return entry[3]
    samples: list[dict] = []
    current: dict | None = None
    for mname, offset, size in members:
        key, _, name = mname.partition(".")
        if current is None or current["__key__"] != key:
            current = {"__key__": key, "sample_id": int(key)}
            samples.append(current)
        if name.endswith(".npy"):
            current[name[:-4]] = npy_view(mm, offset, size)
        elif name.endswith(".json"):
            current[name[:-5]] = json.loads(mm[offset : offset + size])
    _MAPS[str(path)] = (*entry, samples)
    return samples


_SMALL = 8192  # members up to this size are read with their tar header in one pread


def _read_shard_pread(path, wanted: set[str] | None, start: int = 0, first_only: bool = False) -> Iterator[dict]:
    """The lazy reader: one ``pread`` per member (tar header + npy header + small data), big
    arrays left as :class:`FileArray`. Cheaper than touching a memory map page by page.
    ``start``: byte offset of a sample's first header; ``first_only``: stop after that sample."""
    file = ShardFile(path)
    fd, end = file.fd, os.fstat(file.fd).st_size
    pos = int(start)
    current: dict | None = None
    while pos + 512 <= end:
        chunk = os.pread(fd, 512 + _SMALL, pos)
        if chunk[0] == 0:
            break
        typeflag, name, size = _ustar(chunk)
        if typeflag not in _REGULAR and typeflag != _DIR:  # pax/GNU headers: not ours, use the generic reader
            yield from read_shard(path, None if wanted is None else [w[:-4] for w in wanted], lazy=False)
            return
        data = pos + 512
        pos = data + (size + 511) // 512 * 512
        if typeflag == _DIR:
            continue
        key, _, fname = name.partition(".")
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current
                if first_only:
                    return
            current = {"__key__": key, "sample_id": int(key)}
        if wanted is not None and fname not in wanted:
            continue
        if fname.endswith(".npy"):
            field = fname[:-4]
            if size <= _SMALL:
                current[field] = npy_view(chunk, 512, size)
            else:
                dtype, shape, _count, fortran, hlen = npy_header(chunk, 512, size)
                if fortran:
                    current[field] = np.asarray(FileArray(file, data + hlen, dtype, shape[::-1])).T
                else:
                    current[field] = FileArray(file, data + hlen, dtype, shape)
        elif fname.endswith(".json"):
            raw = chunk[512 : 512 + size] if size <= _SMALL else os.pread(fd, size, data)
            current[fname[:-5]] = json.loads(raw)
    if current is not None:
        yield current


def copy_into(out: np.ndarray, src, index: int | None = None, rows: int | None = None) -> None:
    """out[...] = src (whole) or src[index, :rows], reading from the shard when ``src`` is lazy."""
    if isinstance(src, FileArray):
        src.read_into(out, index, rows)
    elif index is None:
        out[...] = src
    else:
        out[...] = src[index, :rows]


def buffer_shuffle(stream: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Seeded reservoir-style shuffle holding at most ``size`` items (memory bounded by ``size``)."""
    buf: list[Any] = []
    for item in stream:
        if len(buf) < size:
            buf.append(item)
            continue
        k = rng.randrange(len(buf))
        yield buf[k]
        buf[k] = item
    rng.shuffle(buf)
    yield from buf


def epoch_rng(seed: int, epoch: int, salt: int = 0) -> random.Random:
    """The random stream of (seed, epoch[, salt]): what makes a stream's batches reproducible."""
    return random.Random((int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(salt))


class ShardStream(torch.utils.data.IterableDataset):
    """Deterministic, resumable batches over shards.

    ``read_shard(shard) -> Iterator[dict]`` yields cheap per-sample dicts with ``sample_id``;
    ``collate(samples, rng) -> batch`` builds the batch (``rng`` is seeded by (seed, epoch, batch
    index), e.g. for picking one of several captions). ``keep(sample) -> bool`` filters (a split).

    * shard order is shuffled per epoch and samples pass through a seeded shuffle buffer of
      ``shuffle_buffer`` samples, so memory is bounded by the buffer (plus one shard's headers),
      not by the dataset; the sequence of batches is a pure function of (seed, epoch);
    * ``set_position(epoch, start)`` skips the first ``start`` batches of an epoch without
      collating them (resume at the exact data position: with a lazy :func:`read_shard`, a
      skipped sample costs a header parse, no array read);
    * with ``num_workers`` DataLoader workers, every worker walks the same cheap sample stream and
      collates (reads the large arrays of) only the batches ``start + w, start + w + n, ...``, so
      the DataLoader's round-robin yields exactly the single-process batch sequence;
    * ``rank`` / ``world_size`` (data-parallel training, e.g. one Ray Train worker per rank): rank
      r collates only the epoch's batches ``start + r, start + r + world_size, ...`` (and splits
      those over its DataLoader workers as above), so the ranks read disjoint samples and their
      batches together are exactly the single-process epoch; their counts differ by at most one
      (:meth:`count_batches` gives this rank's);
    * ``joins`` attach other artifacts' columns by ``sample_id`` to the samples of each batch
      before ``collate`` (e.g. :class:`train.data.ParquetJoin`).
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
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank {rank} is not in 0..world_size-1 (world_size {world_size})")
        self.rank, self.world_size = int(rank), int(world_size)
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
            if not self._mine(b) or ((b - self.start) // self.world_size) % nw != wid:
                continue
            samples = self._load(payload)
            for j in self.joins:
                samples = [j(s) for s in samples]
            yield self._finish(self.collate(samples, epoch_rng(self.seed, self.epoch, salt=b + 1)), payload)

    def _mine(self, b: int) -> bool:
        """Whether this rank collates the epoch's batch ``b`` (at or after the resume position)."""
        return b >= self.start and (b - self.start) % self.world_size == self.rank

    def _load(self, payload) -> list[dict]:
        return payload

    def _finish(self, batch, payload):
        return batch

    def count_batches(self) -> int:
        """Batches per epoch from position 0 for this rank (walks the cheap sample stream once)."""
        n = sum(1 for sh in self.shards for s in self.read_shard(sh) if self.keep is None or self.keep(s))
        total = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return len(range(self.rank, total, self.world_size))


def loader(stream: ShardStream, num_workers: int = 0) -> Iterable[Any]:
    """Iterate ``stream`` in-process or through a DataLoader with ``num_workers`` workers (same
    batch sequence either way)."""
    if num_workers <= 0:
        return iter(stream)
    return iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers, in_order=True,
                                            persistent_workers=False))
