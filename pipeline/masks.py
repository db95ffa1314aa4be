"""COCO masks: polygons and run-length encoding, through ``pycocotools.mask`` (the reference).

The one RLE module of the project: readers, the synthetic generator, the visual-token stage and the
loaders all encode and decode here.

Format. A mask of shape (h, w) is flattened in column-major (Fortran) order and stored as the
lengths of alternating runs, starting with a run of zeros (which is 0 when the first pixel is set).
Two spellings of ``counts`` exist, both accepted everywhere here:

* uncompressed: ``{"size": [h, w], "counts": [int, ...]}`` (COCO ``iscrowd`` annotations);
* compressed:   ``{"size": [h, w], "counts": "<ascii>"}`` -- pycocotools' string form. This is what
  :func:`rle_encode` produces (``counts`` as ``str``, so it serialises as JSON).

Encoding, decoding, areas, boxes and polygon rasterisation are pycocotools' C code. RLEs read from
files are checked first (:func:`rle_counts`: run lengths non-negative and summing to h*w), because
pycocotools' decoder writes runs without bounds checks and a bad string would overrun its buffer.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from pycocotools import mask as _cm


def counts_to_string(counts: list[int]) -> str:
    """Uncompressed counts -> pycocotools' compressed string (its ``rleToString``)."""
    counts = [int(c) for c in counts]
    n = sum(counts)
    rle = _cm.frPyObjects({"size": [n, 1], "counts": counts}, n, 1)
    return rle["counts"].decode("ascii")


def string_to_counts(s: str) -> list[int]:
    """pycocotools' ``rleFrString`` in Python: the run lengths of a compressed string.

    pycocotools exposes no way to read the counts without decoding into a buffer it does not bound;
    this parser is what validates an untrusted string before it reaches the C decoder.
    """
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


def _as_str(rle: dict) -> dict[str, Any]:
    c = rle["counts"]
    return {"size": [int(v) for v in rle["size"]], "counts": c.decode("ascii") if isinstance(c, bytes) else c}


def rle_encode_many(masks: np.ndarray) -> list[dict[str, Any]]:
    """[V, H, W] masks -> V compressed RLE dicts (``counts`` as str)."""
    masks = np.asarray(masks)
    if masks.ndim != 3:
        raise ValueError(f"rle_encode_many expects [V, H, W] masks, got shape {masks.shape}")
    if len(masks) == 0:
        return []
    m8 = masks.view(np.uint8) if masks.dtype == bool else (masks != 0).view(np.uint8)
    stack = np.asfortranarray(m8.transpose(1, 2, 0))  # one copy: pycocotools wants [H, W, V] Fortran order
    return [_as_str(r) for r in _cm.encode(stack)]


def rle_encode(mask: np.ndarray) -> dict[str, Any]:
    """Binary mask (h, w) -> compressed COCO RLE ``{"size": [h, w], "counts": str}``."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"rle_encode expects a 2-D mask, got shape {mask.shape}")
    return rle_encode_many(mask[None])[0]


def rle_counts(rle: dict[str, Any]) -> list[int]:
    """Run lengths of either spelling, checked: non-negative and summing to h*w."""
    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    if isinstance(counts, (bytes, bytearray)):
        counts = counts.decode("ascii")
    out = string_to_counts(counts) if isinstance(counts, str) else [int(c) for c in counts]
    if any(c < 0 for c in out):
        raise ValueError("RLE has a negative run length")
    if sum(out) != h * w:
        raise ValueError(f"RLE run lengths sum to {sum(out)}, expected h*w = {h * w}")
    return out


def _checked(rle: dict[str, Any]) -> dict[str, Any]:
    """A compressed RLE pycocotools can take safely (validated; bytes counts)."""
    h, w = (int(v) for v in rle["size"])
    counts = rle_counts(rle)
    if isinstance(rle["counts"], (str, bytes, bytearray)):
        c = rle["counts"]
        return {"size": [h, w], "counts": c.encode("ascii") if isinstance(c, str) else bytes(c)}
    return _cm.frPyObjects({"size": [h, w], "counts": counts}, h, w)


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """COCO RLE (either spelling) -> bool mask of shape ``rle["size"]``."""
    return _cm.decode(_checked(rle)).astype(bool)


def rle_compress(rle: dict[str, Any]) -> dict[str, Any]:
    """Any spelling -> compressed string spelling (no pixel decode needed)."""
    return _as_str(_checked(rle))


def rle_area(rle: dict[str, Any]) -> int:
    return int(_cm.area(_checked(rle)))


def rle_to_bbox(rle: dict[str, Any]) -> tuple[float, float, float, float]:
    """Tight (x0, y0, x1, y1) box of the set pixels, x1/y1 exclusive; zeros when empty."""
    x, y, w, h = (float(v) for v in _cm.toBbox(_checked(rle)))
    return (x, y, x + w, y + h)


class BadPolygon(ValueError):
    """A polygon pycocotools cannot rasterise safely (non-finite, or far outside the image)."""


def _checked_polygon(part: list[float], h: int, w: int) -> list[float]:
    """``part`` as floats, or :class:`BadPolygon`. pycocotools' ``rleFrPoly`` walks every edge at
    5x resolution in C ints without bounds checks: a vertex at 1e9 segfaults the process (a Ray
    worker restarted on it forever), NaN is undefined behaviour. A vertex may lie outside the
    image (COCO has a few, clipped by the rasteriser) but by at most the image's longer side."""
    pts, m = [float(v) for v in part], max(h, w)
    for i, v in enumerate(pts):
        lo, hi = (-m, w + m) if i % 2 == 0 else (-m, h + m)
        if not math.isfinite(v) or not lo <= v <= hi:
            axis = "x" if i % 2 == 0 else "y"
            raise BadPolygon(f"polygon vertex {i // 2} has {axis}={v:g}, outside [{lo}, {hi}] for a {w}x{h} image")
    return pts


