"""Read `clip_tokens` shards back into padded training batches (ConceptOT trainer side).

Shard fields are documented in :mod:`pipeline.stages.extract_clip_tokens`. Reading is zero-copy
as far as possible: each tar is memory-mapped, member offsets come from the tar headers, and every
``.npy`` becomes an ``np.frombuffer`` view of the map; the only copy is into the padded batch.

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

import ast
import json
import mmap
import random
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from pipeline.io.artifacts import Artifact

DEFAULT_FIELDS = ("patch_tokens", "image_embed", "text_tokens", "text_mask", "text_embed", "caption_ids")


def _npy_view(buf, start: int, size: int) -> np.ndarray:
    """View of a .npy file stored at ``buf[start:start+size]`` (format 1.0/2.0/3.0 header)."""
    major = buf[start + 6]
    if major == 1:
        hlen = int.from_bytes(buf[start + 8 : start + 10], "little")
        hstart = start + 10
    else:
        hlen = int.from_bytes(buf[start + 8 : start + 12], "little")
        hstart = start + 12
    header = ast.literal_eval(bytes(buf[hstart : hstart + hlen]).decode("latin1"))
    dtype = np.dtype(header["descr"])
    shape = tuple(header["shape"])
    count = int(np.prod(shape)) if shape else 1
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=hstart + hlen)
    if header["fortran_order"]:
        return arr.reshape(shape[::-1]).T
    return arr.reshape(shape)


def read_shard(path: str | Path, fields: Iterable[str] | None = DEFAULT_FIELDS) -> Iterator[dict]:
    """Yield ``{"sample_id": int, field: array, ...}`` per sample (field names without ``.npy``).

    Arrays are read-only views into a memory map of the shard; copy them to keep them past the
    next sample if needed (collating copies anyway)."""
    wanted = None if fields is None else {f"{f}.npy" for f in fields}
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        # Parse only the headers; data is accessed through the map.
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
        current: dict | None = None
        for m in members:
            key, _, name = m.name.partition(".")
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "sample_id": int(key)}
            if wanted is not None and name not in wanted:
                continue
            if name.endswith(".npy"):
                current[name[:-4]] = _npy_view(mm, m.offset_data, m.size)
            elif name.endswith(".json"):
                current[name[:-5]] = json.loads(mm[m.offset_data : m.offset_data + m.size])
        if current is not None:
            yield current


def _pad_stack(arrays: list[np.ndarray], length: int, dtype) -> np.ndarray:
    """Stack [m_i, ...] arrays into [B, length, ...] zero padded."""
    out = np.zeros((len(arrays), length, *arrays[0].shape[1:]), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def collate(samples: list[dict], captions: str = "random", rng: random.Random | None = None) -> dict[str, torch.Tensor]:
    """Padded batch from per-sample dicts (see the module docstring for keys and shapes)."""
    if captions not in ("random", "first", "all"):
        raise ValueError(f"captions must be random, first or all, got {captions!r}")
    batch = {
        "sample_id": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
        "patch_tokens": torch.from_numpy(np.stack([s["patch_tokens"] for s in samples])),
        "image_embed": torch.from_numpy(np.stack([s["image_embed"] for s in samples])),
    }
    tok, msk, emb, cid, owner = [], [], [], [], []
    for i, s in enumerate(samples):
        c = s["caption_ids"].shape[0]
        if captions == "all":
            picks = range(c)
        else:
            picks = [0 if captions == "first" else (rng or random).randrange(c)]
        for j in picks:
            n = int(s["text_mask"][j].sum())
            tok.append(s["text_tokens"][j, :n])
            msk.append(n)
            emb.append(s["text_embed"][j])
            cid.append(s["caption_ids"][j])
            owner.append(i)
    m = max(msk, default=0)
    d_t = samples[0]["text_tokens"].shape[-1]
    batch["text_tokens"] = torch.from_numpy(_pad_stack(tok, m, np.float16) if tok else np.zeros((0, 0, d_t), np.float16))
    lengths = torch.tensor(msk, dtype=torch.int64)
    batch["text_mask"] = torch.arange(m)[None, :] < lengths[:, None]
    batch["text_embed"] = torch.from_numpy(np.stack(emb)) if emb else torch.zeros((0, batch["image_embed"].shape[1]), dtype=torch.float16)
    batch["caption_id"] = torch.tensor(cid, dtype=torch.int64)
    if captions == "all":
        batch["caption_sample"] = torch.tensor(owner, dtype=torch.int64)
    return batch


def shard_paths(artifact: str | Path | Artifact) -> list[Path]:
    art = artifact if isinstance(artifact, Artifact) else Artifact(artifact)
    return art.files("shards")


class ClipTokenBatches(torch.utils.data.IterableDataset):
    """Iterate padded batches over a `clip_tokens` artifact, shard by shard (bounded memory).

    ``shuffle``: shard order and a ``shuffle_buffer``-sample buffer are shuffled each epoch
    (``set_epoch``). ``sample_ids``: keep only these samples (a split). ``drop_last``: drop the
    final short batch.
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
    ):
        super().__init__()
        self.paths = shard_paths(artifact)
        self.batch_size, self.captions = batch_size, captions
        self.shuffle, self.shuffle_buffer, self.seed, self.drop_last = shuffle, shuffle_buffer, seed, drop_last
        self.keep = None if sample_ids is None else set(int(s) for s in sample_ids)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _samples(self, paths: list[Path], rng: random.Random) -> Iterator[dict]:
        for p in paths:
            for s in read_shard(p):
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
        stream = self._samples(paths, rng)
        if self.shuffle:
            stream = _buffer_shuffle(stream, self.shuffle_buffer, rng)
        buf: list[dict] = []
        for s in stream:
            buf.append(s)
            if len(buf) == self.batch_size:
                yield collate(buf, self.captions, rng)
                buf = []
        if buf and not self.drop_last:
            yield collate(buf, self.captions, rng)


def _buffer_shuffle(stream: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    buf: list[dict] = []
    for s in stream:
        if len(buf) < size:
            buf.append(s)
            continue
        k = rng.randrange(len(buf))
        yield buf[k]
        buf[k] = s
    rng.shuffle(buf)
    yield from buf
