"""relation-head: trained on the generated dataset's scene graphs (extracted with ground-truth
segmentation + relations), held-out recall@20 far above chance; the exported checkpoint drives
the stage's `learned` backend, whose stored triplets equal a direct forward pass over the stored
tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import Artifact
from pipeline.loaders.visual_tokens import iter_samples
from pipeline.models.relations import box_features, load_relation_checkpoint
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest
from train.eval.interface import NoScorableItems
from train.eval.intervals import mean_interval
from train.jobs.relation_head.metrics import per_image_recall, predicate_order, prior_recall, recall_at_k, recall_rows


def test_recall_at_k_matches_definition():
    probs = np.zeros((3, 3, 4))
    probs[0, 1, 2] = 0.9
    probs[1, 0, 3] = 0.8
    probs[2, 2, 0] = 1.0  # diagonal: never ranked
    gt = np.array([[0, 1, 2], [2, 0, 1]])
    r, chance = recall_at_k(probs, gt, 1)
    assert r == 0.5 and chance == 1 / 24
    assert recall_at_k(probs, gt, 24)[0] == 1.0 and recall_at_k(probs, np.zeros((0, 3), int), 5) is None


def test_recall_rows_have_chance_interval_and_skips():
    from pipeline.models.relations import build_relation_head

    torch.manual_seed(0)
    model = build_relation_head(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3, dropout=0.0)
    r = np.random.default_rng(0)
    items = [(i, r.random((4, 8), dtype=np.float32), r.random((4, 8), dtype=np.float32),
              np.array([[0, 1, i % 3], [2, 3, 0]]) if i % 5 else np.zeros((0, 3), np.int64)) for i in range(30)]
    rank = predicate_order(items, 3)
    assert rank.tolist() == [0, 1, 2]  # predicate 0 in every graph, then 1 (8 graphs) and 2 (8 graphs, tie: index)
    rows = recall_rows(model, items, 3, 8, [5, 10], rank)
    assert [r.metric for r in rows] == ["recall@5", "recall@10"]
    per, rand, prior = per_image_recall(model, items, 3, 8, [5, 10], rank)
    for row, k in zip(rows, (5, 10)):
        assert row.n == 24 and row.skipped == 6 and row.skip_reasons == {"no_ground_truth_relation": 6}
        assert np.allclose(rand[k], k / 36) and f"a random ranking: {100 * k / 36:.2f}" in row.note
        assert row.value == pytest.approx(100 * np.mean(per[k])) and row.chance == pytest.approx(100 * np.mean(prior[k]))
        assert (row.ci_low, row.ci_high) == pytest.approx(mean_interval(per[k], 100.0))
        assert row.ci_low <= row.value <= row.ci_high and row.ci_low < row.ci_high
    with pytest.raises(NoScorableItems, match="none of the 2 held-out images"):
        recall_rows(model, [it for it in items if len(it[3]) == 0][:2], 3, 8, [5], rank)


def test_the_chance_prior_ranks_predicates_at_each_instance_count():
    """Images with 2 instances always relate by predicate 0, images with 3 by predicate 1, and there are more of the
    latter: the global order puts 1 first, the by-count order puts each count's own predicate first; a count with no
    training graph (V = 4) falls back to the global order; prior_recall reads the rank of the image's count; the
    ``strongest`` mode takes, per K, the order whose mean expected recall on the scored graphs is the higher."""
    from train.jobs.relation_head.metrics import PredicatePrior, prior_lists

    r = np.random.default_rng(0)
    items = [(i, r.random((2, 4), dtype=np.float32), r.random((2, 8), dtype=np.float32), np.array([[0, 1, 0]]))
             for i in range(4)]
    items += [(10 + i, r.random((3, 4), dtype=np.float32), r.random((3, 8), dtype=np.float32), np.array([[0, 2, 1]]))
              for i in range(6)]
    glob = PredicatePrior(items, 3, mode="global")
    count = PredicatePrior(items, 3, mode="instance_count")
    assert glob.rank(2).tolist() == glob.rank(3).tolist() == [1, 0, 2] == count.rank(4).tolist()
    assert count.rank(2).tolist() == [0, 1, 2] and count.rank(3).tolist() == [1, 0, 2]
    trip2 = np.array([[1, 0, 0]])  # V = 2: P = 2 pairs, predicate 0 first by count: recall@1 = 1/2 (1/2 pairs)
    assert prior_recall(trip2, 2, 1, count) == pytest.approx(0.5) and prior_recall(trip2, 2, 1, glob) == 0.0
    assert prior_recall(trip2, 2, 1, count.rank(2)) == pytest.approx(0.5)  # a plain rank array is still accepted
    best = PredicatePrior(items, 3)
    assert best.mode == "strongest"
    # held-out graphs the by-count order ranks better: it is taken ...
    assert prior_lists([(trip2, 2), (np.array([[0, 2, 1]]), 3)], [1], best)[1] == pytest.approx([0.5, 1 / 6])
    # ... and ones where the counts' orders are wrong (V = 2 now relates by predicate 1): the global order is
    trip_wrong = np.array([[1, 0, 1]])
    assert prior_lists([(trip_wrong, 2)], [1], best)[1] == pytest.approx([0.5])
    assert prior_lists([(trip_wrong, 2)], [1], count)[1] == pytest.approx([0.0])


def test_prior_recall_is_the_image_blind_ranking():
    """V = 3 (P = 6 ordered pairs): the most frequent predicate fills ranks 0-5, the next 6-11."""
    rank = np.array([1, 0, 2])  # predicate 1 most frequent, then 0, then 2
    trip = np.array([[0, 1, 1], [1, 2, 0], [2, 0, 2]])
    assert prior_recall(trip, 3, 3, rank) == pytest.approx((0.5 + 0 + 0) / 3)
    assert prior_recall(trip, 3, 9, rank) == pytest.approx((1 + 0.5 + 0) / 3)
    assert prior_recall(trip, 3, 18, rank) == pytest.approx(1.0)


def test_shuffled_control_permutes_graphs_within_instance_counts():
    from train.jobs.relation_head.job import shuffle_graphs

    r = np.random.default_rng(0)
    items = [(i, r.random((2 + i % 3, 4), dtype=np.float32), r.random((2 + i % 3, 8), dtype=np.float32),
              np.array([[0, 1, i]])) for i in range(30)]
    out = shuffle_graphs(items, 0)
    assert all(np.array_equal(a[3], b[3]) for a, b in zip(out, shuffle_graphs(items, 0)))  # fixed by the seed
    moved = relabelled = 0
    for a, b in zip(items, out):
        assert a[0] == b[0] and a[1] is b[1] and a[2] is b[2]
        src = int(b[3][0, 2])
        assert len(items[src][1]) == len(a[1])  # the graph comes from an image with as many instances
        moved += src != a[0]
        s, o = b[3][0, :2]
        assert 0 <= s < len(a[1]) and 0 <= o < len(a[1]) and s != o  # still a valid pair of this image's instances
        relabelled += (s, o) != (0, 1)
    assert moved >= 20
    assert sorted(int(b[3][0, 2]) for b in out) == list(range(30))
    assert all(np.array_equal(it[3], np.array([[0, 1, i]])) for i, it in enumerate(items))  # the input is not changed
    # the donated pair is moved off the donor's indices: with V = 2, 3, 4 a random relabelling keeps (0, 1) with
    # probability 1/2, 1/6, 1/12; over 30 items that leaves (0, 1) about 8 times, and 25 of 30 kept is p < 1e-6
    assert relabelled >= 10, relabelled


@pytest.mark.slow
def test_relation_head_learns_scene_graphs(tmp_path, ray_session):
    from train.jobs.relation_head import make_job
    from train.loop import train

    m = make_manifest(
        tmp_path,
        [
            "dataset.synthetic.n_images=200",
            "dataset.synthetic.corrupt_images=0",
            "stages.ingest.shard_size=100",
            "stages.extract_visual_tokens.shard_size=100",
            "train.relation_head.epochs=15",
            "train.relation_head.width=64",
            "train.relation_head.heads=2",
            "train.relation_head.cls_dim=16",
            "train.relation_head.lr=0.003",
            "train.relation_head.recall_k=[20]",
        ],
    )
    run_stage("ingest", RunContext(m))
    run_stage("extract-visual-tokens", RunContext(m))  # demo settings: annotations + annotations
    cfg = m.train.relation_head
    job = make_job(cfg, m, tmp_path / "rh", torch.device("cpu"))
    res = train(job, resume=False, progress=False)
    assert res["val_images"] >= 10
    assert res["val_recall@20"] > 60 and res["val_recall@20"] > 5 * res["val_chance_random_recall@20"], res
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "rh" / "eval" / "final" / "results.parquet").to_pylist()
    got = {r["metric"]: r for r in table if r["benchmark"] == "relation-head" and r["subset"] == "held_out"}
    r20 = got["recall@20"]
    assert r20["value"] == pytest.approx(res["val_recall@20"]) and r20["chance"] == pytest.approx(res["val_chance_recall@20"])
    assert r20["ci_low"] <= r20["value"] <= r20["ci_high"] < 100.001 and r20["n"] == res["val_images"]
    ck_path = tmp_path / "rh" / "relation_head.pt"
    model, ck = load_relation_checkpoint(ck_path)
    assert ck["predicates"] == Artifact(f"{m.output}/visual_tokens").manifest["predicates"]

    # the stage's learned backend with this checkpoint
    m2 = make_manifest(
        tmp_path,
        [
            "dataset.synthetic.n_images=200",
            "dataset.synthetic.corrupt_images=0",
            "stages.extract_visual_tokens.relations=learned",
            f"models.relation_head={ck_path}",
        ],
    )
    run_stage("extract-visual-tokens", RunContext(m2, limit=12))
    art = Artifact(f"{m2.output}/visual_tokens")
    assert art.manifest["models"]["relation_head"]["random_weights"] is False
    n_trip = 0
    for f in art.files("shards"):
        for s in iter_samples(f):
            meta = s["meta.json"]
            V = len(s["tangible.npy"])
            if V == 0:
                continue
            with torch.no_grad():
                emb = torch.from_numpy(s["tangible.npy"].astype(np.float32))[None]
                bx = torch.from_numpy(box_features(s["boxes.npy"], (meta["height"], meta["width"])))[None]
                P = torch.sigmoid(model(emb, bx))[0].numpy()
            trip = s["triplets.npy"]
            pid = np.asarray(meta["predicate_ids"])
            got = {(a, b, pid[c]) for a, b, c in trip.tolist()}
            # stage used fp32 embeddings, the file holds fp16: compare away from the threshold
            assert {tuple(x) for x in np.argwhere(P > 0.06).tolist()} <= got
            assert all(P[a, b, c] > 0.04 for a, b, c in got)
            np.testing.assert_allclose(s["triplet_scores.npy"], P[trip[:, 0], trip[:, 1], pid[trip[:, 2]]] if len(trip) else [], atol=1e-2)
            n_trip += len(got)
    assert n_trip > 0


def test_unit_tokens_makes_the_head_blind_to_the_tokens_scale():
    """``unit_tokens``: the logits do not change when every token is scaled (CLIP pools at norm ~11 and oracle
    vectors at ~1.5 reach the head alike); without it they do. The option travels in the checkpoint config."""
    import torch

    from pipeline.models.relations import build_relation_head

    torch.manual_seed(0)
    emb, boxes = torch.randn(2, 4, 8), torch.rand(2, 4, 8)
    for unit in (True, False):
        model = build_relation_head(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3, dropout=0.0,
                                    unit_tokens=unit).eval()
        assert model.config["unit_tokens"] is unit
        with torch.no_grad():
            a, b = model(emb, boxes), model(7.5 * emb, boxes)
        finite = torch.isfinite(a)
        assert torch.allclose(a[finite], b[finite], atol=1e-5) is unit


def _geometry_items(n: int, seed: int, d: int = 8):
    """Scenes of 4 boxes at random places; the ground truth is geometric: predicate 0 = `left of`
    (centre x smaller by > 0.1), 1 = `over` (centre y smaller by > 0.1), 2 = never; the tokens are noise."""
    r = np.random.default_rng(seed)
    items = []
    for i in range(n):
        xy = r.random((4, 2)) * 0.8
        wh = 0.05 + 0.1 * r.random((4, 2))
        b = np.concatenate([xy, xy + wh], 1)
        feats = box_features(b * 100, (100, 100))
        c = (b[:, :2] + b[:, 2:]) / 2
        trip = [(s, o, 0) for s in range(4) for o in range(4) if s != o and c[o, 0] - c[s, 0] > 0.1]
        trip += [(s, o, 1) for s in range(4) for o in range(4) if s != o and c[o, 1] - c[s, 1] > 0.1]
        items.append((1000 * seed + i, r.normal(size=(4, d)).astype(np.float32), feats,
                      np.array(trip, np.int64).reshape(-1, 3)))
    return items


def test_boxes_only_baseline_learns_planted_geometry_on_the_same_images(one_thread):
    """The boxes-only classifier, trained on geometric relations, beats the image-blind prior ranking
    (the rows' chance) by a wide margin on held-out scenes; its rows are recomputed here from its own
    forward pass, on the result rows' images (same n, same image clusters)."""
    from pipeline.models.relations import build_relation_head
    from train.jobs.relation_head.boxes_only import train_boxes_only

    tr, ev = _geometry_items(120, 0), _geometry_items(40, 1)
    rank = predicate_order(tr, 3)
    base = train_boxes_only(tr, 3, 8, seed=0, steps=100)
    with torch.no_grad():  # as the harness calls job_metrics
        again = train_boxes_only(tr, 3, 8, seed=0, steps=100)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), again.state_dict().values()))  # seeded
    torch.manual_seed(0)
    head = build_relation_head(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3, dropout=0.0, use_boxes=False)
    rows = {r.metric: r for r in recall_rows(head, ev, 3, 8, [3, 5], rank, baselines={"boxes-only": (base, "b")})}
    for k in (3, 5):
        b, res = rows[f"recall@{k}[boxes-only]"], rows[f"recall@{k}"]
        assert b.baseline_for == f"held_out/recall@{k}" and b.n == res.n == 40 and b.note == "b"
        assert np.array_equal(b.est.cluster, res.est.cluster) and b.est.cluster.tolist() == [it[0] for it in ev]
        want = []
        for it in ev:  # brute force: rank the 4 x 3 x 3 entries of the MLP's own logits
            with torch.no_grad():
                lg = base(None, torch.from_numpy(it[2])[None], torch.zeros(1, 4, dtype=torch.bool))[0].numpy()
            flat = [(lg[s, o, c], (s, o, c)) for s in range(4) for o in range(4) for c in range(3) if s != o]
            top = {e for _, e in sorted(flat, key=lambda x: -x[0])[:k]}
            want.append(len(top & {tuple(t) for t in it[3].tolist()}) / len(it[3]))
        assert b.value == pytest.approx(100 * np.mean(want))
        # the planted geometry: near the best any ranking can do (k of an image's triples), far above the
        # image-blind prior ranking (the rows' chance)
        best = 100 * np.mean([min(k, len(it[3])) / len(it[3]) for it in ev])
        assert b.value >= 0.9 * best and b.ci_low > 2 * b.chance, (b.value, best, b.chance)


