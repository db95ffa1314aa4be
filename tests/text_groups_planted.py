"""A `samples` + `image_groups` artifact pair for the text-groups trainer (test helper).

Captions, gold phrase spans and SugarCrepe-style negatives come from the generated dataset's own
functions (:mod:`pipeline.synthetic`: scenes of coloured shapes, ``make_captions``,
``make_negatives``), without rendering files. The image groups are planted, in the schema of
:mod:`pipeline.stages.extract_image_groups`: K_img = 8 slots of width d; each object of the scene
holds one slot carrying a fixed random embedding of its (colour, shape) PAIR (not a sum of a
colour and a shape vector, so swapping attributes between two objects changes the image side),
the other slots carry the embedding of the background colour; every slot gets Gaussian noise of
std ``noise`` / sqrt(d) per coordinate, and slots are shuffled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, sample_key
from pipeline.stages.ingest import CAPTIONS_SCHEMA, PHRASES_SCHEMA, SAMPLES_SCHEMA
from pipeline.synthetic.captions import make_captions, make_negatives
from pipeline.synthetic.generate import split_of
from pipeline.synthetic.scene import COLOR_NAMES, SHAPES, make_scene, relations


def write_planted(out: Path, n_images: int = 600, captions_per_image: int = 3, k_img: int = 8, d: int = 32,
                  noise: float = 0.3, seed: int = 0, S: int = 48, max_objects: int = 4, shard_size: int = 200,
                  extra_captions: dict[int, list[tuple[str, list[tuple[int, int]]]]] | None = None,
                  min_objects: int = 1, palette: tuple[int, int] | None = None) -> dict:
    """Write <out>/samples and <out>/image_groups; returns {"negatives": {kind: [(sample_id, pos, neg)]},
    "pair_embedding": [C, S, d], "splits": {sample_id: split}}. ``extra_captions`` {index: [(text, spans)]}
    adds captions (e.g. bad ones) to image ``index``. ``palette`` (n_colours, n_shapes): every object
    gets a distinct colour among the first n_colours and a distinct shape among the first n_shapes, so
    that scenes sharing their colours and shapes but pairing them differently are frequent (in-batch
    negatives that only binding separates)."""
    out = Path(out)
    rng0 = np.random.default_rng([seed, 99])
    pair = rng0.normal(size=(len(COLOR_NAMES), len(SHAPES), d)) / np.sqrt(d) * 1.0
    bg = rng0.normal(size=(len(COLOR_NAMES), d)) / np.sqrt(d) * 0.5
    grid = np.mgrid[0:S, 0:S].astype(np.float32)
    samples, captions, phrases, negatives, groups = [], [], [], {}, {}
    splits = {}
    for i in range(n_images):
        sid = i + 1
        rng = np.random.default_rng([seed, i])
        n_obj = int(rng.integers(min_objects, max_objects + 1))
        scene = make_scene(rng, S, n_obj, (grid[0], grid[1]))
        if palette is not None:
            cols = rng.permutation(palette[0])[:len(scene.objects)]
            shps = rng.permutation(palette[1])[:len(scene.objects)]
            for o, c, sh in zip(scene.objects, cols, shps):
                o.color, o.shape = COLOR_NAMES[int(c)], SHAPES[int(sh)]
        rels = relations(scene)
        caps = make_captions(scene, rels, captions_per_image, rng)
        for kind, (pos, neg) in make_negatives(scene, rels, rng).items():
            negatives.setdefault(kind, []).append((sid, pos, neg))
        split = split_of(i)
        splits[sid] = split
        samples.append({"sample_id": sid, "source_id": f"{sid:012d}", "image": f"/nonexistent/{sid:012d}.jpg",
                        "width": S, "height": S, "split": split})
        all_caps = [(t, [(s, e) for s, e, _, _ in sp]) for t, sp in caps] + list((extra_captions or {}).get(i, []))
        for c, (text, spans) in enumerate(all_caps):
            cid = sid * 1000 + c + 1
            captions.append({"caption_id": cid, "sample_id": sid, "text": text})
            for s, e in spans:
                phrases.append({"caption_id": cid, "sample_id": sid, "start": int(s), "end": int(e),
                                "text": text[max(0, s):max(0, e)], "instance_ids": []})
        slots = [bg[COLOR_NAMES.index(scene.background)] if scene.background in COLOR_NAMES else bg[0]] * k_img
        slots = list(slots)
        for k, o in enumerate(scene.objects[:k_img]):
            slots[k] = pair[COLOR_NAMES.index(o.color), SHAPES.index(o.shape)]
        g = np.stack(slots) + noise * rng.normal(size=(k_img, d)) / np.sqrt(d)
        groups[sid] = g[rng.permutation(k_img)].astype(np.float16)

    sw = ArtifactWriter(out, "samples", "ingest", {"planted": "text-groups"})
    w = sw.unit_writer(unit_name(0), "fp")
    w.write_table("samples", pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA))
    w.write_table("captions", pa.Table.from_pylist(captions, schema=CAPTIONS_SCHEMA))
    w.write_table("phrases", pa.Table.from_pylist(phrases, schema=PHRASES_SCHEMA))
    w.commit()
    sw.finalize([unit_name(0)])

    gw = ArtifactWriter(out, "image_groups", "extract-image-groups", {"planted": "text-groups"})
    units = []
    ids = sorted(groups)
    for u, s0 in enumerate(range(0, len(ids), shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = gw.unit_writer(name, "fp")
        chunk = ids[s0:s0 + shard_size]
        with ShardWriter(uw.shard_path()) as shw:
            for sid in chunk:
                g = groups[sid]
                shw.write(sample_key(sid), {"groups.npy": g, "groups_projected.npy": g[:, :8],
                                            "image_embed.npy": g.mean(0)[:8], "assign.npy": np.full((k_img, 4), 1 / k_img, np.float16)})
        uw.record_shard(uw.shard_path(), shw.count)
        rel = str(uw.shard_path().relative_to(uw.dir))
        uw.write_table("images", pa.table({"sample_id": pa.array(chunk, pa.int64()), "shard": [rel] * len(chunk),
                                           "image_embed": [list(map(float, groups[s].mean(0)[:8])) for s in chunk]}))
        uw.commit()
    gw.finalize(units, extra={"dims": {"n_groups": k_img, "group_dim": d, "projection_dim": 8}})
    return {"negatives": negatives, "pair_embedding": pair, "splits": splits}


def planted_manifest(tmp_path: Path, out: Path, **train):
    """A manifest whose output is ``out`` with train.text_groups options ``train``."""
    from tests.conftest import make_manifest

    sets = [f"output={out}"] + [f"train.text_groups.{k}={v}" for k, v in train.items()]
    m = make_manifest(tmp_path, sets)
    return m
