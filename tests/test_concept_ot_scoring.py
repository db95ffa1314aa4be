"""concept-ot's side of the evaluation harness contract (train/eval/interface.py): score_pairs agrees
with the in-job SugarCrepe scoring for every variant, boxes restrict the local score to the patches
they overlap, retrieval_scores reproduces the job's own two-stage retrieval, scorable_sample_ids
lists the shards' samples. (concept-ot beating global-only through the harness on the testbed:
tests/test_testbed_concept_ot.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import Artifact
from tests.testbed_reduced import copy_testbed

VARIANTS = ["conceptot", "dense-uot", "balanced-ot", "filip", "text-attn", "global-patch", "global-only"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def oracle(small_testbed, tmp_path_factory):
    """This module's copy of the small oracle testbed (tests/conftest.py: 100 generated images through
    the real stages, 128 px, 4 x 4 patch grid) and its manifest (models.clip: scene-oracle, so texts
    the artifact does not hold are encoded by the instrument through the job's own ``_encode_texts``).
    ``<out>/sugarcrepe``: the generated dataset's own swap_att and replace_att files (every image)."""
    out, man = copy_testbed(small_testbed, tmp_path_factory.mktemp("cot_scoring"))
    (out / "sugarcrepe").mkdir()
    for kind in ("swap_att", "replace_att"):
        shutil.copy(out / "source" / "synthetic" / "sugarcrepe" / f"{kind}.json", out / "sugarcrepe")
    return out, man


def make(out, man, variant, **over):
    from pipeline.config import load_manifest
    from train.jobs.concept_ot import make_job

    sets = [f"train.concept_ot.variant={variant}", "train.concept_ot.d_c=16", "train.concept_ot.rank=8",
            "train.concept_ot.eval_splits=[test]", "train.concept_ot.heatmaps=0", "train.concept_ot.eval_pairs_chunk=7",
            f"train.concept_ot.sugarcrepe_dirs=[{out / 'sugarcrepe'}]"]
    sets += [f"train.concept_ot.{k}={v}" for k, v in over.items()]
    m = load_manifest(man, sets)
    job = make_job(m.train.concept_ot, m, out / "train" / variant, torch.device("cpu"))
    torch.manual_seed(1)
    model = job.build_model()
    with torch.no_grad():  # move the untrained mass heads off uniform, so masses matter
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return job, model.eval()


def _sample_of_source(out) -> dict[int, int]:
    """COCO-style file id (the generated image's source_id) -> sample_id, from the samples artifact."""
    t = Artifact(out / "samples").read("samples").to_pydict()
    return {int(src): int(s) for s, src in zip(t["sample_id"], t["source_id"])}


def triples(out):
    from train.eval.in_job import read_folders

    data, _ = read_folders("sugarcrepe", [out / "sugarcrepe"])
    rows = [it for it in data.items if it.subset == "swap_att"] + [it for it in data.items if it.subset == "replace_att"]
    sid = _sample_of_source(out)
    return ([sid[int(Path(r.pairs[0].image).stem)] for r in rows], [r.pairs[0].text for r in rows],
            [r.pairs[1].text for r in rows])


def pairwise_accuracy(pos, neg) -> float:
    return 100 * float((np.asarray(pos) > np.asarray(neg)).mean())  # strict: a tie is wrong


@pytest.mark.parametrize("variant", VARIANTS)
def test_score_pairs_agrees_with_the_in_job_sugarcrepe_scoring(oracle, variant):
    """The reference is the in-job path (ConceptOTJob._sugarcrepe): all images and all texts encoded
    at once, g + lambda * s_local; score_pairs reads images by random access and chunks pairs (7)."""
    from train.jobs.concept_ot.model import _normalize

    out, man = oracle
    job, model = make(out, man, variant)
    sids, pos, neg = triples(out)
    with torch.no_grad():
        got_p = job.score_pairs(model, sids, pos)
        got_n = job.score_pairs(model, np.asarray(sids), neg)
        rows = job._load_images(sorted(set(sids)))
        row_of = {s["sample_id"]: k for k, s in enumerate(rows)}
        texts = sorted(set(pos) | set(neg))
        tok = job._encode_texts(texts)
        img = model.image_features(torch.from_numpy(np.stack([r["patch_tokens"] for r in rows])))
        txt = model.text_features(tok["tokens"], tok["mask"])
        ie = _normalize(torch.from_numpy(np.stack([r["image_embed"] for r in rows])).float())
        te = _normalize(tok["embed"])
        ii = torch.tensor([row_of[s] for s in sids])
        for got, tx in ((got_p, pos), (got_n, neg)):
            tt = torch.tensor([texts.index(t) for t in tx])
            ref = (ie[ii] * te[tt]).sum(-1).double()
            if variant != "global-only":
                ref = ref + job.cfg.lambda_local * model.score_pairs(img, txt, ii, tt).double()
            assert got.dtype == np.float64 and got.shape == (len(sids),)
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6)
        res = job._sugarcrepe(model)
    assert res["sugarcrepe/triples"] == len(sids)  # every triple's image is in the artifact
    from train.eval.in_job import read_folders

    k = sum(it.subset == "swap_att" for it in read_folders("sugarcrepe", [out / "sugarcrepe"])[0].items)
    assert pairwise_accuracy(got_p[:k], got_n[:k]) == pytest.approx(res["sugarcrepe/swap_att"])
    assert pairwise_accuracy(got_p[k:], got_n[k:]) == pytest.approx(res["sugarcrepe/replace_att"])


