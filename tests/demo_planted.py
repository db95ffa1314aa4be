"""A planted-signal ``samples`` + ``clip_tokens`` pair for the *generated* scene dataset (test helper
for the harness on the generated benchmark files of ``manifests/demo.yaml``).

The generated dataset (pipeline/synthetic) writes its own ARO, Winoground, VALSE, SugarCrepe, ...
files; the demo's tiny random CLIP carries no signal about them. Here the scenes' ground truth
(``annotations/instances.json``: colour, shape, box of every object) plants one, with the same
schema and writers as pipeline/stages/extract_clip_tokens.py:

* patch tokens on a 4x4 grid: a cell holds E_v[colour] + E_v[shape] of every object whose box
  covers at least a quarter of it (at least the cell of the box centre), plus noise;
* text tokens, one per word: E_t[word] (colours, shapes and their plurals, sizes; any other word a
  fixed vector of its own), a colour word plus a share of the next shape word's context vector and a
  shape word plus a share of the previous colour's (attribute binding lives at the token level),
  plus a little noise that is a function of the text;
* pooled embeddings: a weak copy of the bag of (colour, shape) words plus noise, on the image side
  from the objects, on the text side from the words; the text noise is a function of the whole text,
  so two captions with the same words in another order get unrelated noise, as a bag-of-words
  encoder with some order sensitivity would (CLIP on ARO's relation swaps). The text noise is
  smaller than the image noise (``text_noise`` 0.3): with it at 1, the pooled score of a swapped
  caption differs from the caption's by more than the local score of 200 training steps can make up
  (measured: conceptot 51 on swap_att, global-only 49).

So word order (ARO VG-Relation's swapped subjects and objects, Winoground's swaps) is in no feature:
every scorer must sit near chance there, while attribute binding (VG-Attribution, SugarCrepe swap_att)
and object / attribute replacement are in the tokens for a trained local scorer to find.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, sample_key
from pipeline.synthetic.scene import COLOR_NAMES, PLURALS, SHAPES, SIZE_NAMES
from tests.cot_planted import add_rows, commit_unit

GRID = 4
SHAPE_OF = {**{s: s for s in SHAPES}, **{p: s for s, p in PLURALS.items()}}


def _words(text: str) -> list[str]:
    return [w.strip(".,:;!?\"'()").lower() for w in text.split() if w.strip(".,:;!?\"'()")]


class GeneratedPlanted:
    def __init__(self, d_v=32, d_t=24, P=16, seed=0, global_signal=0.5, noise=0.6, bind=0.7, text_noise=0.3):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.d_v, self.d_t, self.P = d_v, d_t, P
        words = COLOR_NAMES + SHAPES + SIZE_NAMES + ["<bos>", "<eos>"]
        self.word = {w: i for i, w in enumerate(words)}
        self.Ev = rng.normal(size=(len(words), d_v)) / np.sqrt(d_v)
        self.Et = rng.normal(size=(len(words), d_t)) / np.sqrt(d_t)
        self.Ctx = rng.normal(size=(len(words), d_t)) / np.sqrt(d_t)
        self.Gv = rng.normal(size=(len(words), P)) / np.sqrt(P)
        self.global_signal, self.noise, self.bind, self.text_noise = global_signal, noise, bind, text_noise

    def _other(self, w: str) -> np.ndarray:
        return np.random.default_rng(zlib.crc32(("w:" + w).encode())).normal(size=self.d_t) / np.sqrt(self.d_t)

    def image(self, objects: list[dict], W: int, H: int, rng: np.random.Generator):
        v = self.noise * rng.normal(size=(GRID * GRID, self.d_v)) / np.sqrt(self.d_v)
        cw, ch = W / GRID, H / GRID
        bag = np.zeros(self.P)
        for o in objects:
            x, y, w, h = o["bbox"]
            cells = set()
            for r in range(GRID):
                for q in range(GRID):
                    ix = max(0.0, min(x + w, (q + 1) * cw) - max(x, q * cw))
                    iy = max(0.0, min(y + h, (r + 1) * ch) - max(y, r * ch))
                    if ix * iy >= 0.25 * cw * ch:
                        cells.add(r * GRID + q)
            cx, cy = min(GRID - 1, int((x + w / 2) // cw)), min(GRID - 1, int((y + h / 2) // ch))
            cells.add(cy * GRID + cx)
            for c in cells:
                v[c] += self.Ev[self.word[o["color"]]] + self.Ev[self.word[o["shape"]]]
            bag += self.Gv[self.word[o["color"]]] + self.Gv[self.word[o["shape"]]]
        emb = self.global_signal * bag + rng.normal(size=self.P) / np.sqrt(self.P)
        return v.astype(np.float16), emb.astype(np.float16)

    def text(self, text: str):
        """(tokens [M, d_t], pooled [P]) of any text; the same text always gives the same arrays."""
        rng = np.random.default_rng(zlib.crc32(text.encode()))
        ws = _words(text)
        toks = [self.Et[self.word["<bos>"]]]
        bag = np.zeros(self.P)
        for j, w in enumerate(ws):
            s = SHAPE_OF.get(w)
            if w in self.word and w not in ("<bos>", "<eos>"):
                t = self.Et[self.word[w]].copy()
            elif s is not None:
                t = self.Et[self.word[s]].copy()
            else:
                t = self._other(w)
            if w in COLOR_NAMES:
                nxt = [SHAPE_OF[x] for x in ws[j + 1: j + 3] if x in SHAPE_OF]
                if nxt:
                    t += self.bind * self.Ctx[self.word[nxt[0]]]
                bag += self.Gv[self.word[w]]
            if s is not None:
                prev = [x for x in ws[max(0, j - 2): j] if x in COLOR_NAMES]
                if prev:
                    t += self.bind * self.Ctx[self.word[prev[-1]]]
                bag += self.Gv[self.word[s]]
            toks.append(t + 0.1 * rng.normal(size=self.d_t) / np.sqrt(self.d_t))
        toks.append(self.Et[self.word["<eos>"]])
        emb = self.global_signal * bag + self.text_noise * rng.normal(size=self.P) / np.sqrt(self.P)
        return np.stack(toks).astype(np.float16), emb.astype(np.float16)

    def encode_texts(self, texts):
        """Stands in for the frozen CLIP text tower (``ConceptOTJob._encode_texts``)."""
        import torch

        enc = [self.text(t) for t in texts]
        return {"tokens": torch.nn.utils.rnn.pad_sequence([torch.tensor(t).float() for t, _ in enc], batch_first=True),
                "mask": torch.nn.utils.rnn.pad_sequence([torch.ones(len(t), dtype=torch.bool) for t, _ in enc],
                                                        batch_first=True),
                "embed": torch.tensor(np.stack([e for _, e in enc])).float()}


def write_generated_planted(out: Path, source: Path, shard_size: int = 64, seed: int = 0, **kw) -> GeneratedPlanted:
    """Write ``<out>/samples`` (samples + captions of the generated dataset at ``source``; sample id =
    COCO image id, source id = file stem, image = the file) and a planted ``<out>/clip_tokens``."""
    out, source = Path(out), Path(source)
    pl_ = GeneratedPlanted(seed=seed, **kw)
    caps = json.loads((source / "annotations" / "captions.json").read_text())
    inst = json.loads((source / "annotations" / "instances.json").read_text())
    images = sorted(caps["images"], key=lambda im: im["id"])
    objects: dict[int, list[dict]] = {}
    for a in inst["annotations"]:
        objects.setdefault(a["image_id"], []).append(
            {"color": a["attributes"]["color"], "shape": SHAPES[a["category_id"] - 1], "bbox": a["bbox"]})
    texts: dict[int, list[tuple[int, str]]] = {}
    for a in caps["annotations"]:
        if isinstance(a.get("caption"), str) and a["caption"].strip():
            texts.setdefault(a["image_id"], []).append((int(a["id"]), a["caption"].strip()))
    images = [im for im in images if texts.get(im["id"])]
    ids = [int(im["id"]) for im in images]
    sw = ArtifactWriter(out, "samples", "ingest", {"planted": "generated"})
    w = sw.unit_writer(unit_name(0), "fp")
    w.write_table("samples", pa.table({
        "sample_id": pa.array(ids, pa.int64()), "source_id": [Path(im["file_name"]).stem for im in images],
        "image": [str(source / "images" / im["file_name"]) for im in images],
        "width": pa.array([im["width"] for im in images], pa.int32()),
        "height": pa.array([im["height"] for im in images], pa.int32()),
        "split": [im.get("split") or "train" for im in images]}))
    rows = [(cid, i, t) for i in ids for cid, t in texts[i]]
    w.write_table("captions", pa.table({"caption_id": pa.array([r[0] for r in rows], pa.int64()),
                                        "sample_id": pa.array([r[1] for r in rows], pa.int64()),
                                        "text": [r[2] for r in rows]}))
    w.commit()
    sw.finalize([unit_name(0)])
    cw = ArtifactWriter(out, "clip_tokens", "extract-clip-tokens", {"max_text_tokens": 48, "project_tokens": False})
    units = []
    for u, s0 in enumerate(range(0, len(images), shard_size)):
        name = unit_name(u)
        units.append(name)
        uw = cw.unit_writer(name, "fp")
        img_rows, cap_rows = {"sample_id": [], "embed": []}, {"caption_id": [], "sample_id": [], "n": [], "embed": []}
        with ShardWriter(uw.shard_path()) as shw:
            for im in images[s0:s0 + shard_size]:
                i = int(im["id"])
                patches, iemb = pl_.image(objects.get(i, []), im["width"], im["height"], np.random.default_rng([seed, i]))
                cids = [c for c, _ in texts[i]]
                enc = [pl_.text(t) for _, t in texts[i]]
                M = max(t.shape[0] for t, _ in enc)
                tok = np.zeros((len(cids), M, pl_.d_t), np.float16)
                mask = np.zeros((len(cids), M), bool)
                for j, (t, _) in enumerate(enc):
                    tok[j, : len(t)] = t
                    mask[j, : len(t)] = True
                shw.write(sample_key(i), {
                    "patch_tokens.npy": patches, "image_embed.npy": iemb, "text_tokens.npy": tok, "text_mask.npy": mask,
                    "text_embed.npy": np.stack([e for _, e in enc]), "caption_ids.npy": np.array(cids, np.int64),
                    "token_ids.npy": np.zeros((len(cids), M), np.int32),
                    "token_offsets.npy": np.zeros((len(cids), M, 2), np.int32)})
                add_rows(img_rows, cap_rows, i, iemb, cids, [e for _, e in enc])
        commit_unit(uw, shw, img_rows, cap_rows)
    cw.finalize(units, extra={"dims": {"vision_dim": pl_.d_v, "text_dim": pl_.d_t, "projection_dim": pl_.P,
                                       "n_patches": GRID * GRID}})
    return pl_
