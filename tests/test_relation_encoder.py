"""relation-encoder (issue 46, item 3): the mask matching that labels predicted instances with the corpus's scene
graphs, checked against pycocotools' IoU and a brute-force assignment; the labels of a planted image; the stages
on the corpus (`pipeline run <stage> --corpus`): the manifest mapping and its one-line refusals."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=REPO):
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True)
    return r.returncode, r.stderr.strip().splitlines()


def _blobs(rng, n, h=24, w=24):
    """n random rectangles-with-holes masks (they overlap each other at random)."""
    out = np.zeros((n, h, w), bool)
    for i in range(n):
        y0, x0 = rng.integers(0, h - 6), rng.integers(0, w - 6)
        y1, x1 = y0 + rng.integers(3, h - y0), x0 + rng.integers(3, w - x0)
        out[i, y0:y1, x0:x1] = True
        out[i] &= rng.random((h, w)) > 0.15
    return out


def test_mask_iou_is_pycocotools_iou():
    from pycocotools import mask as mu

    from train.jobs.relation_encoder.labels import mask_iou

    rng = np.random.default_rng(0)
    a, b = _blobs(rng, 5), _blobs(rng, 4)
    enc = lambda m: mu.encode(np.asfortranarray(m.transpose(1, 2, 0).astype(np.uint8)))  # noqa: E731
    ref = mu.iou(enc(a), enc(b), [0] * len(b))
    np.testing.assert_allclose(mask_iou(a, b), ref, rtol=1e-6, atol=1e-7)


def _brute_force_best(iou: np.ndarray, thr: float) -> float:
    """The largest summed IoU over every one-to-one partial assignment whose pairs are all >= thr."""
    p, g = iou.shape
    best = 0.0
    for k in range(0, min(p, g) + 1):
        for gs in itertools.combinations(range(g), k):
            for ps in itertools.permutations(range(p), k):
                vals = [iou[a, b] for a, b in zip(ps, gs)]
                if all(v >= thr for v in vals):
                    best = max(best, float(sum(vals)))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thr", [0.1, 0.3, 0.5])
def test_matching_is_the_best_one_to_one_assignment_above_the_threshold(seed, thr):
    from train.jobs.relation_encoder.labels import mask_iou, match_instances

    rng = np.random.default_rng(seed)
    pred, gt = _blobs(rng, int(rng.integers(1, 5))), _blobs(rng, int(rng.integers(1, 5)))
    iou = mask_iou(pred, gt)
    m = match_instances(pred, gt, thr)
    used = m[m >= 0]
    assert len(set(used.tolist())) == len(used)  # one to one
    assert all(iou[p, g] >= thr for g, p in enumerate(m) if p >= 0)
    got = sum(iou[p, g] for g, p in enumerate(m) if p >= 0)
    assert got == pytest.approx(_brute_force_best(iou, thr), abs=1e-6)
    # and the unmatched pairs could not have been added: every free (pred, gt) pair is below the threshold
    free_p = sorted(set(range(len(pred))) - set(used.tolist()))
    for g in np.nonzero(m < 0)[0]:
        assert all(iou[p, g] < thr for p in free_p)


def test_a_planted_image_gets_the_relations_of_its_matched_instances():
    """Three ground-truth squares; the predictions: square 2 and square 0 (in that order, each shrunk by a
    pixel row: IoU 0.8), a background segment, and square 1 found only in part (IoU 0.4). The relations: 0 left of
    2, 2 above 0, 1 left of 0 (lost at IoU 0.5: 1 is unmatched), 0 under 2 (mapped with the map's swap: 2 above 0,
    the same label again), and a predicate outside the vocabulary (unmapped)."""
    from pipeline.masks import rle_encode
    from pipeline.visual_tokens.predicates import PredicateMapper
    from train.jobs.relation_encoder.labels import graph_labels

    h = w = 20
    gt = np.zeros((3, h, w), bool)
    gt[0, 0:5, 0:5] = gt[1, 0:5, 10:15] = gt[2, 10:15, 0:5] = True
    rows = [{"instance_id": 7 + i, "box": [0, 0, 1, 1], "mask_rle": rle_encode(gt[i])} for i in range(3)]
    pred = np.zeros((4, h, w), bool)
    pred[0] = gt[2]
    pred[0, 14] = False  # IoU 20/25
    pred[1] = gt[0]
    pred[1, 4] = False
    pred[2, 15:20, 10:20] = True  # background
    pred[3, 0:5, 10:12] = True  # a third of instance 1: IoU 0.4
    vocab = ["left of", "above", "below", "on"]
    mapper = PredicateMapper(vocab, {"under": "~above", "beneath": "below"})
    rels = [{"subject": 7, "object": 9, "predicate": "left of"},
            {"subject": 9, "object": 7, "predicate": "above"},
            {"subject": 8, "object": 7, "predicate": "left of"},       # subject unmatched: lost
            {"subject": 7, "object": 9, "predicate": "under"},         # ~above: 9 above 7
            {"subject": 9, "object": 7, "predicate": "riding"}]        # not in the vocabulary
    trip, st, match = graph_labels(pred, rows, rels, len(vocab), mapper, 0.5)
    assert match.tolist() == [1, -1, 0]
    # instance 7 -> prediction 1, instance 9 -> prediction 0; (s, o, predicate id), sorted, distinct
    assert trip.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert (st.relations, st.unmapped, st.lost, st.triplets) == (5, 1, 1, 2)
    assert (st.gt_instances, st.matched_instances, st.pred_instances) == (3, 2, 4)
    assert st.as_dict()["relations_kept_fraction"] == pytest.approx(3 / 4)
    trip, st, match = graph_labels(pred, rows, rels, len(vocab), mapper, 0.39)  # instance 8 now matches prediction 3
    assert match.tolist() == [1, 3, 0] and st.lost == 0 and [3, 1, 0] in trip.tolist()


def test_corpus_manifest_runs_stages_in_corpus_with_the_main_outputs_models(tmp_path):
    from pipeline.config import corpus_manifest, load_manifest

    out = f"{tmp_path}/p"
    m = load_manifest(REPO / "manifests" / "pixels-gt.yaml", [f"output={out}", "train.relation_encoder.export_dir={output}/x"])
    c = corpus_manifest(m)
    assert c.output == f"{out}/corpus" and c.dataset.kind == "synthetic" and c.dataset.synthetic.seed == m.corpus.seed
    assert c.dataset.synthetic.first_id == m.corpus.first_id and c.corpus is None
    # {output} keeps standing for the manifest's output: the encoders the corpus trained, not <output>/corpus/encoders
    assert c.models.clip == m.models.clip == f"{out}/encoders/clip"
    assert c.models.sam == f"clip-pool:{out}/encoders/clip"
    assert c.train.relation_encoder.export_dir == f"{out}/x"
    assert c.stages.extract_visual_tokens == m.stages.extract_visual_tokens and c.eval == m.eval


def test_a_corpus_stage_that_needs_an_encoder_says_the_command_for_the_main_output(tmp_path):
    rc, err = _cli("run", "extract-clip-tokens", "--corpus", "-m", "manifests/pixels-gt.yaml", "--set", f"output={tmp_path}/p")
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: 1 model folder the manifest names does not exist: {tmp_path}/p/encoders/clip "
                             "(models.clip): make it with `train run clip-encoder -m manifests/pixels-gt.yaml --set "
                             f"output={tmp_path}/p`"), err
    assert not (tmp_path / "p" / "corpus").exists()


def test_a_corpus_stage_before_the_corpus_is_ingested_names_ingest_corpus(tmp_path):
    rc, err = _cli("run", "extract-clip-tokens", "--corpus", "-m", "manifests/tiny.yaml", "--set", f"output={tmp_path}/t",
                   "--set", "corpus.seed=5")
    assert rc == 2
    assert err[-1] == (f"error: input artifact 'samples' not found under {tmp_path}/t/corpus: run `pipeline run ingest "
                       f"-m manifests/tiny.yaml --set output={tmp_path}/t --set corpus.seed=5 --corpus` first"), err


def test_what_makes_no_sense_on_the_corpus_is_refused_in_one_line(tmp_path):
    rc, err = _cli("run", "all", "--corpus", "-m", "manifests/pixels-gt.yaml", "--set", f"output={tmp_path}/p")
    assert rc == 2 and err == [
        "error: --corpus runs one stage at a time: `all` would build every artifact of the testbed's pipeline on the "
        "encoders' pretraining data; name the stage the corpus needs, e.g. `pipeline run extract-visual-tokens -m "
        f"manifests/pixels-gt.yaml --set output={tmp_path}/p --corpus`"]
    rc, err = _cli("run", "extract-visual-tokens", "--corpus", "-m", "manifests/pixels-gt.yaml", "--set", f"output={tmp_path}/p",
                   "--set", "stages.extract_visual_tokens.relations=learned")
    assert rc == 2 and err == [
        "error: --corpus: stages.extract_visual_tokens.relations is learned, but the relation model learns from the "
        "corpus's visual tokens (`train run relation-encoder`), so it cannot predict them; add --set "
        "stages.extract_visual_tokens.relations=geometric (the relation encoder's labels are the corpus's scene graphs, "
        "not these triplets)"]
    rc, err = _cli("run", "extract-clip-tokens", "--corpus", "-m", "manifests/tiny.yaml", "--set", f"output={tmp_path}/t")
    assert rc == 2 and err == ["error: --corpus: the manifest has no `corpus:` block (the encoders' pretraining corpus; "
                               "see manifests/pixels.yaml)"]
    assert not (tmp_path / "p").exists() and not (tmp_path / "t").exists()


def test_the_relation_encoder_without_the_corpus_tokens_names_the_corpus_stage(tmp_path):
    r = subprocess.run([sys.executable, "-m", "train.cli", "run", "relation-encoder", "-m", "manifests/pixels-gt.yaml",
                        "--set", f"output={tmp_path}/p"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: relation-encoder: visual_tokens artifact {tmp_path}/p/corpus/visual_tokens is missing (no "
        "_manifest.json): run `pipeline run extract-visual-tokens --corpus` (the manifest's pretraining corpus) first")


def test_models_relation_head_may_name_the_export_folder(tmp_path):
    """load_relation_checkpoint takes the file or the encoder's export folder holding relation_head.pt."""
    import torch

    from pipeline.io.checkpoint import save_checkpoint_file
    from pipeline.models.relations import build_relation_head, load_relation_checkpoint, relation_checkpoint_file

    cfg = dict(in_dim=6, width=8, layers=1, heads=2, cls_dim=4, n_predicates=3)
    torch.manual_seed(0)
    model = build_relation_head(**cfg)
    folder = tmp_path / "encoders" / "relations"
    folder.mkdir(parents=True)
    save_checkpoint_file(folder / "relation_head.pt", {"state_dict": model.state_dict(), "config": cfg, "predicates": ["a", "b", "c"]})
    assert relation_checkpoint_file(folder) == folder / "relation_head.pt"
    for where in (folder, folder / "relation_head.pt"):
        loaded, ck = load_relation_checkpoint(where)
        x, b = torch.randn(1, 3, 6), torch.rand(1, 3, 8)
        torch.testing.assert_close(loaded(x, b), model.eval()(x, b))


