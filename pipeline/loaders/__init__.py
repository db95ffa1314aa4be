"""Readers that turn stage artifacts (WebDataset shards) into training batches."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any


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
