"""Implementation of the `infoground` job (see train/jobs/infoground/__init__.py for the description)."""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.io.artifacts import Artifact
from pipeline.io.shards import ShardStream, loader
from pipeline.io.wds import iter_shard
from pipeline.loaders.negatives import NegativesReader
from pipeline.loaders.regions import RegionsReader, collate_regions, iter_shard_mapped
from train.data import ParquetMultiJoin
from train.jobs.infoground.losses import infoground_loss
from train.jobs.infoground.model import InfoGroundModel
from train.job import Job

GROUNDING_METRICS = ("r1", "r5", "r10", "pointing_accuracy")


def _resolve(root, p: str) -> Path | str:
    from pipeline.io.storage import resolve_under

    return resolve_under(root, p)


def _artifact(root, rel: str, expected: str, what: str) -> Artifact:
    path = _resolve(root, rel)
    try:
        art = Artifact(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"infoground: {what} artifact {path} is missing (no _manifest.json): run "
                                f"`pipeline run {what_stage(expected)}` first") from None
    if art.name != expected:
        raise ValueError(f"infoground: {path} holds a {art.name!r} artifact, expected {expected!r}")
    return art


def what_stage(artifact: str) -> str:
    return {"regions": "extract-regions", "negatives": "negative-captions", "samples": "ingest"}.get(artifact, artifact)


# ------------------------------------------------------------------------------------- reading
def read_captions(shard: str):
    """One item per caption of a negatives shard: its word features and its nouns' negatives
    (arrays are views of the shard's map; the collate copies them into the batch)."""
    for rec in iter_shard_mapped(shard):
        sid = int(rec["__key__"])
        wj = rec.get("words.json")
        if not wj or "words.npy" not in rec:
            continue
        wc = np.asarray(wj["caption_id"], np.int64)
        wi = np.asarray(wj["word_index"], np.int32)
        wf = rec["words.npy"]
        nj = rec.get("negs.json")
        if nj and "negs.npy" in rec:
            nc = np.asarray(nj["caption_id"], np.int64)
            nwi, ncount = np.asarray(nj["word_index"], np.int32), np.asarray(nj["count"], np.int32)
            nvalid = np.asarray(nj["valid"], bool).reshape(len(nc), -1)
        else:
            nc = np.zeros(0, np.int64)
        for cid in np.unique(wc):
            rows = np.nonzero(wc == cid)[0]
            item = {"sample_id": sid, "caption_id": int(cid), "wf": wf[rows], "wi": wi[rows]}
            nr = np.nonzero(nc == cid)[0]
            if len(nr):
                item["neg_wi"], item["neg_count"], item["neg_valid"] = nwi[nr], ncount[nr], nvalid[nr]
                item["neg_f"] = rec["negs.npy"][nr]
            yield item


_READERS: dict[str, RegionsReader] = {}


def regions_reader(path: str) -> RegionsReader:
    """One reader (and member index) per regions artifact and process."""
    if path not in _READERS:
        _READERS[path] = RegionsReader(path)
    return _READERS[path]