def test_the_testbed_runs_the_relation_encoder_after_the_corpus_stage_it_learns_from():
    """benchmarks/testbed.py on manifests/pixels.yaml: relation-encoder is an encoder job of it (models.relation_head
    names its export) and none of pixels-gt.yaml; it runs after the others, each corpus stage first, as typed."""
    sys.path.insert(0, str(REPO))
    from benchmarks.testbed import corpus_encoders, run_corpus_encoders
    from benchmarks.testbed_encoders import encoder_jobs

    jobs = encoder_jobs("manifests/pixels.yaml", [])
    assert "relation-encoder" in jobs and "relation-encoder" not in encoder_jobs("manifests/pixels-gt.yaml", [])
    assert corpus_encoders(jobs) == ["relation-encoder"]
    calls = []

    def cli(*args):
        calls.append(args)
        return ({"run_dir": "r"} if args[0] == "train" else None), 1.0, "", ""

    sets = ["--set", "output=/x"]
    out = run_corpus_encoders(cli, "M.yaml", sets, ["relation-encoder"])
    assert calls == [("pipeline", "run", "extract-visual-tokens", "--corpus", "--manifest", "M.yaml", *sets,
                      "--set", "stages.extract_visual_tokens.relations=geometric"),
                     ("train", "run", "relation-encoder", "--manifest", "M.yaml", "--json", "--no-progress", "--export", *sets)]
    assert out == [("relation-encoder", {"run_dir": "r"}, 1.0, "", "")]
    calls.clear()
    failing = lambda *a: (calls.append(a), (None, 2.0, "error: boom", "log"))[1]  # noqa: E731
    out = run_corpus_encoders(failing, "M.yaml", [], ["relation-encoder"])
    assert len(calls) == 1 and out == [("relation-encoder", None, 2.0,
                                        "pipeline run extract-visual-tokens --corpus failed: error: boom", "")]


