"""Held-out splits from a hash of each image's stable key (manifest ``dataset.splits``).

An image's split is a function of ``(seed, key)`` alone: ``u = blake2b(seed, key) / 2**64`` in
[0, 1); ``u < test`` -> ``test``, ``u < test + val`` -> ``val``, else ``train``. Adding, removing or
reordering other images never moves it, and every caption (and every record) of one key shares
its split, so no training image is evaluated on. The key is ``SourceRecord.split_key`` where the
reader sets one (``cc3m_tsv``: the image reference as written in the TSV; ``webdataset``: the
sample's ``url`` from its ``.json``, as img2dataset writes it, else its key), else ``source_id``
(``folder``: the image's path relative to the folder; COCO / Karpathy / Flickr / synthetic: the
image id). Row numbers and ``sample_id`` are never used: they change when rows are added.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

from pipeline.readers.base import SourceRecord

SPLITS = ("train", "val", "test")


def key_unit(key: str, seed: int = 0) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, key)``."""
    h = hashlib.blake2b(f"{seed}\0{key}".encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def split_of(key: str, val: float, test: float, seed: int = 0) -> str:
    u = key_unit(key, seed)
    return "test" if u < test else "val" if u < test + val else "train"


def record_key(rec: SourceRecord) -> str:
    return rec.split_key if rec.split_key is not None else rec.source_id


def assign_splits(records: Iterable[SourceRecord], cfg, keep: str | None = None) -> Iterator[SourceRecord]:
    """Set each record's split from ``cfg`` (:class:`pipeline.config.SplitsConfig`); with ``keep``
    yield only the records of that split."""
    for rec in records:
        rec.split = split_of(record_key(rec), cfg.val, cfg.test, cfg.seed)
        if keep is None or rec.split == keep:
            yield rec
