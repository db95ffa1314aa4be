"""The generated dataset: determinism, idempotence, ground-truth consistency, and every format it
writes read back through the real readers."""
from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import SyntheticConfig
from pipeline.masks import rle_decode
from pipeline.readers import ImageError, open_image, read_dataset
from pipeline.readers.base import EMPTY_CAPTION
from pipeline.readers.flickr import read_flickr30k_entities
from pipeline.readers.karpathy import read_karpathy
from pipeline.synthetic.generate import NEGATIVE_KINDS, generate
from pipeline.synthetic.captions import PRED_PHRASES
from pipeline.synthetic.scene import COLORS, INVERSE, PREDICATES

PARAMS = dict(n_images=24, seed=3, image_size=64, captions_per_image=4, min_objects=1, max_objects=4)


def tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    paths = generate(root, **PARAMS, corrupt_images=2, empty_captions=3)
    syn = SyntheticConfig(**PARAMS, corrupt_images=2, empty_captions=3, root=str(root))
    ds = types.SimpleNamespace(kind="synthetic", synthetic=syn, split=None)
    records = list(read_dataset(ds, root / "unused"))
    return paths, records


def test_deterministic_from_seed(tmp_path, gen):
    a = generate(tmp_path / "a", **PARAMS)
    b = generate(tmp_path / "b", **PARAMS)
    ha, hb = tree_hashes(a["root"]), tree_hashes(b["root"])
    assert len(ha) >= 3 * PARAMS["n_images"] + 10 and ha == hb  # images, Sentences, Annotations + json
    c = generate(tmp_path / "c", **{**PARAMS, "seed": 4})
    hc = tree_hashes(c["root"])
    assert ha["images/000000000001.jpg"] != hc["images/000000000001.jpg"]
    # rendering in parallel worker processes changes nothing
    e = generate(tmp_path / "e", **PARAMS, workers=2)
    assert tree_hashes(e["root"]) == ha
    # image i depends only on (seed, i): a bigger dataset starts with the same images
    d = generate(tmp_path / "d", **{**PARAMS, "n_images": 30})
    hd = tree_hashes(d["root"])
    for f in ("images/000000000024.jpg", "flickr30k_entities/Sentences/000000000024.txt"):
        assert hd[f] == ha[f]


def test_idempotent_until_params_change(tmp_path):
    p = generate(tmp_path, **{**PARAMS, "n_images": 6})
    sentinel = p["images"] / "sentinel"
    sentinel.write_text("left alone by a no-op call")
    mtime = p["captions"].stat().st_mtime_ns
    generate(tmp_path, **{**PARAMS, "n_images": 6})
    assert sentinel.exists() and p["captions"].stat().st_mtime_ns == mtime
    generate(tmp_path, **{**PARAMS, "n_images": 7})
    assert not sentinel.exists()
    assert len(list(p["images"].glob("*.jpg"))) == 7
    assert json.loads(p["params"].read_text())["params"]["n_images"] == 7


def test_records_and_injected_errors(gen):
    paths, recs = gen
    params = json.loads(paths["params"].read_text())
    assert len(recs) == PARAMS["n_images"]
    assert [r.source_id for r in recs] == [str(i) for i in range(1, PARAMS["n_images"] + 1)]
    assert all(len(r.captions) == PARAMS["captions_per_image"] for r in recs)
    problems = [(r.source_id, p) for r in recs for p in r.problems]
    assert len(problems) == 3 and all(p[1] == EMPTY_CAPTION for _, p in problems)
    corrupt = set(params["corrupt_images"])
    assert len(corrupt) == 2
    for r in recs:
        if Path(r.image).name in corrupt:
            with pytest.raises(ImageError):
                open_image(r.image)
        else:
            assert open_image(r.image).size == (64, 64)
    assert {r.split for r in recs} == {"train", "val", "test"}
    assert all(PARAMS["min_objects"] <= len(r.instances) <= PARAMS["max_objects"] for r in recs)


