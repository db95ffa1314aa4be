"""Fixed width adapters: map d_in-dimensional embeddings to the configured token width.

The paper's tokens are 512-d because SEEM's are; SAM's decoder tokens are 256-d and text
encoders vary. A *learned* projection would need training data at extraction time, so the stage
uses a fixed, seeded, norm-preserving one (documented choice): for d_in <= d_out a matrix with
orthonormal rows (an isometry: inner products and norms are kept exactly, nothing is lost); for
d_in > d_out a random orthonormal-column projection scaled by sqrt(d_in / d_out) (Johnson-
Lindenstrauss: norms kept in expectation). d_in == d_out is the identity. The trainer's own
learned layers sit on top.
"""

from __future__ import annotations

import numpy as np


def projection_matrix(d_in: int, d_out: int, seed: int = 0) -> np.ndarray:
    if d_in == d_out:
        return np.eye(d_in, dtype=np.float32)
    rng = np.random.default_rng([seed, d_in, d_out])
    g = rng.standard_normal((max(d_in, d_out), min(d_in, d_out)))
    q, r = np.linalg.qr(g)  # q: orthonormal columns
    q = q * np.sign(np.diag(r))[None, :]  # unique (Haar) choice
    if d_in < d_out:
        return q.T.astype(np.float32)  # [d_in, d_out], rows orthonormal
    return (q * np.sqrt(d_in / d_out)).astype(np.float32)  # [d_in, d_out]


def project(x: np.ndarray, d_out: int, seed: int = 0) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x @ projection_matrix(x.shape[-1], d_out, seed)
