"""build-index: hard negatives vs brute force (flat exact; IVF recall and speed), the batched IVF
scan vs FAISS's own IVF search, and the stage end to end on a hand-made clip_tokens artifact."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

from pipeline.stages.build_index import (
    BatchedIVF,
    blas_threads,
    build_index,
    clustered_embeddings,
    default_nlist,
    default_nprobe,
    ivf_lists,
    ivf_search_batched,
    l2_normalize,
    search_excluding,
)


def brute_negatives(q, q_owner, x, x_ids, x_owner, k):
    """Reference: full similarity matrix, true pairs set to -inf, stable top-k."""
    s = q @ x.T
    s[x_owner[None, :] == q_owner[:, None]] = -np.inf
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return x_ids[order], np.take_along_axis(s, order, axis=1)


def toy_pairs(n_img=150, seed=0, d=32):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 8, n_img)
    img_ids = np.sort(rng.choice(10_000, n_img, replace=False)).astype(np.int64)
    owner = np.repeat(img_ids, counts)
    cap_ids = np.arange(len(owner), dtype=np.int64) * 3 + 7
    xi = l2_normalize(rng.standard_normal((n_img, d)))
    # captions near their image, so the true pairs are the top hits and exclusion matters
    xc = l2_normalize(np.repeat(xi, counts, axis=0) * 2 + rng.standard_normal((len(owner), d)) * 0.5)
    return xi, img_ids, xc, cap_ids, owner, int(counts.max())


def test_flat_hard_negatives_equal_brute_force():
    xi, img_ids, xc, cap_ids, owner, cmax = toy_pairs()
    k = 32
    cap_index = build_index(xc, cap_ids, "flat")
    ids, sc = search_excluding(cap_index, xi, k, (cap_ids, owner), img_ids, cmax)
    ref_ids, ref_sc = brute_negatives(xi, img_ids, xc, cap_ids, owner, k)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(sc, ref_sc, rtol=1e-5, atol=1e-5)
    assert not np.isin(ids, cap_ids[owner == img_ids[0]]).any(axis=1)[0]
    img_index = build_index(xi, img_ids, "flat")
    ids2, sc2 = search_excluding(img_index, xc, k, None, owner, 1)
    ref2, refs2 = brute_negatives(xc, owner, xi, img_ids, img_ids, k)
    np.testing.assert_array_equal(ids2, ref2)
    np.testing.assert_allclose(sc2, refs2, rtol=1e-5, atol=1e-5)
    assert (ids2 != owner[:, None]).all()
    # the true pairs really were the nearest: exclusion did work
    raw = cap_index.search(xi, 1)[1][:, 0]
    assert (owner[np.searchsorted(cap_ids, raw)] == img_ids).mean() > 0.9


def test_batched_ivf_equals_faiss_ivf_and_pads_short_lists(tmp_path):
    import faiss

    x = clustered_embeddings(6000, 64, clusters=60, seed=1)
    q, x = x[:300], x[300:]
    ids = np.arange(len(x), dtype=np.int64) + 1000
    with blas_threads(1):
        index = build_index(x, ids, "ivf", nlist=40, nprobe=3)
        centroids, assign = ivf_lists(index, x)
        ours_s, ours_i = ivf_search_batched(x, ids, centroids, assign, q, 20, 3)
    # the stage's way: FAISS's own lists read back by id equal the assignment by the quantizer
    np.testing.assert_array_equal(ivf_lists(index, x, ids)[1], assign)
    ivf = faiss.extract_index_ivf(index)
    # FAISS's own assignment (inverted list contents) equals ours
    for lst in range(0, 40, 7):
        got = faiss.rev_swig_ptr(ivf.invlists.get_ids(lst), ivf.invlists.list_size(lst)).copy()
        assert sorted(got.tolist()) == sorted(ids[assign == lst].tolist())
    ref_s, ref_i = index.search(q, 20)
    np.testing.assert_allclose(ours_s, ref_s, rtol=1e-4, atol=1e-5)
    assert (ours_i == ref_i).mean() > 0.999  # equal up to exact ties
    # the search units' way: the base memory-mapped, one list gathered at a time; and the contiguous copy
    path = tmp_path / "x.npy"
    np.save(path, x)
    mm = np.load(path, mmap_mode="r")
    with blas_threads(1):
        for got_s, got_i in (BatchedIVF(mm, ids, centroids, assign, 3, copy=False).search(q, 20),
                             BatchedIVF(x, ids, centroids, assign, 3, copy=True).search(q, 20)):
            np.testing.assert_array_equal(got_i, ours_i)
            np.testing.assert_allclose(got_s, ours_s, rtol=1e-6)
    # tiny probe: fewer candidates than k -> -1 padding, like FAISS
    s1, i1 = ivf_search_batched(x, ids, centroids, assign, q[:5], 500, 1)
    assert ((i1 == -1) == np.isneginf(s1)).all()
    sizes = np.bincount(assign, minlength=40)
    probe1 = np.argmax(q[:5] @ centroids.T, axis=1)
    assert ((i1 >= 0).sum(axis=1) == np.minimum(sizes[probe1], 500)).all()


def test_defaults():
    assert default_nlist(100_000) == 1265
    assert default_nprobe(1265) == 13
    assert default_nlist(100) == 2  # at most n/39 lists


@pytest.mark.slow
def test_ivf_recall_and_speed_on_100k_clustered():
    """Issue target: recall@10 >= 0.95 at the default nprobe on 100k clustered vectors, >= 5x faster than flat."""
    import faiss

    faiss.omp_set_num_threads(1)
    x = clustered_embeddings(101_000, 512, seed=0)
    q, x = x[100_000:], x[:100_000]
    ids = np.arange(len(x), dtype=np.int64)
    with blas_threads(1):
        flat = build_index(x, ids, "flat")
        ivf = build_index(x, ids, "ivf")
        centroids, assign = ivf_lists(ivf, x)
        batched = BatchedIVF(x, ids, centroids, assign, ivf.nprobe)
        t_flat = t_ivf = float("inf")
        for _ in range(3):  # shared machine: best of three
            t0 = time.perf_counter()
            _, ref = flat.search(q, 10)
            t_flat = min(t_flat, time.perf_counter() - t0)
            t0 = time.perf_counter()
            _, got = batched.search(q, 10)
            t_ivf = min(t_ivf, time.perf_counter() - t0)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ref, got)])
    assert ivf.nprobe == 13 and ivf.nlist == 1265
    assert recall >= 0.95, recall
    assert t_flat / t_ivf >= 5, (t_flat, t_ivf)


def _fake_clip_tokens(out, xi, img_ids, xc, cap_ids, owner):
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages._image_actor import f16_list

    w = ArtifactWriter(out, "clip_tokens", "extract-clip-tokens", {"fake": True})
    uw = w.unit_writer("00000", "fp")
    uw.write_table("images", pa.table({"sample_id": img_ids, "shard": ["x"] * len(img_ids), "image_embed": f16_list(xi)}))
    uw.write_table(
        "captions",
        pa.table({"caption_id": cap_ids, "sample_id": owner, "n_tokens": pa.array([5] * len(owner), pa.int32()), "text_embed": f16_list(xc)}),
    )
    uw.commit({"rows": len(img_ids)})
    w.finalize(["00000"])


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_stage_end_to_end_and_resume(tmp_path, ray_session, kind, monkeypatch):
    from pipeline.io.artifacts import Artifact
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    xi, img_ids, xc, cap_ids, owner, _ = toy_pairs(n_img=120, seed=2)
    # what the stage will see: fp16 on disk, then normalised
    xi16, xc16 = l2_normalize(xi.astype(np.float16)), l2_normalize(xc.astype(np.float16))
    _fake_clip_tokens(tmp_path / "run", xi, img_ids, xc, cap_ids, owner)
    ov = [f"stages.build_index.index={kind}", "stages.build_index.query_chunk=100", "stages.build_index.k=16"]
    if kind == "ivf":
        ov += ["stages.build_index.nlist=4", "stages.build_index.nprobe=4"]  # all lists probed: exact
    m = make_manifest(tmp_path, ov)
    summary = run_stage("build-index", RunContext(m))
    assert summary["index"] == {"images": kind, "captions": kind}
    art = Artifact(tmp_path / "run" / "index")
    assert art.manifest["tables"]["caption_negatives"]["files"] == -(-len(cap_ids) // 100)
    neg = art.read("image_negatives").to_pylist()
    ref_ids, ref_sc = brute_negatives(xi16, img_ids, xc16, cap_ids, owner, 16)
    got = {r["sample_id"]: r for r in neg}
    assert sorted(got) == img_ids.tolist()
    for row, sid in enumerate(img_ids):
        np.testing.assert_allclose(got[sid]["scores"], ref_sc[row], rtol=1e-4, atol=1e-5)
        assert got[sid]["caption_ids"] == ref_ids[row].tolist()
    cneg = art.read("caption_negatives").to_pylist()
    ref2, _ = brute_negatives(xc16, owner, xi16, img_ids, img_ids, 16)
    by_cap = {r["caption_id"]: r for r in cneg}
    for row, cid in enumerate(cap_ids):
        assert by_cap[cid]["sample_id"] == owner[row]
        assert by_cap[cid]["image_ids"] == ref2[row].tolist()
    # the FAISS file answers queries with the real ids
    import faiss

    index = faiss.read_index(str(art.dir / "faiss" / "captions.faiss"))
    _, top = index.search(xi16[:3], 1)
    assert set(top[:, 0]) <= set(cap_ids.tolist())
    # rerun: nothing redone, index not rebuilt, and no embedding loaded into the driver
    import pipeline.stages.build_index as bi

    monkeypatch.setattr(bi, "_load_embeddings", lambda *a, **k: pytest.fail("embeddings loaded with the index up to date"))
    before = (art.dir / "faiss" / "images.faiss").stat().st_mtime_ns
    markers = {p: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")}
    run_stage("build-index", RunContext(m))
    assert (art.dir / "faiss" / "images.faiss").stat().st_mtime_ns == before
    assert {p: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")} == markers
    # a lost search unit is redone from its own query slice of the stored matrices (still no
    # embedding in the driver), byte for byte
    lost = art.dir / Artifact(art.dir).shard_entries("caption_negatives")[1]["path"]
    data = lost.read_bytes()
    lost.unlink()
    run_stage("build-index", RunContext(m))
    assert lost.read_bytes() == data
