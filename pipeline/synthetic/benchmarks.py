"""The generated dataset's own compositionality benchmarks, each in a public benchmark's file format,
so that ``train eval`` on ``manifests/demo.yaml`` exercises every reader end to end.

Written from the dataset's ground truth (instances with colour / shape / size / box, the scene
graph, and the SugarCrepe-style negatives of :func:`pipeline.synthetic.captions.make_negatives`),
with no random draws, so the files are a function of the generated scenes. Only objects whose
colour + shape is unique in their image are named, so that every negative is false for its image.
Under the dataset root:

``aro/visual_genome_relation.json``
    ARO VG-Relation: one case per pair of such objects (i < j by drawing order): true "the red
    circle is to the left of the blue square", false = the two objects swapped; ``relation_name``
    = the scene-graph predicate of (i, j); the box (``bbox_x/y/w/h``) = the union of both boxes.
``aro/visual_genome_attribution.json``
    ARO VG-Attribution: pairs with different colours and shapes whose swapped combinations are not
    in the image: true "the red circle and the blue square", false "the blue circle and the red
    square", ``attributes`` = the two colours in alphabetical order (the objects named in that order,
    so that each colour pair is one group), box = union.
``winoground/examples.jsonl``
    Winoground: pairs of images whose captions are word-order swaps of each other. Random scenes
    rarely hold the same two coloured shapes, so the captions name objects by shape alone (or by
    colour alone: "the red shape ..."), among shapes (colours) unique in both images: image_0 has
    "the circle is above the square", image_1 has "the square is above the circle". Each image
    pair is used once per caption pair, matched one-to-one in image order. ``image_0`` /
    ``image_1`` are the generated images' file stems (no copies; the matcher finds them by stem);
    ``collapsed_tag`` is ``Object`` (shapes swapped) or ``Attribute`` (colours swapped). With few
    images there may be few or no such pairs: the file is then short or empty (the reader says so).
``valse/{existence,counting-small-quant,relations,actant-swap,foil-it}.json``
    VALSE pieces: existence ("There is a red circle." / "There is no red circle."), counting
    ("There are 3 shapes." / the count plus or minus one), spatial relations (the replace_rel
    negatives), actant swap (swap_obj) and foil-it (replace_obj); ``mturk`` marks every item as
    validated (3 of 3), since each foil is false by construction.
``vl_checklist/corpus/<Category>/<type>/synthetic.yaml`` + ``vl_checklist/data/<Category>/synthetic/<type>.json``
    VL-CheckList: Attribute/color (replace_att), Attribute/size (the object's size word replaced),
    Object/Location/{center,mid,margin} and Object/Size/{small,medium,large} (replace_obj, filed by
    where the replaced object lies: centre within the middle third of the image, mid, margin; and by
    its size), Relation/spatial (replace_rel). ``ANNO_PATH`` is relative to the dataset root,
    ``IMG_ROOT`` is ``images/``.
``svo_probes/svo_probes.csv``
    SVO-Probes: one row per Winoground pair above: ``sentence`` = caption_0, positive image =
    image_0, negative image = image_1, where the same two objects stand in the inverse relation, so
    the negative differs in the relation (``verb_neg`` true; triplets "circle,left of,square" /
    "circle,right of,square"). Image ids are the image file stems; urls are empty.
``foil/foilv1.0_test_2017.json``
    FOIL-COCO layout: each replace_obj caption (``foil: false``) and its foil (``foil: true``),
    sharing the annotation id.

The generated benchmarks use every image, training images included (like ``sugarcrepe/``): the
demo checks the plumbing and planted signals, not generalisation.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from pipeline.synthetic.captions import PRED_PHRASES, article
from pipeline.synthetic.scene import SHAPES

SIZE_SWAP = {"small": "large", "medium": "large", "large": "small"}


def _phrase(p: str) -> str:
    return PRED_PHRASES[p][0]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _union(a, b) -> dict:
    x0, y0 = min(a[0], b[0]), min(a[1], b[1])
    x1, y1 = max(a[0] + a[2], b[0] + b[2]), max(a[1] + a[3], b[1] + b[3])
    return {"bbox_x": float(x0), "bbox_y": float(y0), "bbox_w": float(x1 - x0), "bbox_h": float(y1 - y0)}


def _scenes(images, instances, graphs) -> list[dict]:
    """Per image, in image order: file name, size, objects (ann id, shape, colour, size, bbox) and
    the predicate of every ordered pair of ann ids."""
    objs = defaultdict(list)
    for a in instances:
        objs[a["image_id"]].append({"id": a["id"], "shape": SHAPES[a["category_id"] - 1], "color": a["attributes"]["color"],
                                    "size": a["attributes"]["size"], "bbox": a["bbox"]})
    rels = {g["image_id"]: {(r["subject"], r["object"]): r["predicate"] for r in g["relations"]} for g in graphs}
    return [{"image_id": im["id"], "file_name": im["file_name"], "W": im["width"], "H": im["height"],
             "objects": objs.get(im["id"], []), "rel": rels.get(im["id"], {})} for im in images]


def _unique(objects, key) -> list[dict]:
    c = Counter(key(o) for o in objects)
    return [o for o in objects if c[key(o)] == 1]


def _aro(scenes) -> tuple[list, list]:
    relation, attribution = [], []
    for sc in scenes:
        objs = _unique(sc["objects"], lambda o: (o["color"], o["shape"]))
        present = {(o["color"], o["shape"]) for o in sc["objects"]}
        base = {"image_id": str(sc["image_id"]), "image_path": sc["file_name"]}
        for n, a in enumerate(objs):
            for b in objs[n + 1:]:
                p = sc["rel"].get((a["id"], b["id"]))
                na, nb = f"the {a['color']} {a['shape']}", f"the {b['color']} {b['shape']}"
                if p is not None:
                    relation.append({**base, "relation_name": p, **_union(a["bbox"], b["bbox"]),
                                     "true_caption": f"{na} is {_phrase(p)} {nb}",
                                     "false_caption": f"{nb} is {_phrase(p)} {na}"})
                if (a["color"] != b["color"] and a["shape"] != b["shape"] and (b["color"], a["shape"]) not in present
                        and (a["color"], b["shape"]) not in present):
                    x, y = (a, b) if a["color"] < b["color"] else (b, a)  # one group per colour pair, alphabetical
                    attribution.append({**base, "attributes": [x["color"], y["color"]], **_union(x["bbox"], y["bbox"]),
                                        "true_caption": f"the {x['color']} {x['shape']} and the {y['color']} {y['shape']}",
                                        "false_caption": f"the {y['color']} {x['shape']} and the {x['color']} {y['shape']}"})
    return relation, attribution


def _winoground(scenes) -> list[dict]:
    out = []
    for tag, key, noun in (("Object", "shape", lambda v: v), ("Attribute", "color", lambda v: f"{v} shape")):
        index: dict[tuple, list[int]] = defaultdict(list)
        for k, sc in enumerate(scenes):
            objs = _unique(sc["objects"], lambda o: o[key])
            for a in objs:
                for b in objs:
                    if a is not b and (p := sc["rel"].get((a["id"], b["id"]))) is not None:
                        index[(a[key], b[key], p)].append(k)
        for (va, vb, p), left in sorted(index.items()):
            if va >= vb:
                continue
            left_set = set(left)
            right = [k for k in index.get((vb, va, p), []) if k not in left_set]
            right_set = set(right)
            for i0, i1 in zip([k for k in left if k not in right_set], right):
                c0 = f"the {noun(va)} is {_phrase(p)} the {noun(vb)}"
                c1 = f"the {noun(vb)} is {_phrase(p)} the {noun(va)}"
                out.append({"image_0": Path(scenes[i0]["file_name"]).stem, "image_1": Path(scenes[i1]["file_name"]).stem,
                            "caption_0": c0, "caption_1": c1, "tag": f"{key} swap", "secondary_tag": "Symbolic",
                            "num_main_preds": 1, "collapsed_tag": tag})
    out.sort(key=lambda e: (e["image_0"], e["image_1"], e["caption_0"]))
    return [{"id": n, **e} for n, e in enumerate(out)]


def _valse(scenes, negatives) -> dict[str, dict]:
    def item(piece, n, sc_file, cap, foil, ph, classes="", classes_foil=""):
        return f"{piece}_test_{n}", {
            "dataset": "vlpipe-synthetic", "original_split": "all", "dataset_idx": sc_file, "linguistic_phenomena": ph,
            "image_file": sc_file, "caption": cap, "classes": classes, "classes_foil": classes_foil,
            "mturk": {"foil": 0, "caption": 3, "other": 0}, "foil": foil}

    pieces: dict[str, dict] = {"existence": {}, "counting-small-quant": {}}
    for sc in scenes:
        objs = _unique(sc["objects"], lambda o: (o["color"], o["shape"]))
        if objs:
            o = objs[0]
            k, v = item("existence", len(pieces["existence"]), sc["file_name"], f"There is {article(o['color'])} {o['color']} "
                        f"{o['shape']}.", f"There is no {o['color']} {o['shape']}.", "existence", o["shape"], "no")
            pieces["existence"][k] = v
        n = len(sc["objects"])
        m = n + 1 if n < 2 else n - 1
        num = lambda c: f"There {'is' if c == 1 else 'are'} {c} shape{'' if c == 1 else 's'}."  # noqa: E731
        k, v = item("counting-small-quant", len(pieces["counting-small-quant"]), sc["file_name"], num(n), num(m), "counting",
                    str(n), str(m))
        pieces["counting-small-quant"][k] = v
    for piece, kind, ph in (("relations", "replace_rel", "relations"), ("actant-swap", "swap_obj", "actions"),
                            ("foil-it", "replace_obj", "noun phrases")):
        pieces[piece] = dict(item(piece, n, e["filename"], e["caption"], e["negative_caption"], ph)
                             for n, e in enumerate(negatives[kind].values()))
    return pieces


def _location(o, W, H) -> str:
    x, y, w, h = o["bbox"]
    d = 2 * max(abs((x + w / 2) / W - 0.5), abs((y + h / 2) / H - 0.5))  # 0 at the centre, 1 at the border
    return "center" if d < 1 / 3 else "mid" if d < 2 / 3 else "margin"


def _vl_checklist(scenes, negatives) -> dict[str, list]:
    by_file = {sc["file_name"]: sc for sc in scenes}
    out: dict[str, list] = defaultdict(list)

    def entry(f, pos, neg):
        return [f, {"POS": [pos], "NEG": [neg]}]

    for e in negatives["replace_att"].values():
        out["Attribute/color"].append(entry(e["filename"], e["caption"], e["negative_caption"]))
    for sc in scenes:
        objs = _unique(sc["objects"], lambda o: (o["color"], o["shape"]))
        if objs:
            o = objs[-1]
            z = SIZE_SWAP[o["size"]]
            out["Attribute/size"].append(entry(sc["file_name"], _cap(f"{article(o['size'])} {o['size']} {o['color']} {o['shape']}."),
                                               _cap(f"{article(z)} {z} {o['color']} {o['shape']}.")))
    for e in negatives["replace_obj"].values():
        sc = by_file[e["filename"]]
        words = e["caption"].lower().split()
        color, shape = words[1], words[2]
        o = next((o for o in sc["objects"] if o["color"] == color and o["shape"] == shape), None)
        if o is None:  # cannot happen for captions make_negatives wrote; keep the file consistent anyway
            continue
        pair = entry(e["filename"], e["caption"], e["negative_caption"])
        out[f"Object/Location/{_location(o, sc['W'], sc['H'])}"].append(pair)
        out[f"Object/Size/{o['size']}"].append(pair)
    for e in negatives["replace_rel"].values():
        out["Relation/spatial"].append(entry(e["filename"], e["caption"], e["negative_caption"]))
    return dict(sorted(out.items()))


def _foil(images, negatives) -> dict:
    ids = {im["file_name"]: im["id"] for im in images}
    anns = []
    for n, e in enumerate(negatives["replace_obj"].values()):
        pos, neg = e["caption"].lower().rstrip(".").split(), e["negative_caption"].lower().rstrip(".").split()
        target, foil = next(((a, b) for a, b in zip(pos, neg) if a != b), ("", ""))
        common = {"image_id": ids[e["filename"]], "id": n + 1}
        anns.append({**common, "caption": e["caption"], "foil": False, "target_word": "ORIG", "foil_word": "ORIG",
                     "foil_id": 2 * n + 1})
        anns.append({**common, "caption": e["negative_caption"], "foil": True, "target_word": target, "foil_word": foil,
                     "foil_id": 2 * n + 2})
    return {"info": {"description": "vlpipe generated shapes dataset: FOIL-format replaced-object foils"},
            "images": [{"id": im["id"], "file_name": im["file_name"], "width": im["width"], "height": im["height"]}
                       for im in images],
            "annotations": anns}


def _svo(wg_rows: list[dict], path: Path) -> None:
    import csv
    import io

    from pipeline.synthetic.scene import INVERSE

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["", "sentence", "pos_triplet", "neg_triplet", "pos_url", "neg_url", "pos_image_id", "neg_image_id",
                "subj_neg", "verb_neg", "obj_neg"])
    for n, e in enumerate(wg_rows):
        phrase_of = {ph[0]: p for p, ph in PRED_PHRASES.items()}
        p = next(q for ph, q in phrase_of.items() if f" is {ph} " in e["caption_0"])
        a, b = (x.removeprefix("the ") for x in e["caption_0"].split(f" is {PRED_PHRASES[p][0]} "))
        w.writerow([n, e["caption_0"], f"{a},{p},{b}", f"{a},{INVERSE[p]},{b}", "", "", e["image_0"], e["image_1"],
                    False, True, False])
    path.write_text(buf.getvalue(), encoding="utf-8")


def write_benchmarks(root: Path, images, instances, graphs, negatives: dict[str, dict], dump) -> dict[str, Path]:
    """Write every benchmark file above under ``root``; return {name: path} for the manifest."""
    scenes = _scenes(images, instances, graphs)
    root = Path(root)
    paths = {}
    aro = root / "aro"
    aro.mkdir(parents=True, exist_ok=True)
    rel, att = _aro(scenes)
    (aro / "visual_genome_relation.json").write_text(json.dumps(rel, indent=1), encoding="utf-8")
    (aro / "visual_genome_attribution.json").write_text(json.dumps(att, indent=1), encoding="utf-8")
    paths["aro_vg_relation"] = aro / "visual_genome_relation.json"
    paths["aro_vg_attribution"] = aro / "visual_genome_attribution.json"
    wg = root / "winoground"
    wg.mkdir(parents=True, exist_ok=True)
    wg_rows = _winoground(scenes)
    (wg / "examples.jsonl").write_text("".join(json.dumps(e) + "\n" for e in wg_rows), encoding="utf-8")
    paths["winoground"] = wg / "examples.jsonl"
    valse = root / "valse"
    valse.mkdir(parents=True, exist_ok=True)
    for piece, d in _valse(scenes, negatives).items():
        (valse / f"{piece}.json").write_text(json.dumps(d, indent=4), encoding="utf-8")
    paths["valse"] = valse
    vlc = root / "vl_checklist"
    for typ, rows in _vl_checklist(scenes, negatives).items():
        cat, rest = typ.split("/", 1)
        anno = Path("vl_checklist") / "data" / cat / "synthetic" / f"{rest.replace('/', '_').lower()}.json"
        (root / anno).parent.mkdir(parents=True, exist_ok=True)
        (root / anno).write_text(json.dumps(rows), encoding="utf-8")
        y = vlc / "corpus" / typ / "synthetic.yaml"
        y.parent.mkdir(parents=True, exist_ok=True)
        y.write_text(f'ANNO_PATH: "{anno.as_posix()}"\nIMG_ROOT: "images/"\nTYPE: "TUPLE_JSON"\n', encoding="utf-8")
    paths["vl_checklist"] = vlc / "corpus"
    svo = root / "svo_probes"
    svo.mkdir(parents=True, exist_ok=True)
    _svo(wg_rows, svo / "svo_probes.csv")
    paths["svo_probes"] = svo / "svo_probes.csv"
    foil = root / "foil"
    foil.mkdir(parents=True, exist_ok=True)
    dump(_foil(images, negatives), foil / "foilv1.0_test_2017.json")
    paths["foil"] = foil / "foilv1.0_test_2017.json"
    return paths