def test_masks_inside_boxes_and_match_pixels(gen):
    paths, recs = gen
    corrupt = set(json.loads(paths["params"].read_text())["corrupt_images"])
    checked = 0
    for r in recs:
        img = None if Path(r.image).name in corrupt else np.asarray(open_image(r.image), dtype=np.float32)
        for inst in r.instances:
            m = rle_decode(inst.mask_rle)
            assert m.shape == (64, 64) and m.sum() > 0
            x0, y0, x1, y1 = (int(v) for v in inst.box)
            outside = m.copy()
            outside[y0:y1, x0:x1] = False
            assert not outside.any()
            if img is not None and inst.attributes["texture"] == "plain" and m.sum() >= 30:
                # JPEG blurs edges, so compare the mean colour of the visible pixels
                mean = img[m].mean(0)
                assert np.abs(mean - np.array(COLORS[inst.attributes["color"]])).max() < 40, (r.source_id, inst)
                checked += 1
    assert checked >= 10


def test_scene_graph_matches_geometry(gen):
    _, recs = gen
    n_rel = 0
    for r in recs:
        inst = {i.id: i for i in r.instances}
        pairs = {(x.subject, x.object): x.predicate for x in r.relations}
        n = len(inst)
        assert len(pairs) == len(r.relations) == n * (n - 1)  # every ordered pair exactly once
        for (s, o), p in pairs.items():
            assert p in PREDICATES and pairs[(o, s)] == INVERSE[p]
            a, b = inst[s], inst[o]
            dx = (a.box[0] + a.box[2]) / 2 - (b.box[0] + b.box[2]) / 2
            dy = (a.box[1] + a.box[3]) / 2 - (b.box[1] + b.box[3]) / 2
            if p in ("in front of", "behind"):
                boxes_meet = a.box[0] < b.box[2] and b.box[0] < a.box[2] and a.box[1] < b.box[3] and b.box[1] < a.box[3]
                assert boxes_meet
                later = int(a.attributes["draw_order"]) > int(b.attributes["draw_order"])
                assert later == (p == "in front of")
            elif p == "left of":
                assert dx < 0 and abs(dx) >= abs(dy)
            elif p == "right of":
                assert dx > 0 and abs(dx) >= abs(dy)
            elif p == "above":
                assert dy < 0 and abs(dy) > abs(dx)
            else:
                assert dy > 0 and abs(dy) > abs(dx)
            n_rel += 1
    assert n_rel > 20


def test_phrases_point_at_their_objects(gen):
    _, recs = gen
    n = 0
    for r in recs:
        inst = {i.id: i for i in r.instances}
        for p in r.phrases:
            assert r.captions[p.caption_index][p.start:p.end] == p.text
            assert p.instance_ids and all(i in inst for i in p.instance_ids)
            if len(p.instance_ids) == 1:
                o = inst[p.instance_ids[0]]
                words = p.text.lower().split()
                assert o.category in words or "shape" in words
                assert any(w in words for w in (o.category, o.attributes["color"], o.attributes["size"]))
                n += 1
    assert n > 50
    vocab = {w.strip(".,:").lower() for r in recs for c in r.captions for w in c.split()}
    assert len(vocab) > 60  # varied templates, not one fixed sentence


def test_flickr_and_karpathy_copies_agree(gen):
    paths, recs = gen
    fl = list(read_flickr30k_entities(paths["flickr30k_entities"], paths["images"]))
    kp = list(read_karpathy(paths["karpathy"], paths["root"]))
    assert len(fl) == len(kp) == len(recs)
    for r, f, k in zip(recs, fl, kp):
        assert f.captions == r.captions == k.captions
        assert f.image == r.image == k.image and f.split == r.split == k.split
        # same spans; Flickr instance ids are box numbers, so compare the boxes they point at
        coco = sorted((p.caption_index, p.start, p.end, tuple(sorted(next(i.box for i in r.instances if i.id == x)
                                                                     for x in p.instance_ids))) for p in r.phrases)
        flk = sorted((p.caption_index, p.start, p.end, tuple(sorted(f.instances[x].box for x in p.instance_ids)))
                     for p in f.phrases)
        assert coco == flk
    assert [r.source_id for r in kp if r.split == "val"] == [r.source_id for r in recs if r.split == "val"]


