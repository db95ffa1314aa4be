"""FAISS indexes over pooled CLIP embeddings and top-K cross-modal hard negatives -> `index`.

Input: the ``images`` and ``captions`` tables of `clip_tokens` (pooled projected embeddings).
Similarity is CLIP's global similarity, the cosine (vectors are L2-normalised, inner-product
index). Index choice (``index: auto``): exact ``IndexFlatIP`` up to ``flat_max`` vectors
(300,000: the issue's "a few hundred thousand"), ``IndexIVFFlat`` beyond, with ``nlist`` =
4 sqrt(n) lists (FAISS's guideline is 4-16 sqrt(n); the low end keeps lists large so a small
``nprobe`` reaches the 0.95 recall target) and ``nprobe`` = ``nprobe_fraction`` x nlist lists
probed per query (default 1/100, 13 of 1265 lists at 100k vectors: recall@10 ~0.97 at ~7x the
speed of flat on 100k clustered 512-d vectors, see BENCHMARKS.md for the trade-off). Overridable.

Hard negatives (ConceptOT Alg. 2, lines 6: N_X(i) = TopK_{j != i} g_ij, N_I(i) = TopK_{j != i}
g_ji): for every image the K most similar captions that are not its own, and for every caption
the K most similar images other than its own. The paper mines K_h = 4 per batch; the artifact
stores K = 32 (``k``) over the whole dataset so trainers can choose. Rows are sorted by
decreasing similarity; slots without a candidate (only possible with IVF) hold id -1, score NaN.

Artifact layout (``<output>/index/``)::

    faiss/images.faiss, faiss/captions.faiss     FAISS indexes whose ids are sample_id / caption_id
    faiss/images.npy, faiss/captions.npy          float32 [n, P] L2-normalised embeddings (query side)
    faiss/images_ids.npy, faiss/captions_ids.npy  int64 ids in row order; captions_owner.npy: sample_id per caption
    faiss/*_centroids.npy, faiss/*_assign.npy     IVF only: centroids and each row's list
    image_negatives/*.parquet    sample_id int64, caption_ids list<int64>[K], scores list<float32>[K]
    caption_negatives/*.parquet  caption_id int64, sample_id int64, image_ids list<int64>[K], scores list<float32>[K]

Bulk search: flat indexes are searched with FAISS; IVF hard negatives use
:func:`ivf_search_batched`, the same IVF search (same lists, same ``nprobe``) done list by list
with BLAS over all queries at once (FAISS's per-query IVF scan is memory-bound; see there).
The FAISS files are rebuilt only when the embeddings or index options change (``faiss/_build.json``
holds their fingerprint) or a file of the build is missing or not the bytes written (``_build.json``
records each one's size and sha256; a plain rerun mends a damaged index); every file under ``faiss/``
is in ``_manifest.json``'s ``files``, checked by `pipeline status` and `pipeline verify`. Search runs in
resumable units of ``query_chunk`` queries.

Driver memory: building loads every embedding into the driver (one FAISS index over all of them
needs them in one place: inherent to this stage), in :func:`_build`, and releases them before the
search; a rerun whose index is up to date loads no embedding at all. Each search unit
memory-maps the stored matrices and reads only its own ``[start, stop)`` query slice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from pipeline.io.atomic import atomic_path, fingerprint, write_json_atomic
from pipeline.stage import RunContext, StageConfig, StageError, run_units, unit_writer

log = logging.getLogger("pipeline")

NAME = "build-index"
READS = ["clip_tokens"]
WRITES = ["index"]


class Config(StageConfig):
    k: int = Field(32, ge=1, description="hard negatives stored per image and per caption (ConceptOT mines K_h=4 of them)")
    index: Literal["auto", "flat", "ivf"] = Field("auto", description="auto: flat up to flat_max vectors, IVF beyond")
    flat_max: int = Field(300_000, ge=1, description="largest index built exact (flat) under index=auto")
    nlist: int | None = Field(None, ge=1, description="IVF lists; default 4*sqrt(n), at most n/39 (FAISS training minimum)")
    nprobe: int | None = Field(None, ge=1, description="IVF lists probed per query; default nprobe_fraction * nlist")
    nprobe_fraction: float = Field(0.01, gt=0, le=1, description="default nprobe as a fraction of nlist (BENCHMARKS.md)")
    kmeans_iters: int = Field(10, ge=1, description="IVF k-means iterations (FAISS default 25; 10 loses no recall here, 2.5x faster)")
    normalize: bool = Field(True, description="L2-normalise embeddings (cosine similarity, CLIP's global score)")
    query_chunk: int = Field(20_000, ge=1, description="queries per search unit (unit of resume)")
    train_size: int = Field(64, ge=39, description="IVF k-means training points per list (sampled; FAISS warns below 39)")
    seed: int = 0
    threads: int = Field(1, ge=1, description="FAISS threads per search task")


NEG_IMAGE_SCHEMA = pa.schema([("sample_id", pa.int64()), ("caption_ids", pa.list_(pa.int64())), ("scores", pa.list_(pa.float32()))])
NEG_CAPTION_SCHEMA = pa.schema(
    [("caption_id", pa.int64()), ("sample_id", pa.int64()), ("image_ids", pa.list_(pa.int64())), ("scores", pa.list_(pa.float32()))]
)


# ---------------------------------------------------------------------------------------------
# index building and search (pure functions, also used by tests and the benchmark)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def resolve_kind(n: int, kind: str, flat_max: int) -> str:
    if kind == "auto":
        return "flat" if n <= flat_max else "ivf"
    return kind


def default_nlist(n: int) -> int:
    return int(max(1, min(round(4 * math.sqrt(n)), n // 39 if n >= 39 else 1)))


def default_nprobe(nlist: int, fraction: float = 0.01) -> int:
    return int(max(1, min(nlist, math.ceil(nlist * fraction))))


def build_index(
    x: np.ndarray,
    ids: np.ndarray,
    kind: str = "flat",
    nlist: int | None = None,
    nprobe: int | None = None,
    nprobe_fraction: float = 0.01,
    train_size: int = 64,
    seed: int = 0,
    kmeans_iters: int = 10,
):
    """Inner-product index over the rows of ``x`` (float32), returning ``ids`` on search."""
    import faiss

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if kind == "flat":
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(d))
        index.add_with_ids(x, ids)
        return index
    if kind != "ivf":
        raise ValueError(f"unknown index kind {kind!r}")
    nlist = nlist or default_nlist(n)
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    m = min(n, train_size * nlist)
    train = x[np.sort(rng.choice(n, m, replace=False))] if m < n else x
    index.cp.seed = seed
    index.cp.niter = kmeans_iters
    index.train(train)
    index.add_with_ids(x, ids)
    index.nprobe = nprobe or default_nprobe(nlist, nprobe_fraction)
    return index


def search_excluding(index, queries: np.ndarray, k: int, result_owner: np.ndarray | None, query_owner: np.ndarray, max_excluded: int):
    """Top-``k`` ids and scores per query, dropping results whose owner equals the query's owner.

    ``result_owner(ids)`` is given as an array aligned with the sorted ids of the index: for the
    caption index, the sample_id of each caption (``None``: a result's owner is its own id, the
    image index). Searching ``k + max_excluded`` guarantees k survivors from an exact index."""
    d_all, i_all = index.search(np.ascontiguousarray(queries, dtype=np.float32), k + max_excluded)
    if result_owner is None:
        owner = i_all
    else:
        ids_sorted, owners = result_owner
        pos = np.searchsorted(ids_sorted, np.maximum(i_all, 0))
        owner = owners[np.minimum(pos, len(owners) - 1)]
    keep = (i_all >= 0) & (owner != query_owner[:, None])
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]
    ids = np.take_along_axis(i_all, order, axis=1)
    scores = np.take_along_axis(d_all, order, axis=1).astype(np.float32)
    valid = np.take_along_axis(keep, order, axis=1)
    ids = np.where(valid, ids, -1)
    scores = np.where(valid, scores, np.nan).astype(np.float32)
    return ids, scores


def ivf_lists(index, x: np.ndarray, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Centroids [nlist, d] of an IVF index and the list of every row of ``x`` (as FAISS assigns
    them when adding: nearest centroid by the quantizer's metric). With the rows' ``ids`` (unique,
    as added), read from the index's own inverted lists instead of assigning every row again."""
    import faiss

    ivf = faiss.extract_index_ivf(index)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    if ids is None:
        _, assign = ivf.quantizer.search(np.ascontiguousarray(x, dtype=np.float32), 1)
        return centroids, assign[:, 0].astype(np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    inv = ivf.invlists
    sizes = np.array([inv.list_size(lst) for lst in range(ivf.nlist)], dtype=np.int64)
    listed = np.concatenate([faiss.rev_swig_ptr(inv.get_ids(lst), int(n)).copy() for lst, n in enumerate(sizes) if n]
                            or [np.zeros(0, np.int64)])
    order = np.argsort(ids, kind="stable")
    rows = order[np.searchsorted(ids, listed, sorter=order)]
    assign = np.full(len(ids), -1, np.int64)
    assign[rows] = np.repeat(np.arange(ivf.nlist), sizes)
    if len(listed) != len(ids) or (assign < 0).any():
        raise ValueError("ivf_lists: the index's lists do not hold each id once")
    return centroids, assign


class IvfLayout:
    """An IVF base list by list: each list's rows of ``x`` (ascending) and their ids, and its
    ``[start, stop)`` bounds. With ``copy`` the vectors are also reordered into one contiguous
    block per list (a view per list instead of a gather: worth it when the same base is searched
    many times, at the cost of a second copy of it in memory); without, a list's vectors are
    gathered from ``x`` when it is scored (``x`` may be a memory map: a search unit then holds
    one list's vectors at a time, not the base)."""

    def __init__(self, x: np.ndarray, ids: np.ndarray, assign: np.ndarray, nlist: int, copy: bool = True):
        self.rows = np.argsort(assign, kind="stable")
        self.bounds = np.searchsorted(np.asarray(assign)[self.rows], np.arange(nlist + 1))
        self.ids = np.asarray(ids)[self.rows]
        self.x = x
        self.xs = np.ascontiguousarray(np.asarray(x, dtype=np.float32)[self.rows]) if copy else None

    def vectors(self, lst: int) -> np.ndarray:
        a, b = self.bounds[lst], self.bounds[lst + 1]
        if self.xs is not None:
            return self.xs[a:b]
        return np.asarray(self.x[self.rows[a:b]], dtype=np.float32)


def ivf_probes(queries: np.ndarray, centroids: np.ndarray, nprobe: int, block: int = 4096) -> np.ndarray:
    """The ``nprobe`` lists each query probes (its nearest centroids by inner product), [q, nprobe];
    scored ``block`` queries at a time so the query x centroid matrix stays small."""
    nq, nlist = len(queries), len(centroids)
    if nprobe >= nlist:
        return np.tile(np.arange(nlist), (nq, 1))
    probe = np.empty((nq, nprobe), np.int64)
    for a in range(0, nq, block):
        cs = queries[a:a + block] @ centroids.T
        probe[a:a + block] = np.argpartition(-cs, nprobe - 1, axis=1)[:, :nprobe]
    return probe


def ivf_search_batched(x: np.ndarray, ids: np.ndarray, centroids: np.ndarray, assign: np.ndarray, queries: np.ndarray, k: int, nprobe: int, layout=None):
    """The IVF search for a whole batch of queries, list by list with BLAS.

    Same candidates as FAISS's ``IndexIVFFlat.search`` with the same ``nprobe`` (the ``nprobe``
    nearest centroids' lists, exact inner products inside them), so the same top-k up to ties,
    but each inverted list is scored against all queries probing it in one matrix product
    instead of one query at a time: FAISS's per-query scan is memory-bound and on CPU barely
    beats a BLAS flat search, which defeats the point of IVF for offline mining where all
    queries are known up front. Each query keeps a running top-k, merged list by list (memory
    O(queries x k), not O(queries x nprobe x k): at 1M captions the candidates of one 50k-query
    unit were ~1.5 GB before, and their global sort most of the unit's time). Returns
    (scores [q, k], ids [q, k]) by decreasing score; -1 / -inf where fewer.
    ``layout`` is the base's :class:`IvfLayout`, when the same base is searched more than once."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    nq, nlist = len(queries), len(centroids)
    nprobe = min(nprobe, nlist)
    lay = layout if layout is not None else IvfLayout(x, ids, assign, nlist, copy=False)
    probe = ivf_probes(queries, centroids, nprobe).reshape(-1)
    order = np.argsort(probe, kind="stable")  # inverted view: for each list, the queries probing it
    q_sorted = order // nprobe
    q_bounds = np.searchsorted(probe[order], np.arange(nlist + 1))
    best_s = np.full((nq, k), -np.inf, np.float32)
    best_i = np.full((nq, k), -1, np.int64)
    for lst in range(nlist):
        qa, qb = q_bounds[lst], q_bounds[lst + 1]
        ra, rb = lay.bounds[lst], lay.bounds[lst + 1]
        if qa == qb or ra == rb:
            continue
        qi = q_sorted[qa:qb]  # distinct: a query probes a list once
        sc = np.concatenate([best_s[qi], queries[qi] @ lay.vectors(lst).T], axis=1)
        ci = np.concatenate([best_i[qi], np.broadcast_to(lay.ids[ra:rb], (len(qi), rb - ra))], axis=1)
        top = np.argpartition(-sc, k - 1, axis=1)[:, :k]  # k + the list's rows > k columns
        best_s[qi] = np.take_along_axis(sc, top, axis=1)
        best_i[qi] = np.take_along_axis(ci, top, axis=1)
    o = np.argsort(-best_s, axis=1, kind="stable")
    return np.take_along_axis(best_s, o, axis=1), np.take_along_axis(best_i, o, axis=1)


def clustered_embeddings(n: int, d: int = 512, clusters: int = 1000, noise: float = 1.0, seed: int = 0) -> np.ndarray:
    """L2-normalised Gaussian-mixture vectors shaped like CLIP embeddings (tests, benchmark):
    a shared mean direction (the "cone": unrelated pairs have cosine ~0.3, not 0), clusters of
    Dirichlet-distributed sizes, and anisotropic within-cluster noise (power-law spectrum in a
    random basis). With noise=1.0 a point's nearest neighbour has cosine ~0.8."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal(d)
    mean /= np.linalg.norm(mean)
    centers = rng.standard_normal((clusters, d)) / np.sqrt(d)
    labels = rng.choice(clusters, n, p=rng.dirichlet(np.full(clusters, 0.5)))
    spec = np.arange(1, d + 1) ** -0.5
    spec /= np.sqrt((spec**2).sum())
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    eps = (rng.standard_normal((n, d)).astype(np.float32) * spec.astype(np.float32)) @ basis.astype(np.float32)
    return l2_normalize(mean + centers[labels] + noise * eps)


class BatchedIVF:
    """Adapter giving :func:`ivf_search_batched` FAISS's ``search(q, k) -> (D, I)`` shape."""

    def __init__(self, x, ids, centroids, assign, nprobe, copy: bool = True):
        self.x, self.ids, self.centroids, self.assign, self.nprobe = x, ids, centroids, assign, nprobe
        self.layout = IvfLayout(x, ids, assign, len(centroids), copy)  # once, not per search

    def search(self, queries, k):
        return ivf_search_batched(self.x, self.ids, self.centroids, self.assign, queries, k, self.nprobe, self.layout)


# ---------------------------------------------------------------------------------------------
# stage


def _faiss_write(index, path) -> None:
    import faiss

    with atomic_path(path) as tmp:
        faiss.write_index(index, str(tmp))


def _npy_write(path, arr) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)


