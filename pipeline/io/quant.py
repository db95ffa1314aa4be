"""Compact token storage: int8 with one float16 scale per token (absmax), dequantised on read.

A token array ``x`` [..., d] is stored as ``q = round(x / s)`` int8 in ``<field>.npy`` with
``s = max|x| / 127`` per token (the last axis) as float16 in ``<field>_scale.npy`` [...]; readers
through :mod:`pipeline.io.shards` get ``q * s`` back as float16 under the field's own name, so a
loader or trainer never sees the difference (:func:`dequantize_sample`). Per element the error is
at most ``s / 2`` = 1/254 of the token's largest magnitude (plus float16 rounding of the result);
the token's bytes drop from ``2 d`` to ``d + 2``. The same absmax per-row (per-token) int8 scheme
as LLM.int8()'s vector-wise quantisation (Dettmers et al. 2022, Sec. 3.1), without its outlier
split: these are stored features, not weights in a matmul.
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = "_scale"
PRECISIONS = ("float16", "int8")


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float16 per-token scales) of ``x`` [..., d]; a zero token has scale 0."""
    x32 = np.asarray(x, np.float32)
    if x32.shape[-1] == 0 or x32.size == 0:
        return np.zeros(x32.shape, np.int8), np.zeros(x32.shape[:-1], np.float16)
    scale = (np.abs(x32).max(axis=-1) / 127.0).astype(np.float16)  # rounded first: q is computed with the stored scale
    s32 = scale.astype(np.float32)[..., None]
    q = np.divide(x32, s32, out=np.zeros_like(x32), where=s32 > 0)
    return np.clip(np.rint(q), -127, 127).astype(np.int8), scale


def dequantize(q, scale) -> np.ndarray:
    """float16 ``q * scale`` (the token arrays as a float16 artifact would hold them)."""
    q, scale = np.asarray(q), np.asarray(scale)
    return (q.astype(np.float32) * scale.astype(np.float32)[..., None]).astype(np.float16)


def with_scales(fields) -> list[str]:
    """``fields`` and each one's scale companion (read together; absent ones are ignored)."""
    fields = list(fields)
    return fields + [f + SCALE_SUFFIX for f in fields if not f.endswith(SCALE_SUFFIX)]


def dequantize_sample(sample: dict) -> dict:
    """Replace every int8 field that has a ``<field>_scale`` companion by its float16 values, in place."""
    for key in [k for k in sample if k.endswith(SCALE_SUFFIX)]:
        base = key[: -len(SCALE_SUFFIX)]
        scale = sample.pop(key)
        if base in sample:  # np.asarray reads a lazily mapped member (shards.FileArray.__array__)
            sample[base] = dequantize(np.asarray(sample[base]), np.asarray(scale))
    return sample


def quantize_fields(fields: dict, names) -> dict:
    """``fields`` with each of ``names`` (``.npy`` member names) stored int8 plus its scale member."""
    out = dict(fields)
    for name in names:
        q, s = quantize(out[name])
        out[name] = q
        out[name[: -len(".npy")] + SCALE_SUFFIX + ".npy"] = s
    return out
