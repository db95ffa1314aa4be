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