class Collate:
    """Caption items -> a batch (see train/jobs/infoground/losses.py for the layout). A picklable
    object (DataLoader workers); the regions are joined here, one read per distinct image."""

    def __init__(self, regions_path: str, variant: str, n_neg: int, max_words: int | None, max_regions: int | None):
        self.regions_path, self.variant, self.n_neg = regions_path, variant, n_neg
        self.max_words, self.max_regions = max_words, max_regions
        self._reader = None

    @property
    def reader(self) -> RegionsReader:
        if self._reader is None:
            self._reader = regions_reader(self.regions_path)
        return self._reader

    def __getstate__(self):
        return {**self.__dict__, "_reader": None}

    def __call__(self, samples: list[dict], rng: random.Random) -> dict:
        sids = list(dict.fromkeys(int(s["sample_id"]) for s in samples))
        pos = {s: i for i, s in enumerate(sids)}
        regs = collate_regions([self.reader.get(s, ("boxes.npy", "features.npy")) for s in sids], self.max_regions)
        B = len(samples)
        wlist = [s["wf"] if self.max_words is None else s["wf"][: self.max_words] for s in samples]
        T = max(1, max(len(w) for w in wlist))
        dw = int(samples[0]["wf"].shape[1])
        words = np.zeros((B, T, dw), np.float32)
        wmask = np.zeros((B, T), bool)
        for b, w in enumerate(wlist):
            words[b, : len(w)] = w
            wmask[b, : len(w)] = True
        batch = {
            "caption_id": torch.as_tensor([s["caption_id"] for s in samples], dtype=torch.int64),
            "image_of": torch.as_tensor([pos[int(s["sample_id"])] for s in samples], dtype=torch.int64),
            "sample_ids": torch.as_tensor(sids, dtype=torch.int64),
            "region_features": torch.from_numpy(regs["features"]),
            "region_mask": torch.from_numpy(regs["mask"]),
            "words": torch.from_numpy(words),
            "word_mask": torch.from_numpy(wmask),
        }
        if self.variant != "none":
            lw, lm = self._lang(samples, rng, dw)
            batch["lang_words"], batch["lang_mask"] = torch.from_numpy(lw), torch.from_numpy(lm)
        return batch

    def _lang(self, samples, rng: random.Random, dw: int):
        K = self.n_neg
        B = len(samples)
        lw = np.zeros((B, 1 + K, dw), np.float32)
        lm = np.zeros((B, 1 + K), bool)
        if self.variant == "contextual":
            for b, s in enumerate(samples):
                if "neg_wi" not in s:
                    continue
                ok = [j for j in range(len(s["neg_wi"]))
                      if s["neg_count"][j] > 0 and s["neg_valid"][j][: s["neg_count"][j]].any()
                      and (s["wi"] == s["neg_wi"][j]).any()]
                if not ok:
                    continue
                j = ok[rng.randrange(len(ok))] if len(ok) > 1 else ok[0]
                row = int(np.nonzero(s["wi"] == s["neg_wi"][j])[0][0])
                k = min(K, int(s["neg_count"][j]), s["neg_f"].shape[1])
                lw[b, 0] = s["wf"][row]
                lw[b, 1 : 1 + k] = s["neg_f"][j, :k]
                lm[b, 0] = True
                lm[b, 1 : 1 + k] = s["neg_valid"][j][:k]
            return lw, lm
        # random (Table 2): the chosen noun against nouns of other captions (of other images) of the
        # batch, each with its stored feature, i.e. in its own caption's context
        nouns = []  # per caption: [(row, text)]
        for s in samples:
            wi_noun = dict(zip(s.get("w_word_index", []), zip(s.get("w_is_noun", []), s.get("w_text", []))))
            rows = [(r, wi_noun[int(w)][1]) for r, w in enumerate(s["wi"]) if wi_noun.get(int(w), (False,))[0]]
            nouns.append(rows)
        for b, s in enumerate(samples):
            if not nouns[b]:
                continue
            row, text = nouns[b][rng.randrange(len(nouns[b]))]
            pool = [(c, r) for c, other in enumerate(samples) if other["sample_id"] != s["sample_id"]
                    for r, t in nouns[c] if t.lower() != text.lower()]
            if not pool:
                continue
            pick = rng.sample(pool, min(K, len(pool)))
            lw[b, 0] = s["wf"][row]
            lm[b, 0] = True
            for m, (c, r) in enumerate(pick):
                lw[b, 1 + m] = samples[c]["wf"][r]
                lm[b, 1 + m] = True
        return lw, lm


