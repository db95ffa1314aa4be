"""InfoGround's training batches (Gupta et al. 2020, Sec. 2.3-2.4): caption items read from the
negatives artifact's shards, joined with their image's regions, collated into the layout that
:mod:`train.jobs.infoground.losses` documents.

A caption item carries its noun/adjective word features (L_img) and, per noun, the in-context
features of its negatives; the collate draws one noun per caption (L_lang), from the stream's
seeded ``rng`` so that a resumed epoch redraws the same nouns.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pipeline.loaders.regions import RegionsReader, collate_regions, iter_shard_mapped


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

    def __init__(self, regions_path: str, variant: str, n_neg: int, max_words: int | None, max_regions: int | None,
                 region_of: dict[int, int] | None = None):
        self.regions_path, self.variant, self.n_neg = regions_path, variant, n_neg
        self.max_words, self.max_regions = max_words, max_regions
        self.region_of = region_of or {}  # control: shuffled: whose regions each training image gets
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
        regs = collate_regions([self.reader.get(self.region_of.get(s, s), ("boxes.npy", "features.npy")) for s in sids],
                               self.max_regions)
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


def shuffled_regions(train_ids, seed: int) -> dict[int, int]:
    """``control: shuffled``: a fixed permutation of the training images' region sets with respect
    to their captions (image ``s`` is trained with the regions of image ``region_of[s]``), seeded
    by ``seed`` and drawn once before training."""
    ids = np.asarray(sorted(int(s) for s in train_ids), np.int64)
    perm = np.random.default_rng([int(seed), 777]).permutation(len(ids))
    return dict(zip(ids.tolist(), ids[perm].tolist()))


class FilterCaption:
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