def test_score_pairs_boxes_restrict_the_local_score(oracle):
    out, man = oracle
    job, model = make(out, man, "dense-uot")
    sids, pos, _ = triples(out)
    sids, pos = sids[:6], pos[:6]
    with torch.no_grad():
        plain = job.score_pairs(model, sids, pos)
        assert job.crop_note == ""
        # NaN rows: no box; whole-image boxes: all patches -> the plain score
        whole = np.array([[0, 0, 128, 128]] * 6, np.float64)
        whole[::2] = np.nan
        np.testing.assert_allclose(job.score_pairs(model, sids, pos, whole), plain, rtol=1e-6)
        # the top-left quarter of a 128 x 128 image on the 4 x 4 grid: patches 0, 1, 4, 5
        q = np.array([[0, 0, 63, 63]] * 6, np.float64)
        got = job.score_pairs(model, sids, pos, q)
        assert "patches overlapping the box" in job.crop_note
        ref = []
        for s, t in zip(sids, pos):
            rows = job._read_images([s])
            tok = job._encode_texts([t])
            img = model.image_features(torch.from_numpy(rows["patch_tokens"][:, [0, 1, 4, 5]]))
            txt = model.text_features(tok["tokens"], tok["mask"])
            from train.jobs.concept_ot.model import _normalize

            g = float((_normalize(torch.from_numpy(rows["image_embed"]).float()) * _normalize(tok["embed"])).sum())
            ref.append(g + job.cfg.lambda_local * float(model.score_pairs(img, txt, torch.tensor([0]), torch.tensor([0]))))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        assert not np.allclose(got, plain)


