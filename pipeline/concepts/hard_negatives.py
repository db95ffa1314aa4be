"""Hard concept negatives for MCP type-2 negatives ("replace the concept with another concept C'",
Song et al. 2024, Sec. 3.3): for each concept, the nearest *other* concepts by text embedding,
excluding the concepts that contain it or that it contains (those are not different concepts:
"a small kitten" vs "small kitten" would make a false negative).

Search is FAISS inner product on L2-normalised embeddings (= cosine).  ``index="flat"`` is exact;
``"hnsw"`` (HNSW, M=32, efSearch >= 4k) is approximate and meant for vocabularies of millions;
``"auto"`` picks flat up to ``flat_max`` concepts.  Rows are searched for ``k`` + a margin of
extra neighbours; rows whose margin was eaten by excluded concepts are searched again deeper
(doubling), so every row ends with ``min(k, eligible concepts)`` negatives.
"""
from __future__ import annotations

import logging

import numpy as np


def token_matrix(texts: list[str], n_max: int) -> np.ndarray:
    """Word ids [len(texts), n_max] (-1 padded) of space-separated concept texts."""
    import polars as pl

    words = pl.Series(texts, dtype=pl.String).str.split(" ")
    lens = words.list.len().to_numpy().astype(np.int64)
    if len(lens) and lens.max() > n_max:
        raise ValueError("a concept is longer than n_max words")
    flat = words.explode()
    ids = flat.cast(pl.Categorical).to_physical().to_numpy().astype(np.int64)
    out = np.full((len(texts), n_max), -1, dtype=np.int64)
    rows = np.repeat(np.arange(len(texts)), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    out[rows, cols] = ids
    return out


def related(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise: word sequence a[i] contains b[i] or is contained in it (contiguously)."""
    return _contains(a, b) | _contains(b, a)


def _contains(big: np.ndarray, small: np.ndarray) -> np.ndarray:
    P, N = big.shape
    pad = np.concatenate([big, np.full((P, N), -2, dtype=big.dtype)], axis=1)  # -2 never matches
    hit = np.zeros(P, dtype=bool)
    for j in range(N):
        ok = np.ones(P, dtype=bool)
        for t in range(N):
            ok &= (small[:, t] == -1) | (pad[:, j + t] == small[:, t])
        hit |= ok
    return hit


def _build_index(emb: np.ndarray, kind: str, flat_max: int, k: int):
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    d = emb.shape[1]
    if kind == "auto":
        kind = "flat" if len(emb) <= flat_max else "hnsw"
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = max(64, 4 * k)
    else:
        raise ValueError(f"hard negative index must be auto, flat or hnsw, got {kind!r}")
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    return index, kind


def search_depth(n: int, k: int, margin: int | None = None) -> int:
    """Neighbours searched per concept on the first pass: ``k`` plus a margin for the ones skipped
    (itself, related concepts); the rare concept left short is searched again twice as deep."""
    return min(n, k + (margin if margin is not None else max(8, k)))


def mine_hard_negatives(emb: np.ndarray, tokens: np.ndarray, k: int = 10, index: str = "auto",
                        flat_max: int = 200_000, batch: int = 8192, margin: int | None = None,
                        exclude_related: bool = True):
    """Returns (neighbours int64 [U, k] row indices, -1 padded; scores float32 [U, k]; index kind)."""
    U = len(emb)
    nb = np.full((U, k), -1, dtype=np.int64)
    sc = np.zeros((U, k), dtype=np.float32)
    if U <= 1 or k == 0:
        return nb, sc, "flat"
    idx, kind = _build_index(emb, index, flat_max, k)
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    todo = np.arange(U)
    depth = search_depth(U, k, margin)
    while len(todo):
        nxt = []
        for s in range(0, len(todo), batch):
            rows = todo[s:s + batch]
            D, I = idx.search(emb[rows], depth)
            q = np.repeat(rows, depth)
            c = I.reshape(-1)
            ok = (c >= 0) & (c != q)
            if exclude_related:
                cc = np.where(ok, c, 0)
                ok &= ~related(tokens[q], tokens[cc])
            ok = ok.reshape(len(rows), depth)
            # stable: keep search order (best first) among the allowed neighbours
            order = np.argsort(~ok, axis=1, kind="stable")[:, :k]
            got = np.take_along_axis(ok, order, 1)
            kk = order.shape[1]  # < k when the vocabulary has fewer than k other concepts
            nb[rows, :kk] = np.where(got, np.take_along_axis(I, order, 1), -1)
            sc[rows, :kk] = np.where(got, np.take_along_axis(D, order, 1), 0).astype(np.float32)
            nb[rows, kk:], sc[rows, kk:] = -1, 0
            short = got.sum(1) < k
            if depth < U and short.any():
                nxt.append(rows[short])
        todo = np.concatenate(nxt) if nxt else np.zeros(0, np.int64)
        depth = min(U, depth * 2)
    return nb, sc, kind
