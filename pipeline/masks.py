"""Run-length encoding of binary masks, bit-compatible with COCO / pycocotools.

pycocotools is not a dependency, so this is a numpy re-implementation of its ``maskApi.c``.

Format. A mask of shape (h, w) is flattened in column-major (Fortran) order and stored as the
lengths of alternating runs, starting with a run of zeros (which is 0 when the first pixel is set).
Two spellings of ``counts`` exist, both accepted everywhere here:

* uncompressed: ``{"size": [h, w], "counts": [int, ...]}`` (COCO ``iscrowd`` annotations);
* compressed:   ``{"size": [h, w], "counts": "<ascii>"}`` -- pycocotools' string form (each count,
  from the fourth on, stored as a delta to the count two before it, then as 5-bit little-endian
  chunks offset by 48). This is what :func:`rle_encode` produces and what the readers emit,
  so any RLE coming out of ``pipeline.readers`` can be handed to ``pycocotools.mask.decode``.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _counts_from_mask(mask: np.ndarray) -> list[int]:
    flat = np.asarray(mask, dtype=bool).ravel(order="F")
    if flat.size == 0:
        return []
    # Positions where the value changes delimit the runs; a leading zero-length run of zeros is
    # needed when the first pixel is set, because counts always start with a zeros run.
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate(([0], change, [flat.size]))
    counts = np.diff(bounds)
    if flat[0]:
        counts = np.concatenate(([0], counts))
    return counts.tolist()


def counts_to_string(counts: list[int]) -> str:
    """pycocotools ``rleToString``."""
    out: list[str] = []
    for i, c in enumerate(counts):
        x = int(c)
        if i > 2:
            x -= int(counts[i - 2])
        more = True
        while more:
            ch = x & 0x1F
            x >>= 5  # arithmetic shift, as in C on a signed long
            more = (x != -1) if (ch & 0x10) else (x != 0)
            if more:
                ch |= 0x20
            out.append(chr(ch + 48))
    return "".join(out)


def string_to_counts(s: str) -> list[int]:
    """pycocotools ``rleFrString``."""
    counts: list[int] = []
    p, n = 0, len(s)
    while p < n:
        x, k, more = 0, 0, True
        while more:
            if p >= n:
                raise ValueError("RLE string ends in the middle of a count")
            ch = ord(s[p]) - 48
            if ch < 0 or ch > 63:
                raise ValueError(f"RLE string has an invalid character {s[p]!r}")
            x |= (ch & 0x1F) << (5 * k)
            more = bool(ch & 0x20)
            p += 1
            k += 1
            if not more and (ch & 0x10):
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def rle_encode(mask: np.ndarray) -> dict[str, Any]:
    """Binary mask (h, w) -> compressed COCO RLE ``{"size": [h, w], "counts": str}``."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"rle_encode expects a 2-D mask, got shape {mask.shape}")
    h, w = mask.shape
    return {"size": [int(h), int(w)], "counts": counts_to_string(_counts_from_mask(mask))}


def rle_counts(rle: dict[str, Any]) -> list[int]:
    counts = rle["counts"]
    if isinstance(counts, (bytes, bytearray)):
        counts = counts.decode("ascii")
    if isinstance(counts, str):
        return string_to_counts(counts)
    return [int(c) for c in counts]


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """COCO RLE (either spelling) -> bool mask of shape ``rle["size"]``."""
    h, w = (int(v) for v in rle["size"])
    counts = np.asarray(rle_counts(rle), dtype=np.int64)
    if counts.size and (counts < 0).any():
        raise ValueError("RLE has a negative run length")
    if int(counts.sum()) != h * w:
        raise ValueError(f"RLE run lengths sum to {int(counts.sum())}, expected h*w = {h * w}")
    values = np.zeros(counts.size, dtype=bool)
    values[1::2] = True
    flat = np.repeat(values, counts)
    return flat.reshape((w, h)).T.copy()


def rle_compress(rle: dict[str, Any]) -> dict[str, Any]:
    """Any spelling -> compressed string spelling (no pixel decode needed)."""
    return {"size": [int(v) for v in rle["size"]], "counts": counts_to_string(rle_counts(rle))}


def rle_area(rle: dict[str, Any]) -> int:
    return int(sum(rle_counts(rle)[1::2]))


def rle_to_bbox(rle: dict[str, Any]) -> tuple[float, float, float, float]:
    """Tight (x0, y0, x1, y1) box of the set pixels, x1/y1 exclusive; zeros when empty."""
    m = rle_decode(rle)
    ys, xs = np.nonzero(m)
    if ys.size == 0:
        return (0.0, 0.0, 0.0, 0.0)
    return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))


def polygons_to_mask(polygons: list[list[float]], h: int, w: int) -> np.ndarray:
    """COCO polygon segmentation (list of flat [x0, y0, x1, y1, ...] lists) -> bool mask.

    Rasterised with PIL; the union of all polygons (COCO semantics for multi-part objects).
    Pixel-exact agreement with pycocotools' own rasteriser is not promised -- edges may differ
    by one pixel -- which is fine for training masks.
    """
    from PIL import Image, ImageDraw

    img = Image.new("L", (int(w), int(h)), 0)
    draw = ImageDraw.Draw(img)
    for poly in polygons:
        pts = [(float(poly[i]), float(poly[i + 1])) for i in range(0, len(poly) - 1, 2)]
        if len(pts) >= 3:
            draw.polygon(pts, fill=1, outline=1)
    return np.asarray(img, dtype=bool)


def segmentation_to_rle(seg: Any, h: int, w: int) -> dict[str, Any]:
    """Any COCO ``segmentation`` value (polygons, uncompressed or compressed RLE) -> compressed RLE."""
    if isinstance(seg, dict):
        if "size" not in seg or "counts" not in seg:
            raise ValueError("RLE segmentation needs 'size' and 'counts'")
        return rle_compress(seg)
    if isinstance(seg, list):
        return rle_encode(polygons_to_mask(seg, h, w))
    raise ValueError(f"unsupported segmentation of type {type(seg).__name__}")