def test_sugarcrepe_files(gen):
    paths, recs = gen
    images = {Path(r.image).name for r in recs}
    descs = {Path(r.image).name: {(i.attributes["color"], i.category) for i in r.instances} for r in recs}
    total = 0
    for kind in NEGATIVE_KINDS:
        data = json.loads((paths["sugarcrepe"] / f"{kind}.json").read_text())
        assert list(data) == [str(i) for i in range(len(data))]
        for e in data.values():
            assert set(e) == {"filename", "caption", "negative_caption"}
            assert e["filename"] in images and e["caption"] != e["negative_caption"]
            pos, neg = e["caption"].lower().rstrip(".").split(), e["negative_caption"].lower().rstrip(".").split()
            if kind.startswith("swap"):
                strip = lambda ws: sorted(w for w in ws if w not in ("a", "an"))  # noqa: E731
                assert strip(pos) == strip(neg)  # same words, different binding
            if kind == "replace_att":
                # the negative names a colour+shape pair that is not in the image
                j = next(i for i, w in enumerate(neg) if w in COLORS)
                assert (neg[j], neg[j + 1]) not in descs[e["filename"]]
                assert (pos[j], pos[j + 1]) in descs[e["filename"]]
            total += 1
    assert total >= 2 * PARAMS["n_images"]


def test_split_filter_and_bad_params(tmp_path, gen):
    paths, recs = gen
    syn = SyntheticConfig(**PARAMS, corrupt_images=2, empty_captions=3, root=str(paths["root"]))
    val = list(read_dataset(types.SimpleNamespace(kind="synthetic", synthetic=syn, split="val"), tmp_path))
    assert val and all(r.split == "val" for r in val)
    assert len(val) == sum(r.split == "val" for r in recs)
    with pytest.raises(ValueError):
        generate(tmp_path / "bad", **{**PARAMS, "min_objects": 5, "max_objects": 2})


def test_heldout_fraction_moves_only_the_splits(tmp_path, gen):
    """``heldout`` 0.4: 8 of every 20 images held out (12-15 val, 16-19 test); the scenes and captions
    are the same images as the default's, only their split changes; bad fractions are refused."""
    from pipeline.synthetic.generate import split_of

    assert [split_of(i) for i in range(20)] == ["train"] * 18 + ["val", "test"]
    assert [split_of(i, 0.4) for i in range(20)] == ["train"] * 12 + ["val"] * 4 + ["test"] * 4
    p = generate(tmp_path / "h", **{**PARAMS, "n_images": 40}, heldout=0.4)
    imgs = json.loads(p["captions"].read_text())["images"]
    counts = {s: sum(im["split"] == s for im in imgs) for s in ("train", "val", "test")}
    assert counts == {"train": 24, "val": 8, "test": 8}
    assert json.loads(p["params"].read_text())["params"]["heldout"] == 0.4
    karpathy = json.loads(p["karpathy"].read_text())["images"]
    assert [k["split"] for k in karpathy] == [im["split"] for im in imgs]
    assert (p["flickr30k_entities"] / "test.txt").read_text().split() == [f"{i + 1:012d}" for i in range(40) if i % 20 >= 16]
    base = tree_hashes(gen[0]["root"])
    assert tree_hashes(p["root"])["images/000000000013.jpg"] == base["images/000000000013.jpg"]
    for bad in (0.15, 0.0, 1.0, 0.05):
        with pytest.raises(ValueError, match="heldout"):
            generate(tmp_path / "bad2", **PARAMS, heldout=bad)


def test_empty_scenes_and_crowded_scenes(tmp_path):
    from pipeline.readers.coco import read_coco

    p = generate(tmp_path / "e", n_images=12, seed=1, image_size=32, captions_per_image=2, min_objects=0, max_objects=1)
    recs = list(read_coco(p["captions"], p["images"], p["instances"], p["scene_graphs"]))
    empty = [r for r in recs if not r.instances]
    assert empty and all(r.captions and all(r.captions) and not r.problems and not r.phrases for r in empty)
    p = generate(tmp_path / "c", n_images=3, seed=1, image_size=64, captions_per_image=3, min_objects=8, max_objects=8)
    recs = list(read_coco(p["captions"], p["images"], p["instances"], p["scene_graphs"]))
    assert [len(r.instances) for r in recs] == [8, 8, 8] and all(len(r.relations) == 56 for r in recs)


