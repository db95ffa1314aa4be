"""A `clip_tokens` + `samples` artifact pair with a planted token-level signal, written with the
same schema and writers as pipeline/stages/extract_clip_tokens.py (test helper for the ConceptOT
trainer).

Scene: each image holds 1-3 objects (colour, shape) on a 4x4 patch grid; each object covers a
patch or two. Patch tokens live in a "vision" space: an object's patches carry
E_v[colour] + E_v[shape] + noise, background patches noise. Caption tokens live in a different
"text" space: BOS, then for every object "<colour> <shape>" (token of a word = its text embedding
plus a contextual share of its partner word, so attribute binding is visible at the token level),
filler words, EOS. Pooled embeddings carry only a weak, noisy copy of the bag of concepts, so
global retrieval is poor and fine-grained matching has room to help. SugarCrepe-style
swap_att / replace_att negatives are written alongside.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, sample_key

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "star", "ring", "cross"]
FILLER = ["a", "and", "picture", "with", "there", "is"]


class Planted:
    def __init__(self, d_v=32, d_t=24, P=16, seed=0, global_signal=0.35, noise=0.6):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.d_v, self.d_t, self.P = d_v, d_t, P
        words = COLORS + SHAPES + FILLER + ["<bos>", "<eos>"]
        self.word = {w: i for i, w in enumerate(words)}
        self.Ev = rng.normal(size=(len(words), d_v)) / np.sqrt(d_v)
        self.Et = rng.normal(size=(len(words), d_t)) / np.sqrt(d_t)
        self.Ctx = rng.normal(size=(len(words), d_t)) / np.sqrt(d_t)  # contextual share
        self.Gv = rng.normal(size=(len(words), P)) / np.sqrt(P)
        self.Gt = self.Gv  # pooled embeddings share a joint space (as CLIP projections do)
        self.global_signal, self.noise = global_signal, noise

    def scene(self):
        k = int(self.rng.integers(1, 4))
        colors = self.rng.choice(len(COLORS), k, replace=False)
        shapes = self.rng.choice(len(SHAPES), k, replace=False)
        return [(COLORS[c], SHAPES[s]) for c, s in zip(colors, shapes)]

    def image(self, objs):
        N = 16
        v = self.noise * self.rng.normal(size=(N, self.d_v)) / np.sqrt(self.d_v)
        cells = self.rng.permutation(N)
        self.last_cells = []  # the patch cells of each object (ground truth of the grounding test)
        for n, (c, s) in enumerate(objs):
            mine = cells[2 * n: 2 * n + 1 + int(self.rng.integers(0, 2))]
            self.last_cells.append([int(x) for x in mine])
            for cell in mine:
                v[cell] += self.Ev[self.word[c]] + self.Ev[self.word[s]]
        bag = sum(self.Gv[self.word[c]] + self.Gv[self.word[s]] for c, s in objs)
        emb = self.global_signal * bag + self.rng.normal(size=self.P) / np.sqrt(self.P)
        return v.astype(np.float16), emb.astype(np.float16)

    def text(self, text: str):
        """Tokens [M, d_t] and pooled embedding for a caption made of known words (the noise is
        a function of the text, so encoding the same text twice gives the same arrays)."""
        import zlib

        rng = np.random.default_rng(zlib.crc32(text.encode()))
        ws = [w.strip(".,").lower() for w in text.split()]
        ws = [w for w in ws if w in self.word]
        toks = [self.Et[self.word["<bos>"]]]
        for j, w in enumerate(ws):
            t = self.Et[self.word[w]].copy()
            if w in COLORS and j + 1 < len(ws) and ws[j + 1] in SHAPES:
                t += 0.7 * self.Ctx[self.word[ws[j + 1]]]
            if w in SHAPES and j > 0 and ws[j - 1] in COLORS:
                t += 0.7 * self.Ctx[self.word[ws[j - 1]]]
            toks.append(t + 0.1 * rng.normal(size=self.d_t) / np.sqrt(self.d_t))
        toks.append(self.Et[self.word["<eos>"]])
        bag = sum(self.Gt[self.word[w]] for w in ws if w in COLORS or w in SHAPES)
        emb = self.global_signal * bag + rng.normal(size=self.P) / np.sqrt(self.P)
        return np.stack(toks).astype(np.float16), emb.astype(np.float16)

    def caption(self, objs):
        parts = [f"{c} {s}" for c, s in objs]
        filler = list(self.rng.choice(FILLER, int(self.rng.integers(0, 3))))
        return " ".join(filler + [" and ".join(parts)])


def write_planted(out: Path, n_images=240, captions_per_image=2, shard_size=64, seed=0, **kw) -> Planted:
    """Write <out>/samples (samples + captions tables, split column; instances + phrases: each object
    "<colour> <shape>" of a caption is a phrase linked to one instance whose box encloses the object's
    patch cells, 16 px each on the 64 x 64 image) and <out>/clip_tokens."""
    out = Path(out)
    pl_ = Planted(seed=seed, **kw)
    scenes = [pl_.scene() for _ in range(n_images)]
    # samples artifact
    sw = ArtifactWriter(out, "samples", "ingest", {"planted": True})
    w = sw.unit_writer(unit_name(0), "fp")
    ids = list(range(1, n_images + 1))
    splits = ["test" if i % 5 == 4 else "train" for i in range(n_images)]
    w.write_table("samples", pa.table({
        "sample_id": pa.array(ids, pa.int64()), "source_id": [f"{i:012d}" for i in ids],
        "image": [f"/nonexistent/{i:012d}.jpg" for i in ids], "width": [64] * n_images, "height": [64] * n_images,
        "split": splits}))
    cap_rows = {"caption_id": [], "sample_id": [], "text": []}
    texts = {}
    for i, objs in zip(ids, scenes):
        for c in range(captions_per_image):
            cid = i * 1000 + c + 1
            t = pl_.caption(objs)
            cap_rows["caption_id"].append(cid)
            cap_rows["sample_id"].append(i)
            cap_rows["text"].append(t)
            texts[cid] = t
    w.write_table("captions", pa.table({"caption_id": pa.array(cap_rows["caption_id"], pa.int64()),
                                        "sample_id": pa.array(cap_rows["sample_id"], pa.int64()),
                                        "text": cap_rows["text"]}))
    # the images (after every caption, so the random stream is the one the calibrated tests saw)
    pix = {}
    for i, objs in zip(ids, scenes):
        patches, iemb = pl_.image(objs)
        pix[i] = (patches, iemb, pl_.last_cells)
    inst = {"sample_id": [], "instance_id": [], "category": [], "box": [], "mask_rle": [], "attributes": []}
    phr = {"caption_id": [], "sample_id": [], "start": [], "end": [], "text": [], "instance_ids": []}
    for i, objs in zip(ids, scenes):
        for n, ((c, s), cells) in enumerate(zip(objs, pix[i][2])):
            r, q = np.array(cells) // 4, np.array(cells) % 4
            inst["sample_id"].append(i)
            inst["instance_id"].append(i * 10 + n)
            inst["category"].append(s)
            inst["box"].append([16.0 * q.min(), 16.0 * r.min(), 16.0 * (q.max() + 1), 16.0 * (r.max() + 1)])
            inst["mask_rle"].append("")
            inst["attributes"].append(json.dumps({"color": c}))
            for cid in (i * 1000 + k + 1 for k in range(captions_per_image)):
                st = texts[cid].index(f"{c} {s}")
                phr["caption_id"].append(cid)
                phr["sample_id"].append(i)
                phr["start"].append(st)
                phr["end"].append(st + len(c) + 1 + len(s))
                phr["text"].append(f"{c} {s}")
                phr["instance_ids"].append([i * 10 + n])
    w.write_table("instances", pa.table({**{k: v for k, v in inst.items() if k != "box"},
                                         "sample_id": pa.array(inst["sample_id"], pa.int64()),
                                         "instance_id": pa.array(inst["instance_id"], pa.int64()),
                                         "box": pa.array(inst["box"], pa.list_(pa.float32(), 4))}))
    w.write_table("phrases", pa.table({**phr, "caption_id": pa.array(phr["caption_id"], pa.int64()),
                                       "sample_id": pa.array(phr["sample_id"], pa.int64()),
                                       "start": pa.array(phr["start"], pa.int32()), "end": pa.array(phr["end"], pa.int32()),
                                       "instance_ids": pa.array(phr["instance_ids"], pa.list_(pa.int64()))}))
    w.commit()
    sw.finalize([unit_name(0)])
    # clip_tokens artifact (schema of extract_clip_tokens)
    cw = ArtifactWriter(out, "clip_tokens", "extract-clip-tokens", {"max_text_tokens": 48, "project_tokens": False})
    units = []
    for u, s0 in enumerate(range(0, n_images, shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = cw.unit_writer(name, "fp")
        img_rows, caps = {"sample_id": [], "embed": []}, {"caption_id": [], "sample_id": [], "n": [], "embed": []}
        with ShardWriter(uw.shard_path()) as shw:
            for i, objs in list(zip(ids, scenes))[s0:s0 + shard_size]:
                patches, iemb = pix[i][0], pix[i][1]
                cids = [i * 1000 + c + 1 for c in range(captions_per_image)]
                enc = [pl_.text(texts[c]) for c in cids]
                M = max(t.shape[0] for t, _ in enc)
                tok = np.zeros((len(cids), M, pl_.d_t), np.float16)
                mask = np.zeros((len(cids), M), bool)
                offs = np.zeros((len(cids), M, 2), np.int32)
                for j, (t, _) in enumerate(enc):
                    tok[j, : len(t)] = t
                    mask[j, : len(t)] = True
                    # character spans of the words (BOS/EOS [0, 0])
                    pos, k = 0, 1
                    for word in texts[cids[j]].split():
                        st = texts[cids[j]].index(word, pos)
                        pos = st + len(word)
                        if k < len(t) - 1:
                            offs[j, k] = (st, pos)
                            k += 1
                shw.write(sample_key(i), {
                    "patch_tokens.npy": patches, "image_embed.npy": iemb, "text_tokens.npy": tok, "text_mask.npy": mask,
                    "text_embed.npy": np.stack([e for _, e in enc]), "caption_ids.npy": np.array(cids, np.int64),
                    "token_ids.npy": np.zeros((len(cids), M), np.int32), "token_offsets.npy": offs})
                add_rows(img_rows, caps, i, iemb, cids, [e for _, e in enc])
        commit_unit(uw, shw, img_rows, caps)
    cw.finalize(units, extra={"dims": {"vision_dim": pl_.d_v, "text_dim": pl_.d_t, "projection_dim": pl_.P,
                                       "n_patches": 16}})
    # SugarCrepe-format negatives for the test images (swap_att and replace_att)
    sc = {"swap_att": {}, "replace_att": {}}
    for i, objs in zip(ids, scenes):
        if splits[i - 1] != "test":
            continue
        pos = " and ".join(f"{c} {s}" for c, s in objs)
        if len(objs) >= 2:
            sw_objs = [(objs[1][0], objs[0][1]), (objs[0][0], objs[1][1])] + objs[2:]
            sc["swap_att"][str(len(sc["swap_att"]))] = {
                "filename": f"{i:012d}.jpg", "caption": pos, "negative_caption": " and ".join(f"{c} {s}" for c, s in sw_objs)}
        other = [c for c in COLORS if c not in {o[0] for o in objs}][0]
        rep = [(other, objs[0][1])] + objs[1:]
        sc["replace_att"][str(len(sc["replace_att"]))] = {
            "filename": f"{i:012d}.jpg", "caption": pos, "negative_caption": " and ".join(f"{c} {s}" for c, s in rep)}
    (out / "sugarcrepe").mkdir(parents=True, exist_ok=True)
    for k, d in sc.items():
        (out / "sugarcrepe" / f"{k}.json").write_text(json.dumps(d, indent=4))
    return pl_


def add_rows(img_rows: dict, caps: dict, sample_id: int, image_embed, caption_ids, text_embeds) -> None:
    """Queue one sample's rows of the clip_tokens ``images`` / ``captions`` tables."""
    img_rows["sample_id"].append(sample_id)
    img_rows["embed"].append(image_embed)
    for c, e in zip(caption_ids, text_embeds):
        caps["caption_id"].append(c)
        caps["sample_id"].append(sample_id)
        caps["n"].append(0)
        caps["embed"].append(e)


def commit_unit(uw, shw, img_rows: dict, caps: dict) -> None:
    """Record a written clip_tokens shard, write the unit's ``images`` / ``captions`` tables, commit."""
    uw.record_shard(uw.shard_path(), shw.count)
    rel = str(uw.shard_path().relative_to(uw.dir))
    uw.write_table("images", pa.table({"sample_id": pa.array(img_rows["sample_id"], pa.int64()),
                                       "shard": [rel] * len(img_rows["sample_id"]),
                                       "image_embed": [list(map(float, e)) for e in img_rows["embed"]]}))
    uw.write_table("captions", pa.table({"caption_id": pa.array(caps["caption_id"], pa.int64()),
                                         "sample_id": pa.array(caps["sample_id"], pa.int64()),
                                         "n_tokens": pa.array(caps["n"], pa.int32()),
                                         "text_embed": [list(map(float, e)) for e in caps["embed"]]}))
    uw.commit()
