"""The scene-graph core of visual tokens (Kalibhat et al., Sec. 4.1-4.2), pure vectorised numpy.

Inputs per image: instance scores ``[V]`` (segmenter confidence), predicate scores ``[V, V, C]``
(relation predictor; ``scores[a, b, c]`` = P(subject a --c--> object b)) and boxes ``[V, 4]``
(x0, y0, x1, y1). :func:`build_graph` turns them into what the ``visual_tokens`` artifact stores:

* **Triplets** E: every ordered pair a != b and predicate c with ``scores[a, b, c] > threshold``
  (paper: 0.05, "as specified by the RAM model"; strictly greater, as RAM keeps scores *over* it).
  The diagonal (an instance related to itself) is always masked, as RAM does. Optionally only the
  ``max_per_pair`` best predicates of each pair are kept (None: all, the paper's rule).
* **Intangible tokens** U: one per *distinct* predicate used by a kept triplet, ordered by
  vocabulary index, so ``predicates[u]`` is the vocabulary index of token u and a triplet row is
  (subject index in V, object index in V, index in U). Triplet rows are sorted by
  (subject, object, vocabulary index).
* **Truncation** to the context length L (paper: 77): |T| = 1 + |V| + |U| must be <= L. Instances
  are ranked by score (ties: lower input index first) and the largest prefix k is kept such that
  1 + k + |U(k)| <= L, where U(k) are the predicates of triplets among those k instances. Since
  |U(k)| never decreases, 1 + k + |U(k)| grows strictly with k, so the largest feasible k is well
  defined and found with one cumulative count (no loop). Instances keep their input order.
* **4-NN**: for each kept instance the (up to) 4 nearest *other* kept instances by Euclidean
  distance between box centres, nearest first; ties in distance are broken by the lower instance
  index (stable sort); -1 where fewer than 4 others exist.
* **Attention ranks** A [T, T] uint8 over T = (image feature, V..., U...):
  7 node->node (A[s, o] for each triplet, directional: A[o, s] is not set by it),
  6 node->edge (A[s, u] and A[o, u]), 5 edge->node (A[u, s] and A[u, o]),
  4, 3, 2, 1 for the 1st..4th nearest neighbour (A[a, knn[a, k]] = 4 - k; directional),
  0 otherwise (the image-feature row/column, the diagonal, padding).
  A pair in several categories gets the highest rank (only 7 and the kNN ranks can meet, on a
  node->node pair; 6/5 always involve an edge token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RANK_NODE_NODE = 7
RANK_NODE_EDGE = 6
RANK_EDGE_NODE = 5
RANK_KNN = (4, 3, 2, 1)  # first .. fourth nearest neighbour
K_NEIGHBOURS = 4
TOKEN_IMAGE, TOKEN_TANGIBLE, TOKEN_INTANGIBLE = 0, 1, 2


@dataclass
class Graph:
    keep: np.ndarray  # [V'] int64 indices of the kept instances in the input order
    triplets: np.ndarray  # [E, 3] int64 (subject in V', object in V', predicate in U)
    triplet_scores: np.ndarray  # [E] float32
    predicates: np.ndarray  # [U] int64 vocabulary index of each intangible token
    knn: np.ndarray  # [V', 4] int64, -1 padded
    ranks: np.ndarray  # [T, T] uint8, T = 1 + V' + U

    @property
    def n_tokens(self) -> int:
        return 1 + len(self.keep) + len(self.predicates)


def box_centres(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2], axis=1)


def knn_by_centre(boxes: np.ndarray, k: int = K_NEIGHBOURS) -> np.ndarray:
    """[V, k] nearest other instances by box-centre distance, nearest first, ties -> lower index."""
    c = box_centres(boxes)
    v = len(c)
    out = np.full((v, k), -1, dtype=np.int64)
    if v <= 1:
        return out
    d2 = ((c[:, None, :] - c[None, :, :]) ** 2).sum(-1)  # squared distance: same order, exact ties
    np.fill_diagonal(d2, np.inf)
    order = np.argsort(d2, axis=1, kind="stable")[:, : min(k, v - 1)]
    out[:, : order.shape[1]] = order
    return out


def triplet_candidates(scores: np.ndarray, threshold: float, max_per_pair: int | None = None):
    """(a, b, c, score) arrays of every score over ``threshold`` with a != b."""
    s = np.asarray(scores, dtype=np.float32)
    v = s.shape[0]
    if v == 0 or s.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, np.zeros(0, dtype=np.float32)
    ok = s > threshold
    ok[np.arange(v), np.arange(v), :] = False
    if max_per_pair is not None and max_per_pair < s.shape[2]:
        # rank of each predicate inside its pair (stable: equal scores -> lower vocabulary index)
        order = np.argsort(-s, axis=2, kind="stable")
        rank = np.argsort(order, axis=2)  # inverse permutation: position of each predicate
        ok &= rank < max_per_pair
    a, b, c = np.nonzero(ok)  # lexicographic (a, b, c) order
    return a.astype(np.int64), b.astype(np.int64), c.astype(np.int64), s[a, b, c]


def truncate(instance_scores: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, n_predicates: int, context: int) -> np.ndarray:
    """Indices (input order) of the instances kept under the context length; see module doc."""
    scores = np.asarray(instance_scores, dtype=np.float64)
    v = len(scores)
    budget = context - 1  # the image feature always takes one slot
    if v == 0 or budget <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-scores, kind="stable")
    pos = np.empty(v, dtype=np.int64)
    pos[order] = np.arange(v)
    # predicate c first appears once both endpoints of one of its triplets are in the prefix
    first_k = np.full(n_predicates, v + 1, dtype=np.int64)
    if len(c):  # group-wise minimum by predicate (sort + reduceat; ufunc.at is slow for many triplets)
        need = np.maximum(pos[a], pos[b]) + 1
        by_c = np.argsort(c, kind="stable")
        cs = c[by_c]
        starts = np.flatnonzero(np.concatenate(([True], cs[1:] != cs[:-1])))
        first_k[cs[starts]] = np.minimum.reduceat(need[by_c], starts)
    n_u = np.cumsum(np.bincount(np.minimum(first_k, v + 1), minlength=v + 2))[: v + 1]  # |U(k)|, k=0..v
    total = np.arange(v + 1) + n_u  # k + |U(k)|, strictly increasing
    k = int(np.searchsorted(total, budget, side="right") - 1)
    return np.sort(order[:k])


def rank_matrix(n_v: int, triplets: np.ndarray, n_u: int, knn: np.ndarray) -> np.ndarray:
    """Ranks written in increasing order so the highest wins: each (a, b) occurs at most once among
    the kNN cells, 7 then overwrites kNN ranks on the same node pair, and 6 / 5 cells (node-edge,
    edge-node) never meet another category. Equal to an element-wise maximum (tested against one)."""
    t = 1 + n_v + n_u
    A = np.zeros((t, t), dtype=np.uint8)
    if n_v:
        rows = np.repeat(np.arange(n_v), knn.shape[1])
        cols = knn.reshape(-1)
        vals = np.tile(np.asarray(RANK_KNN[: knn.shape[1]], dtype=np.uint8), n_v)
        ok = cols >= 0
        A[1 + rows[ok], 1 + cols[ok]] = vals[ok]
    if len(triplets):
        s, o, u = 1 + triplets[:, 0], 1 + triplets[:, 1], 1 + n_v + triplets[:, 2]
        A[s, o] = RANK_NODE_NODE
        A[np.concatenate([s, o]), np.concatenate([u, u])] = RANK_NODE_EDGE
        A[np.concatenate([u, u]), np.concatenate([s, o])] = RANK_EDGE_NODE
    return A


def build_graph(
    instance_scores: np.ndarray,
    predicate_scores: np.ndarray,
    boxes: np.ndarray,
    *,
    threshold: float = 0.05,
    context: int = 77,
    max_per_pair: int | None = None,
) -> Graph:
    inst = np.asarray(instance_scores, dtype=np.float64).reshape(-1)
    v = len(inst)
    ps = np.asarray(predicate_scores, dtype=np.float32)
    n_pred = ps.shape[2] if ps.ndim == 3 else 0
    if v == 0:
        ps = np.zeros((0, 0, n_pred), dtype=np.float32)
    if ps.shape[:2] != (v, v):
        raise ValueError(f"predicate scores {ps.shape} do not match {v} instances")
    a, b, c, sc = triplet_candidates(ps, threshold, max_per_pair)
    keep = truncate(inst, a, b, c, n_pred, context)
    new_index = np.full(v, -1, dtype=np.int64)
    new_index[keep] = np.arange(len(keep))
    sel = (new_index[a] >= 0) & (new_index[b] >= 0) if len(a) else np.zeros(0, dtype=bool)
    a, b, c, sc = new_index[a[sel]], new_index[b[sel]], c[sel], sc[sel]
    predicates = np.unique(c)  # sorted vocabulary indices
    u = np.searchsorted(predicates, c)
    triplets = np.stack([a, b, u], axis=1).astype(np.int64) if len(a) else np.zeros((0, 3), dtype=np.int64)
    # already lexicographic in (a, b, c) because np.nonzero scans in C order and new_index is monotone
    knn = knn_by_centre(np.asarray(boxes, dtype=np.float64).reshape(-1, 4)[keep])
    ranks = rank_matrix(len(keep), triplets, len(predicates), knn)
    return Graph(keep.astype(np.int64), triplets, sc.astype(np.float32), predicates.astype(np.int64), knn, ranks)


def token_types(n_v: int, n_u: int) -> np.ndarray:
    return np.concatenate([[TOKEN_IMAGE], np.full(n_v, TOKEN_TANGIBLE), np.full(n_u, TOKEN_INTANGIBLE)]).astype(np.int8)