def _graph_of(r):
    """(colour, shape) -> instance id for objects unique in the record, and the predicate table."""
    from collections import Counter

    descs = Counter((i.attributes["color"], i.category) for i in r.instances)
    ids = {(i.attributes["color"], i.category): i.id for i in r.instances if descs[(i.attributes["color"], i.category)] == 1}
    return ids, {(x.subject, x.object): x.predicate for x in r.relations}


def test_benchmark_files_read_back_and_match_the_images(gen):
    """Every generated benchmark goes through its reader without a malformed row, and each image key
    reaches a sample through the matcher (corrupt images are still named: ingest rejects them)."""
    from train.eval.benchmarks import read_benchmark
    from train.eval.images import ImageMatcher

    paths, recs = gen
    root = paths["root"]
    m = ImageMatcher({"sample_id": list(range(len(recs))), "source_id": [r.source_id for r in recs],
                      "image": [r.image for r in recs]})
    specs = {"sugarcrepe": root / "sugarcrepe", "aro_vg_relation": root / "aro" / "visual_genome_relation.json",
             "aro_vg_attribution": root / "aro" / "visual_genome_attribution.json", "valse": root / "valse",
             "vl_checklist": root / "vl_checklist" / "corpus", "foil": root / "foil" / "foilv1.0_test_2017.json",
             "winoground": root / "winoground" / "examples.jsonl", "svo_probes": root / "svo_probes" / "svo_probes.csv"}
    counts = {}
    for fmt, path in specs.items():
        s = types.SimpleNamespace(name=fmt, format=fmt, path=str(path), images=None, image_map=None, split=None,
                                  max_items=None, subsets=None, options={"min_count": 1})
        d = read_benchmark(s)
        assert d.skipped == {} and d.total == len(d.items), fmt
        keys = [p.image for it in d.items for p in it.pairs]
        assert (m.match_many(keys) >= 0).all(), (fmt, m.summary(keys).line())
        counts[fmt] = len(d.items)
        if d.items and fmt != "winoground":  # an oracle that ranks the true caption first scores 100 everywhere
            rows = d.score(d.items, [np.arange(len(it.pairs), 0, -1, dtype=float) for it in d.items])
            assert rows and all(r.value == 100.0 and r.chance == 50.0 for r in rows), fmt
    n = PARAMS["n_images"]
    assert counts["aro_vg_relation"] > n and counts["aro_vg_attribution"] > n // 2 and counts["foil"] > n // 2
    assert counts["valse"] > 3 * n and counts["vl_checklist"] > 2 * n
    for typ in ("Attribute/color", "Attribute/size", "Relation/spatial"):
        assert (root / "vl_checklist" / "corpus" / typ / "synthetic.yaml").is_file()
    assert any((root / "vl_checklist" / "corpus" / "Object" / "Location").iterdir())


def test_aro_cases_agree_with_the_scene_graph(gen):
    paths, recs = gen
    by_file = {Path(r.image).name: r for r in recs}
    rel = json.loads((paths["root"] / "aro" / "visual_genome_relation.json").read_text())
    assert rel and set(rel[0]) == {"image_id", "image_path", "relation_name", "bbox_x", "bbox_y", "bbox_w", "bbox_h",
                                   "true_caption", "false_caption"}
    for case in rel:
        r = by_file[case["image_path"]]
        ids, pred = _graph_of(r)
        phrase = next(ph[0] for p, ph in PRED_PHRASES.items() if p == case["relation_name"])
        a, b = case["true_caption"].split(f" is {phrase} ")
        sa, sb = (tuple(x.split()[1:3]) for x in (a, b))
        assert pred[(ids[sa], ids[sb])] == case["relation_name"]  # true caption holds
        assert pred[(ids[sb], ids[sa])] == INVERSE[case["relation_name"]] != case["relation_name"]  # the swap does not
        assert case["false_caption"] == f"{b} is {phrase} {a}"
        boxes = [next(i.box for i in r.instances if i.id == ids[s]) for s in (sa, sb)]
        assert case["bbox_x"] == min(bx[0] for bx in boxes) and case["bbox_x"] + case["bbox_w"] == max(bx[2] for bx in boxes)
    att = json.loads((paths["root"] / "aro" / "visual_genome_attribution.json").read_text())
    for case in att:
        present = {(i.attributes["color"], i.category) for i in by_file[case["image_path"]].instances}
        w = case["false_caption"].split()
        assert (w[1], w[2]) not in present and (w[5], w[6]) not in present and case["attributes"] == [w[5], w[1]]
        assert case["attributes"] == sorted(case["attributes"])  # one group per colour pair


