"""Read `clip_tokens` shards back into padded training batches (ConceptOT trainer side).

Shard fields are documented in :mod:`pipeline.stages.extract_clip_tokens`. Reading copies each
byte once: member offsets come from the tar headers (parsed directly: USTAR headers are fixed
fields, and listing a 1000-sample shard's 8000 members this way took 0.16-0.25 s against 2.1-4.0 s
with :mod:`tarfile` on the shared test VM -- 9-25x; archives with pax/GNU headers go through
tarfile), ``.npy`` headers are parsed by ``numpy.lib.format`` (cached), small arrays are views of a
memory map, and the large ones (patch and text tokens) are ``pread`` from the page cache straight
into the padded batch arrays, which costs what copying in-memory arrays into a batch costs.

Usage::

    from pipeline.loaders.clip_tokens import ClipTokenBatches
    for batch in ClipTokenBatches("runs/demo/clip_tokens", batch_size=64, captions="random", seed=0):
        batch["patch_tokens"]  # torch.float16 [B, N, d_v]
        ...

Batch keys (torch tensors), ``captions="random"`` or ``"first"`` (one caption per image; images
without captions are skipped):

    sample_id     int64   [B]
    patch_tokens  float16 [B, N, d_v]
    image_embed   float16 [B, P]
    caption_id    int64   [B]
    text_tokens   float16 [B, M, d_t]   M = longest valid length in the batch, zero padded
    text_mask     bool    [B, M]
    text_embed    float16 [B, P]

``captions="all"``: every caption of every image; text keys then have C_total rows and
``caption_sample`` int64 [C_total] gives each caption's row in the image part of the batch.

Iterating with a ``torch.utils.data.DataLoader`` (``batch_size=None``, ``num_workers=k``) splits
the shards across workers.
"""

from __future__ import annotations

import functools
import io
import json
import mmap
import os
import random
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from numpy.lib import format as npformat

from pipeline.io.artifacts import Artifact
from pipeline.loaders import buffer_shuffle

DEFAULT_FIELDS = ("patch_tokens", "image_embed", "text_tokens", "text_mask", "text_embed", "caption_ids")


@functools.lru_cache(maxsize=4096)
def _npy_header_of(raw: bytes) -> tuple[np.dtype, tuple[int, ...], int, bool, int]:
    """(dtype, shape, element count, fortran order, header length) of a .npy header, parsed by
    ``numpy.lib.format`` (magic, version, header dict). Cached: headers repeat across samples."""
    f = io.BytesIO(raw)
    version = npformat.read_magic(f)
    read = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return dtype, shape, int(np.prod(shape)) if shape else 1, bool(fortran), f.tell()


def _npy_header(buf, start: int, size: int) -> tuple[np.dtype, tuple[int, ...], int, bool, int]:
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


def _npy_view(buf, start: int, size: int) -> np.ndarray:
    """View of a .npy file stored at ``buf[start:start+size]`` (format 1.0/2.0/3.0 header)."""
    dtype, shape, count, fortran, hlen = _npy_header(buf, start, size)
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


def _tar_members(mm, fh) -> list[tuple[str, int, int]]:
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


LAZY_FIELDS = ("patch_tokens", "text_tokens")  # the large ones: read straight into the batch


class _ShardFile:
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
    """A C-ordered array stored in a shard, not yet read: ``read()`` it, or let :func:`collate`
    ``pread`` its rows directly into the padded batch (one copy from the page cache, no page
    faults on a memory map, no intermediate array)."""

    __slots__ = ("file", "offset", "dtype", "shape")

    def __init__(self, file: _ShardFile, offset: int, dtype: np.dtype, shape: tuple[int, ...]):
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


def _materialize(a) -> np.ndarray:
    return a.read() if isinstance(a, FileArray) else a


_MAPS: dict[str, tuple] = {}  # path -> ((size, mtime), map, members[, parsed samples])


def _mapped(path: str | Path) -> tuple[mmap.mmap, list[tuple[str, int, int]]]:
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
        members = _tar_members(mm, fh)
    _MAPS[path] = (key, mm, members)
    return mm, members