def polygons_to_rle(polygons: list[list[float]], h: int, w: int) -> dict[str, Any]:
    """COCO polygon segmentation (flat [x0, y0, x1, y1, ...] lists) -> the compressed RLE of their
    union, rasterised by pycocotools exactly as the COCO API does. Parts with fewer than three
    points are ignored; a non-finite vertex or one beyond the image by more than its size raises
    :class:`BadPolygon` (before the C code sees it)."""
    h, w = int(h), int(w)
    if h <= 0 or w <= 0:
        raise BadPolygon(f"polygons need a positive image size, got {w}x{h}")
    parts = [_checked_polygon(p, h, w) for p in polygons if len(p) >= 6]
    if not parts:
        return rle_encode(np.zeros((int(h), int(w)), bool))
    rles = _cm.frPyObjects(parts, int(h), int(w))
    return _as_str(_cm.merge(rles) if len(rles) > 1 else rles[0])


def polygons_to_mask(polygons: list[list[float]], h: int, w: int) -> np.ndarray:
    """COCO polygons -> bool mask (h, w), rasterised by pycocotools."""
    return rle_decode(polygons_to_rle(polygons, h, w))


def segmentation_to_rle(seg: Any, h: int, w: int) -> dict[str, Any]:
    """Any COCO ``segmentation`` value (polygons, uncompressed or compressed RLE) -> compressed RLE."""
    if isinstance(seg, dict):
        if "size" not in seg or "counts" not in seg:
            raise ValueError("RLE segmentation needs 'size' and 'counts'")
        return rle_compress(seg)
    if isinstance(seg, list):
        return polygons_to_rle(seg, h, w)
    raise ValueError(f"unsupported segmentation of type {type(seg).__name__}")


def deferred_to_rle(mask: dict | None) -> dict | None:
    """A mask as the COCO reader leaves it with ``defer_masks`` (``{"segmentation", "height",
    "width"}``) -> compressed RLE; an RLE (or None) is returned as is. Run by the ingest workers, so
    the driver never rasterises polygons."""
    if not isinstance(mask, dict) or "segmentation" not in mask:
        return mask
    return segmentation_to_rle(mask["segmentation"], int(mask["height"]), int(mask["width"]))


def remove_small_regions(mask: np.ndarray, area_thresh: float, mode: str) -> tuple[np.ndarray, bool]:
    """segment-anything's ``utils.amg.remove_small_regions`` with scipy in place of OpenCV (not a dependency here):
    ``mode="holes"`` fills the background components of ``mask`` smaller than ``area_thresh`` pixels,
    ``mode="islands"`` drops its foreground components smaller than that (all of them small: the largest is kept).
    8-connected, as SAM's ``cv2.connectedComponentsWithStats(..., 8)``. Returns (mask, changed)."""
    from scipy import ndimage

    if mode not in ("holes", "islands"):
        raise ValueError(f"remove_small_regions: mode {mode!r} is not 'holes' or 'islands'")
    holes = mode == "holes"
    work = np.asarray(mask, bool) ^ holes
    labels, n = ndimage.label(work, structure=np.ones((3, 3), bool))
    sizes = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    small = np.nonzero(sizes < area_thresh)[0] + 1
    if not len(small):
        return np.asarray(mask, bool), False
    if holes:  # the mask plus its small holes
        return np.isin(labels, np.concatenate([[0], small])), True
    keep = np.setdiff1d(np.arange(1, n + 1), small)
    if not len(keep):
        keep = np.array([int(np.argmax(sizes)) + 1])
    return np.isin(labels, keep), True
