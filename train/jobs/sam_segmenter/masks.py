"""Instance masks of the samples artifact as arrays (the job's targets and the measurement's ground truth)."""

from __future__ import annotations

import numpy as np


def decode_masks(rles: list, hw: tuple[int, int], where: str) -> np.ndarray:
    """bool [K, H, W] of an image's COCO RLE instance masks (non-empty ones)."""
    from pipeline.masks import rle_decode

    out = []
    for r in rles:
        m = rle_decode(r)
        if m.shape != tuple(hw):
            raise ValueError(f"{where}: instance mask {m.shape} does not match its image {tuple(hw)}")
        if m.any():
            out.append(m)
    return np.stack(out) if out else np.zeros((0, *hw), bool)