def blas_threads(n: int):
    """Limit BLAS threads (small matrix products thrash with several threads on a busy machine)."""
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(n)
    except ImportError:  # pragma: no cover
        import contextlib

        return contextlib.nullcontext()


def search_unit(payload: dict) -> dict:
    """Ray task: hard negatives for queries [start, stop) of one side."""
    with blas_threads(payload["threads"]):
        return _search_unit(payload)


def _search_unit(payload: dict) -> dict:
    import faiss

    faiss.omp_set_num_threads(payload["threads"])
    w = unit_writer(payload)
    root = os.path.join(payload["artifact_dir"], "faiss")
    side, start, stop, k = payload["side"], payload["start"], payload["stop"], payload["k"]
    other = "captions" if side == "images" else "images"
    if payload["nprobe"]:  # IVF: batched list-by-list scan of the same inverted lists
        index = BatchedIVF(
            np.load(os.path.join(root, f"{other}.npy"), mmap_mode="r"),
            np.load(os.path.join(root, f"{other}_ids.npy")),
            np.load(os.path.join(root, f"{other}_centroids.npy")),
            np.load(os.path.join(root, f"{other}_assign.npy")),
            payload["nprobe"],
            copy=False,  # one list's vectors at a time from the memory map, not a second copy of the base
        )
    else:
        index = faiss.read_index(os.path.join(root, f"{other}.faiss"))
    # this unit's query slice only (memory-mapped); an image query also needs every caption's
    # owner to skip its own captions (two int64 columns)
    q = np.load(os.path.join(root, f"{side}.npy"), mmap_mode="r")[start:stop]
    qids = np.array(np.load(os.path.join(root, f"{side}_ids.npy"), mmap_mode="r")[start:stop])
    cap_owner = np.load(os.path.join(root, "captions_owner.npy"), mmap_mode="r")
    if side == "images":
        cap_ids = np.load(os.path.join(root, "captions_ids.npy"))
        order = np.argsort(cap_ids, kind="stable")
        ids, scores = search_excluding(index, q, k, (cap_ids[order], np.asarray(cap_owner)[order]), qids, payload["max_captions"])
        table = pa.table(
            {
                "sample_id": pa.array(qids, pa.int64()),
                "caption_ids": pa.array(list(ids), pa.list_(pa.int64())),
                "scores": pa.array(list(scores), pa.list_(pa.float32())),
            },
            schema=NEG_IMAGE_SCHEMA,
        )
        w.write_table("image_negatives", table)
    else:
        owner = np.array(cap_owner[start:stop])
        ids, scores = search_excluding(index, q, k, None, owner, 1)
        table = pa.table(
            {
                "caption_id": pa.array(qids, pa.int64()),
                "sample_id": pa.array(owner, pa.int64()),
                "image_ids": pa.array(list(ids), pa.list_(pa.int64())),
                "scores": pa.array(list(scores), pa.list_(pa.float32())),
            },
            schema=NEG_CAPTION_SCHEMA,
        )
        w.write_table("caption_negatives", table)
    missing = int((ids < 0).sum())
    res = w.commit({"rows": stop - start, "missing_slots": missing})
    return {"unit": res.unit, "stats": res.stats}


