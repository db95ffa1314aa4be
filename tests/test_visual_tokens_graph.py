"""Graph core of visual tokens: exact checks on hand-made scenes and against a brute-force loop."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.visual_tokens.graph import build_graph, knn_by_centre, token_types


# ---------------------------------------------------------------- brute-force reference (loops)
def ref_graph(inst, scores, boxes, threshold=0.05, context=77, max_per_pair=None):
    v = len(inst)
    C = scores.shape[2] if scores.ndim == 3 else 0
    cands = []
    for a in range(v):
        for b in range(v):
            if a == b:
                continue
            preds = [c for c in range(C) if scores[a, b, c] > threshold]
            if max_per_pair is not None:
                best = sorted(range(C), key=lambda c: (-scores[a, b, c], c))[:max_per_pair]
                preds = [c for c in preds if c in best]
            cands += [(a, b, c) for c in preds]
    order = sorted(range(v), key=lambda i: (-inst[i], i))
    keep = []
    for k in range(v + 1):  # largest prefix that fits
        top = set(order[:k])
        us = {c for a, b, c in cands if a in top and b in top}
        if 1 + k + len(us) <= context:
            keep = sorted(top)
    new = {old: i for i, old in enumerate(keep)}
    trip = [(new[a], new[b], c) for a, b, c in cands if a in new and b in new]
    preds = sorted({c for _, _, c in trip})
    trip = sorted((a, b, preds.index(c)) for a, b, c in trip)
    cen = [((boxes[i][0] + boxes[i][2]) / 2, (boxes[i][1] + boxes[i][3]) / 2) for i in keep]
    knn = []
    for i in range(len(keep)):
        others = sorted((j for j in range(len(keep)) if j != i), key=lambda j: (math.dist(cen[i], cen[j]), j))
        knn.append((others + [-1] * 4)[:4])
    nv, nu = len(keep), len(preds)
    T = 1 + nv + nu
    A = np.zeros((T, T), dtype=np.uint8)
    for x, y in itertools.product(range(T), range(T)):
        r = 0
        if 1 <= x <= nv and 1 <= y <= nv:
            a, b = x - 1, y - 1
            if any(s == a and o == b for s, o, _ in trip):
                r = max(r, 7)
            if b in knn[a]:
                r = max(r, 4 - knn[a].index(b))
        if 1 <= x <= nv and y > nv:  # node -> edge
            if any((s == x - 1 or o == x - 1) and u == y - 1 - nv for s, o, u in trip):
                r = max(r, 6)
        if x > nv and 1 <= y <= nv:  # edge -> node
            if any((s == y - 1 or o == y - 1) and u == x - 1 - nv for s, o, u in trip):
                r = max(r, 5)
        A[x, y] = r
    return keep, trip, preds, knn, A


def check_against_ref(inst, scores, boxes, **kw):
    g = build_graph(inst, scores, boxes, **kw)
    keep, trip, preds, knn, A = ref_graph(np.asarray(inst), np.asarray(scores), np.asarray(boxes), **kw)
    assert g.keep.tolist() == keep
    assert [tuple(t) for t in g.triplets.tolist()] == trip
    assert g.predicates.tolist() == preds
    assert g.knn.tolist() == [list(k) for k in knn] or (len(knn) == 0 and g.knn.shape == (0, 4))
    np.testing.assert_array_equal(g.ranks, A)
    assert g.ranks.dtype == np.uint8 and g.n_tokens == A.shape[0] <= kw.get("context", 77)
    return g


# ---------------------------------------------------------------- hand-made scenes, exact values
def sq(cx, cy, r=1.0):
    return [cx - r, cy - r, cx + r, cy + r]


def test_three_instances_exact_ranks():
    # instances on a line at x = 0, 1, 3; predicates: 0 -[2]-> 1 (0.9), 2 -[0]-> 0 (0.06), one under threshold
    boxes = np.array([sq(0, 0), sq(1, 0), sq(3, 0)])
    S = np.zeros((3, 3, 4), np.float32)
    S[0, 1, 2] = 0.9
    S[2, 0, 0] = 0.06
    S[1, 2, 3] = 0.05  # exactly at the threshold: not "over" it
    S[1, 1, 1] = 0.99  # diagonal: masked
    g = build_graph(np.ones(3), S, boxes)
    assert g.keep.tolist() == [0, 1, 2]
    assert g.predicates.tolist() == [0, 2]  # U ordered by vocabulary index
    assert g.triplets.tolist() == [[0, 1, 1], [2, 0, 0]]
    assert g.knn.tolist() == [[1, 2, -1, -1], [0, 2, -1, -1], [1, 0, -1, -1]]
    # T = [I, v0, v1, v2, u0(pred 0), u1(pred 2)]
    A = np.array(
        [
            [0, 0, 0, 0, 0, 0],
            [0, 0, 7, 3, 6, 6],  # v0: ->v1 triplet (7 beats 1st-NN 4); v2 2nd NN; object of u0, subject of u1
            [0, 4, 0, 3, 0, 0],  # v1: NN v0 (4), v2 (3); v1 is object of u1 -> 6
            [0, 7, 4, 0, 6, 0],  # v2: ->v0 triplet (7 beats 2nd NN 3); 1st NN v1; node->u0
            [0, 5, 0, 5, 0, 0],  # u0 -> its subject v2 and object v0
            [0, 5, 5, 0, 0, 0],  # u1 -> v0, v1
        ],
        dtype=np.uint8,
    )
    A[2, 5] = 6
    np.testing.assert_array_equal(g.ranks, A)
    assert token_types(3, 2).tolist() == [0, 1, 1, 1, 2, 2]
    check_against_ref(np.ones(3), S, boxes)


def test_knn_ties_go_to_lower_index_and_pad():
    # centre 0 at origin, 1..4 all at distance 1, 5 at distance 2
    boxes = np.array([sq(0, 0), sq(0, 1), sq(1, 0), sq(0, -1), sq(-1, 0), sq(2, 0)])
    knn = knn_by_centre(boxes)
    assert knn[0].tolist() == [1, 2, 3, 4]
    assert knn[5].tolist() == [2, 0, 1, 3]  # 2 at 1; 0 at 2; 1 and 3 at sqrt(5): tie -> 1 first
    assert knn_by_centre(boxes[:2]).tolist() == [[1, -1, -1, -1], [0, -1, -1, -1]]


def test_zero_and_one_instance():
    g0 = build_graph(np.zeros(0), np.zeros((0, 0, 56)), np.zeros((0, 4)))
    assert g0.keep.shape == (0,) and g0.triplets.shape == (0, 3) and g0.knn.shape == (0, 4)
    np.testing.assert_array_equal(g0.ranks, np.zeros((1, 1), np.uint8))
    g1 = build_graph(np.ones(1), np.full((1, 1, 56), 0.9), np.array([sq(5, 5)]))
    assert g1.keep.tolist() == [0] and g1.triplets.shape == (0, 3) and g1.predicates.shape == (0,)
    assert g1.knn.tolist() == [[-1, -1, -1, -1]]
    np.testing.assert_array_equal(g1.ranks, np.zeros((2, 2), np.uint8))


def test_missing_relations_leave_only_knn():
    boxes = np.array([sq(0, 0), sq(5, 0)])
    g = build_graph(np.ones(2), np.zeros((2, 2, 56)), boxes)
    assert g.triplets.shape == (0, 3) and g.predicates.size == 0
    np.testing.assert_array_equal(g.ranks, np.array([[0, 0, 0], [0, 0, 4], [0, 4, 0]], np.uint8))


def test_truncation_keeps_highest_scoring_instances():
    # 5 instances, all pairs related by predicate (a+b) % 7 -> many predicates; context 8
    v, C = 5, 7
    S = np.zeros((v, v, C), np.float32)
    for a in range(v):
        for b in range(v):
            if a != b:
                S[a, b, (a + b) % C] = 0.5
    inst = np.array([0.1, 0.9, 0.5, 0.9, 0.2])  # order: 1, 3 (tie -> lower index first), 2, 4, 0
    boxes = np.array([sq(i, 0) for i in range(v)])
    g = check_against_ref(inst, S, boxes, context=8)
    # k=3 (1,3,2): predicates {4, 3, 5} -> T = 1+3+3 = 7; k=4 adds 4: {4,3,5,6,0} -> 10 > 8
    assert g.keep.tolist() == [1, 2, 3]
    assert g.n_tokens == 7
    # a context that fits only the image feature
    assert build_graph(inst, S, boxes, context=1).keep.size == 0
    g2 = check_against_ref(inst, S, boxes, context=3)  # k=1 -> T=2; k=2 -> 1+2+1 = 4 > 3
    assert g2.keep.tolist() == [1]


def test_max_per_pair():
    S = np.zeros((2, 2, 5), np.float32)
    S[0, 1] = [0.3, 0.9, 0.3, 0.01, 0.5]
    g = build_graph(np.ones(2), S, np.array([sq(0, 0), sq(1, 0)]), max_per_pair=2)
    assert g.predicates.tolist() == [1, 4]
    g3 = check_against_ref(np.ones(2), S, np.array([sq(0, 0), sq(1, 0)]), max_per_pair=3)
    assert g3.predicates.tolist() == [0, 1, 4]  # tie 0.3/0.3 -> lower vocabulary index


@pytest.mark.parametrize("seed", range(12))
def test_random_scenes_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    v = int(rng.integers(0, 12))
    C = int(rng.integers(1, 9))
    S = (rng.random((v, v, C)) ** 6).astype(np.float32)  # mostly under the threshold
    # integer-grid boxes: many exact distance ties
    xy = rng.integers(0, 4, size=(v, 2)).astype(float)
    boxes = np.concatenate([xy, xy + rng.integers(1, 3, size=(v, 2))], axis=1)
    inst = rng.integers(0, 3, size=v) / 2.0  # score ties
    context = int(rng.choice([77, 12, 6, 2]))
    mpp = [None, 1, 2][seed % 3]
    check_against_ref(inst, S, boxes, context=context, max_per_pair=mpp)