def fits_in_memory(paths: Iterable[str | Path], fraction: float = 0.5) -> bool:
    """Whether shards this large can stay in the page cache (at most ``fraction`` of available RAM).

    Kept maps pay off only then; an artifact larger than that would be evicted and re-faulted
    every epoch, where a plain ``pread`` per batch is cheaper."""
    import psutil

    total = sum(os.path.getsize(p) for p in paths)
    return total <= fraction * psutil.virtual_memory().available


def shard_reader(paths: Iterable[str | Path], mapped: bool | None = None):
    """``read_shard`` for these shards: kept maps when they fit in memory (``mapped=None``)."""
    use_maps = fits_in_memory(paths) if mapped is None else mapped
    return functools.partial(read_shard, lazy=not use_maps)


def close_mappings() -> None:
    """Forget every kept shard map (the OS unmaps each once no array views it any more)."""
    _MAPS.clear()
    _SELECTED.clear()


def read_shard(path: str | Path, fields: Iterable[str] | None = DEFAULT_FIELDS, lazy: bool = False) -> Iterator[dict]:
    """Yield ``{"sample_id": int, field: array, ...}`` per sample (field names without ``.npy``).

    ``lazy=False``: every array is a read-only view into a kept memory map of the shard (see
    :func:`_mapped`; copy to keep it writable). ``lazy=True``: the large fields
    (:data:`LAZY_FIELDS`) are :class:`FileArray` handles that :func:`collate` ``pread``s straight
    into the batch (no map kept: for artifacts much larger than RAM)."""
    wanted = None if fields is None else {f"{f}.npy" for f in fields}
    if lazy:
        yield from _read_shard_pread(path, wanted)
        return
    if wanted is None:
        samples = _parsed(path)
    else:
        # the field selection is made once per (mapping, fields) and cached beside the parse
        keep = frozenset({"__key__", "sample_id"} | {w[:-4] for w in wanted})
        samples = _selected(path, keep)
    for sample in samples:
        # A fresh dict per sample: callers may add keys without touching the cached parse.
        yield dict(sample)


def _selected(path: str | Path, keep: frozenset) -> list[dict]:
    """The kept map's parsed samples restricted to the ``keep`` keys (cached per mapping)."""
    samples = _parsed(path)
    cache = _SELECTED.get(str(path))
    if cache is None or cache[0] is not samples:
        cache = _SELECTED[str(path)] = (samples, {})
    out = cache[1].get(keep)
    if out is None:
        out = cache[1][keep] = [{k: v for k, v in s.items() if k in keep} for s in samples]
    return out


_SELECTED: dict[str, tuple[list, dict]] = {}  # path -> (the parse it selects from, {keep: samples})


def read_sample(path: str | Path, position: int, fields: Iterable[str] | None = DEFAULT_FIELDS,
                lazy: bool = False) -> dict:
    """The ``position``-th sample of a shard (random access, e.g. an index neighbour), in the form
    :func:`read_shard` yields it. ``lazy=False``: views into the kept map (the shard's headers are
    parsed once per mapping); ``lazy=True``: one pass over the tar headers per shard is cached
    (8 bytes per sample), then only this sample's members are read, big arrays as
    :class:`FileArray`."""
    wanted = None if fields is None else {f"{f}.npy" for f in fields}
    offsets = None
    if lazy:
        st = os.stat(path)
        offsets = _sample_offsets(str(path), st.st_size, st.st_mtime_ns)
    if offsets is None:  # mapped, or a tar with pax/GNU headers (the generic reader's case)
        sample = _parsed(path)[position]
        keep = None if wanted is None else {"__key__", "sample_id"} | {w[:-4] for w in wanted}
        return dict(sample) if keep is None else {k: v for k, v in sample.items() if k in keep}
    return next(_read_shard_pread(path, wanted, start=int(offsets[position]), first_only=True))


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


def _parsed(path: str | Path) -> list[dict]:
    """Every sample of a kept map as views (parsed once per mapping, like the map itself)."""
    mm, members = _mapped(path)
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
            current[name[:-4]] = _npy_view(mm, offset, size)
        elif name.endswith(".json"):
            current[name[:-5]] = json.loads(mm[offset : offset + size])
    _MAPS[str(path)] = (*entry, samples)
    return samples