def test_labels_are_the_scene_graphs_unless_the_artifact_holds_them(tmp_path, capsys):
    """``labels: auto``: an artifact extracted with ``relations: geometric`` (or learned) holds another model's
    triplets, so the head takes the samples' scene graphs matched to its instances instead (relation-encoder's
    labels); ``labels: artifact`` keeps the artifact's own, with a warning. With ground-truth masks the matching is
    exact, so the matched labels equal the ground-truth graphs (``relations: annotations``) image for image."""
    from train.jobs.relation_encoder.labels import load_labelled_graphs
    from train.jobs.relation_head import make_job
    from train.jobs.relation_head.batches import load_graphs

    sets = ["dataset.synthetic.n_images=40", "dataset.synthetic.corrupt_images=0", "stages.ingest.shard_size=100",
            "stages.extract_visual_tokens.shard_size=100"]
    truth = make_manifest(tmp_path / "a", sets)
    run_stage("ingest", RunContext(truth))
    run_stage("extract-visual-tokens", RunContext(truth))  # segmenter and relations: annotations
    geo = make_manifest(tmp_path / "b", sets + ["stages.extract_visual_tokens.relations=geometric"])
    run_stage("ingest", RunContext(geo))
    run_stage("extract-visual-tokens", RunContext(geo))
    want = {it[0]: {tuple(t) for t in it[3].tolist()} for it in load_graphs(f"{truth.output}/visual_tokens")[0]}
    own = {it[0]: {tuple(t) for t in it[3].tolist()} for it in load_graphs(f"{geo.output}/visual_tokens")[0]}
    assert sum(len(v) for v in want.values()) > 20 and own != want  # the geometric rules are not the graphs

    def labels(m, mode):
        m.train.relation_head.labels = mode
        job = make_job(m.train.relation_head, m, tmp_path / f"run-{mode}", torch.device("cpu"))
        return job.label_source, {it[0]: {tuple(t) for t in it[3].tolist()} for it in job.train_graphs + job.eval_items}

    src, got = labels(geo, "auto")
    assert src == "matched" and got == {k: v for k, v in want.items() if k in got} and len(got) >= 30
    assert "relation-head: labels: the samples' scene graphs" in capsys.readouterr().out
    matched = load_labelled_graphs(f"{geo.output}/visual_tokens", f"{geo.output}/samples", 0.5)[0]
    assert got == {it[0]: {tuple(t) for t in it[3].tolist()} for it in matched if it[0] in got}
    src, got = labels(geo, "artifact")
    assert src == "artifact" and got == {k: v for k, v in own.items() if k in got}
    assert "not ground-truth annotations" in capsys.readouterr().out
    assert labels(truth, "auto")[0] == "artifact"


