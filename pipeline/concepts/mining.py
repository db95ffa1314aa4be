"""Vectorised C3 concept mining (Song et al. 2024, Sec. 3.2, Algorithm 1).

Semantics (shared exactly with :mod:`pipeline.concepts.reference`):

* A sample's text is all of its captions; candidates are its *distinct* word n-grams for
  ``n = n_max .. 1`` (longest first), never spanning two captions; within one n, in order of first
  occurrence (caption order, then position).
* A candidate is a concept of sample i when at least one *other* sample contains it, i.e. its
  document frequency over the whole dataset (number of samples whose text contains it) is >= 2.
  This is the exact version of Algorithm 1's retrieval; with ``subset_size=S`` the paper's random
  subset D_s (S samples drawn uniformly from D, afresh for every candidate) is reproduced: the number
  of other containing samples that fall in D_s is drawn from Hypergeometric(|D|, df-1, S) and the
  candidate is a concept only if that number is >= 1.
* Coverage ("the longer concept covers the shorter one"): a candidate that is a contiguous
  sub-sequence of a concept already accepted for the same sample is skipped (``coverage="contained"``;
  ``"none"`` is Algorithm 1 verbatim).  Candidates made only of stopwords are skipped (option).
  Not in the paper (option ``skip_stopword_edge``, default off): candidates whose first or last word is
  a stopword ("in the center of the", "a red circle") are skipped before coverage, so the phrase
  inside them ("red circle") is the concept: a phrase-boundary filter for templated captions.
* At most ``k2`` concepts per sample (early termination in Algorithm 1), each with up to ``k1``
  partner samples drawn uniformly without replacement from the other samples containing it (the
  first K1 hits of a randomly ordered scan, as in Algorithm 1).

Output order and ids: rows per sample in mining order; ``partners`` ascending by sample id.
``concept_id`` numbers every n-gram with df >= 2 by (n, then lexicographic order of its words),
a definition that depends only on the dataset, not on chunking or workers; ``vocab`` lists the
ids actually used.

Exactness: n-grams are never hashed.  Level n keys are the exact pair (dense id of the (n-1)-gram
prefix, last token id) packed into one int64 (asserted to fit), then renumbered densely among the
n-grams with df >= 2.  So there are no collisions by construction.  Apriori pruning: an n-gram can
have df >= 2 only if its (n-1)-prefix and (n-1)-suffix do, so only those positions are counted.

Randomness is counter-based: every draw is splitmix64(seed, sample_id, concept_id, draw index),
so results do not depend on chunking, worker count or processing order.  Partner subsets use
Floyd's algorithm (K1 draws per concept, O(K1) regardless of df); a draw in [0, r) is
``((h >> 32) * r) >> 32`` whose bias is below r / 2**32 (negligible, documented).

Memory: captions are tokenised in chunks; the whole-dataset state is O(tokens) int32 arrays (token
ids, per-level n-gram ids, postings) - about 4 bytes x tokens x (n_max + 3) at the peak; the
per-sample selection and partner sampling run in sample chunks (and Ray tasks, see the stage).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from .normalize import Normalizer, Tokenized, stopword_set, tokenize

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
PACK_BITS = 63  # bits available for packed sort keys (tests lower it to exercise the fallbacks)
SUBSET_STREAM = 1 << 20  # draw index used for the D_s hypergeometric draw (partners use 0..k1-1)


@dataclass(frozen=True)
class MiningParams:
    n_max: int = 5  # N: n-grams for n in [1, N] (paper: 1..5)
    k1: int = 5  # partners per concept (paper: 5)
    k2: int = 80  # concepts per sample (paper: 80)
    seed: int = 0
    subset_size: int | None = None  # None = exact whole-dataset index; S = paper's random D_s
    coverage: str = "contained"  # "contained" | "none"
    skip_stopword_only: bool = True
    skip_stopword_edge: bool = False  # not in the paper: skip candidates that begin or end with a stopword
    stopwords: str | tuple[str, ...] = "nltk"
    lowercase: bool = True
    unicode_form: str | None = "NFKC"
    token_pattern: str = r"[^\W_]+(?:'[^\W_]+)*"
    chunk_samples: int = 50_000  # samples per selection chunk (bounds transient memory)
    chunk_captions: int = 500_000  # captions per tokenisation chunk

    def __post_init__(self):
        if self.n_max < 1 or self.k1 < 1 or self.k2 < 1:
            raise ValueError("n_max, k1 and k2 must be >= 1")
        if self.coverage not in ("contained", "none"):
            raise ValueError(f"coverage must be 'contained' or 'none', got {self.coverage!r}")
        if self.subset_size is not None and self.subset_size < 1:
            raise ValueError("subset_size must be >= 1 or None")

    @property
    def normalizer(self) -> Normalizer:
        return Normalizer(self.lowercase, self.unicode_form, self.token_pattern)


# ----------------------------------------------------------------------------------------------
# counter-based RNG (identical arithmetic in reference.py, on Python ints)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rng_hash(seed: int, sample_id: np.ndarray, concept_id: np.ndarray, draw: int | np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        k0 = _mix(np.asarray([((seed + 1) * GOLDEN) & MASK64], dtype=np.uint64))
        h = _mix(k0 ^ np.asarray(sample_id).astype(np.int64).view(np.uint64))
        h = _mix(h ^ np.asarray(concept_id).astype(np.int64).view(np.uint64))
        d = (np.asarray(draw, dtype=np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)
        return _mix(h ^ d)


def uniform_below(h: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Integer in [0, r) from a 64-bit hash (r < 2**32)."""
    return ((h >> np.uint64(32)) * np.asarray(r).astype(np.uint64)) >> np.uint64(32)