_SMALL = 8192  # members up to this size are read with their tar header in one pread


def _read_shard_pread(path, wanted: set[str] | None, start: int = 0, first_only: bool = False) -> Iterator[dict]:
    """The lazy reader: one ``pread`` per member (tar header + npy header + small data), big
    arrays left as :class:`FileArray`. Cheaper than touching a memory map page by page.
    ``start``: byte offset of a sample's first header; ``first_only``: stop after that sample."""
    file = _ShardFile(path)
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
                current[field] = _npy_view(chunk, 512, size)
            else:
                dtype, shape, _count, fortran, hlen = _npy_header(chunk, 512, size)
                if fortran:
                    current[field] = np.asarray(FileArray(file, data + hlen, dtype, shape[::-1])).T
                else:
                    current[field] = FileArray(file, data + hlen, dtype, shape)
        elif fname.endswith(".json"):
            raw = chunk[512 : 512 + size] if size <= _SMALL else os.pread(fd, size, data)
            current[fname[:-5]] = json.loads(raw)
    if current is not None:
        yield current


def _fill(out: np.ndarray, src, index: int | None = None, rows: int | None = None) -> None:
    """out[...] = src (whole) or src[index, :rows], reading from the shard when ``src`` is lazy."""
    if isinstance(src, FileArray):
        src.read_into(out, index, rows)
    elif index is None:
        out[...] = src
    else:
        out[...] = src[index, :rows]


def collate(samples: list[dict], captions: str = "random", rng: random.Random | None = None) -> dict[str, torch.Tensor]:
    """Padded batch from per-sample dicts (see the module docstring for keys and shapes); sample
    arrays may be numpy arrays or lazy :class:`FileArray` handles."""
    if captions not in ("random", "first", "all"):
        raise ValueError(f"captions must be random, first or all, got {captions!r}")
    b = len(samples)
    p0 = samples[0]["patch_tokens"]
    patches = np.empty((b, *p0.shape), p0.dtype)
    for i, s in enumerate(samples):
        _fill(patches[i], s["patch_tokens"])
    batch = {
        "sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
        "patch_tokens": torch.from_numpy(patches),
        "image_embed": torch.from_numpy(np.stack([_materialize(s["image_embed"]) for s in samples])),
    }
    picks: list[tuple[int, int, int]] = []  # (sample row, caption row, valid tokens)
    for i, s in enumerate(samples):
        c = s["caption_ids"].shape[0]
        lengths = s["text_mask"].sum(axis=1)
        if captions == "all":
            js = range(c)
        else:
            js = [0 if captions == "first" else (rng or random).randrange(c)]
        picks.extend((i, j, int(lengths[j])) for j in js)
    t0 = samples[0]["text_tokens"]
    m = max((n for _, _, n in picks), default=0)
    tokens = np.zeros((len(picks), m, t0.shape[-1]), t0.dtype)
    for r, (i, j, n) in enumerate(picks):
        if n:
            _fill(tokens[r, :n], samples[i]["text_tokens"], j, n)
    lengths = torch.tensor([n for _, _, n in picks], dtype=torch.int64)
    batch["text_tokens"] = torch.from_numpy(tokens)
    batch["text_mask"] = torch.arange(m)[None, :] < lengths[:, None]
    if picks:
        batch["text_embed"] = torch.from_numpy(np.stack([samples[i]["text_embed"][j] for i, j, _ in picks]))
    else:
        batch["text_embed"] = torch.zeros((0, batch["image_embed"].shape[1]), dtype=torch.float16)
    batch["caption_id"] = torch.tensor([int(samples[i]["caption_ids"][j]) for i, j, _ in picks], dtype=torch.int64)
    if captions == "all":
        batch["caption_sample"] = torch.tensor([i for i, _, _ in picks], dtype=torch.int64)
    return batch


def shard_paths(artifact: str | Path | Artifact) -> list[Path]:
    art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    return art.files("shards")


