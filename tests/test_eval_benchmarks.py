"""Benchmark readers on small files in each benchmark's published format, and each scorer against a
hand-computed answer (train/eval/benchmarks/)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from train.eval.benchmarks import FORMAT_HELP, FORMATS, BenchmarkError, read_benchmark
from train.eval.images import ImageMatcher


def spec(fmt, path, name=None, **kw):
    base = dict(name=name or fmt, format=fmt, path=str(path), images=None, image_map=None, split=None, max_items=None,
                subsets=None, options={})
    base.update(kw)
    return SimpleNamespace(**base)


def rows_by(rows):
    return {(r.subset, r.metric): r for r in rows}


def S(*xs):
    return np.array(xs, dtype=np.float64)


# -- SugarCrepe -------------------------------------------------------------------------------------


def sc_row(f, c, n):
    return {"filename": f, "caption": c, "negative_caption": n}


def write_sugarcrepe(d: Path):
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "replace_obj": {"0": sc_row("000000000001.jpg", "a red circle", "a red square"),
                        "1": sc_row("000000000002.jpg", "a cat", "a dog"),
                        "2": sc_row("000000000003.jpg", "a bus", "a car"),
                        "3": {"filename": "000000000004.jpg", "caption": "no negative"}},  # malformed
        "swap_att": {"0": sc_row("000000000001.jpg", "red circle and blue square", "blue circle and red square"),
                     "1": sc_row("000000000005.jpg", "x", "y")},
        "add_obj": {"0": sc_row("COCO_val2014_000000000002.jpg", "a cat", "a cat and a hat")},
    }
    for k, v in files.items():
        (d / f"{k}.json").write_text(json.dumps(v, indent=4))
    (d / "LICENSE.json").write_text("{}")  # not a kind: ignored
    return d


def test_sugarcrepe_json_weighting_and_strict_ties(tmp_path):
    data = read_benchmark(spec("sugarcrepe", write_sugarcrepe(tmp_path / "data")))
    assert data.kind == "pairwise" and len(data.items) == 6 and data.total == 6
    assert data.skipped == {"malformed: missing or empty field 'negative_caption'": 1}
    it = data.items[0]
    assert it.subset in {"add_obj", "replace_obj", "swap_att"}
    by_kind = {}
    for it in data.items:
        by_kind.setdefault(it.subset, []).append(it)
    assert {k: len(v) for k, v in by_kind.items()} == {"add_obj": 1, "replace_obj": 3, "swap_att": 2}
    ro = by_kind["replace_obj"][0]
    assert [(p.image, p.text) for p in ro.pairs] == [("000000000001.jpg", "a red circle"), ("000000000001.jpg", "a red square")]
    # replace_obj: right, TIE (wrong), right -> 2/3; swap_att: right, wrong -> 1/2; add_obj: right
    score = {"replace_obj": [S(2, 1), S(1, 1), S(0.5, 0.1)], "swap_att": [S(3, 1), S(0, 1)], "add_obj": [S(1, 0)]}
    items = [it for k in ("replace_obj", "swap_att", "add_obj") for it in by_kind[k]]
    scores = [s for k in ("replace_obj", "swap_att", "add_obj") for s in score[k]]
    r = rows_by(data.score(items, scores))
    assert r[("replace_obj", "accuracy")].value == pytest.approx(200 / 3) and r[("replace_obj", "accuracy")].n == 3
    assert r[("swap_att", "accuracy")].value == pytest.approx(50.0)
    # triple-weighted: (2 + 1) / 5 = 60, not the mean of the kinds (58.3); add_* not in it
    assert r[("all", "accuracy")].value == pytest.approx(60.0) and r[("all", "accuracy")].n == 5
    assert r[("add", "accuracy")].value == pytest.approx(100.0) and r[("add", "accuracy")].n == 1
    assert all(x.chance == 50.0 for x in r.values())
    # the tie is said where it happened (a word-order-blind model ties on every swap: 0%, not a bug)
    assert r[("replace_obj", "accuracy")].note == "1 of 3 items tied at the top (scored wrong, as the original)"
    assert r[("swap_att", "accuracy")].note == "" and "1 of 5 items tied" in r[("all", "accuracy")].note


def test_sugarcrepe_old_ent_names_and_unusable_file(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    (d / "swap_ent.json").write_text(json.dumps({"0": sc_row("a.jpg", "p", "n")}))
    data = read_benchmark(spec("sugarcrepe", d))
    assert [it.subset for it in data.items] == ["swap_obj"]
    (d / "mine.json").write_text(json.dumps({"0": sc_row("a.jpg", "p", "n")}))
    assert [it.subset for it in read_benchmark(spec("sugarcrepe", d / "mine.json", options={"kind": "add_att"})).items] == ["add_att"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "replace_rel.json").write_text(json.dumps({"0": {"filename": "a.jpg"}, "1": {"caption": "x"}}))
    with pytest.raises(BenchmarkError, match=r"replace_rel.json: row 0: missing or empty fields 'caption', 'negative_caption'"):
        read_benchmark(spec("sugarcrepe", bad))
    (bad / "replace_rel.json").write_text("{not json")
    with pytest.raises(BenchmarkError, match=r"replace_rel.json: not valid JSON \(line 1"):
        read_benchmark(spec("sugarcrepe", bad))


def test_sugarcrepe_hf_parquet_layout(tmp_path):
    d = tmp_path / "SugarCrepe_replace_rel" / "data"
    d.mkdir(parents=True)
    img = pa.array([{"bytes": b"\xff\xd8", "path": "000000000007.jpg"}, {"bytes": b"\xff\xd8", "path": None},
                    {"bytes": b"", "path": "x.jpg"}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    tab = pa.table({"image": img, "tested_labels": [["a man on a horse", "a man under a horse"], ["p", "n"], ["only one"]],
                    "true_label": [3, 8, 1]})
    pq.write_table(tab, d / "test-00000-of-00001-abc.parquet")
    data = read_benchmark(spec("sugarcrepe", tmp_path / "SugarCrepe_replace_rel"))
    assert [it.subset for it in data.items] == ["replace_rel", "replace_rel"]
    assert [(p.image, p.text) for p in data.items[0].pairs] == [("000000000007.jpg", "a man on a horse"),
                                                                ("000000000007.jpg", "a man under a horse")]
    assert data.items[1].pairs[0].image == "replace_rel/1"  # no path in the parquet: give image_map
    assert data.skipped == {"malformed: tested_labels is not [caption, negative_caption]": 1}


def test_items_whose_image_is_missing_are_kept_for_counting(tmp_path):
    """The reader keeps every item; the matcher says which have no image (the harness counts them)."""
    data = read_benchmark(spec("sugarcrepe", write_sugarcrepe(tmp_path / "data")))
    m = ImageMatcher({"sample_id": [10, 11], "source_id": ["1", "2"], "image": ["/i/000000000001.jpg", "/i/000000000002.jpg"]})
    ids = m.match_many([it.pairs[0].image for it in data.items])
    assert len(ids) == 6 and int((ids < 0).sum()) == 2  # images 3 and 5 are not in the samples
    assert sorted(set(ids[ids >= 0].tolist())) == [10, 11]  # COCO_val2014_000000000002.jpg -> sample 11


# -- ARO --------------------------------------------------------------------------------------------


def vg(rel, true, false, x=10, y=20, w=30, h=40, image="2358789.jpg", **kw):
    r = {"image_id": image.split(".")[0], "image_path": image, "bbox_x": x, "bbox_y": y, "bbox_w": w, "bbox_h": h,
         "true_caption": true, "false_caption": false}
    if rel is not None:
        r["relation_name"] = rel
    r.update(kw)
    return r


def test_aro_vg_relation_macro_and_micro(tmp_path):
    d = tmp_path / "ARO"
    d.mkdir()
    rows = [vg("on", "the cat is on the mat", "the mat is on the cat"), vg("on", "a", "b"), vg("on", "c", "d"),
            vg("behind", "e", "f"), vg("on", "g", "h", w=0), {"image_path": "1.jpg", "relation_name": "on"}]
    (d / "visual_genome_relation.json").write_text(json.dumps(rows))
    data = read_benchmark(spec("aro_vg_relation", d))
    assert len(data.items) == 4 and data.total == 6
    assert data.skipped == {"malformed: bbox_w / bbox_h not positive": 1,
                            "malformed: missing or empty fields 'true_caption', 'false_caption'": 1}
    p = data.items[0].pairs
    assert p[0].text == "the cat is on the mat" and p[1].text == "the mat is on the cat"
    assert p[0].box == (10.0, 20.0, 40.0, 60.0) and p[0].image == "2358789.jpg"
    # on: right, right, tie (wrong) -> 66.7; behind: wrong -> 0; macro 33.3, micro 2/4 = 50
    r = rows_by(data.score(data.items, [S(1, 0), S(2, 1), S(1, 1), S(0, 1)]))
    assert r[("on", "accuracy")].value == pytest.approx(200 / 3) and r[("behind", "accuracy")].value == 0.0
    assert r[("all", "macro_accuracy")].value == pytest.approx(100 / 3) and r[("all", "macro_accuracy")].n == 4
    assert r[("all", "accuracy")].value == pytest.approx(50.0) and r[("all", "accuracy")].chance == 50.0
    # the tie is counted in the "all" rows' notes: a model blind to word order ties everywhere
    assert "1 of 4 items tied at the top" in r[("all", "accuracy")].note
    assert "1 of 4 items tied" in r[("all", "macro_accuracy")].note
    r = rows_by(data.score(data.items, [S(1, 0), S(2, 1), S(3, 0), S(0, 1)]))
    assert "tied" not in r[("all", "accuracy")].note


def test_aro_vg_attribution_min_count(tmp_path):
    f = tmp_path / "visual_genome_attribution.json"
    rows = [vg(None, "the white cat and the black dog", "the black cat and the white dog", attributes=["white", "black"])] * 3
    rows += [vg(None, "the red bus and the blue car", "the blue bus and the red car", attributes=["red", "blue"])]
    rows += [vg(None, "x", "y", attributes="red")]
    f.write_text(json.dumps(rows))
    data = read_benchmark(spec("aro_vg_attribution", f))
    assert [it.subset for it in data.items] == ["white_black"] * 3 + ["red_blue"]
    assert data.skipped == {"malformed: 'attributes' is not a list of two attribute names": 1}
    scores = [S(1, 0), S(1, 0), S(0, 1), S(0, 1)]
    r = rows_by(data.score(data.items, scores))  # default min_count 25 (the original): no pair qualifies
    assert ("all", "macro_accuracy") not in r and r[("all", "accuracy")].value == pytest.approx(50.0)
    data = read_benchmark(spec("aro_vg_attribution", f, options={"min_count": 2}))
    r = rows_by(data.score(data.items, scores))
    assert r[("all", "macro_accuracy")].value == pytest.approx(200 / 3) and r[("all", "macro_accuracy")].n == 3


def karpathy(path: Path):
    imgs = [
        {"filepath": "val2014", "filename": "COCO_val2014_000000000011.jpg", "split": "test", "cocoid": 11,
         "sentences": [{"raw": "A small brown dog runs across the green grass."}, {"raw": "Two old men sit on a bench."}]},
        {"filepath": "val2014", "filename": "COCO_val2014_000000000012.jpg", "split": "test", "cocoid": 12,
         "sentences": [{"raw": "A red bus drives down a busy city street near tall buildings."}]},
        {"filepath": "train2014", "filename": "COCO_train2014_000000000013.jpg", "split": "train", "cocoid": 13,
         "sentences": [{"raw": "train caption"}]},
        {"filepath": "val2014", "filename": "COCO_val2014_000000000014.jpg", "split": "restval", "cocoid": 14,
         "sentences": [{"raw": "restval caption"}]},
    ]
    path.write_text(json.dumps({"dataset": "coco", "images": imgs}))
    return path


def test_aro_order_perturbations_seeded_and_scored(tmp_path):
    from train.eval.benchmarks.aro import pre_caption

    f = karpathy(tmp_path / "dataset_coco.json")
    a = read_benchmark(spec("aro_order", f))
    b = read_benchmark(spec("aro_order", f))
    assert len(a.items) == 3 and a.total == 3  # the 3 test captions; train and restval left out
    assert [[p.text for p in it.pairs] for it in a.items] == [[p.text for p in it.pairs] for it in b.items]
    c = read_benchmark(spec("aro_order", f, options={"seed": 1}))
    assert [[p.text for p in it.pairs] for it in a.items] != [[p.text for p in it.pairs] for it in c.items]
    for it in a.items:
        true = it.pairs[0].text
        assert true == pre_caption(true) and "." not in true and true == true.lower()
        assert 2 <= len(it.pairs) <= 5 and all(p.image == it.pairs[0].image for p in it.pairs)
        for p in it.pairs[1:]:
            assert p.text != true and sorted(p.text.split()) == sorted(true.split())  # a reordering of the same words
    long = a.items[2]
    assert long.pairs[0].image == "COCO_val2014_000000000012.jpg" and len(long.pairs) == 5
    assert long.meta["perturbations"] == ["shuffle_nouns_and_adj", "shuffle_allbut_nouns_and_adj",
                                          "shuffle_within_trigrams", "shuffle_trigrams"]
    # correct: strictly highest true caption; item 2 ties with a distractor -> wrong
    scores = [np.r_[5.0, np.zeros(len(a.items[0].pairs) - 1)], np.r_[0.0, np.ones(len(a.items[1].pairs) - 1)],
              np.r_[1.0, 1.0, np.zeros(len(long.pairs) - 2)]]
    (row,) = a.score(a.items, scores)
    assert row.value == pytest.approx(100 / 3) and row.n == 3
    assert row.chance == pytest.approx(100 * np.mean([1 / len(it.pairs) for it in a.items]))
    blip = tmp_path / "coco_karpathy_test.json"
    blip.write_text(json.dumps([{"image": "val2014/COCO_val2014_000000000012.jpg",
                                 "caption": ["A red bus drives down a busy city street near tall buildings."]}]))
    d = read_benchmark(spec("aro_order", blip))
    assert d.items[0].pairs[0].text == long.pairs[0].text and d.items[0].pairs[0].image.startswith("val2014/COCO_val2014_")
    assert len(d.items[0].pairs) == 5 and d.total == 1


def test_aro_order_pre_caption_matches_the_original():
    from train.eval.benchmarks.aro import pre_caption

    assert pre_caption('A "big" dog; runs!  (fast).') == "a big dog runs fast"
    assert pre_caption(" ".join(f"w{k}" for k in range(40))).split() == [f"w{k}" for k in range(30)]


# -- Winoground -------------------------------------------------------------------------------------


def test_winoground_three_scores_hand_computed(tmp_path):
    d = tmp_path / "winoground"
    d.mkdir()
    ex = [
        {"id": 0, "image_0": "ex_0_img_0", "image_1": "ex_0_img_1", "caption_0": "an old person kisses a young person",
         "caption_1": "a young person kisses an old person", "tag": "Noun", "secondary_tag": "", "num_main_preds": 1,
         "collapsed_tag": "Object"},
        {"id": 1, "image_0": "ex_1_img_0", "image_1": "ex_1_img_1", "caption_0": "the dog is on the mat",
         "caption_1": "the mat is on the dog", "tag": "Relation", "secondary_tag": "", "num_main_preds": 1,
         "collapsed_tag": "Relation"},
        {"id": 2, "image_0": "ex_2_img_0", "image_1": "ex_2_img_1", "caption_0": "a b", "caption_1": "b a", "tag": "x",
         "secondary_tag": "", "num_main_preds": 2, "collapsed_tag": "Relation"},
    ]
    lines = [json.dumps(e) for e in ex] + ["", "{broken", json.dumps({"id": 9, "image_0": "a", "caption_0": "x"})]
    (d / "examples.jsonl").write_text("\n".join(lines) + "\n")
    data = read_benchmark(spec("winoground", d))
    assert len(data.items) == 3 and data.total == 5
    assert set(data.skipped) == {"malformed: not valid JSON (Expecting property name enclosed in double quotes)",
                                 "malformed: missing or empty 'image_1', 'caption_1'"}
    assert [(p.image, p.text) for p in data.items[0].pairs] == [
        ("ex_0_img_0", ex[0]["caption_0"]), ("ex_0_img_1", ex[0]["caption_0"]),
        ("ex_0_img_0", ex[0]["caption_1"]), ("ex_0_img_1", ex[0]["caption_1"])]
    # scores per item in pair order (c0i0, c0i1, c1i0, c1i1)
    scores = [S(0.9, 0.1, 0.2, 0.8),   # text: .9>.2, .8>.1 yes; image: .9>.1, .8>.2 yes -> group yes
              S(0.9, 0.1, 0.5, 0.4),   # text: .9>.5, .4>.1 yes; image: .9>.1, .4>.5 no -> group no
              S(0.3, 0.6, 0.2, 0.5)]   # text: .3>.2, .5>.6 no; image: .3>.6 no -> none
    r = rows_by(data.score(data.items, scores))
    assert r[("all", "text_score")].value == pytest.approx(200 / 3)
    assert r[("all", "image_score")].value == pytest.approx(100 / 3)
    assert r[("all", "group_score")].value == pytest.approx(100 / 3)
    assert (r[("all", "text_score")].chance, r[("all", "image_score")].chance) == (25.0, 25.0)
    assert r[("all", "group_score")].chance == pytest.approx(100 / 6)
    assert r[("Relation", "text_score")].value == 50.0 and r[("Relation", "group_score")].n == 2
    # a model that scores everything equal gets nothing (strict)
    r0 = rows_by(data.score(data.items, [S(1, 1, 1, 1)] * 3))
    assert r0[("all", "text_score")].value == 0.0
    # the ties are counted in each row's note (the reason it lands below chance), per score's comparisons
    assert r0[("all", "text_score")].note == "3 of 3 items tied in a comparison (scored wrong, as the original)"
    assert r[("all", "text_score")].note == "" and r[("all", "text_score")].tied == (0, 3)
    r1 = rows_by(data.score(data.items, [S(0.9, 0.9, 0.2, 0.8), S(0.9, 0.1, 0.5, 0.4), S(0.3, 0.6, 0.2, 0.5)]))
    assert (r1[("all", "text_score")].tied, r1[("all", "image_score")].tied, r1[("all", "group_score")].tied) == \
        ((0, 3), (1, 3), (1, 3))  # c0i0 == c0i1: a tie of the image score (and so the group's), not the text's


def test_winoground_group_chance_is_exact():
    """4 of the 24 orderings of four distinct scores satisfy both text and image: 1/6."""
    from itertools import permutations

    from train.eval.benchmarks.winoground import item_scores

    res = np.array([item_scores(p) for p in permutations([0, 1, 2, 3])])
    assert res.mean(0).tolist() == pytest.approx([0.25, 0.25, 1 / 6])


# -- VALSE ------------------------------------------------------------------------------------------


def valse_item(img, cap, foil, votes, ph="counting"):
    return {"dataset": "visual7w", "original_split": "test", "dataset_idx": img, "linguistic_phenomena": ph,
            "image_file": img, "caption": cap, "classes": "x", "classes_foil": "y",
            "mturk": {"foil": 3 - votes, "caption": votes, "other": 0}, "foil": foil}


def test_valse_validated_items_pieces_and_phenomena(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "counting-hard.json").write_text(json.dumps({
        "counting_hard_0": valse_item("v7w_1.jpg", "There are 2 dogs.", "There are 4 dogs.", 3),
        "counting_hard_1": valse_item("v7w_2.jpg", "There are 3 cats.", "There are 1 cats.", 2),
        "counting_hard_2": valse_item("v7w_3.jpg", "not valid", "foil", 1),  # dropped: not validated
    }))
    (d / "counting-small-quant.json").write_text(json.dumps({
        "c_0": valse_item("v7w_4.jpg", "There is 1 dog.", "There are 2 dogs.", 3),
        "c_1": {"image_file": "v7w_5.jpg", "caption": "no foil"},  # malformed
    }))
    (d / "existence.json").write_text(json.dumps({"existence_0": valse_item("v7w_6.jpg", "There are no animals.",
                                                                            "There are animals.", 3, "existence")}))
    data = read_benchmark(spec("valse", d))
    assert [it.subset for it in data.items] == ["counting/counting-hard", "counting/counting-hard",
                                                "counting/counting-small-quant", "existence/existence"]
    assert data.skipped == {"malformed: missing or empty field 'foil'": 1}  # non-validated items are not skips:
    assert data.total == 5 and "1 not validated (mturk.caption < 2)" in data.source  # they are not in the benchmark
    # counting-hard: right, wrong -> 50; small-quant: right -> 100; existence: tie -> 0
    r = rows_by(data.score(data.items, [S(1, 0), S(0, 1), S(2, 1), S(1, 1)]))
    assert r[("counting/counting-hard", "accuracy")].value == 50.0
    assert r[("counting", "accuracy")].value == pytest.approx(75.0) and r[("counting", "accuracy")].n == 3
    assert r[("existence", "accuracy")].value == 0.0
    assert r[("all", "macro_accuracy")].value == pytest.approx(50.0)  # (50 + 100 + 0) / 3 pieces
    assert r[("all", "accuracy")].value == pytest.approx(50.0) and r[("all", "accuracy")].n == 4
    # the tie: in its piece's, its phenomenon's and the overall rows' notes (macro rows add up their rows')
    tie = "1 of {} items tied at the top (scored wrong, as the original)"
    assert r[("existence/existence", "accuracy")].note == tie.format(1)
    assert r[("existence", "accuracy")].note.endswith(tie.format(1)) and r[("all", "accuracy")].note.endswith(tie.format(4))
    assert r[("all", "macro_accuracy")].note.endswith(tie.format(4)) and "tied" not in r[("counting", "accuracy")].note
    assert read_benchmark(spec("valse", d, subsets=["existence"])).items[0].key == "existence/existence_0"


# -- VL-CheckList -----------------------------------------------------------------------------------


def test_vl_checklist_configs_and_category_averages(tmp_path):
    root = tmp_path / "vlc"
    corpus = root / "corpus" / "v1"
    entries = {
        ("Attribute/color", "vg"): [["VG_100K/1.jpg", {"POS": ["a red car"], "NEG": ["a blue car"]}],
                                    ["VG_100K/2.jpg", {"POS": ["a white cat"], "NEG": ["a black cat"]}]],
        ("Attribute/size", "vaw"): [["VG_100K/3.jpg", {"POS": ["a big dog"], "NEG": ["a small dog"]}],
                                    ["VG_100K/4.jpg", {"POS": [], "NEG": ["x"]}]],  # malformed
        ("Object/Location/center", "vg_obj"): [["VG_100K_2/5.jpg", {"POS": ["a man"], "NEG": ["a woman"]}]],
        ("Relation/spatial", "vg"): [["VG_100K/6.jpg", {"POS": ["cup on table"], "NEG": ["cup under table"]}],
                                     ["VG_100K/7.jpg", {"POS": ["a on b"], "NEG": ["b on a"]}]],
    }
    for (typ, corpus_name), rows in entries.items():
        y = corpus / typ / f"{corpus_name}.yaml"
        y.parent.mkdir(parents=True, exist_ok=True)
        anno = f"data/{typ.split('/')[0]}/{corpus_name}/{typ.split('/')[-1]}.json"
        (root / anno).parent.mkdir(parents=True, exist_ok=True)
        (root / anno).write_text(json.dumps(rows))
        y.write_text(f'ANNO_PATH: "{anno}"\nIMG_ROOT: "vg/"\nTYPE: "TUPLE_JSON"\n')
    d = read_benchmark(spec("vl_checklist", root / "corpus"))
    subsets = [it.subset for it in d.items]
    assert sorted(set(subsets)) == ["Attribute/color/vg", "Attribute/size/vaw", "Object/Location/center/vg_obj",
                                    "Relation/spatial/vg"]
    assert d.skipped == {"malformed: POS is not a non-empty list of texts": 1}
    assert d.items[subsets.index("Object/Location/center/vg_obj")].pairs[0].image == "vg/VG_100K_2/5.jpg"
    sc = {"Attribute/color/vg": [S(1, 0), S(0, 1)], "Attribute/size/vaw": [S(1, 0)],
          "Object/Location/center/vg_obj": [S(0, 0)], "Relation/spatial/vg": [S(1, 0), S(1, 0)]}
    scores = [sc[s][sum(1 for t in subsets[:k] if t == s)] for k, s in enumerate(subsets)]
    r = rows_by(d.score(d.items, scores))
    assert r[("Attribute/color", "accuracy")].value == 50.0 and r[("Attribute/size", "accuracy")].value == 100.0
    assert r[("Attribute", "accuracy")].value == pytest.approx(75.0)  # mean of its two types, not pooled (66.7)
    assert r[("Object", "accuracy")].value == 0.0 and r[("Relation", "accuracy")].value == 100.0
    assert r[("all", "macro_accuracy")].value == pytest.approx(175 / 3)
    assert r[("all", "accuracy")].value == pytest.approx(400 / 6) and r[("all", "accuracy")].n == 6
    # one config file; a missing ANNO_PATH target is a one-line error naming it
    one = read_benchmark(spec("vl_checklist", corpus / "Relation/spatial/vg.yaml"))
    assert len(one.items) == 2
    (corpus / "Relation/spatial/vg.yaml").write_text('ANNO_PATH: "data/nowhere.json"\nIMG_ROOT: "vg/"\n')
    with pytest.raises(BenchmarkError, match=r"nowhere.json: file not found"):
        read_benchmark(spec("vl_checklist", corpus / "Relation/spatial/vg.yaml"))


def test_vl_checklist_config_without_its_data_file_is_skipped_naming_where_it_belongs(tmp_path, monkeypatch):
    """One missing data file skips that config (counted, with the path beside the corpus folder, not
    under the working folder); the others are read."""
    root = tmp_path / "VL-CheckList"
    for typ, anno in (("Attribute/color", "data/Attribute/vg/color.json"), ("Relation/spatial", "data/Relation/vg/spatial.json")):
        y = root / "corpus" / "v1" / typ / "vg.yaml"
        y.parent.mkdir(parents=True)
        y.write_text(f'ANNO_PATH: "{anno}"\nIMG_ROOT: "vg/"\nTYPE: "TUPLE_JSON"\n')
    (root / "data/Attribute/vg").mkdir(parents=True)
    (root / "data/Attribute/vg/color.json").write_text(json.dumps([["VG_100K/1.jpg", {"POS": ["a red car"], "NEG": ["a blue car"]}]]))
    monkeypatch.chdir(tmp_path)
    d = read_benchmark(spec("vl_checklist", root / "corpus"))
    assert [it.subset for it in d.items] == ["Attribute/color/vg"]
    assert d.skipped == {f"config skipped, data file not found: {root / 'data/Relation/vg/spatial.json'}": 1}
    (root / "data/Attribute/vg/color.json").unlink()
    with pytest.raises(BenchmarkError, match=r"VL-CheckList data .*VL-CheckList/data/Attribute/vg/color.json: file not found "
                                             r"\(and 1 other configs' data files\)"):
        read_benchmark(spec("vl_checklist", root / "corpus"))


# -- SVO-Probes, FOIL, retrieval --------------------------------------------------------------------


def test_svo_probes_negative_images(tmp_path):
    f = tmp_path / "svo_probes.csv"
    cols = ["", "sentence", "pos_triplet", "neg_triplet", "pos_url", "neg_url", "pos_image_id", "neg_image_id",
            "subj_neg", "verb_neg", "obj_neg"]
    rows = [[0, "A girl stands in grass.", "girl,stand,grass", "dog,stand,grass", "u1", "u2", 101, 102, True, False, False],
            [1, "A man rides a horse.", "man,ride,horse", "man,feed,horse", "u3", "u4", 103, 104, False, True, False],
            [2, "A man rides a bike.", "man,ride,bike", "man,ride,horse", "u5", "u6", 105, 106, False, False, True],
            [3, "", "x", "y", "u", "u", 1, 2, False, False, True]]
    with f.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        w.writerows(rows)
    d = read_benchmark(spec("svo_probes", f))
    assert [it.subset for it in d.items] == ["subject", "verb", "object"]
    assert d.skipped == {"malformed: empty 'sentence'": 1}
    assert [(p.image, p.text) for p in d.items[0].pairs] == [("101", "A girl stands in grass."), ("102", "A girl stands in grass.")]
    r = rows_by(d.score(d.items, [S(1, 0), S(0, 1), S(3, 2)]))
    assert r[("verb", "accuracy")].value == 0.0 and r[("all", "accuracy")].value == pytest.approx(200 / 3)
    f.write_text("sentence,pos_image_id\nx,1\n")
    with pytest.raises(BenchmarkError, match=r"svo_probes.csv: no column\(s\) neg_image_id"):
        read_benchmark(spec("svo_probes", f))


def test_foil_pairs_originals_with_foils(tmp_path):
    f = tmp_path / "foilv1.0_test_2017.json"
    anns = [{"image_id": 391895, "id": 7, "caption": "A man rides a motorcycle.", "foil": False, "target_word": "ORIG",
             "foil_word": "ORIG", "foil_id": 1},
            {"image_id": 391895, "id": 7, "caption": "A man rides a bicycle.", "foil": True, "target_word": "motorcycle",
             "foil_word": "bicycle", "foil_id": 2},
            {"image_id": 391895, "id": 7, "caption": "A dog rides a motorcycle.", "foil": True, "target_word": "man",
             "foil_word": "dog", "foil_id": 3},
            {"image_id": 5, "id": 9, "caption": "A cat on a sofa.", "foil": True, "target_word": "dog", "foil_word": "cat",
             "foil_id": 4},
            {"image_id": 5, "id": 10, "foil": True}]
    f.write_text(json.dumps({"images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg"}], "annotations": anns}))
    d = read_benchmark(spec("foil", f))
    assert len(d.items) == 2 and d.total == 3
    assert d.skipped == {"no original caption": 1, "malformed: missing or empty 'caption'": 1}
    assert [(p.image, p.text) for p in d.items[1].pairs] == [("COCO_val2014_000000391895.jpg", "A man rides a motorcycle."),
                                                             ("COCO_val2014_000000391895.jpg", "A dog rides a motorcycle.")]
    (r,) = d.score(d.items, [S(1, 0), S(0, 0)])
    assert (r.subset, r.value, r.n, r.chance) == ("all", 50.0, 2, 50.0)


def test_retrieval_karpathy_split(tmp_path):
    f = karpathy(tmp_path / "dataset_coco.json")
    d = read_benchmark(spec("retrieval", f))
    assert d.kind == "retrieval" and [it.key for it in d.items] == ["COCO_val2014_000000000011.jpg",
                                                                    "COCO_val2014_000000000012.jpg"]
    assert [len(it.pairs) for it in d.items] == [2, 1]
    tr = read_benchmark(spec("retrieval", f, split="train"))
    assert [it.key for it in tr.items] == ["COCO_train2014_000000000013.jpg", "COCO_val2014_000000000014.jpg"]  # + restval
    with pytest.raises(TypeError, match="retrieval_scores"):
        d.score(d.items, [])
    with pytest.raises(BenchmarkError, match="no image in split 'val'"):
        read_benchmark(spec("retrieval", f, split="val"))


# -- read_benchmark ---------------------------------------------------------------------------------


def test_formats_subsets_and_max_items(tmp_path):
    assert set(FORMATS) == {"sugarcrepe", "aro_vg_relation", "aro_vg_attribution", "aro_order", "winoground", "valse",
                            "vl_checklist", "svo_probes", "foil", "retrieval"}
    assert set(FORMAT_HELP) == set(FORMATS)
    d = write_sugarcrepe(tmp_path / "data")
    with pytest.raises(BenchmarkError, match="unknown format 'nope'"):
        read_benchmark(spec("nope", d))
    sub = read_benchmark(spec("sugarcrepe", d, subsets=["replace_obj"]))
    assert {it.subset for it in sub.items} == {"replace_obj"} and len(sub.items) == 3
    a = read_benchmark(spec("sugarcrepe", d, max_items=4))
    b = read_benchmark(spec("sugarcrepe", d, max_items=4))
    assert len(a.items) == 4 and [it.key for it in a.items] == [it.key for it in b.items]
    with pytest.raises(BenchmarkError, match="no item in subsets swap_rel"):
        read_benchmark(spec("sugarcrepe", d, subsets=["swap_rel"]))
    with pytest.raises(BenchmarkError, match="not found"):
        read_benchmark(spec("sugarcrepe", tmp_path / "absent"))


def test_published_sugarcrepe_counts(sugarcrepe_dir):
    """The shared copy of RAIVNLab/sugar-crepe data/ reads whole: the published per-kind counts."""
    d = read_benchmark(spec("sugarcrepe", sugarcrepe_dir))
    from collections import Counter

    assert d.skipped == {} and Counter(it.subset for it in d.items) == {
        "replace_obj": 1652, "replace_att": 788, "replace_rel": 1406, "swap_obj": 245, "swap_att": 666,
        "add_obj": 2062, "add_att": 692}
    assert all(it.pairs[0].image.endswith(".jpg") and it.pairs[0].text != it.pairs[1].text for it in d.items)
    # 7,511 items on 1,560 COCO val2017 images (the README's error example counts these)
    images = sorted({p.image for it in d.items for p in it.pairs})
    assert len(d.items) == d.total == 7511 and len(images) == 1560


def test_published_sugarcrepe_images_match_coco_runs_only(sugarcrepe_dir):
    """The real file names reach a COCO run's samples (Karpathy val2014 names) through the COCO id;
    against a Visual Genome run holding the same numbers they are foreign, not matched."""
    d = read_benchmark(spec("sugarcrepe", sugarcrepe_dir))
    images = sorted({p.image for it in d.items for p in it.pairs})
    ids = [int(Path(k).stem) for k in images]
    coco = ImageMatcher({"sample_id": list(range(len(ids))), "source_id": [str(i) for i in ids],
                         "image": [f"val2014/COCO_val2014_{i:012d}.jpg" for i in ids]})
    assert (coco.match_many(images) == np.arange(len(ids))).all()
    vg = ImageMatcher({"sample_id": list(range(len(ids))), "source_id": [str(i) for i in ids],
                       "image": [f"VG_100K/{i}.jpg" for i in ids]})
    s = vg.summary(images)
    assert s.matched == 0 and s.foreign == {"COCO": 1560}


LFS = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146b6bd1a8e3a4ffc7a0f6a8e6c3f0b5d7e9a1c2b3d4e5f60718293a4b5\nsize 1234567\n"


@pytest.mark.parametrize("fmt, rel", [
    ("sugarcrepe", "replace_obj.json"), ("sugarcrepe", "SugarCrepe_replace_obj/data/test-00000.parquet"),
    ("valse", "existence.json"), ("vl_checklist", "corpus/Attribute/color/vg.yaml"), ("winoground", "examples.jsonl"),
    ("svo_probes", "svo_probes.csv"), ("foil", "foilv1.0_test_2017.json"), ("retrieval", "dataset_coco.json"),
    ("aro_vg_relation", "visual_genome_relation.json")])
def test_a_git_lfs_pointer_is_named_as_one(tmp_path, fmt, rel):
    """A clone without `git lfs pull` holds pointers: the error says so, not 'not valid JSON'."""
    f = tmp_path / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(LFS)
    with pytest.raises(BenchmarkError, match=rf"{f.name}: a Git LFS pointer, not the file \(1,234,567 bytes\): fetch it"):
        read_benchmark(spec(fmt, f))


def test_vl_checklist_data_file_and_image_map_as_lfs_pointers(tmp_path):
    y = tmp_path / "corpus" / "Attribute" / "color" / "vg.yaml"
    y.parent.mkdir(parents=True)
    y.write_text('ANNO_PATH: "data/color.json"\nIMG_ROOT: "vg/"\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "color.json").write_text(LFS)
    with pytest.raises(BenchmarkError, match=r"color.json: a Git LFS pointer"):
        read_benchmark(spec("vl_checklist", tmp_path / "corpus"))
    from train.eval.images import read_image_map

    for name in ("map.json", "map.csv"):
        (tmp_path / name).write_text(LFS)
        with pytest.raises(ValueError, match=rf"image_map .*{name}: a Git LFS pointer"):
            read_image_map(tmp_path / name)


def test_winoground_chance_is_computed_for_the_items_scored():
    """A random score per distinct (image, caption) pair, simulated: its mean text / image / group score is the
    rows' chance, 25 / 25 / 16.67 % on items of four distinct pairs and 0 on an item whose two images are one
    (the generated file can hold one; its pairs tie, and a tie is wrong)."""
    from train.eval.benchmarks.winoground import score
    from train.eval.interface import Item, Pair

    def item(i0, i1, c0, c1):
        return Item([Pair(i0, c0), Pair(i1, c0), Pair(i0, c1), Pair(i1, c1)], subset="Object")

    items = [item("a", "b", "x y", "y x"), item("c", "d", "x z", "z x"), item("e", "e", "u v", "v u")]
    rows = {r.metric: r for r in score("wg", items, [np.zeros(4)] * 3) if r.subset == "all"}
    rng = np.random.default_rng(0)
    sims = []
    for _ in range(4000):
        draws: dict = {}
        sc = [np.array([draws.setdefault((p.image, p.text), rng.random()) for p in it.pairs]) for it in items]
        got = {r.metric: r.value for r in score("wg", items, sc) if r.subset == "all"}
        sims.append([got["text_score"], got["image_score"], got["group_score"]])
    sim = np.mean(sims, axis=0)
    want = [2 / 3 * 25.0, 2 / 3 * 25.0, 2 / 3 * 100 / 6]
    assert [rows[m].chance for m in ("text_score", "image_score", "group_score")] == pytest.approx(want)
    assert sim == pytest.approx(want, abs=1.2)  # 4,000 simulated scorers: standard error about 0.25