def test_per_predicate_recall_and_mean_recall_against_brute_force():
    """predicate:<p> recall@K rows and held-out mean_recall@K (mR@K) equal a brute-force recount from the model's own
    scores: per image, each predicate's share of its triples among the top K (ties broken as recall_at_k breaks
    them), averaged over the images that have it, mR the mean over predicates; chance is the image-blind ranking's
    expected recall of each predicate's triples; the baseline's rows name theirs (baseline_for)."""
    from pipeline.models.relations import build_relation_head
    from train.jobs.relation_head.metrics import PredicatePrior

    torch.manual_seed(0)
    model = build_relation_head(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3, dropout=0.0)
    base = build_relation_head(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3, dropout=0.0)
    r = np.random.default_rng(1)
    items = []
    for i in range(40):
        v = 3 + i % 2
        trip = np.array([[a, b, r.integers(3)] for a in range(v) for b in range(v) if a != b and r.random() < 0.4], np.int64)
        items.append((100 + i, r.random((v, 8), dtype=np.float32), r.random((v, 8), dtype=np.float32), trip.reshape(-1, 3)))
    prior = PredicatePrior(items, 3, mode="global")
    vocab = ["on", "left/of", "near"]
    rows = recall_rows(model, items, 3, 8, [2, 4], prior, vocab=vocab, baselines={"b": (base, "the baseline")})
    got = {(x.subset, x.metric): x for x in rows}
    for m, tag in ((model, ""), (base, "[b]")):
        for k in (2, 4):
            per: dict[int, list[float]] = {}
            chance: dict[int, list[float]] = {}
            with torch.no_grad():
                from train.jobs.relation_head.batches import collate

                emb, box, pad, _ = collate(items, 3, 8)
                probs = torch.sigmoid(m(emb, box, pad)).numpy()
            for i, it in enumerate(items):
                if not len(it[3]):
                    continue
                v = len(it[1])
                flat = [(probs[i, s, o, c], s * v * 3 + o * 3 + c, (s, o, c)) for s in range(v) for o in range(v)
                        for c in range(3) if s != o]
                top = {e for _, _, e in sorted(flat, key=lambda x: (-x[0], x[1]))[:k]}
                gt = {tuple(t) for t in it[3].tolist()}
                for c in {t[2] for t in gt}:
                    mine = [t for t in gt if t[2] == c]
                    per.setdefault(c, []).append(sum(t in top for t in mine) / len(mine))
                    p = v * (v - 1)
                    chance.setdefault(c, []).append(float(np.clip((k - prior.global_rank[c] * p) / p, 0, 1)))
            for c, vals in per.items():
                row = got[(f"predicate:{vocab[c].replace('/', '-')}", f"recall@{k}{tag}")]
                assert row.value == pytest.approx(100 * np.mean(vals)) and row.n == len(vals)
                assert row.chance == pytest.approx(100 * np.mean(chance[c])) and row.ci_low <= row.value <= row.ci_high
                assert row.ci_low < row.ci_high  # never zero width, even where every image scored the same
                assert row.baseline_for == (f"predicate:{vocab[c].replace('/', '-')}/recall@{k}" if tag else "")
            mr = got[("held_out", f"mean_recall@{k}{tag}")]
            assert mr.value == pytest.approx(100 * np.mean([np.mean(x) for x in per.values()]))
            assert mr.chance == pytest.approx(100 * np.mean([np.mean(x) for x in chance.values()]))
            assert mr.n == sum(1 for it in items if len(it[3])) and mr.ci_low < mr.value < mr.ci_high
    # strongest: one image-blind order for all predicates, the one whose mR is the higher
    def mr_chance(mode):
        rs = recall_rows(model, items, 3, 8, [2], PredicatePrior(items, 3, mode=mode), vocab=vocab)
        return {(x.subset, x.metric): x.chance for x in rs}

    g, c, s = mr_chance("global"), mr_chance("instance_count"), mr_chance("strongest")
    key = ("held_out", "mean_recall@2")
    assert g[key] != c[key] and s[key] == max(g[key], c[key])
    pick = g if g[key] >= c[key] else c
    assert all(s[kk] == pick[kk] for kk in s if kk[0].startswith("predicate:"))


def test_a_recall_every_image_shares_has_an_interval_of_the_images():
    """61 images none of which recalls a predicate: the bootstrap has no spread to resample; the interval is Wilson's
    on 61 observations (0 to ~5.9%), not [0, 0]; with spread, it is the cluster bootstrap's."""
    from train.eval.intervals import interval, mean, wilson_n
    from train.jobs.relation_head.metrics import recall_interval

    zeros = mean(np.zeros(61), np.arange(61))
    assert recall_interval(zeros) == pytest.approx(wilson_n(0.0, 61)) and 5 < recall_interval(zeros)[1] < 7
    ones = mean(np.ones(20), np.arange(20))
    assert recall_interval(ones) == pytest.approx(wilson_n(1.0, 20)) and recall_interval(ones)[0] < 100
    mixed = mean(np.r_[np.zeros(30), np.ones(31)], np.arange(61))
    assert recall_interval(mixed) == pytest.approx(interval(mixed, 100.0))
