"""`samples` + `regions` + `negatives` artifacts of arbitrary widths, written with the schemas of
ingest, extract-regions and negative-captions: the input of ``bench_infoground.py`` (the paper's
2048-d regions and 768-d words, which the testbed's real stages do not produce) and the structural
fixtures of tests/test_infoground.py (foreign ids, empty region sets, short negative lists, another
width). Not evidence of learning: that is shown through the real stages on the generated dataset
(tests/test_testbed_infoground.py, docs/jobs/infoground.md "Testbed").

Scene: each image holds 2 objects (a colour and a shape each) in distinct cells of a 4x4 grid of a
128 x 128 image plus ``distractors`` boxes in other cells. Region features (d_r) of an object are
E_r[colour] + E_r[shape] + noise; a distractor's are E_r[another colour] + E_r[a background
class] + noise. Word features (d_w) are E_w[word] + a caption context vector + noise; the 25
negatives of a noun are other nouns' E_w in the same context. Captions: "a <c1> <s1> and a <c2>
<s2>" (and the objects swapped); phrases "<c> <s>" link to their object's box.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, sample_key

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "star", "ring", "cross", "heart", "arrow"]
OTHER_NOUNS = ["dog", "cat", "car", "tree", "house", "boat", "chair", "table", "lamp", "cup", "book", "phone",
               "horse", "bird", "kite", "clock", "shoe", "hat", "door", "bike"]
NOUNS = SHAPES + OTHER_NOUNS
BACKGROUND = ["grass", "sky", "wall", "floor", "road", "water"]  # distractor regions: never a caption word or a negative


def split_of(sid: int) -> str:
    return "test" if sid % 5 == 4 else "val" if sid % 5 == 3 else "train"


class GroundingGenerator:
    def __init__(self, d_r=32, d_w=24, seed=0, noise_r=0.5, noise_w=0.3, context=0.5, distractors=3):
        self.rng = np.random.default_rng(seed)
        vocab = COLORS + NOUNS + BACKGROUND
        self.idx = {w: i for i, w in enumerate(vocab)}
        self.Er = self.rng.normal(size=(len(vocab), d_r)) / np.sqrt(d_r) * 2
        self.Ew = self.rng.normal(size=(len(vocab), d_w)) / np.sqrt(d_w) * 2
        self.d_r, self.d_w = d_r, d_w
        self.noise_r, self.noise_w, self.context, self.distractors = noise_r, noise_w, context, distractors

    def word(self, w: str, ctx: np.ndarray) -> np.ndarray:
        return self.Ew[self.idx[w]] + self.context * ctx + self.noise_w * self.rng.normal(size=self.d_w) / np.sqrt(self.d_w)

    def region(self, c: str, s: str) -> np.ndarray:
        return self.Er[self.idx[c]] + self.Er[self.idx[s]] + self.noise_r * self.rng.normal(size=self.d_r) / np.sqrt(self.d_r)


def write_grounding_artifacts(out: Path, n_images=300, shard_size=64, seed=0, short_negatives_every=7, id_offset=0,
                            empty_regions=(), **kw):
    """Write <out>/samples, <out>/regions and <out>/negatives (sample ids id_offset + 1, 2, ...;
    the ids in ``empty_regions`` get 0 regions). Returns the generator."""
    from pipeline.stages.negative_captions import NEGATIVES_SCHEMA, WORDS_SCHEMA

    out = Path(out)
    pg = GroundingGenerator(seed=seed, **kw)
    rng = pg.rng
    ids = list(range(id_offset + 1, id_offset + n_images + 1))
    scenes = {}
    for sid in ids:
        cols = rng.choice(len(COLORS), 2 + pg.distractors, replace=False) if pg.distractors <= len(COLORS) - 2 else \
            np.concatenate([c2 := rng.choice(len(COLORS), 2, replace=False),  # distractors: other colours, repeats allowed
                            rng.choice(np.setdiff1d(np.arange(len(COLORS)), c2), pg.distractors)])
        shs = rng.choice(len(SHAPES), 2, replace=False)
        bgs = rng.choice(len(BACKGROUND), pg.distractors, replace=True)
        cells = rng.choice(16, 2 + pg.distractors, replace=False)
        boxes = []
        for c in cells:
            x, y = (c % 4) * 32, (c // 4) * 32
            jit = rng.uniform(0, 4, size=4)
            boxes.append([x + jit[0], y + jit[1], x + 32 - jit[2], y + 32 - jit[3]])
        objs = [(COLORS[cols[i]], SHAPES[shs[i]]) for i in range(2)]
        dis = [(COLORS[cols[i]], BACKGROUND[bgs[i - 2]]) for i in range(2, 2 + pg.distractors)]
        perm = rng.permutation(2 + pg.distractors)  # regions in a random order (not objects first)
        scenes[sid] = {"objs": objs, "dis": dis, "boxes": np.asarray(boxes, np.float32), "perm": perm}

    # ---- samples: samples, captions, instances, phrases
    sw = ArtifactWriter(out, "samples", "ingest", {"planted": True})
    w = sw.unit_writer(unit_name(0), "fp")
    samples = {"sample_id": ids, "source_id": [f"{i:012d}" for i in ids], "image": [f"/nonexistent/{i}.jpg" for i in ids],
               "width": [128] * n_images, "height": [128] * n_images, "split": [split_of(i) for i in ids]}
    caps = {"caption_id": [], "sample_id": [], "text": []}
    inst = {"sample_id": [], "instance_id": [], "category": [], "box": [], "mask_rle": [], "attributes": []}
    phr = {"caption_id": [], "sample_id": [], "start": [], "end": [], "text": [], "instance_ids": []}
    cap_words = {}  # caption_id -> [(word, start, end, pos, instance)]
    for sid in ids:
        sc = scenes[sid]
        for k, (c, s) in enumerate(sc["objs"]):
            inst["sample_id"].append(sid)
            inst["instance_id"].append(k)
            inst["category"].append(s)
            inst["box"].append([float(v) for v in sc["boxes"][k]])
            inst["mask_rle"].append(None)
            inst["attributes"].append("{}")
        for j, order in enumerate([(0, 1), (1, 0)]):
            cid = sid * 10 + j
            text, ws = "a ", []
            for n, k in enumerate(order):
                c, s = sc["objs"][k]
                st = len(text)
                ws.append((c, st, st + len(c), "ADJ", k))
                ws.append((s, st + len(c) + 1, st + len(c) + 1 + len(s), "NOUN", k))
                phr["caption_id"].append(cid)
                phr["sample_id"].append(sid)
                phr["start"].append(st)
                phr["end"].append(st + len(c) + 1 + len(s))
                phr["text"].append(f"{c} {s}")
                phr["instance_ids"].append([k])
                text += f"{c} {s}" + (" and a " if n == 0 else "")
            caps["caption_id"].append(cid)
            caps["sample_id"].append(sid)
            caps["text"].append(text)
            cap_words[cid] = ws
    w.write_table("samples", pa.table({"sample_id": pa.array(ids, pa.int64()), "source_id": samples["source_id"],
                                       "image": samples["image"], "width": pa.array(samples["width"], pa.int32()),
                                       "height": pa.array(samples["height"], pa.int32()), "split": samples["split"]}))
    w.write_table("captions", pa.table({"caption_id": pa.array(caps["caption_id"], pa.int64()),
                                        "sample_id": pa.array(caps["sample_id"], pa.int64()), "text": caps["text"]}))
    w.write_table("instances", pa.table({"sample_id": pa.array(inst["sample_id"], pa.int64()),
                                         "instance_id": pa.array(inst["instance_id"], pa.int64()),
                                         "category": inst["category"], "box": pa.array(inst["box"], pa.list_(pa.float32(), 4)),
                                         "mask_rle": pa.array(inst["mask_rle"], pa.string()), "attributes": inst["attributes"]}))
    w.write_table("phrases", pa.table({"caption_id": pa.array(phr["caption_id"], pa.int64()),
                                       "sample_id": pa.array(phr["sample_id"], pa.int64()),
                                       "start": pa.array(phr["start"], pa.int32()), "end": pa.array(phr["end"], pa.int32()),
                                       "text": phr["text"], "instance_ids": pa.array(phr["instance_ids"], pa.list_(pa.int64()))}))
    w.commit()
    sw.finalize([unit_name(0)])

    # ---- regions
    rw = ArtifactWriter(out, "regions", "extract-regions", {"backend": "annotations"})
    units = []
    for u, s0 in enumerate(range(0, n_images, shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = rw.unit_writer(name, "fp")
        with ShardWriter(uw.shard_path()) as shw:
            for sid in ids[s0:s0 + shard_size]:
                sc = scenes[sid]
                pairs = sc["objs"] + sc["dis"]
                feats = np.stack([pg.region(c, s) for c, s in pairs])[sc["perm"]]
                iid = np.asarray([k if k < 2 else -1 for k in range(len(pairs))], np.int64)[sc["perm"]]
                if sid in empty_regions:  # the detector found nothing
                    sc["perm"], feats, iid, pairs = sc["perm"][:0], feats[:0], iid[:0], []
                shw.write(sample_key(sid), {"boxes.npy": sc["boxes"][sc["perm"]], "features.npy": feats.astype(np.float16),
                                            "scores.npy": np.ones(len(pairs), np.float32),
                                            "labels.npy": -np.ones(len(pairs), np.int64), "instance_ids.npy": iid,
                                            "categories.json": [s for _, s in pairs], "image_size.npy": np.asarray([128, 128], np.int32)})
        uw.record_shard(uw.shard_path(), shw.count)
        uw.commit()
    rw.finalize(units, extra={"dims": {"feature_dim": pg.d_r, "max_boxes": 30}, "backend": "annotations"})

    # ---- negatives
    K = 25
    nw = ArtifactWriter(out, "negatives", "negative-captions", {"negative_features": "all", "feature_pos": ["NOUN", "ADJ"],
                                                               "noun_pos": ["NOUN"], "include_propn": True})
    units = []
    n_short = 0
    for u, s0 in enumerate(range(0, n_images, shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = nw.unit_writer(name, "fp")
        word_rows, neg_rows = [], []
        with ShardWriter(uw.shard_path()) as shw:
            for sid in ids[s0:s0 + shard_size]:
                wf, wc, wi = [], [], []
                nf, nc, ni, nn_, nv = [], [], [], [], []
                for cid in (sid * 10, sid * 10 + 1):
                    ctx = rng.normal(size=pg.d_w) / np.sqrt(pg.d_w)
                    for t, (word, st, en, pos, k) in enumerate(cap_words[cid]):
                        word_index = 1 + t + (t // 2) * 2  # "a red circle and a blue square": tokens 1, 2, 5, 6
                        word_rows.append(dict(caption_id=cid, sample_id=sid, word_index=word_index, start=st, end=en,
                                              text=word, pos=pos, lemma=word, is_noun=pos == "NOUN", feature_row=len(wc)))
                        wf.append(pg.word(word, ctx))
                        wc.append(cid)
                        wi.append(word_index)
                        if pos == "NOUN":
                            # not the image's other object (a false negative: it is in the image)
                            cands = [n for n in NOUNS if n not in {o[1] for o in scenes[sid]["objs"]}]
                            cands = [cands[i] for i in rng.permutation(len(cands))[:K]]
                            count = K
                            if short_negatives_every and (sid + len(nc)) % short_negatives_every == 0:
                                count = 20  # a noun with fewer valid negatives (mask)
                                n_short += 1
                            f = np.zeros((K, pg.d_w), np.float32)
                            f[:count] = np.stack([pg.word(n, ctx) for n in cands[:count]])
                            neg_rows.append(dict(caption_id=cid, sample_id=sid, word_index=word_index, start=st, end=en,
                                                 noun=word, lemma=word, candidates=cands[:count], candidate_ids=list(range(count)),
                                                 p=[0.0] * count, q=[0.0] * count, score=[0.0] * count, rejected=[],
                                                 feature_row=len(nc)))
                            nf.append(f)
                            nc.append(cid)
                            ni.append(word_index)
                            nn_.append(count)
                            nv.append([True] * count + [False] * (K - count))
                shw.write(sample_key(sid), {"words.npy": np.stack(wf).astype(np.float16),
                                            "words.json": {"caption_id": wc, "word_index": wi},
                                            "negs.npy": np.stack(nf).astype(np.float16),
                                            "negs.json": {"caption_id": nc, "word_index": ni, "count": nn_, "valid": nv}})
        uw.record_shard(uw.shard_path(), shw.count)
        uw.write_table("words", pa.Table.from_pylist(word_rows, schema=WORDS_SCHEMA))
        uw.write_table("negatives", pa.Table.from_pylist(neg_rows, schema=NEGATIVES_SCHEMA))
        uw.commit()
    nw.finalize(units, extra={"feature_dim": pg.d_w, "negative_feature_k": K})
    pg.n_short = n_short
    return pg