def test_winoground_pairs_are_true_for_exactly_their_image(tmp_path):
    """Each caption holds in its own image and not in the other (checked on the scene graph)."""
    from collections import Counter

    from pipeline.readers.coco import read_coco

    p = generate(tmp_path / "w", n_images=60, seed=5, image_size=64, captions_per_image=1)
    recs = {Path(r.image).stem: r for r in read_coco(p["captions"], p["images"], p["instances"], p["scene_graphs"])}
    ex = [json.loads(x) for x in (p["root"] / "winoground" / "examples.jsonl").read_text().splitlines()]
    assert len(ex) >= 5 and {e["collapsed_tag"] for e in ex} == {"Object", "Attribute"}

    def holds(r, caption) -> bool:
        key = "category" if not caption.split()[2] == "shape" else "color"
        phrase = next(ph[0] for ph in PRED_PHRASES.values() if f" is {ph[0]} " in caption)
        p_name = next(k for k, ph in PRED_PHRASES.items() if ph[0] == phrase)
        a, b = (x.split()[1] for x in caption.split(f" is {phrase} "))
        val = (lambda i: i.category) if key == "category" else (lambda i: i.attributes["color"])
        c = Counter(val(i) for i in r.instances)
        assert c[a] == 1 and c[b] == 1, "named objects must be unique in both images"
        ia, ib = (next(i.id for i in r.instances if val(i) == v) for v in (a, b))
        return next(x.predicate for x in r.relations if (x.subject, x.object) == (ia, ib)) == p_name

    for e in ex:
        i0, i1 = recs[e["image_0"]], recs[e["image_1"]]
        assert sorted(e["caption_0"].split()) == sorted(e["caption_1"].split())  # same words, another order
        assert holds(i0, e["caption_0"]) and not holds(i1, e["caption_0"])
        assert holds(i1, e["caption_1"]) and not holds(i0, e["caption_1"])


def test_captions_of_is_the_written_captions(gen, tmp_path):
    """`captions_of` (what `pipeline plan` mines for a generated dataset too large to generate) is
    the generator's captions.json, caption for caption, except the ones `empty_captions` blanked;
    and so for the "large" vocabulary too."""
    from pipeline.synthetic.generate import captions_of

    paths, _ = gen
    written = json.loads(paths["captions"].read_text())["annotations"]
    ours = captions_of(PARAMS["n_images"], **{k: v for k, v in PARAMS.items() if k != "n_images"})
    by_image: dict[int, list[str]] = {}
    for a in sorted(written, key=lambda a: a["id"]):
        by_image.setdefault(a["image_id"], []).append(a["caption"])
    blank = [(w, o) for i, caps in by_image.items() for w, o in zip(caps, ours[i - 1]) if w != o]
    assert len(blank) == 3 and all(not w.strip() for w, _ in blank)  # exactly the three blanked
    assert sum(len(c) for c in ours) == PARAMS["n_images"] * PARAMS["captions_per_image"]
    large = dict(PARAMS, n_images=6, vocabulary="large")
    p2 = generate(tmp_path / "large", **large)
    w2 = [a["caption"] for a in sorted(json.loads(p2["captions"].read_text())["annotations"], key=lambda a: a["id"])]
    assert [c for caps in captions_of(**large) for c in caps] == w2
    assert [c for caps in captions_of(**dict(large, vocabulary="small")) for c in caps] != w2
