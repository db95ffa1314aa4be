"""concept-ot's scores: the evaluation harness's interface (train/eval/interface.py) and the
encodings of the in-job evaluation.

``score_pairs`` = g + lambda_l * s_local (global-only: g), images by random access into the shards,
texts through the frozen CLIP text tower (cached per text); a box restricts the local score to the
patches it overlaps. ``retrieval_scores`` = ``global`` and the G.4 rerank per direction, with the
artifact's stored encodings for its own captions."""

from __future__ import annotations

import math

import numpy as np
import torch

from pipeline.loaders.clip_tokens import collate as ct_collate
from pipeline.loaders.clip_tokens import read_sample, read_shard
from train.eval.retrieval import two_stage_scores
from train.jobs.concept_ot.boxes import box_patch_mask
from train.jobs.concept_ot.model import ConceptOTModel, _normalize


class ConceptOTScoring:
    """The scoring half of :class:`train.jobs.concept_ot.job.ConceptOTJob` (it reads the sample
    table of :class:`train.jobs.concept_ot.batches.ConceptOTBatches`)."""

    TEXT_CACHE_BYTES = 256 * 2**20  # encoded benchmark texts kept (oldest evicted first)

    def scorable_sample_ids(self) -> np.ndarray:
        """Every sample id of the clip_tokens shards (any split: benchmarks choose their images)."""
        return self._table()["ids"].copy()

    def _read_images(self, sample_ids, fields=("patch_tokens", "image_embed")) -> dict[str, np.ndarray]:
        """Stacked arrays of ``sample_ids`` by random access into the shards (shard, position from
        the sample table)."""
        rows = self._rows(sample_ids)
        if (rows < 0).any():
            raise KeyError(f"sample_id {int(np.asarray(sample_ids)[rows < 0][0])} is not in {self.art.dir}")
        t = self._table()
        out: dict[str, list] = {f: [] for f in fields}
        for r in rows.tolist():
            s = read_sample(self.shards[int(t["shard"][r])], int(t["pos"][r]), fields=fields, lazy=self._lazy)
            for f in fields:
                out[f].append(np.asarray(s[f]))
        return {f: np.stack(v) if f in ("patch_tokens", "image_embed") else v for f, v in out.items()}

    def _texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text encodings (tokens, mask, embed) of ``texts``, padded, from a per-text cache
        (:meth:`_encode_texts` for the texts not seen yet)."""
        cache = self._text_cache
        new = [t for t in dict.fromkeys(texts) if t not in cache]
        got = {t: cache[t] for t in dict.fromkeys(texts) if t in cache}
        if new:
            enc = self._encode_texts(new)
            for k, t in enumerate(new):
                m = enc["mask"][k].bool()
                # float16: the encodings are rounded to it already (as the artifact stores them)
                got[t] = cache[t] = (enc["tokens"][k][m].half(), enc["embed"][k].half())
                self._text_cache_bytes += got[t][0].numel() * 2 + got[t][1].numel() * 2
            while self._text_cache_bytes > self.TEXT_CACHE_BYTES and len(cache) > len(got):
                old = next(iter(cache))  # oldest first (insertion order)
                if old in got:
                    cache[old] = cache.pop(old)  # in use: move to the end
                    continue
                tk, em = cache.pop(old)
                self._text_cache_bytes -= tk.numel() * 2 + em.numel() * 2
        toks = [got[t][0].float() for t in texts]
        return {"tokens": torch.nn.utils.rnn.pad_sequence(toks, batch_first=True),
                "mask": torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks],
                                                        batch_first=True),
                "embed": torch.stack([got[t][1].float() for t in texts])}

    def _box_views(self, sids: np.ndarray, boxes) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """(view of each pair [P], the patch indices of each view, None = all patches): the distinct
        (image, patch subset) combinations a chunk of pairs needs."""
        P = len(sids)
        keep: list = [None] * P
        if boxes is not None:
            b = np.asarray(boxes, np.float64).reshape(P, 4)
            has = np.isfinite(b).all(1)
            if has.any():
                side = int(round(math.sqrt(self.n_patches)))
                if side * side != self.n_patches:
                    raise ValueError(f"{self.art.dir}: {self.n_patches} patch tokens are not a square grid; cannot crop")
                wh = self._image_sizes(sids[has])
                masks = box_patch_mask(b[has], wh[:, 0], wh[:, 1], side)
                for p, m in zip(np.flatnonzero(has).tolist(), masks):
                    keep[p] = np.flatnonzero(m)
        key_of: dict = {}
        views: list = []
        view = np.empty(P, np.int64)
        for p in range(P):
            key = (int(sids[p]), None if keep[p] is None or len(keep[p]) == self.n_patches else keep[p].tobytes())
            if key not in key_of:
                key_of[key] = len(views)
                views.append((int(sids[p]), None if key[1] is None else keep[p]))
            view[p] = key_of[key]
        return view, views

    def _image_sizes(self, sids) -> np.ndarray:
        """[n, 2] (width, height) from the samples artifact."""
        import polars as pl

        if self.samples is None:
            raise ValueError(f"boxes need the samples artifact's image sizes ({self.cfg.samples_artifact} is missing)")
        u = np.unique(np.asarray(sids, np.int64))
        t = self.samples.scan("samples").select("sample_id", "width", "height").filter(
            pl.col("sample_id").is_in(u.tolist())).collect()
        wh = dict(zip(t["sample_id"].to_list(), zip(t["width"].to_list(), t["height"].to_list())))
        out = np.empty((len(sids), 2), np.float64)
        for k, s in enumerate(np.asarray(sids).tolist()):
            w, h = wh.get(int(s), (None, None))
            if not w or not h:
                raise ValueError(f"sample {s}: no width/height in {self.samples.dir}; cannot map its box to patches")
            out[k] = (w, h)
        return out

    @torch.no_grad()
    def score_pairs(self, model: ConceptOTModel, sample_ids, texts, boxes=None, local: bool = True) -> np.ndarray:
        """s(I, x) = g + lambda_local * s_local (global-only: g), as the SugarCrepe evaluation and the
        G.4 rerank score. g: cosine of the frozen pooled CLIP embeddings; texts are encoded by the frozen
        CLIP text tower (``models.clip``, cached per text); image features are read by random access.
        ``boxes`` [P, 4] (NaN rows: no box): the local score uses only the patch tokens overlapping the
        box (masses renormalised over them); the global term stays the whole image's pooled embedding
        (the artifact holds no crop embedding), which ``crop_note`` records. ``local=False``: g alone
        (the in-job ``sugarcrepe_global/*`` figures)."""
        sids = np.asarray(sample_ids, np.int64).reshape(-1)
        texts = list(texts)
        P = len(sids)
        out = np.empty(P, np.float64)
        if P == 0:
            return out
        if len(texts) != P:
            raise ValueError(f"score_pairs: {P} sample ids but {len(texts)} texts")
        if boxes is not None and np.isfinite(np.asarray(boxes, np.float64)).all(1).any():
            self.crop_note = ("global-only: boxes ignored (pooled whole-image embedding)" if self.cfg.variant == "global-only"
                              else "local score over the patches overlapping the box; global term of the whole image")
        dev, lam = self.device, self.cfg.lambda_local
        chunk = self.cfg.eval_pairs_chunk
        for s in range(0, P, chunk):
            e = min(P, s + chunk)
            cs, ct = sids[s:e], texts[s:e]
            u_sid, inv_i = np.unique(cs, return_inverse=True)
            u_txt = list(dict.fromkeys(ct))
            t_of = {t: k for k, t in enumerate(u_txt)}
            inv_t = torch.tensor([t_of[t] for t in ct])
            arr = self._read_images(u_sid)
            tok = self._texts(u_txt)
            ie = _normalize(torch.from_numpy(arr["image_embed"]).float())
            te = _normalize(tok["embed"].float())
            g = (ie[torch.from_numpy(inv_i)] * te[inv_t]).sum(-1).double()
            if self.cfg.variant == "global-only" or not local:
                out[s:e] = g.numpy()
                continue
            txt = model.text_features(tok["tokens"].to(dev), tok["mask"].to(dev))
            view, views = self._box_views(cs, None if boxes is None else np.asarray(boxes)[s:e])
            loc = torch.empty(e - s, dtype=torch.float64)
            patches = torch.from_numpy(arr["patch_tokens"])
            row_of = {int(x): k for k, x in enumerate(u_sid.tolist())}
            by_size: dict[int, list[int]] = {}
            for v, (sid, keep) in enumerate(views):
                by_size.setdefault(self.n_patches if keep is None else len(keep), []).append(v)
            for n, vs in by_size.items():
                feats = torch.stack([patches[row_of[views[v][0]]] if views[v][1] is None
                                     else patches[row_of[views[v][0]]][torch.from_numpy(views[v][1])] for v in vs])
                img = model.image_features(feats.to(dev))
                local_of = {v: k for k, v in enumerate(vs)}
                ps = np.flatnonzero(np.isin(view, vs))
                ii = torch.tensor([local_of[int(view[p])] for p in ps], device=dev)
                loc[torch.from_numpy(ps)] = model.score_pairs(img, txt, ii, inv_t[ps].to(dev)).double().cpu()
            out[s:e] = (g + lam * loc).numpy()
        return out

    def _stored_texts(self, caption_ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{caption_id: (tokens [m, d], embed)} for the ids the clip_tokens artifact holds (its frozen
        encodings, as training saw them), read from their images' samples."""
        import polars as pl

        cids = np.unique(np.asarray(caption_ids, np.int64))
        cids = cids[cids >= 0]
        if not cids.size or "captions" not in self.art.tables():
            return {}
        own = self.art.scan("captions").select("caption_id", "sample_id").filter(
            pl.col("caption_id").is_in(cids.tolist())).collect()
        owners = np.unique(own["sample_id"].to_numpy())
        owners = owners[self._rows(owners) >= 0]
        out = {}
        if not owners.size:
            return out
        arr = self._read_images(owners, fields=("text_tokens", "text_mask", "text_embed", "caption_ids"))
        want = set(cids.tolist())
        for tk, mk, em, ci in zip(arr["text_tokens"], arr["text_mask"], arr["text_embed"], arr["caption_ids"]):
            for j, c in enumerate(np.asarray(ci).tolist()):
                if c in want:
                    m = np.asarray(mk[j], bool)
                    out[int(c)] = (torch.from_numpy(np.array(tk[j])[m]).float(), torch.from_numpy(np.array(em[j])).float())
        return out

    # the harness's no-learning baselines: the frozen global cosine g, on every pairwise benchmark and as
    # the ``global`` retrieval protocol beside the learnt ``rerank`` (pipeline.report.significance)
    baseline_protocols = {"global": "rerank"}

    def has_frozen_baseline(self) -> bool:
        return self.cfg.variant != "global-only"  # global-only's score is g itself

    def score_pairs_frozen(self, model: ConceptOTModel, sample_ids, texts, boxes=None) -> np.ndarray:
        """g alone (the frozen pooled CLIP cosine): what concept-ot scores without its trained local term."""
        return self.score_pairs(model, sample_ids, texts, boxes, local=False)

    @torch.no_grad()
    def retrieval_scores(self, model: ConceptOTModel, sample_ids, caption_ids, texts) -> dict:
        """ConceptOT G.4: ``global`` = g [I, T]; the two-stage protocol (global top-``rerank_top_k``
        candidates per query, reranked by g + lambda_local * s_local, the rest below them in g order)
        ranks each direction over its own candidates, so it is returned per direction:
        ``rerank/i2t`` (read along rows) and ``rerank/t2i`` (read along columns), both [I, T].
        Captions the artifact holds use their stored (frozen) encodings; others are encoded."""
        sids = np.asarray(sample_ids, np.int64).reshape(-1)
        cids = np.asarray(caption_ids, np.int64).reshape(-1)
        texts = list(texts)
        stored = self._stored_texts(cids)
        miss = [t for c, t in zip(cids.tolist(), texts) if c not in stored]
        enc = self._texts(miss) if miss else None
        enc_of = {t: k for k, t in enumerate(miss)}
        toks, embs = [], []
        for c, t in zip(cids.tolist(), texts):
            if c in stored:
                toks.append(stored[c][0])
                embs.append(stored[c][1])
            else:
                k = enc_of[t]
                toks.append(enc["tokens"][k][enc["mask"][k]])
                embs.append(enc["embed"][k])
        arr = self._read_images(sids)
        ie = _normalize(torch.from_numpy(arr["image_embed"]).float())
        te = _normalize(torch.stack(embs).float())
        g = ie @ te.t()
        res = {"global": g.double().numpy()}
        if self.cfg.variant == "global-only":
            return res
        dev = self.device
        pt = torch.from_numpy(arr["patch_tokens"])  # image features in chunks: no float32 copy of all patches
        img = _cat_feats([model.image_features(pt[s:s + 64].to(dev)) for s in range(0, len(pt), 64)])
        tt = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True)
        mm = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks], batch_first=True)
        txt = model.text_features(tt.to(dev), mm.to(dev))

        def local(qi, ti):
            return model.score_pairs(img, txt, qi.to(dev), ti.to(dev)).cpu()

        s_i2t, s_t2i = two_stage_scores(g, local, self.cfg.lambda_local, self.cfg.rerank_top_k, self.cfg.eval_pairs_chunk)
        res["rerank/i2t"] = s_i2t.numpy()
        res["rerank/t2i"] = s_t2i.t().contiguous().numpy()
        return res

    def _load_images(self, sids: list[int]) -> list[dict]:
        want = set(sids)
        out = []
        tab = None
        if "images" in self.art.tables():
            import polars as pl

            tab = self.art.scan("images").select("sample_id", "shard").filter(pl.col("sample_id").is_in(sorted(want))).collect()
        shards = sorted(set(tab["shard"].to_list())) if tab is not None and tab.height else None
        paths = [str(self.art.local_file(s)) for s in shards] if shards else self.shards  # each checked (sha256)
        for p in paths:
            for s in read_shard(p, fields=("patch_tokens", "image_embed", "caption_ids")):
                if s["sample_id"] in want:
                    out.append({"sample_id": s["sample_id"], "patch_tokens": np.array(s["patch_tokens"]),
                                "image_embed": np.array(s["image_embed"])})
        return out

    def _encode_texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text tower (models.clip) for texts that are not in the artifact, encoded as
        the artifact stores its captions (:func:`pipeline.models.clip.encode_texts_like_artifact`)."""
        from pipeline.models import clip

        return clip.encode_texts_like_artifact(self.manifest.models.clip, self.art.manifest, list(texts))

    # --- the in-job evaluation's encodings (retrieval on the eval splits, heatmaps) -------------
    def _eval_samples(self) -> list[dict]:
        out = []
        for p in self.shards:
            for s in read_shard(p, fields=None):
                if s["caption_ids"].shape[0] == 0 or self.split_of(s["sample_id"]) not in self.cfg.eval_splits:
                    continue
                out.append(s)
                if len(out) >= self.cfg.eval_max_images:
                    return out
        return out

    def _encode_eval(self, model, samples: list[dict], chunk: int = 64) -> dict:
        dev = self.device
        ie, te, cap_img, cap_ids, imgs, txts = [], [], [], [], [], []
        for s in range(0, len(samples), chunk):
            b = ct_collate(samples[s:s + chunk], "all")
            ie.append(_normalize(b["image_embed"].float()))
            te.append(_normalize(b["text_embed"].float()))
            cap_img.append(b["caption_sample"] + s)
            cap_ids.append(b["caption_id"])
            imgs.append(model.image_features(b["patch_tokens"].to(dev)))
            txts.append(model.text_features(b["text_tokens"].to(dev), b["text_mask"].to(dev)))
        return {"ie": torch.cat(ie), "te": torch.cat(te), "cap_img": torch.cat(cap_img), "caption_id": torch.cat(cap_ids),
                "img": _cat_feats(imgs), "txt": _cat_feats(txts, pad_dim=1)}


def _cat_feats(parts: list[dict], pad_dim: int | None = None) -> dict:
    if not parts or not parts[0]:
        return {}
    out = {}
    for k in parts[0]:
        ts = [p[k] for p in parts]
        if pad_dim is not None and ts[0].dim() > 1:
            L = max(t.shape[pad_dim] for t in ts)
            padded = []
            for t in ts:
                shape = list(t.shape)
                shape[pad_dim] = L
                z = torch.zeros(shape, dtype=t.dtype, device=t.device)
                z.narrow(pad_dim, 0, t.shape[pad_dim]).copy_(t)
                padded.append(z)
            ts = padded
        out[k] = torch.cat(ts)
    return out
