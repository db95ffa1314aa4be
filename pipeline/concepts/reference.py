"""Brute-force, plain-Python C3 concept mining with the exact semantics of ``mining.py``.

A dictionary-based inverted index (n-gram tuple -> set of sample ids) and a per-sample loop that
is a direct transcription of Algorithm 1 (Song et al. 2024) plus the documented coverage and
stopword rules.  It is the oracle of the tests and the plain-Python baseline of the benchmark.

It shares with the vectorised miner only the *definitions* (normalisation, concept-id numbering,
the counter-based random draws); the draws are recomputed here on Python integers.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

from .mining import GOLDEN, MASK64, SUBSET_STREAM, MiningParams
from .normalize import stopword_set


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def rng_hash(seed: int, sample_id: int, concept_id: int, draw: int) -> int:
    h = _mix(((seed + 1) * GOLDEN) & MASK64)
    h = _mix(h ^ (sample_id & MASK64))
    h = _mix(h ^ (concept_id & MASK64))
    return _mix(h ^ (((draw + 1) * GOLDEN) & MASK64))


def uniform_below(h: int, r: int) -> int:
    return ((h >> 32) * r) >> 32


def floyd_sample(m: int, k: int, seed: int, sample_id: int, concept_id: int) -> list[int]:
    """Uniform k-subset of range(m) (Floyd), with the shared counter-based draws."""
    chosen: list[int] = []
    for step in range(k):
        j = m - k + step
        t = uniform_below(rng_hash(seed, sample_id, concept_id, step), j + 1)
        chosen.append(j if t in chosen else t)
    return chosen


def _contains(big: tuple, small: tuple) -> bool:
    n = len(small)
    return any(big[j:j + n] == small for j in range(len(big) - n + 1))


def mine_reference(samples: Iterable[tuple[int, Sequence[str]]], params: MiningParams = MiningParams()):
    """``samples``: (sample_id, [caption, ...]).  Returns (rows, vocab) where rows is a list of
    (sample_id, concept_id, [partner sample ids]) in mining order and vocab maps
    concept_id -> (text, n, df) for the concepts used."""
    norm = params.normalizer
    N = params.n_max
    data: dict[int, list[list[str]]] = defaultdict(list)
    for sid, caps in samples:
        data[int(sid)].extend(norm.tokens(c) for c in caps)
    sids = sorted(data)

    index: dict[tuple, set] = defaultdict(set)  # the plain inverted index: n-gram -> samples
    for sid in sids:
        for toks in data[sid]:
            for n in range(1, N + 1):
                for p in range(len(toks) - n + 1):
                    index[tuple(toks[p:p + n])].add(sid)

    # concept ids: all n-grams with df >= 2 ordered by (n, words) - same numbering as the miner
    frequent = sorted((g for g, s in index.items() if len(s) >= 2), key=lambda g: (len(g), g))
    cid_of = {g: i for i, g in enumerate(frequent)}
    stops = stopword_set(params.stopwords) if params.skip_stopword_only else frozenset()
    edge_stops = stopword_set(params.stopwords) if params.skip_stopword_edge else frozenset()
    n_total = len(sids)
    if params.subset_size is not None:
        from scipy.stats import hypergeom

    rows, vocab = [], {}
    for sid in sids:
        caps = data[sid]
        seen, cands = set(), []
        for n in range(N, 0, -1):  # longest first
            for toks in caps:
                for p in range(len(toks) - n + 1):
                    g = tuple(toks[p:p + n])
                    if g not in seen:
                        seen.add(g)
                        cands.append(g)
        accepted: list[tuple] = []
        for g in cands:
            if len(accepted) >= params.k2:
                break  # early termination at K2 concepts
            holders = index[g]
            if len(holders) < 2:
                continue  # no other sample contains it
            if params.skip_stopword_only and all(w.lower() in stops for w in g):
                continue
            if params.skip_stopword_edge and (g[0].lower() in edge_stops or g[-1].lower() in edge_stops):
                continue
            if params.coverage == "contained" and any(len(c) > len(g) and _contains(c, g) for c in accepted):
                continue  # covered by a longer accepted concept
            cid = cid_of[g]
            m = len(holders) - 1
            hits = m
            if params.subset_size is not None:  # hits of the paper's random subset D_s
                h = rng_hash(params.seed, sid, cid, SUBSET_STREAM)
                u = ((h >> 11) + 0.5) * (1.0 / 9007199254740992.0)
                hits = int(hypergeom.ppf(u, n_total, m, min(params.subset_size, n_total)))
                if hits < 1:
                    continue
            others = sorted(holders - {sid})
            picks = floyd_sample(m, min(params.k1, hits), params.seed, sid, cid)
            accepted.append(g)
            rows.append((sid, cid, sorted(others[t] for t in picks)))
            vocab[cid] = (" ".join(g), len(g), len(holders))
    return rows, vocab