def test_box_patch_mask_and_heatmap_box_by_hand():
    from train.boxes import box_iou_rows as box_iou
    from train.jobs.concept_ot.boxes import box_patch_mask, heatmap_boxes, patch_edges

    # a 200 x 100 image: the grid covers the centre square x in [50, 150], 4 x 4 patches of 25 px
    xs, ys = patch_edges([200], [100], 4)
    assert xs[0].tolist() == [50, 75, 100, 125, 150] and ys[0].tolist() == [0, 25, 50, 75, 100]
    m = box_patch_mask(np.array([[60, 30, 99, 49]]), [200], [100], 4)[0].reshape(4, 4)
    assert np.argwhere(m).tolist() == [[1, 0], [1, 1]]
    # outside the centre square: the nearest patch
    assert np.argwhere(box_patch_mask(np.array([[0, 0, 10, 10]]), [200], [100], 4)[0].reshape(4, 4)).tolist() == [[0, 0]]
    h = np.zeros((4, 4))
    h[1, 1], h[1, 2], h[2, 1] = 1.0, 0.6, 0.4  # threshold 0.5 x max keeps (1,1), (1,2)
    b = heatmap_boxes(h.reshape(1, -1), [200], [100], 4, 0.5)[0]
    assert b.tolist() == [75, 25, 125, 50]
    b3 = heatmap_boxes(h.reshape(1, -1), [200], [100], 4, 0.3)[0]  # also (2,1)
    assert b3.tolist() == [75, 25, 125, 75]
    assert box_iou(np.array([b]), np.array([[75, 25, 125, 50]]))[0] == pytest.approx(1.0)
    # IoU by hand: [0,0,2,2] vs [1,1,3,3] -> 1 / 7
    assert box_iou(np.array([[0, 0, 2, 2]]), np.array([[1, 1, 3, 3]]))[0] == pytest.approx(1 / 7)
    assert box_iou(np.array([[0, 0, 1, 1]]), np.array([[2, 2, 3, 3]]))[0] == 0


def test_retrieval_scores_reproduce_the_job_retrieval(oracle):
    from train.eval.harness import recall_first_hit

    out, man = oracle
    job, model = make(out, man, "conceptot", rerank_top_k=5, eval_max_images=1000)
    t = Artifact(out / "samples").read("samples").to_pydict()
    test = sorted(s for s, sp in zip(t["sample_id"], t["split"]) if sp == "test")
    caps = Artifact(out / "samples").read("captions").to_pydict()
    pairs = sorted((s, c, x) for c, s, x in zip(caps["caption_id"], caps["sample_id"], caps["text"]) if s in set(test))
    img_of = np.array([test.index(s) for s, _, _ in pairs])
    with torch.no_grad():
        mats = job.retrieval_scores(model, test, [c for _, c, _ in pairs], [x for _, _, x in pairs])
        ref = job.evaluate(model, out / "eval_tmp")
    assert set(mats) == {"global", "rerank/i2t", "rerank/t2i"}
    gt = np.zeros((len(test), len(pairs)), bool)
    gt[img_of, np.arange(len(pairs))] = True
    for proto, tag in (("global", "global"), ("rerank/i2t", "rerank")):
        assert 100 * (recall_first_hit(mats[proto], gt) < 1).mean() == pytest.approx(ref[f"{tag}/i2t_R@1"])
    for proto, tag in (("global", "global"), ("rerank/t2i", "rerank")):
        assert 100 * (recall_first_hit(mats[proto].T, gt.T) < 1).mean() == pytest.approx(ref[f"{tag}/t2i_R@1"])
    # stored (frozen) encodings: a caption id the artifact holds scores its stored tokens, so an
    # unknown id with the same text (encoded by the scene-oracle again, the same arrays) agrees
    m2 = job.retrieval_scores(model, test[:3], [-1] * 3, [x for _, _, x in pairs[:3]])
    np.testing.assert_allclose(m2["global"], mats["global"][:3, :3], atol=2e-3)
    assert np.array_equal(job.scorable_sample_ids(), np.arange(100))  # every generated sample (ids 0..99)


