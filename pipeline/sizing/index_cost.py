"""build-index's costs for `pipeline plan`, timed on this machine with the stage's own code.

What the stage does (:mod:`pipeline.stages.build_index`) and how each part is timed here:

* **build** (the driver, once): every embedding read from `clip_tokens` (seconds per row: the
  extract-clip-tokens calibration times reading its unit's embedding columns, see
  :func:`pipeline.sizing.calibrate.clip_tokens`), then per side a flat index (a copy) or an IVF
  index: FAISS k-means on ``min(n, train_size x nlist)`` points for ``kmeans_iters`` iterations
  and the assignment of all ``n`` rows, ``iters x m x nlist + n x nlist`` point-centroid pairs.
  :func:`kmeans_pair_seconds` times the stage's :func:`~pipeline.stages.build_index.build_index` on a
  small IVF with the stage's thread setting and divides by its pairs.
* **search** (the units, in parallel): a query against a flat index costs ``n`` pairs of FAISS's
  exact search (:func:`flat_pair_seconds`, at the stage's ``k`` plus the excluded own matches);
  against an IVF index, :func:`~pipeline.stages.build_index.ivf_probes` over ``nlist`` centroids
  plus the list-by-list scan of ``nprobe`` lists of ``n / nlist`` rows with the running top-k
  (:func:`ivf_query_seconds` times the stage's :func:`~pipeline.stages.build_index.ivf_search_batched`
  on lists of the target's size, or, where a list would be too large to hold here, of two smaller
  sizes, extrapolated linearly in the rows per list).

At 200,000 images x 5 captions the parts missing from the first version of the plan (it counted the
search only, and as IVF on both sides) were the caption queries' exact search of the image index
(200k <= ``flat_max``) and the IVF unit's candidate merge; see docs/scaling.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.sizing.calibrate import _best, _cached

SCAN_FLOATS = 20_000_000  # the largest calibration base (80 MB); beyond, two smaller list sizes are extrapolated


def _rng_unit(n: int, dim: int, seed: int):
    import numpy as np

    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def flat_pair_seconds(cache: Path, dim: int, k: int, queries: int, rows: int, threads: int = 1) -> float:
    """Seconds per (query x row) of FAISS's exact inner-product search returning ``k`` on
    ``threads`` threads, for a unit of ``queries`` queries over ``rows`` rows: timed at that shape,
    or, beyond what takes a few seconds here, at 8,192 queries and the rows that fit (the cost per
    pair falls with both: FAISS scores blocks of 4,096 queries and its top-k heaps fill; at 24 dims
    5.8 ns at 2,048 x 65,536, 1.2 ns at 8,192 x 200,000, 1.3 ns at 50,000 x 200,000)."""
    nq = int(max(1, min(queries, 8192)))
    nb = int(max(1, min(rows, max(16384, 1.6e11 // (nq * dim)))))

    def measure():
        import faiss

        faiss.omp_set_num_threads(threads)
        x, q = _rng_unit(nb, dim, 0), _rng_unit(nq, dim, 1)
        index = faiss.IndexFlatIP(dim)
        index.add(x)
        return {"per_pair_s": _best(lambda: index.search(q, min(k, nb))) / (nq * nb)}

    parts = {"dim": dim, "k": k, "nq": nq, "nb": nb, "threads": threads}
    return _cached(cache, "flat-search", parts, measure)["per_pair_s"]


def kmeans_pair_seconds(cache: Path, dim: int, iters: int) -> float:
    """Seconds per point-centroid pair of the stage's IVF build (k-means, then the assignment of
    every row), with the stage's FAISS threads (all of the driver's cores)."""

    def measure():
        import faiss
        import numpy as np

        from pipeline.stages.build_index import build_index

        faiss.omp_set_num_threads(max(1, os.cpu_count() or 1))
        nlist = 256
        n = nlist * 64
        x = _rng_unit(n, dim, 2)
        ids = np.arange(n)
        t = _best(lambda: build_index(x, ids, "ivf", nlist=nlist, nprobe=1, train_size=64, kmeans_iters=iters))
        return {"per_pair_s": t / (iters * n * nlist + n * nlist)}

    return _cached(cache, "ivf-build", {"dim": dim, "iters": iters}, measure)["per_pair_s"]


def probe_seconds(cache: Path, dim: int, nlist: int, nprobe: int) -> float:
    """Seconds per query of choosing its ``nprobe`` lists among ``nlist`` centroids (one thread)."""

    def measure():
        from pipeline.stages.build_index import blas_threads, ivf_probes

        nq, nl = 4096, min(nlist, max(1, SCAN_FLOATS // (4 * dim)))
        q, c = _rng_unit(nq, dim, 3), _rng_unit(nl, dim, 4)
        with blas_threads(1):
            t = _best(lambda: ivf_probes(q, c, min(nprobe, nl)))
        return {"per_query_s": t / nq * nlist / nl}

    return _cached(cache, "ivf-probe", {"dim": dim, "nlist": nlist, "nprobe": nprobe}, measure)["per_query_s"]


def ivf_query_seconds(cache: Path, dim: int, nprobe: int, rows_per_list: float, k: int, queries_per_list: float) -> float:
    """Seconds per query of the stage's batched IVF scan (its ``nprobe`` lists of ``rows_per_list``
    rows and the running top-``k``), one thread, each list scored for ``queries_per_list`` queries at
    once as in a unit; without the choice of lists (:func:`probe_seconds`)."""
    r = max(1, int(round(rows_per_list)))
    qn = int(min(4096, max(64, round(queries_per_list))))

    def measure():
        import numpy as np

        from pipeline.stages.build_index import blas_threads, ivf_search_batched

        def per_query(rows: int) -> float:  # every query probes all nprobe lists of `rows` rows
            x = _rng_unit(nprobe * rows, dim, 5)
            assign = np.repeat(np.arange(nprobe), rows)
            ids = np.arange(len(x), dtype=np.int64)
            c, q = _rng_unit(nprobe, dim, 6), _rng_unit(qn, dim, 7)
            with blas_threads(1):
                return _best(lambda: ivf_search_batched(x, ids, c, assign, q, k, nprobe)) / qn

        cap = max(2, SCAN_FLOATS // (nprobe * dim))
        if r <= cap:
            return {"per_query_s": per_query(r), "rows": [r]}
        a, b = cap, cap // 2
        ta, tb = per_query(a), per_query(b)
        return {"per_query_s": tb + (ta - tb) * (r - b) / (a - b), "rows": [a, b]}

    return _cached(cache, "ivf-scan", {"dim": dim, "nprobe": nprobe, "rows": r, "k": k, "q": qn}, measure)["per_query_s"]


def costs(cache: Path, dim: int, cfg, n_images: int, n_captions: int, max_captions: int, query_chunk: int) -> dict:
    """build-index's build seconds per side (without the embeddings' reading) and search seconds
    per query of each side, with what they are, for :func:`pipeline.sizing.walltime.stage_wall`."""
    from pipeline.stages.build_index import default_nlist, default_nprobe, resolve_kind

    n = {"images": n_images, "captions": n_captions}
    ivf = {side: resolve_kind(rows, cfg.index, cfg.flat_max) == "ivf" for side, rows in n.items()}  # the stage's rule
    nlist = {side: cfg.nlist or default_nlist(rows) for side, rows in n.items()}
    k_of = {"images": cfg.k + max(1, max_captions), "captions": cfg.k + 1}  # queries of a side skip their own matches
    build, per_query, how = {}, {}, []
    for side, other in (("images", "captions"), ("captions", "images")):
        nb = n[other]
        if not ivf[other]:
            per_query[side] = nb * flat_pair_seconds(cache, dim, k_of[side], min(query_chunk, n[side]), nb)
            how.append(f"{side} queries: exact search of {nb:,} {other}")
        else:
            nprobe = min(nlist[other], cfg.nprobe or default_nprobe(nlist[other], cfg.nprobe_fraction))
            qpl = min(query_chunk, n[side]) * nprobe / nlist[other]
            per_query[side] = probe_seconds(cache, dim, nlist[other], nprobe) + ivf_query_seconds(
                cache, dim, nprobe, nb / nlist[other], k_of[side], qpl)
            how.append(f"{side} queries: IVF over {nlist[other]:,} lists of {other}, {nprobe} probed")
    for side, rows in n.items():
        build[side] = 0.0
        if ivf[side]:
            pairs = cfg.kmeans_iters * min(rows, cfg.train_size * nlist[side]) * nlist[side] + rows * nlist[side]
            build[side] = pairs * kmeans_pair_seconds(cache, dim, cfg.kmeans_iters)
            how.append(f"{side} IVF build {build[side]:.1f} s ({pairs:.3g} point-centroid pairs)")
    return {"build_s": build, "per_query_s": per_query, "how": "; ".join(how)}