# --------------------------------------------------------------------------------- evaluation
def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU [len(a), len(b)] of x0, y0, x1, y1 boxes."""
    ix0 = np.maximum(a[:, None, 0], b[None, :, 0])
    iy0 = np.maximum(a[:, None, 1], b[None, :, 1])
    ix1 = np.minimum(a[:, None, 2], b[None, :, 2])
    iy1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(ix1 - ix0, 0, None) * np.clip(iy1 - iy0, 0, None)
    area = lambda x: np.clip(x[:, 2] - x[:, 0], 0, None) * np.clip(x[:, 3] - x[:, 1], 0, None)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def centre_in(boxes: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """[len(boxes)] True where the box centre lies in some gt box (closed intervals)."""
    cx = (boxes[:, 0] + boxes[:, 2]) / 2
    cy = (boxes[:, 1] + boxes[:, 3]) / 2
    return ((cx[:, None] >= gt[None, :, 0]) & (cx[:, None] <= gt[None, :, 2])
            & (cy[:, None] >= gt[None, :, 1]) & (cy[:, None] <= gt[None, :, 3])).any(1)


def recall_chance(n: int, hits: int, k: int) -> float:
    """P(a uniformly random ranking of n regions puts one of the ``hits`` good ones in its top k)."""
    if hits <= 0:
        return 0.0
    if k >= n:
        return 1.0
    return 1.0 - math.comb(n - hits, k) / math.comb(n, k)


def phrase_outcome(score: np.ndarray, boxes: np.ndarray, gt: np.ndarray, iou_thr: float) -> dict:
    """Grounding of one phrase: score [R] per region, boxes [R, 4], gt [G, 4]. Hits and chances in 0/1."""
    order = np.argsort(-score, kind="stable")
    good = box_iou(boxes, gt).max(1) >= iou_thr
    inside = centre_in(boxes, gt)
    n = len(boxes)
    out = {"pointing_accuracy": float(inside[order[0]]), "pointing_accuracy_chance": float(inside.mean())}
    for k in (1, 5, 10):
        out[f"r{k}"] = float(good[order[:k]].any())
        out[f"r{k}_chance"] = recall_chance(n, int(good.sum()), k)
    return out


class EvalSet:
    """The phrases of one split with everything needed to ground them (loaded once, in memory:
    evaluation sets are small, Flickr30k Entities val/test = 1K images each)."""

    def __init__(self, images: list[dict], skipped: Counter, n_images_skipped: Counter):
        self.images, self.skipped, self.images_skipped = images, skipped, n_images_skipped

    @property
    def n_phrases(self) -> int:
        return sum(len(c["phrases"]) for im in self.images for c in im["captions"])


# ------------------------------------------------------------------------------------ texts
class TextWords:
    """Word features of arbitrary texts, computed as the negatives stage computes them: spaCy POS
    tags (``models.spacy``), words with the negatives artifact's feature tags (NOUN, ADJ and, with
    its ``include_propn``, PROPN), each the mean of its word pieces' last hidden states of
    ``models.word_encoder`` (the MLM's body when the artifact shared it). Results are cached per text."""

    def __init__(self, manifest, params: dict):
        self.manifest, self.params = manifest, params
        self._loaded = None
        self.cache: dict[str, np.ndarray] = {}

    def _load(self):
        if self._loaded is None:
            from pipeline.models.mlm import load_mlm, load_word_encoder
            from pipeline.models.spacy_tagger import Tagger
            from pipeline.negatives.core import MinerOptions

            m = self.manifest.models
            if m.word_encoder == m.mlm:
                lm = load_mlm(m.mlm)
                model, tok = lm.encoder, lm.tokenizer
            else:
                we = load_word_encoder(m.word_encoder)
                model, tok = we.model, we.tokenizer
            p = self.params
            opts = MinerOptions(noun_pos=tuple(p.get("noun_pos", ["NOUN"])),
                                feature_pos=tuple(p.get("feature_pos", ["NOUN", "ADJ"])),
                                include_propn=bool(p.get("include_propn", False)))
            model.eval()
            self._loaded = (Tagger(m.spacy), model, tok, opts.feature_tags(), int(p.get("max_tokens", 128)),
                            p.get("word_pool", "mean"))
        return self._loaded

    @torch.no_grad()
    def encode(self, texts: list[str]) -> list[np.ndarray]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if todo:
            from pipeline.negatives.core import _segment_pool

            tagger, model, tok, tags, max_tokens, pool = self._load()
            tagged = tagger.tag(todo)
            enc = tok(todo, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                      max_length=max_tokens, add_special_tokens=True, padding=True, return_tensors="pt")
            hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state.float()
            for i, (t, words) in enumerate(zip(todo, tagged)):
                fw = [w for w in words if w.pos in tags and any(ch.isalnum() for ch in w.text)]
                spans, _ = _align_one(enc, i, fw)
                rows, seg = [], []
                for j, sp in enumerate([s for s in spans if s is not None]):
                    rows.extend(range(sp[0], sp[1]))
                    seg.extend([j] * (sp[1] - sp[0]))
                if not rows:
                    self.cache[t] = np.zeros((0, hidden.shape[-1]), np.float32)
                    continue
                h = hidden[i, torch.as_tensor(rows)]
                self.cache[t] = _segment_pool(h, torch.as_tensor(seg), max(seg) + 1, pool).numpy()
        return [self.cache[t] for t in texts]


def _align_one(enc, i: int, words) -> tuple[list, bool]:
    """Token span [a, b) of each word in row ``i`` of a padded encoding (None when it did not fit)."""
    offs = enc["offset_mapping"][i].numpy().reshape(-1, 2)
    special = enc["special_tokens_mask"][i].numpy().astype(bool) | (enc["attention_mask"][i].numpy() == 0)
    content = (~special) & (offs[:, 1] > offs[:, 0])
    cs, ce = offs[:, 0], offs[:, 1]
    out = []
    for w in words:
        idx = np.nonzero(content & (cs < w.end) & (ce > w.start))[0]
        out.append(None if len(idx) == 0 or ce[idx[-1]] < w.end else (int(idx[0]), int(idx[-1]) + 1))
    return out, False


# ------------------------------------------------------------------------------------- the job
class InfoGroundJob(Job):
    NAME = "infoground"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        root = manifest.output
        self.neg_art = _artifact(root, cfg.negatives_artifact, "negatives", "negatives")
        self.reg_art = _artifact(root, cfg.regions_artifact, "regions", "regions")
        self.samples = _artifact(root, cfg.samples_artifact, "samples", "samples")
        self.regions = regions_reader(str(self.reg_art.dir))
        try:
            self.neg_shards = [str(p) for p in self.neg_art.files("shards")]
        except KeyError:
            raise ValueError(f"infoground: {self.neg_art.dir} has no feature shards (no caption had a noun or "
                             "adjective, or the stage did not finish)") from None
        self.d_r = int(self.regions.feature_dim)
        self.d_w = self._word_dim(self.neg_art)
        self.skips: Counter = Counter()
        self._check_ids()
        self.split = self._splits(self.samples)
        self._bpe = None
        self._bs = None
        self._eval_sets: dict = {}
        self._text = None
        if cfg.negatives == "contextual" and int(self.neg_art.manifest.get("negative_feature_k") or 0) == 0:
            raise ValueError(f"infoground: {self.neg_art.dir} has no in-context negative features "
                             "(negative_features: none); rerun negative-captions or set negatives: random|none")

    # ------------------------------------------------------------------ artifacts and checks
    @staticmethod
    def _word_dim(art: Artifact) -> int:
        d = art.manifest.get("feature_dim")
        if d:
            return int(d)
        for shard in art.files("shards"):
            for rec in iter_shard(shard, ("words.npy",)):
                if "words.npy" in rec:
                    return int(rec["words.npy"].shape[1])
        raise ValueError(f"infoground: {art.dir}: no word features in the negatives artifact")

    def _check_ids(self) -> None:
        """Negatives samples must (mostly) have regions: else the regions artifact is another dataset's."""
        neg_ids = np.unique(self.neg_art.read("words", ["sample_id"]).column("sample_id").to_numpy())
        if len(neg_ids) == 0:
            raise ValueError(f"infoground: {self.neg_art.dir}: the negatives artifact has no words (no caption had a "
                             "noun or adjective)")
        reg_ids = self.regions.sample_ids()
        have = np.isin(neg_ids, reg_ids)
        if have.mean() < 0.5:
            raise ValueError(f"infoground: only {int(have.sum())} of the {len(neg_ids)} samples of {self.neg_art.dir} "
                             f"have regions in {self.reg_art.dir}: the two artifacts come from different datasets "
                             f"(or runs); point regions_artifact/negatives_artifact at one run's output")
        self.skips["no_regions_entry"] = int((~have).sum())
        zero = [s for s in neg_ids[have] if self.regions.n_regions(int(s)) == 0]
        self.skips["zero_regions"] = len(zero)
        if self.skips["no_regions_entry"] or self.skips["zero_regions"]:
            print(f"infoground: skipping {self.skips['no_regions_entry']} samples without a regions entry and "
                  f"{self.skips['zero_regions']} with 0 regions", file=sys.stderr)

    @staticmethod
    def _splits(samples: Artifact) -> dict[int, str]:
        t = samples.read("samples", ["sample_id", "split"])
        return dict(zip(t.column("sample_id").to_pylist(), t.column("split").to_pylist()))

    def _keep_train(self, s: dict) -> bool:
        sid = int(s["sample_id"])
        return self.split.get(sid) in self.cfg.train_splits and (self.regions.n_regions(sid) or 0) > 0

    # ---------------------------------------------------------------------------- training
    def _stream(self) -> ShardStream:
        cfg = self.cfg
        joins = []
        if cfg.negatives == "random":
            joins.append(ParquetMultiJoin(self.neg_art, "words", ["word_index", "is_noun", "text", "caption_id"],
                                          prefix="w_", cache_files=4))
        collate = Collate(str(self.reg_art.dir), cfg.negatives, cfg.n_negatives, cfg.max_words_per_caption, cfg.max_regions)
        if joins:
            collate = _FilterCaption(collate)
        return ShardStream(self.neg_shards, read_captions, collate, self.batch_size, shuffle=True,
                           shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, drop_last=True, keep=self._keep_train,
                           joins=joins)

    @property
    def batch_size(self) -> int:
        if self._bs is None:
            self._bs = self.cfg.batch_size
            n = sum(1 for sh in self.neg_shards for s in read_captions(sh) if self._keep_train(s))
            if n == 0:
                raise ValueError(f"infoground: no training captions: no sample of splits {self.cfg.train_splits} in "
                                 f"{self.neg_art.dir} has word features and regions")
            if 2 <= n < self._bs:
                print(f"infoground: training split has {n} captions < batch_size {self._bs}; using batches of {n}",
                      file=sys.stderr)
                self._bs = n
        return self._bs

    def build_model(self) -> nn.Module:
        return InfoGroundModel(self.d_r, self.d_w, self.cfg.d, self.cfg.hidden_layers)

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self._stream().count_batches()
            if self.cfg.eval_every is None and self.cfg.eval_per_epoch and self._bpe > 0:
                self.cfg.eval_every = self._bpe  # evaluate (and select best.pt) once per epoch
        return self._bpe

    def batches(self, epoch: int, start: int):
        return loader(self._stream().set_position(epoch, start), self.cfg.num_workers)

    def loss(self, model, batch: dict):
        dev = self.device
        b = {k: v.to(dev) for k, v in batch.items()}
        loss, logs = infoground_loss(model, b, use_lang=self.cfg.negatives != "none")
        logs["captions"] = int(b["words"].shape[0])
        logs["images"] = int(b["sample_ids"].shape[0])
        return loss, logs

    # -------------------------------------------------------------------------- evaluation
    def _eval_root(self):
        return self.cfg.eval_output or self.manifest.output

    def _eval_arts(self):
        cfg = self.cfg
        if not cfg.eval_output:
            return self.neg_art, self.reg_art, self.samples, self.regions
        root = cfg.eval_output
        neg = _artifact(root, "negatives", "negatives", "negatives")
        reg = _artifact(root, "regions", "regions", "regions")
        smp = _artifact(root, "samples", "samples", "samples")
        rr = RegionsReader(reg)
        if rr.feature_dim != self.d_r or self._word_dim(neg) != self.d_w:
            raise ValueError(f"infoground: eval_output {root}: region/word widths {rr.feature_dim}/{self._word_dim(neg)} "
                             f"differ from the training artifacts' {self.d_r}/{self.d_w} (another detector or word encoder)")
        return neg, reg, smp, rr

    def eval_set(self, splits: list[str]) -> EvalSet:
        key = tuple(splits)
        if key in self._eval_sets:
            return self._eval_sets[key]
        neg, reg, smp, rr = self._eval_arts()
        split = self.split if not self.cfg.eval_output else self._splits(smp)
        sids = sorted(s for s, sp in split.items() if sp in splits)
        if self.cfg.eval_max_images:
            sids = sids[: self.cfg.eval_max_images]
        skipped: Counter = Counter()
        img_skipped: Counter = Counter()
        if "phrases" not in smp.tables():
            self._eval_sets[key] = EvalSet([], Counter({"no_phrases_table": 1}), img_skipped)
            return self._eval_sets[key]
        phrases = ParquetMultiJoin(smp, "phrases", ["caption_id", "start", "end", "text", "instance_ids"], cache_files=8)
        instances = ParquetMultiJoin(smp, "instances", ["instance_id", "box"], cache_files=8) \
            if "instances" in smp.tables() else None
        words = ParquetMultiJoin(neg, "words", ["caption_id", "word_index", "start", "end", "text"], cache_files=8)
        nreader = NegativesReader(neg.dir)
        images_tbl = smp.read("samples", ["sample_id", "image", "width", "height"]).to_pydict()
        from pipeline.loaders.samples import image_resolver

        resolve = image_resolver(smp.dir, self.manifest)  # samples.image is relative to the dataset root
        img_path = dict(zip(images_tbl["sample_id"], map(resolve, images_tbl["image"])))
        images = []
        for sid in sids:
            ph = phrases.lookup(sid)
            if not ph or not ph["caption_id"]:
                img_skipped["no_phrases"] += 1
                continue
            n_ph = len(ph["caption_id"])
            R = rr.n_regions(sid)
            if not R:
                skipped["no_regions" if R == 0 else "no_regions_entry"] += n_ph
                continue
            feats = nreader.get(sid)
            if feats is None:
                skipped["no_word_features"] += n_ph
                continue
            reg_s = rr.get(sid, ("boxes.npy", "features.npy", "image_size.npy"))
            inst = instances.lookup(sid) if instances is not None else None
            ibox = {int(i): np.asarray(b, np.float64) for i, b in zip(inst["instance_id"], inst["box"])} if inst else {}
            wt = words.lookup(sid) or {"caption_id": [], "word_index": [], "start": [], "end": [], "text": []}
            span = {(int(c), int(w)): (int(a), int(b), t) for c, w, a, b, t in
                    zip(wt["caption_id"], wt["word_index"], wt["start"], wt["end"], wt["text"])}
            caps = {}
            for cid, st, en, text, iids in zip(ph["caption_id"], ph["start"], ph["end"], ph["text"], ph["instance_ids"]):
                gt = [ibox[int(i)] for i in (iids or []) if int(i) in ibox]
                if not gt:
                    skipped["no_box"] += 1
                    continue
                rows = [r for r in np.nonzero(feats.word_caption_id == cid)[0]
                        if (int(cid), int(feats.word_index[r])) in span
                        and span[(int(cid), int(feats.word_index[r]))][0] >= st
                        and span[(int(cid), int(feats.word_index[r]))][1] <= en]
                if not rows:
                    skipped["no_word_features"] += 1
                    continue
                c = caps.setdefault(int(cid), {"caption_id": int(cid), "phrases": []})
                c["phrases"].append({"text": text, "rows": np.asarray(rows, np.int64), "gt": np.stack(gt)})
            # held-out L_lang check: each noun with stored negatives against them, in its context
            nouns = []
            row_of = {(int(c), int(w)): r for r, (c, w) in enumerate(zip(feats.word_caption_id, feats.word_index))}
            if feats.neg_features is not None:
                for j, (c, w, cnt) in enumerate(zip(feats.neg_caption_id, feats.neg_word_index, feats.neg_count)):
                    valid = np.asarray(feats.neg_valid[j][: int(cnt)], bool)
                    if cnt > 0 and valid.any() and (int(c), int(w)) in row_of:
                        nouns.append((row_of[(int(c), int(w))], feats.neg_features[j, : int(cnt)][valid].astype(np.float32)))
            if not caps:
                continue
            images.append({"nouns": nouns, "sample_id": sid, "boxes": reg_s["boxes"].astype(np.float64),
                           "features": reg_s["features"], "words": feats.word_features,  # float16 until used
                           "word_text": [span.get((int(c), int(w)), (0, 0, "?"))[2]
                                         for c, w in zip(feats.word_caption_id, feats.word_index)],
                           "word_caption": feats.word_caption_id, "captions": list(caps.values()),
                           "image": img_path.get(sid), "image_size": reg_s.get("image_size")})
        es = EvalSet(images, skipped, img_skipped)
        self._eval_sets[key] = es
        return es

    @torch.no_grad()
    def ground(self, model, es: EvalSet, heat_dir: Path | None = None) -> dict:
        """Grounding figures (percent) and their exact chance over the phrases of ``es``."""
        was = model.training
        model.eval()
        dev = self.device
        sums: dict[str, float] = {}
        n = n_nouns = 0
        heat_left = self.cfg.heatmaps if heat_dir is not None else 0
        for im in es.images:
            R = len(im["boxes"]) if self.cfg.max_regions is None else min(len(im["boxes"]), self.cfg.max_regions)
            rf = torch.from_numpy(im["features"][:R].astype(np.float32)).to(dev)[None]
            rmask = torch.ones(1, R, dtype=torch.bool, device=dev)
            k, v = model.regions(rf, rmask)
            w = torch.from_numpy(im["words"].astype(np.float32)).to(dev)
            q, vw = model.words(w, None)
            _, att = model.attention_all(q, vw, k, v, rmask)  # [W, 1, R]
            att = att[:, 0].cpu().numpy()
            boxes = im["boxes"][:R]
            for row, negs in im["nouns"]:
                x = torch.cat([w[row : row + 1], torch.from_numpy(negs).to(dev)])
                qn, vn = model.words(x, None)
                phi_n, _ = model.attention_all(qn, vn, k, v, rmask)
                phi_n = phi_n[:, 0]
                sums["noun_vs_negatives"] = sums.get("noun_vs_negatives", 0.0) + float(phi_n[0] > phi_n[1:].max())
                sums["noun_vs_negatives_chance"] = sums.get("noun_vs_negatives_chance", 0.0) + 1.0 / len(x)
                n_nouns += 1
            for cap in im["captions"]:
                for ph in cap["phrases"]:
                    score = att[ph["rows"]].max(0)
                    o = phrase_outcome(score, boxes, ph["gt"], self.cfg.iou_threshold)
                    for key, val in o.items():
                        sums[key] = sums.get(key, 0.0) + val
                    n += 1
                if heat_left > 0:
                    heat_left -= 1
                    try:
                        save_heatmap(heat_dir / f"heatmap_{im['sample_id']}_{cap['caption_id']}.png", im, cap, att, boxes)
                    except Exception as e:  # a figure must never fail an evaluation
                        print(f"infoground: heatmap of caption {cap['caption_id']} not saved: {e}", file=sys.stderr)
        model.train(was)
        out = {key: 100.0 * val / (n_nouns if key.startswith("noun_vs") else n) for key, val in sums.items()
               if (n_nouns if key.startswith("noun_vs") else n)}
        out["phrases"] = n
        out["nouns"] = n_nouns
        out["skipped"] = int(sum(es.skipped.values()))
        out["skip_reasons"] = dict(es.skipped)
        return out

    def evaluate(self, model, out_dir: Path) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        res: dict = {}
        report = {}
        for name, splits in (("val", self.cfg.val_splits), ("test", self.cfg.test_splits)):
            es = self.eval_set(splits)
            g = self.ground(model, es, out_dir if name == "test" else None)
            report[name] = {"splits": splits, **g}
            if g["phrases"] == 0:
                print(f"infoground: no scorable phrase in splits {splits} (skipped: {g['skip_reasons']})", file=sys.stderr)
            for key in (*GROUNDING_METRICS, "noun_vs_negatives"):
                if key in g:
                    res[f"{name}_{key}"] = g[key]
                    res[f"{name}_{key}_chance"] = g[f"{key}_chance"]
            res[f"{name}_phrases"] = g["phrases"]
            res[f"{name}_nouns"] = g["nouns"]
            res[f"{name}_skipped"] = g["skipped"]
        (out_dir / "grounding.json").write_text(json.dumps(report, indent=1))
        return res

    # ------------------------------------------------------------------ the harness interface
    def scorable_sample_ids(self):
        ids = self.regions.sample_ids()
        return np.asarray([s for s in ids if (self.regions.n_regions(int(s)) or 0) > 0], dtype=np.int64)

    @property
    def text_words(self) -> TextWords:
        if self._text is None:
            self._text = TextWords(self.manifest, self.neg_art.manifest.get("parameters", {}) or {})
        return self._text

    @torch.no_grad()
    def score_word_features(self, model, sample_ids, word_feats: list[np.ndarray], boxes=None) -> np.ndarray:
        """Mean over words of phi(R_I, w) for P pairs (sample_ids[p], word_feats[p] [W_p, d_w]); NaN
        where a text has no word or the image no region. ``boxes`` [P, 4] (NaN rows = none) keeps the
        regions whose centre lies in the box (all regions when none does)."""
        dev = self.device
        out = np.full(len(sample_ids), np.nan, dtype=np.float64)
        by_img: dict[int, list[int]] = {}
        for p, s in enumerate(sample_ids):
            if word_feats[p] is not None and len(word_feats[p]):
                by_img.setdefault(int(s), []).append(p)
        for sid, ps in by_img.items():
            r = self.regions.get(sid, ("boxes.npy", "features.npy"))
            if r is None or len(r["boxes"]) == 0:
                continue
            R = len(r["boxes"])
            k, v = model.regions(torch.from_numpy(r["features"].astype(np.float32)).to(dev)[None],
                                 torch.ones(1, R, dtype=torch.bool, device=dev))
            # every word of every pair of this image in one pass; a pair with a box gets its own region mask
            masks = np.ones((len(ps), R), bool)
            if boxes is not None:
                rb = r["boxes"].astype(np.float64)
                for i, p in enumerate(ps):
                    b = np.asarray(boxes[p], np.float64)
                    if not np.isnan(b).any():
                        inside = centre_in(rb, b[None])
                        if inside.any():
                            masks[i] = inside
            uniq, which = np.unique(masks, axis=0, return_inverse=True)
            which = np.asarray(which).reshape(-1)
            n_words = np.asarray([len(word_feats[p]) for p in ps])
            words = torch.from_numpy(np.concatenate([np.asarray(word_feats[p], np.float32) for p in ps])).to(dev)
            q, vw = model.words(words, None)
            k_u = k.expand(len(uniq), R, k.shape[-1])
            v_u = v.expand(len(uniq), R, v.shape[-1])
            phi, _ = model.attention_all(q, vw, k_u, v_u, torch.from_numpy(uniq).to(dev))  # [words, masks]
            col = torch.from_numpy(np.repeat(which, n_words)).to(dev)
            phi = phi.gather(1, col[:, None])[:, 0].double()
            seg = torch.from_numpy(np.repeat(np.arange(len(ps)), n_words)).to(dev)
            mean = torch.zeros(len(ps), dtype=torch.float64, device=dev).index_add_(0, seg, phi) / torch.from_numpy(
                n_words).to(dev)
            out[np.asarray(ps)] = mean.cpu().numpy()
        return out

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        feats = self.text_words.encode(list(texts))
        return self.score_word_features(model, sample_ids, feats, boxes)

    def job_metrics(self, model, out_dir: Path) -> list:
        from train.eval.interface import NoScorableItems, Row

        es = self.eval_set(self.cfg.test_splits)
        g = self.ground(model, es, Path(out_dir))
        bench = f"grounding:{Path(self._eval_root()).name}"
        if g["phrases"] == 0:
            raise NoScorableItems(f"{bench}: no scorable phrase in splits {self.cfg.test_splits} "
                                  f"(skipped by reason: {g['skip_reasons']})")
        names = {"r1": "R@1", "r5": "R@5", "r10": "R@10", "pointing_accuracy": "pointing accuracy"}
        subset = "+".join(self.cfg.test_splits)
        rows = [Row(bench, subset, names[k], g[k], g["phrases"], g[f"{k}_chance"],
                    skipped=g["skipped"], skip_reasons=g["skip_reasons"], unit="%",
                    note="phrase score = max attention over its noun/adjective words; chance: random region ranking")
                for k in GROUNDING_METRICS]
        if g.get("nouns"):
            rows.append(Row(bench, subset, "noun vs its negatives", g["noun_vs_negatives"], g["nouns"],
                            g["noun_vs_negatives_chance"], unit="%",
                            note="phi of the true noun above all its stored negatives in context (held-out L_lang); "
                                 "chance 1/(1+negatives) per noun"))
        return rows


class _FilterCaption:
    """Keep only the caption's own rows of a joined per-sample words table (random variant)."""

    def __init__(self, inner: Collate):
        self.inner = inner

    def __call__(self, samples: list[dict], rng: random.Random) -> dict:
        for s in samples:
            if "w_caption_id" in s:
                keep = [i for i, c in enumerate(s["w_caption_id"]) if int(c) == s["caption_id"]]
                for key in ("w_word_index", "w_is_noun", "w_text", "w_caption_id"):
                    s[key] = [s[key][i] for i in keep]
        return self.inner(samples, rng)


def save_heatmap(path: Path, im: dict, cap: dict, att: np.ndarray, boxes: np.ndarray) -> None:
    """The image (or a grey canvas of its size) with each phrase's attention painted over its boxes
    (sum of box indicators weighted by the phrase score) and the ground-truth boxes outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    W, H = (int(im["image_size"][0]), int(im["image_size"][1])) if im.get("image_size") is not None else (
        int(boxes[:, 2].max() + 1), int(boxes[:, 3].max() + 1))
    img = None
    if im.get("image") and "::" not in str(im["image"]):
        try:
            from PIL import Image

            img = np.asarray(Image.open(im["image"]).convert("RGB"))
        except Exception:
            img = None
    if img is None:
        img = np.full((H, W, 3), 200, np.uint8)
    ph = cap["phrases"][:4]
    fig, axes = plt.subplots(1, len(ph), figsize=(3.2 * len(ph), 3.4), squeeze=False)
    for ax, p in zip(axes[0], ph):
        score = att[p["rows"]].max(0)
        heat = np.zeros((H, W), np.float64)
        for s, b in zip(score, boxes):
            x0, y0, x1, y1 = [int(round(c)) for c in b]
            heat[max(0, y0):max(0, y1), max(0, x0):max(0, x1)] += s
        ax.imshow(img, extent=(0, W, H, 0))
        ax.imshow(heat, cmap="jet", alpha=0.5, extent=(0, W, H, 0), vmin=0, vmax=max(1e-9, heat.max()))
        for g in p["gt"]:
            ax.add_patch(plt.Rectangle((g[0], g[1]), g[2] - g[0], g[3] - g[1], fill=False, ec="lime", lw=2))
        top = boxes[int(np.argmax(score))]
        ax.add_patch(plt.Rectangle((top[0], top[1]), top[2] - top[0], top[3] - top[1], fill=False, ec="red", lw=1.5, ls="--"))
        ax.set_title(p["text"][:30], fontsize=8)
        ax.axis("off")
    fig.suptitle(f"sample {im['sample_id']} caption {cap['caption_id']} (green: truth, red: top region)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