def test_an_export_is_kept_only_for_the_same_weights_on_tokens_of_the_same_settings(tmp_path):
    """relation-encoder leaves its export folder alone when the weights are the same (so the artifacts extracted with
    it keep their fingerprints), but not when equal weights were trained on tokens recorded under other settings: a
    renamed output folder gives the same weights and another SAM path, which the stage checks (issue 46: the stale
    export's `sam: runs/pixels-nogt/encoders/sam` stopped extract-visual-tokens)."""
    import json

    from pipeline.models.relations import RELATION_FILE
    from train.jobs.relation_encoder.job import export_is_current

    emb = {"sam": "runs/pixels/encoders/sam", "embedding": "clip_pool", "width": 512, "seed": 0}
    assert not export_is_current(tmp_path, "abc", emb)  # nothing there
    (tmp_path / "training.json").write_text(json.dumps({"weights_state_sha256": "abc", "embedding": emb}))
    assert not export_is_current(tmp_path, "abc", emb)  # no checkpoint file
    (tmp_path / RELATION_FILE).write_bytes(b"x")
    assert export_is_current(tmp_path, "abc", emb)
    assert not export_is_current(tmp_path, "abd", emb)  # other weights
    assert not export_is_current(tmp_path, "abc", {**emb, "sam": "runs/pixels-nogt/encoders/sam"})  # other settings
    (tmp_path / "training.json").write_text(json.dumps({"weights_state_sha256": "abc"}))  # an export from before
    assert not export_is_current(tmp_path, "abc", emb)
    (tmp_path / "training.json").write_text("{not json")
    assert not export_is_current(tmp_path, "abc", emb)
