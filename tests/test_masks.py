"""pipeline.masks against pycocotools (issue 18): polygons rasterised as the COCO API does, RLE bytes
identical to pycocotools.mask.encode, both spellings decoded, bad RLEs refused before the C decoder."""

from __future__ import annotations

import numpy as np
import pytest
from pycocotools import mask as cm

from pipeline.masks import (
    polygons_to_mask,
    rle_area,
    rle_decode,
    rle_encode,
    rle_encode_many,
    rle_to_bbox,
    segmentation_to_rle,
)


def _random_polygon(rng, h, w):
    n = int(rng.integers(3, 12))
    cx, cy = rng.uniform(0, w), rng.uniform(0, h)
    ang = np.sort(rng.uniform(0, 2 * np.pi, n))
    rad = rng.uniform(2, max(h, w) / 2, n)
    xs, ys = cx + rad * np.cos(ang), cy + rad * np.sin(ang)
    return np.stack([xs, ys], 1).ravel().tolist()


def test_50_random_polygons_match_the_coco_api():
    rng = np.random.default_rng(0)
    for _ in range(50):
        h, w = (int(v) for v in rng.integers(20, 200, 2))
        polys = [_random_polygon(rng, h, w) for _ in range(int(rng.integers(1, 3)))]
        ref = cm.decode(cm.merge(cm.frPyObjects(polys, h, w))).astype(bool)  # COCO.annToMask
        np.testing.assert_array_equal(polygons_to_mask(polys, h, w), ref)
        rle = segmentation_to_rle(polys, h, w)
        assert rle_area(rle) == int(ref.sum())


def test_rle_bytes_equal_pycocotools_and_both_spellings_decode():
    rng = np.random.default_rng(1)
    masks = [rng.random((int(h), int(w))) < rng.random() for h, w in rng.integers(1, 60, (40, 2))]
    masks += [np.zeros((7, 5), bool), np.ones((7, 5), bool)]
    for m in masks:
        ref = cm.encode(np.asfortranarray(m.astype(np.uint8)))
        got = rle_encode(m)
        assert got == {"size": list(m.shape), "counts": ref["counts"].decode()}
        np.testing.assert_array_equal(rle_decode(got), m)
        np.testing.assert_array_equal(rle_decode({"size": got["size"], "counts": got["counts"].encode()}), m)
        x, y, bw, bh = cm.toBbox(ref)
        assert rle_to_bbox(got) == (x, y, x + bw, y + bh)
    same = [m for m in masks if m.shape == masks[0].shape] * 3
    assert rle_encode_many(np.stack(same)) == [rle_encode(m) for m in same]
    # uncompressed (iscrowd) counts: as pycocotools' frPyObjects reads them
    m = rng.random((9, 6)) < 0.4
    flat = m.ravel(order="F")
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate(([0], change, [flat.size]))).tolist()
    counts = ([0] + counts) if flat[0] else counts
    unc = {"size": [9, 6], "counts": counts}
    np.testing.assert_array_equal(rle_decode(unc), m)
    assert segmentation_to_rle(unc, 9, 6)["counts"] == cm.frPyObjects(unc, 9, 6)["counts"].decode()


@pytest.mark.parametrize(
    "rle, match",
    [
        ({"size": [4, 4], "counts": [3, 100]}, "sum to 103"),
        ({"size": [4, 4], "counts": [3, -1, 14]}, "negative"),
        ({"size": [4, 4], "counts": "0" + chr(47)}, "invalid character"),
        ({"size": [4, 4], "counts": "o"}, "ends in the middle"),  # 'o' = 63: a 'more' bit with nothing after
        ({"size": [2, 2], "counts": rle_encode(np.ones((30, 30), bool))["counts"]}, "sum to 900"),
    ],
)
def test_bad_rle_is_refused_before_the_c_decoder(rle, match):
    with pytest.raises(ValueError, match=match):
        rle_decode(rle)


def _flood_components(work: np.ndarray) -> list[set]:
    """8-connected components of a boolean array by a plain flood fill (the brute-force reference)."""
    seen, comps = np.zeros_like(work), []
    H, W = work.shape
    for y in range(H):
        for x in range(W):
            if work[y, x] and not seen[y, x]:
                comp, stack = set(), [(y, x)]
                seen[y, x] = True
                while stack:
                    cy, cx = stack.pop()
                    comp.add((cy, cx))
                    for dy in (-1, 0, 1):
                        for dx in (-1, 0, 1):
                            ny, nx = cy + dy, cx + dx
                            if 0 <= ny < H and 0 <= nx < W and work[ny, nx] and not seen[ny, nx]:
                                seen[ny, nx] = True
                                stack.append((ny, nx))
                comps.append(comp)
    return comps


def _brute_remove(mask: np.ndarray, area: int, mode: str) -> np.ndarray:
    """segment-anything's remove_small_regions, spelled out: background label 0 is never a small region."""
    holes = mode == "holes"
    comps = _flood_components(mask ^ holes)
    small = [c for c in comps if len(c) < area]
    out = mask.copy()
    if holes:
        for c in small:
            for p in c:
                out[p] = True
        return out
    big = [c for c in comps if len(c) >= area] or [max(comps, key=len)] if comps else []
    out[:] = False
    for c in big:
        for p in c:
            out[p] = True
    return out


@pytest.mark.parametrize("mode", ["holes", "islands"])
def test_remove_small_regions_matches_a_flood_fill_on_random_masks(mode):
    from pipeline.masks import remove_small_regions

    rng = np.random.default_rng(5)
    changed_any = 0
    for _ in range(40):
        m = rng.random((17, 23)) < rng.uniform(0.2, 0.8)
        area = int(rng.integers(1, 12))
        got, changed = remove_small_regions(m, area, mode)
        want = _brute_remove(m, area, mode)
        assert np.array_equal(got, want)
        if not changed:
            assert np.array_equal(got, m)
        changed_any += int(changed)
    assert changed_any > 10


def test_remove_small_regions_on_a_planted_mask():
    from pipeline.masks import remove_small_regions

    m = np.zeros((20, 20), bool)
    m[2:12, 2:12] = True          # the object, 100 px
    m[6, 6] = False               # a 1-px hole
    m[17:19, 17:19] = True        # a 4-px island far away: it alone stretches the tight box to (2, 2, 19, 19)
    filled, ch = remove_small_regions(m, 5, "holes")
    assert ch and filled[6, 6] and filled.sum() == 104
    clean, ch = remove_small_regions(filled, 5, "islands")
    assert ch and clean.sum() == 100 and not clean[17:19, 17:19].any()
    only_small = np.zeros((8, 8), bool)
    only_small[0, 0] = only_small[5, 5] = only_small[5, 6] = True
    kept, _ = remove_small_regions(only_small, 10, "islands")  # every island small: the largest stays (SAM)
    assert kept.sum() == 2 and kept[5, 5] and kept[5, 6]
    with pytest.raises(ValueError, match="mode"):
        remove_small_regions(m, 5, "both")