def test_in_job_sugarcrepe_matches_images_across_naming_schemes(oracle, tmp_path):
    """The in-job SugarCrepe scoring matches a benchmark's image names through the harness's matcher
    (train/eval/images.py): the generated images' SugarCrepe names (000000000001.jpg) and their bare ids
    (1.jpg) match every triple; Karpathy's COCO_val2014_000000000001.jpg names a COCO image, which a
    generated run does not hold: no triple matches (foreign), all are still read. (With the planted
    writer, whose samples passed for COCO, the Karpathy names matched; COCO-to-COCO matching across
    the naming schemes is tested in tests/test_eval_images.py.)"""
    import json

    out, man = oracle
    job, model = make(out, man, "global-only")
    n = len(triples(out)[0])
    for scheme, name, matched in (("bare", "{}.jpg", n), ("karpathy", "COCO_val2014_{:012d}.jpg", 0)):
        d = tmp_path / scheme
        d.mkdir()
        for f in (out / "sugarcrepe").glob("*.json"):
            rows = json.loads(f.read_text())
            for r in rows.values():
                r["filename"] = name.format(int(Path(r["filename"]).stem))
            (d / f.name).write_text(json.dumps(rows))
        job.cfg.sugarcrepe_dirs = [str(d)]
        with torch.no_grad():
            res = job._sugarcrepe(model)
        assert (res["sugarcrepe/triples"], res["sugarcrepe/available"]) == (matched, n), scheme


def test_in_job_sugarcrepe_on_the_generated_folder_scores_held_out_images_only(oracle):
    """The generated dataset's own SugarCrepe folder (``sugarcrepe_dirs`` unset) has items for every
    image, training images included: the in-job rows score only those of ``eval_splits`` (here
    test), counted against a brute-force split lookup; a configured folder is scored whole."""
    from train.eval.in_job import read_folders

    out, man = oracle
    job, model = make(out, man, "global-only", sugarcrepe_dirs="null")
    t = Artifact(out / "samples").read("samples").to_pydict()
    split = {int(src): sp for src, sp in zip(t["source_id"], t["split"])}
    data, n = read_folders("sugarcrepe", [out / "source" / "synthetic" / "sugarcrepe"])
    held = [it for it in data.items if split[int(Path(it.pairs[0].image).stem)] == "test"]
    assert 0 < len(held) < n
    with torch.no_grad():
        res = job._sugarcrepe(model)
    assert (res["sugarcrepe/triples"], res["sugarcrepe/available"]) == (len(held), n)
    with torch.no_grad():
        whole = make(out, man, "global-only")[0]._sugarcrepe(model)  # the configured copy: every image
    assert whole["sugarcrepe/triples"] == len(triples(out)[0])


def test_phrase_groups_follow_the_dataset_spans():
    """Heatmap phrases: the dataset's spans (tokens overlapping [start, end)), not whitespace words."""
    from train.jobs.concept_ot.grounding import _span_groups, _word_groups

    text = "a red circle and blue star"
    # BOS, a, red, cir+cle (two tokens), and, blue, star, EOS
    offs = np.array([[0, 0], [0, 1], [2, 5], [6, 9], [9, 12], [13, 16], [17, 21], [22, 26], [0, 0]])
    assert _span_groups(text, offs, 9, [(2, 12), (17, 26)]) == [("red circle", [2, 3, 4]), ("blue star", [6, 7])]
    assert [w for w, _ in _word_groups(text, offs, 9)] == ["red", "circle", "blue", "star"]


def test_text_cache_is_bounded_and_exact(oracle):
    out, man = oracle
    job, model = make(out, man, "filip", eval_pairs_chunk=5)
    sids, pos, neg = triples(out)
    with torch.no_grad():
        ref = job.score_pairs(model, sids, neg)
        job2, _ = make(out, man, "filip", eval_pairs_chunk=5)
        job2.TEXT_CACHE_BYTES = 4000  # a handful of texts
        got = job2.score_pairs(model, sids, neg)
    np.testing.assert_array_equal(got, ref)
    assert job2._text_cache_bytes <= 4000 + 5 * 2 * 48 * 24 and len(job2._text_cache) < len(set(neg))
    assert job2._text_cache_bytes == sum(t.numel() * 2 + e.numel() * 2 for t, e in job2._text_cache.values())
