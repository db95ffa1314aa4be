"""The generated dataset: scenes of shapes with full ground truth, in the real on-disk formats.

Layout under ``root``::

    images/000000000001.jpg ...            JPEG scenes (image id i -> %012d.jpg)
    annotations/captions.json              COCO captions (+ non-standard "split" on each image)
    annotations/instances.json             COCO instances: amodal bbox, visible-mask RLE
                                           (compressed counts), "attributes" {color, size,
                                           texture, draw_order}; categories = shapes
    annotations/scene_graphs.json          vlpipe-scene-graph/1 (readers/scene_graph.py):
                                           relations between instance ids + caption phrase spans
    karpathy.json                          Karpathy split JSON (filepath "images")
    flickr30k_entities/Sentences/<id>.txt  Flickr30k-Entities markup, one caption per line
    flickr30k_entities/Annotations/<id>.xml  boxes per entity; {train,val,test}.txt id lists
    sugarcrepe/{swap_att,swap_obj,replace_att,replace_obj,replace_rel}.json
    aro/ winoground/ valse/ vl_checklist/ svo_probes/ foil/   the same kinds of negatives (and cross-image
                                           swaps) in other benchmarks' formats: see benchmarks.py
    _params.json                           parameters + ground truth of the injected errors

Ids: image index i (0-based) has image id i + ``first_id`` (default 1; a pretraining corpus beside a
testbed starts elsewhere, so no id is shared, manifest ``corpus``); its instance and caption annotation ids are
``image_id * 1000 + n`` (n = 1, 2, ...; the stride grows if max_objects or captions_per_image
reach 1000), so they do not depend on other images. Splits by i % 20: with the default ``heldout``
0.1, 18 -> val, 19 -> test, else train; ``heldout`` h (a multiple of 0.1) holds out the last 20h
residues, the first half val and the second half test (0.4: 12-15 val, 16-19 test).
Phrase -> instance links: a phrase naming several objects ("two circles") links all of them; in the
Flickr files each distinct set of objects is one entity, and a box lists every entity it belongs to.
Injected errors: ``corrupt_images`` image files are truncated (even picks) or random bytes (odd
picks); ``empty_captions`` captions are blanked to "" or "   " (alternately) in every format, and
their phrases dropped. Both are picked deterministically from the seed; see ``_params.json``.

Idempotent: ``_params.json`` is written last; a call with the same parameters and generator
version finds it and returns at once, different parameters regenerate (the folders above are
removed first, nothing else under ``root`` is touched).
"""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.masks import rle_encode
from pipeline.synthetic.benchmarks import write_benchmarks
from pipeline.synthetic.captions import make_captions, make_negatives
from pipeline.synthetic.lexicon import VOCABULARIES, Lexicon
from pipeline.synthetic.scene import PREDICATES, SHAPES, make_scene, relations

GENERATOR_VERSION = 2
NEGATIVE_KINDS = ["swap_att", "swap_obj", "replace_att", "replace_obj", "replace_rel"]
BENCHMARK_DIRS = ["aro", "winoground", "valse", "vl_checklist", "svo_probes", "foil"]
_OWNED = ["images", "annotations", "flickr30k_entities", "sugarcrepe", "karpathy.json", *BENCHMARK_DIRS]


def heldout_residues(heldout: float) -> int:
    """How many of every 20 images are val + test for a held-out fraction (a multiple of 0.1 in [0.1, 0.9])."""
    h = round(float(heldout) * 20)
    if h % 2 or not 2 <= h <= 18 or abs(h - float(heldout) * 20) > 1e-6:
        raise ValueError(f"synthetic: heldout must be a multiple of 0.1 in [0.1, 0.9] (got {heldout})")
    return h