class ClipTokenBatches(torch.utils.data.IterableDataset):
    """Iterate padded batches over a `clip_tokens` artifact, shard by shard (bounded memory).

    ``shuffle``: shard order and a ``shuffle_buffer``-sample buffer are shuffled each epoch
    (``set_epoch``). ``sample_ids``: keep only these samples (a split). ``drop_last``: drop the
    final short batch.

    ``mapped=True``: read through kept memory maps, so epochs after the first run at memory
    speed; ``mapped=False``: ``pread`` each batch's bytes with no map kept (artifacts larger than
    RAM, where kept maps would only be evicted); ``None`` (default): maps when the artifact takes
    at most half the available memory (:func:`fits_in_memory`).

    ``threads`` > 0: that many background threads build batches ahead (``prefetch`` each); thread
    k takes shards k, k+T, ... and the batches are yielded round-robin over the threads, so the
    order is still deterministic for a given seed. The reads (``preadv``) and numpy copies release
    the GIL, so the threads overlap reading with the consumer's work and with each other. Each
    thread forms its own batches, so up to ``threads`` batches per epoch can be short.
    """

    def __init__(
        self,
        artifact: str | Path | Artifact,
        batch_size: int = 64,
        captions: str = "random",
        shuffle: bool = False,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        drop_last: bool = False,
        sample_ids: Iterable[int] | None = None,
        threads: int = 0,
        prefetch: int = 2,
        mapped: bool | None = None,
    ):
        super().__init__()
        self.paths = shard_paths(artifact)
        self.read = shard_reader(self.paths, mapped)
        self.batch_size, self.captions = batch_size, captions
        self.shuffle, self.shuffle_buffer, self.seed, self.drop_last = shuffle, shuffle_buffer, seed, drop_last
        self.keep = None if sample_ids is None else set(int(s) for s in sample_ids)
        self.threads, self.prefetch = threads, prefetch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _samples(self, paths: list[Path], rng: random.Random) -> Iterator[dict]:
        for p in paths:
            for s in self.read(p):
                if self.keep is not None and s["sample_id"] not in self.keep:
                    continue
                if self.captions != "all" and s["caption_ids"].shape[0] == 0:
                    continue
                yield s

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        paths = list(self.paths)
        if self.shuffle:
            rng.shuffle(paths)
        info = torch.utils.data.get_worker_info()
        if info is not None:
            paths = paths[info.id :: info.num_workers]
        if self.threads <= 0 or len(paths) <= 1:
            yield from self._batches(paths, rng)
            return
        yield from self._threaded(paths, rng)

    def _threaded(self, paths: list[Path], rng: random.Random) -> Iterator[dict[str, torch.Tensor]]:
        import queue
        import threading

        n = min(self.threads, len(paths))
        seeds = [rng.randrange(2**63) for _ in range(n)]
        queues = [queue.Queue(maxsize=max(1, self.prefetch)) for _ in range(n)]
        stop = threading.Event()
        done = object()

        def work(k: int) -> None:
            try:
                for batch in self._batches(paths[k::n], random.Random(seeds[k])):
                    while not stop.is_set():
                        try:
                            queues[k].put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                queues[k].put(done)
            except BaseException as e:  # surfaced in the consumer
                queues[k].put(e)

        workers = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(n)]
        for t in workers:
            t.start()
        live = list(range(n))
        try:
            while live:
                for k in list(live):
                    item = queues[k].get()
                    if item is done:
                        live.remove(k)
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield item
        finally:
            stop.set()
            for t in workers:
                t.join(timeout=5)

    def _batches(self, paths: list[Path], rng: random.Random) -> Iterator[dict[str, torch.Tensor]]:
        stream = self._samples(paths, rng)
        if self.shuffle:
            stream = buffer_shuffle(stream, self.shuffle_buffer, rng)
        buf: list[dict] = []
        for s in stream:
            buf.append(s)
            if len(buf) == self.batch_size:
                yield collate(buf, self.captions, rng)
                buf = []
        if buf and not self.drop_last:
            yield collate(buf, self.captions, rng)