def _load_embeddings(ctx: RunContext, normalize: bool):
    art = ctx.artifact("clip_tokens")
    imgs = art.read("images", ["sample_id", "image_embed"])
    caps = art.read("captions", ["caption_id", "sample_id", "text_embed"])
    if imgs.num_rows == 0:
        raise StageError("clip_tokens has no image embeddings")

    def mat(col) -> np.ndarray:
        col = col.combine_chunks()
        d = col.type.list_size
        return np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, d)

    xi, xc = mat(imgs["image_embed"]), mat(caps["text_embed"])
    if normalize:
        xi, xc = l2_normalize(xi), l2_normalize(xc)
    img_ids = imgs["sample_id"].to_numpy()
    cap_ids = caps["caption_id"].to_numpy()
    cap_owner = caps["sample_id"].to_numpy()
    oi, oc = np.argsort(img_ids, kind="stable"), np.argsort(cap_ids, kind="stable")
    return art, xi[oi], img_ids[oi], xc[oc], cap_ids[oc], cap_owner[oc]


def _build(ctx: RunContext, cfg: Config, writer, build_fp: str) -> dict:
    """Load every embedding of `clip_tokens` and build both indexes (the FAISS files, the
    query-side matrices and id arrays the search units memory-map): the one step that holds the
    whole dataset's embeddings in the driver, inherent to building one index over all of them.
    The matrices are released when it returns: the search units read their own query slices from
    ``faiss/*.npy``, the driver keeps only ``_build.json``, which records every file written with its
    size and sha256 (``files``: a rerun rebuilds when one is missing or changed). Returns that content."""
    import faiss

    root = writer.dir / "faiss"

    t0 = time.perf_counter()
    _, xi, img_ids, xc, cap_ids, cap_owner = _load_embeddings(ctx, cfg.normalize)
    log.info("index: read %s image and %s caption embeddings in %.1fs", f"{len(img_ids):,}", f"{len(cap_ids):,}",
             time.perf_counter() - t0)
    if len(cap_ids) == 0:
        raise StageError("clip_tokens has no caption embeddings; hard negatives need captions")
    faiss.omp_set_num_threads(max(1, os.cpu_count() or 1))
    info = {"fingerprint": build_fp, "indexes": {}}
    sides = {"images": (xi, img_ids), "captions": (xc, cap_ids)}
    for side, (x, ids) in sides.items():
        t0 = time.perf_counter()
        kind = resolve_kind(len(ids), cfg.index, cfg.flat_max)
        index = build_index(x, ids, kind, cfg.nlist, cfg.nprobe, cfg.nprobe_fraction, cfg.train_size, cfg.seed, cfg.kmeans_iters)
        _faiss_write(index, root / f"{side}.faiss")
        _npy_write(root / f"{side}.npy", x)
        _npy_write(root / f"{side}_ids.npy", ids)
        entry = {"kind": kind, "n": int(len(ids)), "dim": int(x.shape[1])}
        if kind == "ivf":
            ivf = faiss.extract_index_ivf(index)
            entry.update(nlist=int(ivf.nlist), nprobe=int(ivf.nprobe))
            centroids, assign = ivf_lists(index, x, ids)
            _npy_write(root / f"{side}_centroids.npy", centroids)
            _npy_write(root / f"{side}_assign.npy", assign)
        info["indexes"][side] = entry
        log.info("index: %s: %s index of %s built and written in %.1fs", side, kind, f"{len(ids):,}", time.perf_counter() - t0)
    _npy_write(root / "captions_owner.npy", cap_owner)
    written = sorted(p.relative_to(writer.dir).as_posix() for p in root.iterdir()
                     if p.suffix in (".faiss", ".npy") and not p.name.startswith("."))
    info["files"] = {rel: {k: e[k] for k in ("bytes", "sha256")} for rel in written for e in [writer.side_entry(rel)]}
    for side in sides:
        info["indexes"][side]["sha256"] = info["files"][f"faiss/{side}.faiss"]["sha256"]
    info["max_captions"] = _max_captions(img_ids, cap_owner)
    write_json_atomic(root / "_build.json", info)
    return info