def unit_float(h: np.ndarray) -> np.ndarray:
    """Float in (0, 1) from a 64-bit hash."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def subset_hits(u: np.ndarray, n_total: int, n_good: np.ndarray, subset_size: int) -> np.ndarray:
    """How many of the ``n_good`` other containing samples fall in a uniform ``subset_size``-subset
    of the ``n_total`` samples (inverse-CDF of the hypergeometric law at ``u``)."""
    from scipy.stats import hypergeom

    s = min(subset_size, n_total)
    return hypergeom.ppf(u, n_total, n_good, s).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# whole-dataset n-gram index


@dataclass
class Level:
    n: int
    base: int  # concept_id = base + level id
    ids: np.ndarray  # int32 [L]: level id of the n-gram starting at each position, -1 if df < 2
    prank: np.ndarray  # int32 [L]: rank of the position's sample in that n-gram's posting list
    df: np.ndarray  # int32 [C_n]
    stop: np.ndarray  # bool [C_n]: made only of stopwords
    post: np.ndarray  # int32: sample indices, CSR by level id, ascending within each id
    off: np.ndarray  # int64 [C_n + 1]
    rep: np.ndarray  # int64 [C_n]: one position where the n-gram occurs

    @property
    def count(self) -> int:
        return len(self.df)


@dataclass
class NgramIndex:
    words: list[str]
    tokens: np.ndarray  # int32 [L]
    pos_sample: np.ndarray  # int32 [L]: sample index of each position
    sample_pos: np.ndarray  # int64 [S + 1]: position range of each sample
    sample_ids: np.ndarray  # int64 [S], ascending
    levels: list[Level] = field(default_factory=list)  # levels[n - 1]

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)

    def level_of_concept(self, cid: np.ndarray) -> np.ndarray:
        bases = np.array([lv.base for lv in self.levels], dtype=np.int64)
        return np.searchsorted(bases, cid, side="right")  # = n


def _sort_pairs(keys: np.ndarray, samp: np.ndarray, pos: np.ndarray, n_samples: int):
    """Order by (key, sample).  Sorting one packed int64 is ~3x faster than a two-column sort; when
    the packed value could overflow, keys are first renumbered densely (order-preserving)."""
    kmax = int(keys.max()) if len(keys) else 0
    if (kmax + 1) * max(n_samples, 1) >= 2**PACK_BITS:
        keys = pl.Series(keys).rank("dense").to_numpy().astype(np.int64) - 1
        kmax = int(keys.max())
    order = pl.Series(keys * n_samples + samp).arg_sort().to_numpy()
    return order


def build_index(
    tok: Tokenized, cap_sample: np.ndarray, sample_ids: np.ndarray, params: MiningParams,
    progress: Callable[[str], None] | None = None,
) -> NgramIndex:
    """``cap_sample[c]`` is the sample index (into ascending ``sample_ids``) of caption c; captions
    must be grouped by sample in ascending order (caption order within a sample is kept)."""
    tokens, cap_len = tok.tokens, tok.cap_len
    L, V = len(tokens), max(len(tok.words), 1)
    S = len(sample_ids)
    cap_sample = np.asarray(cap_sample, dtype=np.int64)
    if len(cap_sample) and np.any(np.diff(cap_sample) < 0):
        raise ValueError("captions must be grouped by ascending sample index")
    pos_sample = np.repeat(cap_sample.astype(np.int32), cap_len)
    cap_end = np.cumsum(cap_len, dtype=np.int64)
    # remaining tokens in the caption from each position (clipped to n_max, fits in int8/int16)
    rem = (np.repeat(cap_end, cap_len) - np.arange(L, dtype=np.int64)).clip(max=params.n_max).astype(np.int16)
    tok_per_sample = np.bincount(cap_sample, weights=cap_len, minlength=S).astype(np.int64)
    sample_pos = np.concatenate([[0], np.cumsum(tok_per_sample)]).astype(np.int64)
    stops = stopword_set(params.stopwords) if params.skip_stopword_only else frozenset()
    is_stop_tok = np.fromiter((w.lower() in stops for w in tok.words), dtype=bool, count=len(tok.words))

    idx = NgramIndex(tok.words, tokens, pos_sample, sample_pos, np.asarray(sample_ids, np.int64))
    base = 0
    prev: Level | None = None
    for n in range(1, params.n_max + 1):
        if prev is None:
            pos = np.arange(L, dtype=np.int64)
            keys = tokens.astype(np.int64)
        else:
            # exact key of the n-gram at p: (level id of its (n-1)-prefix, level-1 id of its last
            # token); both are dense ranks, so the packed key is collision free and its numeric
            # order is the lexicographic order of the word tuples.
            C1 = idx.levels[0].count
            if prev.count * C1 >= 2**62:
                raise OverflowError("n-gram key would not fit in int64")
            pid = prev.ids
            ok = rem >= n
            ok &= pid >= 0
            ok[:-1] &= pid[1:] >= 0  # the suffix (n-1)-gram must have df >= 2 too
            pos = np.flatnonzero(ok)
            keys = pid[pos].astype(np.int64) * C1 + idx.levels[0].ids[pos + (n - 1)]
        ids = np.full(L, -1, dtype=np.int32)
        if len(pos):
            M = len(pos)
            b = max(int(M - 1).bit_length(), 1)
            if b < PACK_BITS and int(keys.max()) < (1 << (PACK_BITS - b)):
                # pack (key, index) into one int64: np.sort is far faster than any argsort, and
                # positions ascending inside a key means samples ascending too
                packed = np.sort((keys << b) | np.arange(M, dtype=np.int64))
                ks = packed >> b
                ps = pos[packed & ((1 << b) - 1)]
                del packed
            else:
                order = _sort_pairs(keys, pos_sample[pos], pos, S)
                ks, ps = keys[order], pos[order]
                del order
            ss = pos_sample[ps]
            newkey = np.empty(len(ks), dtype=bool)
            newkey[0] = True
            np.not_equal(ks[1:], ks[:-1], out=newkey[1:])
            newpair = newkey.copy()
            newpair[1:] |= ss[1:] != ss[:-1]
            gstart = np.flatnonzero(newkey)
            gid = np.cumsum(newkey) - 1
            dfc = np.add.reduceat(newpair.astype(np.int32), gstart)
            keep = dfc >= 2
            gmap = np.where(keep, np.cumsum(keep) - 1, -1).astype(np.int32)
            ids[ps] = gmap[gid]
            prank = np.zeros(L, dtype=np.int32)
            pidx = np.cumsum(newpair) - 1  # index of the (key, sample) pair among distinct pairs
            prank[ps] = pidx - pidx[gstart][gid]
            del pidx
            rep_keys = ks[gstart[keep]]
            df = dfc[keep].astype(np.int32)
            pm = newpair & keep[gid]
            post = ss[pm].astype(np.int32)
            rep = ps[gstart[keep]].astype(np.int64)
            if prev is None:
                stop = is_stop_tok[rep_keys]
            else:
                stop = prev.stop[rep_keys // C1] & idx.levels[0].stop[rep_keys % C1]
            del ks, ss, ps, newkey, newpair, gid, pm
        else:
            df = np.zeros(0, np.int32)
            post = np.zeros(0, np.int32)
            rep = np.zeros(0, np.int64)
            stop = np.zeros(0, bool)
            prank = np.zeros(L, dtype=np.int32)
        off = np.concatenate([[0], np.cumsum(df, dtype=np.int64)])
        lv = Level(n, base, ids, prank, df, stop, post, off, rep)
        idx.levels.append(lv)
        base += lv.count
        prev = lv
        del pos, keys
        if progress:
            progress(f"level n={n}: {lv.count} n-grams with df>=2")
    return idx


# ----------------------------------------------------------------------------------------------
# per-sample selection and partner sampling (runs on a sample range, independent of other ranges)


def _first_uncovered(key: np.ndarray, covered: np.ndarray | None) -> np.ndarray:
    """Indices (ascending) of the first occurrence of each distinct key that is not in ``covered``.

    Packs (key, index) into one int64 and uses ``np.sort`` (SIMD, ~30x faster than a stable
    argsort in numpy 2.x); membership is a searchsorted of the *sorted* keys into the sorted
    covered set, which stays cache friendly.  Falls back to argsort when the packing would overflow.
    """
    m = len(key)
    if m == 0:
        return np.zeros(0, np.int64)
    b = max(int(m - 1).bit_length(), 1)
    if b < PACK_BITS and int(key.max()) < (1 << (PACK_BITS - b)):
        packed = np.sort((key << b) | np.arange(m, dtype=np.int64))
        ks, order = packed >> b, packed & ((1 << b) - 1)
    else:
        order = np.argsort(key, kind="stable")
        ks = key[order]
    first = np.ones(m, dtype=bool)
    first[1:] = ks[1:] != ks[:-1]
    if covered is not None and len(covered):
        cov = np.sort(covered)
        j = np.searchsorted(cov, ks)
        first &= cov[np.minimum(j, len(cov) - 1)] != ks
    return np.sort(order[first])


def _rank_in_group(g: np.ndarray) -> np.ndarray:
    """0,1,2.. within runs of equal values of a non-decreasing array."""
    if len(g) == 0:
        return np.zeros(0, np.int64)
    start = np.ones(len(g), dtype=bool)
    start[1:] = g[1:] != g[:-1]
    idx = np.arange(len(g))
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


@dataclass
class Selection:
    """Accepted concepts of a sample range, in mining order (sample, then n desc, first occurrence)."""

    sample: np.ndarray  # int64 sample index
    n: np.ndarray  # int64
    gid: np.ndarray  # int64 level id
    cid: np.ndarray  # int64 concept id
    n_other: np.ndarray  # int64: df - 1, the other samples containing the concept
    k: np.ndarray  # int64: partners to draw (min(k1, df-1), or min(k1, hits in D_s))
    me: np.ndarray  # int64: rank of the sample itself in the concept's posting list


def select_range(idx: NgramIndex, a: int, b: int, params: MiningParams) -> Selection:
    P0, P1 = int(idx.sample_pos[a]), int(idx.sample_pos[b])
    nloc = b - a
    count = np.zeros(nloc, dtype=np.int64)
    covered: dict[int, list[np.ndarray]] = {n: [] for n in range(1, params.n_max + 1)}
    out = []
    S = idx.n_samples
    edge_stop = None
    if params.skip_stopword_edge:
        stops = stopword_set(params.stopwords)
        edge_stop = np.fromiter((w.lower() in stops for w in idx.words), dtype=bool, count=len(idx.words))
    for n in range(params.n_max, 0, -1):
        lv = idx.levels[n - 1]
        if lv.count == 0:
            continue
        ids = lv.ids[P0:P1]
        m = ids >= 0
        if params.skip_stopword_only:
            m &= ~lv.stop[np.where(m, ids, 0)]
        if edge_stop is not None:
            t0 = idx.tokens[P0:P1]
            t1 = idx.tokens[np.minimum(np.arange(P0, P1) + (n - 1), len(idx.tokens) - 1)]
            m &= ~(edge_stop[t0] | edge_stop[t1])  # only positions with ids >= 0 matter (whole n-grams)
        pos = np.flatnonzero(m)
        if len(pos) == 0:
            continue
        g = ids[pos].astype(np.int64)
        s = idx.pos_sample[P0 + pos].astype(np.int64) - a
        key = s * lv.count + g
        keepi = _first_uncovered(key, np.concatenate(covered[n]) if covered[n] else None)
        pos, g, s = pos[keepi], g[keepi], s[keepi]
        me = lv.prank[P0 + pos].astype(np.int64)
        cid = lv.base + g
        n_other = lv.df[g].astype(np.int64) - 1
        hits = n_other
        if params.subset_size is not None and len(g):
            # hits of a fresh random D_s among the other containing samples; the partners are then
            # a uniform min(k1, hits)-subset of a uniform hits-subset = uniform subset of all others
            u = unit_float(rng_hash(params.seed, idx.sample_ids[a + s], cid, SUBSET_STREAM))
            hits = subset_hits(u, S, n_other, params.subset_size)
            m3 = hits >= 1
            pos, g, s, cid, n_other, hits, me = pos[m3], g[m3], s[m3], cid[m3], n_other[m3], hits[m3], me[m3]
        r = _rank_in_group(s)
        m4 = r < (params.k2 - count[s])
        pos, g, s, cid, n_other, hits, me = pos[m4], g[m4], s[m4], cid[m4], n_other[m4], hits[m4], me[m4]
        count += np.bincount(s, minlength=nloc)
        out.append((s, np.full(len(s), n, np.int64), g, cid, n_other, np.minimum(hits, params.k1), me))
        if params.coverage == "contained" and len(pos):
            for n2 in range(1, n):
                lv2 = idx.levels[n2 - 1]
                for j in range(n - n2 + 1):
                    sub = lv2.ids[P0 + pos + j].astype(np.int64)
                    covered[n2].append(s * lv2.count + sub)
    if not out:
        z = np.zeros(0, np.int64)
        return Selection(z, z, z, z, z, z, z)
    s, n, g, cid, n_other, k, me = (np.concatenate(x) for x in zip(*out))
    # mining order: sample, then n descending, then first occurrence (stable within a level)
    order = np.lexsort((-n, s))
    return Selection(s[order] + a, n[order], g[order], cid[order], n_other[order], k[order],
                     me[order])


def draw_partners(idx: NgramIndex, sel: Selection, params: MiningParams) -> tuple[np.ndarray, np.ndarray]:
    """Partners of every selected (sample, concept): CSR (offsets int64 [R+1], sample_ids int64)."""
    R, K1 = len(sel.cid), params.k1
    k = sel.k
    chosen = np.full((R, K1), -1, dtype=np.int64)  # indices into the list of *other* samples
    if R == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    sid = idx.sample_ids[sel.sample]
    for step in range(K1):  # Floyd's algorithm: uniform k-subset of [0, m) with k draws
        active = step < k
        j = sel.n_other - k + step  # draw in [0, j]
        t = uniform_below(rng_hash(params.seed, sid, sel.cid, step), np.maximum(j + 1, 1)).astype(np.int64)
        dup = (chosen[:, :step] == t[:, None]).any(axis=1)
        t = np.where(dup, j, t)
        chosen[:, step] = np.where(active, t, -1)
    part = np.full((R, K1), -1, dtype=np.int64)  # partner sample indices
    for n in range(1, params.n_max + 1):
        mk = np.flatnonzero(sel.n == n)
        if len(mk) == 0:
            continue
        lv = idx.levels[n - 1]
        post = lv.post
        lo0 = lv.off[sel.gid[mk]]
        me = sel.me[mk]
        ci = chosen[mk]
        valid = ci >= 0
        gi = lo0[:, None] + ci + (ci >= me[:, None])  # skip the sample itself
        part[mk] = np.where(valid, post[np.where(valid, gi, 0)], -1)
    big = np.iinfo(np.int64).max
    part = np.sort(np.where(part >= 0, part, big), axis=1)  # sample indices ascending = sample_id ascending
    valid = part != big
    offsets = np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).astype(np.int64)
    values = idx.sample_ids[part[valid]]
    return offsets, values


def concepts_table(idx: NgramIndex, sel: Selection, params: MiningParams) -> pa.Table:
    offsets, values = draw_partners(idx, sel, params)
    partners = pa.ListArray.from_arrays(pa.array(offsets, pa.int32() if offsets[-1] < 2**31 else pa.int64()),
                                        pa.array(values, pa.int64()))
    if partners.type != pa.list_(pa.int64()):
        partners = partners.cast(pa.list_(pa.int64()))
    return pa.table({
        "sample_id": pa.array(idx.sample_ids[sel.sample], pa.int64()),
        "concept_id": pa.array(sel.cid, pa.int64()),
        "partners": partners,
    })


def vocab_table(idx: NgramIndex, concept_ids: np.ndarray) -> pa.Table:
    """concept_id, text, n, df for the given concept ids (deduplicated), sorted by concept_id."""
    cids = pl.Series(np.asarray(concept_ids, dtype=np.int64)).unique().sort().to_numpy()
    n = idx.level_of_concept(cids)
    N = len(idx.levels)
    rows_tok = np.full((N, len(cids)), -1, dtype=np.int64)  # word j of each concept, -1 past its end
    df = np.zeros(len(cids), np.int32)
    for lvn in range(1, N + 1):
        mk = np.flatnonzero(n == lvn)
        if len(mk) == 0:
            continue
        lv = idx.levels[lvn - 1]
        g = cids[mk] - lv.base
        df[mk] = lv.df[g]
        rep = lv.rep[g]
        for j in range(lvn):
            rows_tok[j, mk] = idx.tokens[rep + j]
    words = pl.Series("w", idx.words, dtype=pl.String)
    cols = {}
    if len(words):
        for j in range(N):
            w = words.gather(np.maximum(rows_tok[j], 0))
            cols[f"w{j}"] = pl.select(pl.when(pl.lit(pl.Series(rows_tok[j] >= 0))).then(pl.lit(w))).to_series()
    text = (pl.DataFrame(cols).select(pl.concat_str(pl.all(), separator=" ", ignore_nulls=True))
            .to_series() if cols and len(cids) else pl.Series([], dtype=pl.String))
    return pa.table({
        "concept_id": pa.array(cids, pa.int64()),
        "text": text.to_arrow().cast(pa.string()),
        "n": pa.array(n.astype(np.int32), pa.int32()),
        "df": pa.array(df, pa.int32()),
    })


# ----------------------------------------------------------------------------------------------
# convenience: whole mining in one process


def prepare(sample_ids: Sequence[int] | np.ndarray, texts: Sequence[str] | pl.Series, params: MiningParams,
            progress: Callable[[str], None] | None = None) -> NgramIndex:
    """``sample_ids[c]`` / ``texts[c]``: one row per caption, any order (stable within a sample)."""
    sid = np.asarray(sample_ids, dtype=np.int64)
    texts = texts if isinstance(texts, pl.Series) else pl.Series("text", list(texts), dtype=pl.String)
    order = np.argsort(sid, kind="stable")
    if np.any(order != np.arange(len(order))):
        sid = sid[order]
        texts = texts.gather(order)
    new = np.ones(len(sid), dtype=bool)
    new[1:] = sid[1:] != sid[:-1]
    uniq, cap_sample = sid[new], np.cumsum(new) - 1
    tok = tokenize(texts, params.normalizer, params.chunk_captions)
    if progress:
        progress(f"tokenised {len(texts)} captions, {len(tok.tokens)} tokens, {len(tok.words)} words")
    return build_index(tok, cap_sample, uniq, params, progress)


def sample_chunks(idx: NgramIndex, params: MiningParams) -> Iterator[tuple[int, int]]:
    S = idx.n_samples
    for a in range(0, S, params.chunk_samples):
        yield a, min(S, a + params.chunk_samples)


def mine(sample_ids, texts, params: MiningParams = MiningParams(),
         progress: Callable[[str], None] | None = None) -> tuple[pa.Table, pa.Table]:
    """Mine concepts in-process.  Returns (concepts, vocab) Arrow tables."""
    idx = prepare(sample_ids, texts, params, progress)
    parts = []
    for a, b in sample_chunks(idx, params):
        sel = select_range(idx, a, b, params)
        parts.append(concepts_table(idx, sel, params))
    concepts = pa.concat_tables(parts) if parts else pa.table(
        {"sample_id": pa.array([], pa.int64()), "concept_id": pa.array([], pa.int64()),
         "partners": pa.array([], pa.list_(pa.int64()))})
    vocab = vocab_table(idx, concepts["concept_id"].to_numpy())
    return concepts, vocab


# ----------------------------------------------------------------------------------------------
# persistence, so that Ray workers (possibly on other machines with shared storage) memory-map
# the whole-dataset index instead of receiving it by value

_LEVEL_ARRAYS = ("ids", "prank", "df", "stop", "post", "off", "rep")


def save_index(idx: NgramIndex, folder) -> None:
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokens", "pos_sample", "sample_pos", "sample_ids"):
        np.save(folder / f"{name}.npy", getattr(idx, name))
    for lv in idx.levels:
        for name in _LEVEL_ARRAYS:
            np.save(folder / f"level{lv.n}_{name}.npy", getattr(lv, name))
    (folder / "index.json").write_text(json.dumps({
        "levels": [{"n": lv.n, "base": lv.base} for lv in idx.levels], "words": idx.words}))


def load_index(folder, mmap: bool = True) -> NgramIndex:
    import json
    from pathlib import Path

    folder = Path(folder)
    meta = json.loads((folder / "index.json").read_text())
    mode = "r" if mmap else None
    arr = {name: np.load(folder / f"{name}.npy", mmap_mode=mode) for name in ("tokens", "pos_sample", "sample_pos", "sample_ids")}
    idx = NgramIndex(meta["words"], **arr)
    for lv in meta["levels"]:
        a = {name: np.load(folder / f"level{lv['n']}_{name}.npy", mmap_mode=mode) for name in _LEVEL_ARRAYS}
        idx.levels.append(Level(lv["n"], lv["base"], **a))
    return idx