def split_of(index: int, heldout: float = 0.1) -> str:
    h = heldout_residues(heldout)
    r = index % 20 - (20 - h)
    return "train" if r < 0 else ("val" if r < h // 2 else "test")


def output_paths(root: str | Path) -> dict[str, Path]:
    root = Path(root).resolve()
    return {
        "root": root,
        "images": root / "images",
        "captions": root / "annotations" / "captions.json",
        "instances": root / "annotations" / "instances.json",
        "scene_graphs": root / "annotations" / "scene_graphs.json",
        "karpathy": root / "karpathy.json",
        "flickr30k_entities": root / "flickr30k_entities",
        "sugarcrepe": root / "sugarcrepe",
        **{d: root / d for d in BENCHMARK_DIRS},
        "params": root / "_params.json",
    }


def _dump(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    # dumps, not dump: only the one-shot encoder uses the C accelerator (several times faster)
    tmp.write_text(json.dumps(obj, separators=(",", ":"), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def _flickr_line(text: str, phrases, entity_of) -> str:
    out, pos = [], 0
    for start, end, ptext, ids, etype in sorted(phrases, key=lambda p: p[0]):
        out.append(text[pos:start])
        out.append(f"[/EN#{entity_of[tuple(ids)]}/{etype} {ptext}]")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _flickr_xml(file_name: str, S: int, boxes) -> str:
    objs = []
    for names, (x0, y0, x1, y1) in boxes:
        nm = "".join(f"<name>{n}</name>" for n in names)
        objs.append(f"<object>{nm}<bndbox><xmin>{int(x0)}</xmin><ymin>{int(y0)}</ymin>"
                    f"<xmax>{int(x1)}</xmax><ymax>{int(y1)}</ymax></bndbox></object>")
    return (f"<annotation><filename>{file_name}</filename><size><width>{S}</width><height>{S}</height>"
            f"<depth>3</depth></size>{''.join(objs)}</annotation>\n")


def id_stride(max_objects: int, captions_per_image: int) -> int:
    """Annotation ids are ``image_id * stride + n`` (n = 1, 2, ...), so an image's ids do not depend
    on the other images (images can be rendered in any order, and image i is the same in a bigger
    dataset)."""
    stride = 1000
    while stride <= max(max_objects, captions_per_image):
        stride *= 10
    return stride


def _scene_captions(cfg: dict, i: int, grid):
    """Image ``i``'s random stream, scene, relations and captions (text, phrase spans). With ``twins`` t > 1, image
    i is member m = i % t of group g = i // t: every member draws from group g's stream, and member m > 0 moves
    each object's shape on by an offset in 1..9 from its own stream (``make_scene``), so the t images of a group
    share background, colours, sizes and places and differ in their shapes (and their captions, mostly, in the
    shape words). t = 1: g = i, no offsets (the scenes of datasets generated before the option)."""
    g, m = divmod(i, cfg.get("twins", 1))
    rng = np.random.default_rng([cfg["seed"], g])
    n_obj = int(rng.integers(cfg["min_objects"], cfg["max_objects"] + 1))
    offsets = np.random.default_rng([cfg["seed"], g, 0x7717, m]).integers(1, len(SHAPES), n_obj) if m else None
    scene = make_scene(rng, cfg["S"], n_obj, (grid[0], grid[1]), offsets)
    rels = relations(scene)
    # vocabulary "large": the same captions re-worded from their own stream (scenes, negatives unchanged)
    lex = Lexicon(np.random.default_rng([cfg["seed"], g, 0x1E71C]) if cfg["vocabulary"] == "large" else None)
    return rng, scene, rels, make_captions(scene, rels, cfg["cpi"], rng, lex)


def captions_of(n_images: int, seed: int = 0, image_size: int = 128, captions_per_image: int = 5, min_objects: int = 1,
                max_objects: int = 4, vocabulary: str = "small", twins: int = 1) -> list[list[str]]:
    """The captions :func:`generate` writes for its first ``n_images`` images with these parameters
    (before ``empty_captions`` blanks any), without writing anything: the text of a generated
    dataset too large to generate for a plan (``pipeline plan`` mines it)."""
    cfg = {"seed": seed, "S": image_size, "cpi": captions_per_image, "min_objects": min_objects,
           "max_objects": max_objects, "vocabulary": vocabulary, "twins": int(twins)}
    grid = np.mgrid[0:image_size, 0:image_size].astype(np.float32)
    return [[text for text, _ in _scene_captions(cfg, i, grid)[3]] for i in range(n_images)]


def _render_range(cfg: dict, start: int, stop: int) -> dict:
    """Render images [start, stop): write their image and Flickr files, return their JSON entries."""
    root = Path(cfg["root"])
    img_dir, fl_root = root / "images", root / "flickr30k_entities"
    S, cpi, seed, stride = cfg["S"], cfg["cpi"], cfg["seed"], cfg["stride"]
    corrupt, blank = cfg["corrupt"], cfg["blank"]
    grid = np.mgrid[0:S, 0:S].astype(np.float32)
    cat_id = {s: k + 1 for k, s in enumerate(SHAPES)}
    out: dict = {k: [] for k in ("images", "captions", "instances", "graphs", "karpathy", "corrupt_files", "blanked_ids")}
    out["negatives"] = {k: [] for k in NEGATIVE_KINDS}
    out["splits"] = {"train": [], "val": [], "test": []}

    for i in range(start, stop):
        image_id = i + cfg["first_id"]
        stem = f"{image_id:012d}"
        fname = f"{stem}.jpg"
        split = split_of(i // cfg["twins"], cfg["heldout"])  # a group of twins is in one split
        rng, scene, rels, caps = _scene_captions(cfg, i, grid)
        negs = make_negatives(scene, rels, rng)

        buf = io.BytesIO()
        Image.fromarray(scene.pixels).save(buf, format="JPEG", quality=92)
        data = buf.getvalue()
        if i in corrupt:
            if corrupt[i] % 2 == 0:
                data = data[: len(data) // 3]
            else:
                data = np.random.default_rng([seed, 0x5EED, i]).integers(0, 256, 600, dtype=np.uint8).tobytes()
            out["corrupt_files"].append(fname)
        (img_dir / fname).write_bytes(data)

        out["images"].append({"id": image_id, "file_name": fname, "width": S, "height": S, "split": split})
        ann_ids = []
        for k, o in enumerate(scene.objects):
            x0, y0, x1, y1 = o.box
            visible = scene.visible_mask(k)
            ann_id = image_id * stride + k + 1
            out["instances"].append({
                "id": ann_id, "image_id": image_id, "category_id": cat_id[o.shape],
                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": int(visible.sum()),
                "segmentation": rle_encode(visible), "iscrowd": 0,
                "attributes": {"color": o.color, "size": o.size, "texture": o.texture, "draw_order": str(o.order)},
            })
            ann_ids.append(ann_id)

        sentences, phrases_json, fl_lines = [], [], []
        entity_of: dict[tuple, int] = {}
        for c, (text, spans) in enumerate(caps):
            cap_id = image_id * stride + c + 1
            gidx = i * cpi + c
            if gidx in blank:
                text, spans = ("" if blank[gidx] % 2 == 0 else "   "), []
                out["blanked_ids"].append(cap_id)
            out["captions"].append({"id": cap_id, "image_id": image_id, "caption": text})
            sentences.append({"raw": text, "tokens": text.lower().rstrip(".").replace(",", "").split(),
                              "imgid": i, "sentid": cap_id})
            fl_spans = []
            for start_, end_, ptext, objs in spans:
                ids = [ann_ids[k] for k in objs]
                phrases_json.append({"caption_id": cap_id, "start": start_, "end": end_, "text": ptext,
                                     "instance_ids": ids})
                entity_of.setdefault(tuple(ids), len(entity_of) + 1)
                shapes = {scene.objects[k].shape for k in objs}
                fl_spans.append((start_, end_, ptext, ids, shapes.pop() if len(shapes) == 1 else "shapes"))
            fl_lines.append(_flickr_line(text, fl_spans, entity_of))

        out["graphs"].append({
            "image_id": image_id,
            "relations": [{"subject": ann_ids[a], "object": ann_ids[b], "predicate": p} for a, b, p in rels],
            "phrases": phrases_json,
        })
        out["karpathy"].append({"filepath": "images", "filename": fname, "split": split, "cocoid": image_id,
                                "imgid": i, "sentences": sentences, "sentids": [x["sentid"] for x in sentences]})
        for kind, (pos, neg) in negs.items():
            out["negatives"][kind].append({"filename": fname, "caption": pos, "negative_caption": neg})

        boxes = []
        for k, aid in enumerate(ann_ids):
            names = [e for key, e in entity_of.items() if aid in key]
            if names:
                boxes.append((names, scene.objects[k].box))
        (fl_root / "Sentences" / f"{stem}.txt").write_text("\n".join(fl_lines) + "\n", encoding="utf-8")
        (fl_root / "Annotations" / f"{stem}.xml").write_text(_flickr_xml(fname, S, boxes), encoding="utf-8")
        out["splits"][split].append(stem)
    return out


def generate(
    root: str | Path,
    n_images: int = 64,
    seed: int = 0,
    image_size: int = 128,
    captions_per_image: int = 5,
    min_objects: int = 1,
    max_objects: int = 4,
    corrupt_images: int = 0,
    empty_captions: int = 0,
    heldout: float = 0.1,
    vocabulary: str = "small",
    first_id: int = 1,
    twins: int = 1,
    *,
    workers: int | None = None,
) -> dict[str, Path]:
    """Write the dataset under ``root`` (see the module doc) unless it is already there with the
    same parameters; return the paths of what was written. ``heldout``: the fraction of images in val + test
    (half each; module doc). ``workers``: processes to render with
    (default: all cores, up to 8, from 2000 images on); the output does not depend on it.
    ``vocabulary``: the captions' surface words, ``small`` or ``large`` (:mod:`pipeline.synthetic.lexicon`).
    ``first_id``: image index i has image id i + first_id (the scenes do not depend on it).
    ``twins``: images come in groups of this many consecutive ids that differ only in their objects' shapes
    (``_scene_captions``; a pretraining corpus where colour alone cannot tell a caption's image); splits by group."""
    paths = output_paths(root)
    root = paths["root"]
    params = {
        "generator_version": GENERATOR_VERSION, "n_images": int(n_images), "seed": int(seed),
        "image_size": int(image_size), "captions_per_image": int(captions_per_image),
        "min_objects": int(min_objects), "max_objects": int(max_objects),
        "corrupt_images": int(corrupt_images), "empty_captions": int(empty_captions),
    }
    heldout_residues(heldout)
    # recorded only when not the default, so datasets generated before these options stay valid
    if float(heldout) != 0.1:
        params["heldout"] = float(heldout)
    if vocabulary != "small":
        params["vocabulary"] = str(vocabulary)
    if int(first_id) != 1:
        params["first_id"] = int(first_id)
    if int(twins) != 1:
        params["twins"] = int(twins)
    if paths["params"].is_file():
        try:
            old = json.loads(paths["params"].read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if old.get("params") == params and all(p.exists() for p in paths.values()):
            return paths
    if n_images < 1 or captions_per_image < 1 or image_size < 32 or first_id < 1 or twins < 1:
        raise ValueError("synthetic: need n_images >= 1, captions_per_image >= 1, image_size >= 32, first_id >= 1, twins >= 1")
    if not 0 < max(min_objects, 1) <= max_objects:
        raise ValueError(f"synthetic: need 1 <= max_objects and min_objects <= max_objects (got {min_objects}, {max_objects})")
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"synthetic: vocabulary must be one of {VOCABULARIES} (got {vocabulary!r})")
    if corrupt_images > n_images or empty_captions > n_images * captions_per_image:
        raise ValueError("synthetic: more corrupt images / empty captions requested than exist")

    root.mkdir(parents=True, exist_ok=True)
    paths["params"].unlink(missing_ok=True)
    for name in _OWNED:
        p = root / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    fl = paths["flickr30k_entities"]
    for d in (paths["images"], paths["captions"].parent, fl / "Sentences", fl / "Annotations", paths["sugarcrepe"]):
        d.mkdir(parents=True, exist_ok=True)

    cpi = int(captions_per_image)
    # Error injection is drawn from its own stream so that it does not change the scenes.
    err_rng = np.random.default_rng([seed, 0x5EED, n_images])
    corrupt = {int(i): n for n, i in enumerate(np.sort(err_rng.choice(n_images, corrupt_images, replace=False)))}
    blank = {int(i): n for n, i in enumerate(np.sort(err_rng.choice(n_images * cpi, empty_captions, replace=False)))}
    cfg = dict(root=str(root), seed=int(seed), S=int(image_size), cpi=cpi, min_objects=int(min_objects),
               max_objects=int(max_objects), stride=id_stride(max_objects, cpi), corrupt=corrupt, blank=blank,
               heldout=float(heldout), vocabulary=str(vocabulary), first_id=int(first_id), twins=int(twins))

    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if n_images >= 2000 else 1
    chunk = min(250, -(-n_images // (4 * max(workers, 1))))  # a few chunks per worker to balance load
    ranges = [(a, min(a + chunk, n_images)) for a in range(0, n_images, chunk)]
    if workers > 1 and len(ranges) > 1:
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing

        # spawn, not fork: the caller may be a Ray driver with threads, which fork can deadlock
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            parts = list(ex.map(_render_range, [cfg] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges]))
    else:
        parts = [_render_range(cfg, a, b) for a, b in ranges]

    def cat(key):
        return [x for part in parts for x in part[key]]

    images, cap_anns, inst_anns, graphs, karpathy = cat("images"), cat("captions"), cat("instances"), cat("graphs"), cat("karpathy")
    negatives = {k: {str(n): e for n, e in enumerate(x for part in parts for x in part["negatives"][k])}
                 for k in NEGATIVE_KINDS}
    split_ids = {s: [x for part in parts for x in part["splits"][s]] for s in ("train", "val", "test")}
    corrupt_files, blanked_ids = cat("corrupt_files"), cat("blanked_ids")
    categories = [{"id": k + 1, "name": s, "supercategory": "shape"} for k, s in enumerate(SHAPES)]
    fl_root = paths["flickr30k_entities"]
    info = {"description": "vlpipe generated shapes dataset", "seed": int(seed), "version": GENERATOR_VERSION}
    _dump({"info": info, "images": images, "annotations": cap_anns}, paths["captions"])
    _dump({"info": info, "images": images, "annotations": inst_anns, "categories": categories}, paths["instances"])
    _dump({"format": "vlpipe-scene-graph/1", "predicates": PREDICATES, "images": graphs}, paths["scene_graphs"])
    _dump({"dataset": "synthetic", "images": karpathy}, paths["karpathy"])
    for s, ids in split_ids.items():
        (fl_root / f"{s}.txt").write_text("".join(f"{x}\n" for x in ids))
    for kind, d in negatives.items():
        # indented like the published SugarCrepe files
        (paths["sugarcrepe"] / f"{kind}.json").write_text(json.dumps(d, indent=4), encoding="utf-8")
    write_benchmarks(root, images, inst_anns, graphs, negatives, _dump)
    # no timings or dates in here: every generated file, this one included, is a function of the params
    _dump({"params": params, "corrupt_images": corrupt_files, "empty_caption_ids": blanked_ids}, paths["params"])
    return paths


def main(argv: list[str] | None = None) -> None:
    """``python -m pipeline.synthetic.generate ROOT --n-images 1000``: generate without a manifest."""
    import argparse
    import inspect

    ap = argparse.ArgumentParser(description="Write the generated shapes dataset under ROOT.")
    ap.add_argument("root")
    sig = inspect.signature(generate)
    for name, p in sig.parameters.items():
        if name != "root":
            ap.add_argument(f"--{name.replace('_', '-')}", type=type(p.default) if p.default is not None else int,
                            default=p.default)
    args = vars(ap.parse_args(argv))
    for k, v in generate(**args).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