def _max_captions(img_ids: np.ndarray, cap_owner: np.ndarray) -> int:
    """The most captions one image has (how many own captions an image query must skip)."""
    return int(np.bincount(np.searchsorted(img_ids, cap_owner), minlength=len(img_ids)).max()) if len(cap_owner) else 0


def _built_info(path) -> dict:
    """``faiss/_build.json`` of an earlier build ({} when absent, unreadable or not a regular file:
    the indexes are built again)."""
    from pipeline.io.run_files import not_regular

    if not_regular(path) is not None or not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) and isinstance(info.get("files"), dict) else {}


def _damaged(writer, info: dict) -> str | None:
    """The first file an earlier build wrote that is missing or not the bytes its ``_build.json``
    records (a stat when the artifact's cache vouches for it), as ``<file>: <problem>``."""
    for rel, e in sorted(info.get("files", {}).items()):
        why = writer.verified.problem({"path": rel, **e}) if isinstance(e, dict) else "no size or sha256 recorded"
        if why is not None:
            return f"{rel}: {why}"
    return None


def run(ctx: RunContext, cfg: Config) -> dict:
    art = ctx.artifact("clip_tokens")
    params = cfg.model_dump(mode="json", exclude={"enabled", "threads"})
    writer = ctx.writer("index", NAME, params, inputs={"clip_tokens": art.fingerprint})
    build_fp = fingerprint(params, art.fingerprint)
    info_path = writer.dir / "faiss" / "_build.json"
    info = _built_info(info_path)
    damaged = _damaged(writer, info) if info.get("fingerprint") == build_fp else None
    if damaged and not ctx.force:  # never searched from an altered index or matrix: built again
        log.warning("index: %s since it was built: building the indexes again", damaged)
    if ctx.force or info.get("fingerprint") != build_fp or damaged:
        info = _build(ctx, cfg, writer, build_fp)
    n = {side: info["indexes"][side]["n"] for side in ("images", "captions")}
    units = []
    for side in ("images", "captions"):
        other = "captions" if side == "images" else "images"
        for u, start in enumerate(range(0, n[side], cfg.query_chunk)):
            stop = min(n[side], start + cfg.query_chunk)
            payload = {
                "side": side,
                "start": start,
                "stop": stop,
                "k": cfg.k,
                "nprobe": info["indexes"][other].get("nprobe", 0),
                "max_captions": info["max_captions"],
                "threads": cfg.threads,
            }
            unit_input = [info["indexes"][other]["sha256"], info["indexes"][side]["sha256"], start, stop]
            units.append((f"{side[:3]}-{u:05d}", unit_input, payload))
    names = run_units(ctx, writer, units, search_unit, total_rows=n["images"] + n["captions"])
    schema = {"image_negatives": str(NEG_IMAGE_SCHEMA), "caption_negatives": str(NEG_CAPTION_SCHEMA)}
    side = [writer.side_entry(rel) for rel in sorted(info["files"])] + [writer.side_entry("faiss/_build.json")]
    m = writer.finalize(names, extra={"faiss": info["indexes"], "similarity": "cosine" if cfg.normalize else "inner product"},
                        schema=schema, files=side)
    return {
        "images": n["images"],
        "captions": n["captions"],
        "index": {s: e["kind"] for s, e in info["indexes"].items()},
        "missing_slots": m["stats"].get("missing_slots", 0),
        "path": str(writer.location),
    }
