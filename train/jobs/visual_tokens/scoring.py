"""visual-tokens' scores: the evaluation harness's interface (train/eval/interface.py).

Image embeddings come from the trained Visual Token Encoder over the joined samples (random access
through the shard indexes); texts not in the artifact go through the frozen CLIP text tower, encoded
as ``extract-clip-tokens`` stores captions, then the job's text head. s(I, x) is the cosine of the two
(boxes are ignored: ``crop_note``).

Its no-learning baselines (train/eval/interface.py): the frozen CLIP it reads, s0(I, x) = the cosine
of the ``clip_tokens`` artifact's pooled image embedding and the CLIP text embedding of x (stored for
the artifact's captions, encoded like them otherwise) -- the ``[frozen]`` rows of every pairwise
benchmark and the ``frozen`` retrieval protocol; and the text-only bar, the job's own text head
against one constant image embedding, the mean of its encoder's (L2-normalised) embeddings of the
evaluation split's images (a constant image: only the texts can order the pairs)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.loaders.visual_tokens import TRAIN_FIELDS
from train.jobs.visual_tokens.batches import TEXT_FIELDS, collate_batch


class VisualTokensScoring:
    """The scoring half of :class:`train.jobs.visual_tokens.job.VisualTokensJob` (it reads the job's
    ``vt_index``, ``join``, ``usable``, ``ct`` and ``_text_cache``)."""

    crop_note = "whole-image token set: the visual-token encoder has no box crop (boxes ignored)"

    def _load(self, sids, captions: bool) -> list[dict]:
        """Samples by id (random access through the shard indexes), as the stream yields them."""
        out = []
        for sid in sids:
            s = {"sample_id": int(sid)}
            if not self.vit:
                s.update({k: v for k, v in self.vt_index.read(int(sid), TRAIN_FIELDS).items() if k != "__key__"})
            ct_f = (TEXT_FIELDS if captions else ()) + (("patch_tokens",) if self.vit else ())
            if ct_f:
                s.update({k: v for k, v in self.join.index.read(int(sid), ct_f).items() if k not in ("__key__", "sample_id")})
            out.append(s)
        return out

    def encode_images(self, model, sids, chunk: int = 128) -> torch.Tensor:
        outs = []
        for a in range(0, len(sids), chunk):
            b = collate_batch(self._load(sids[a:a + chunk], captions=False), None, opts=self._opts())
            outs.append(model.encode_image(b, self.device).cpu())
        return torch.cat(outs) if outs else torch.zeros(0, self.cfg.embed_dim)

    def scorable_sample_ids(self):
        return np.array(sorted(self.usable), dtype=np.int64)

    def _encode_new(self, texts: list[str]) -> None:
        """Texts not yet cached through the frozen CLIP text tower, as the artifact stores captions."""
        from pipeline.models import clip

        new = sorted({t for t in texts if t not in self._text_cache})
        if new:
            enc = clip.encode_texts_like_artifact(self.manifest.models.clip, self.ct.manifest, new)
            for i, t in enumerate(new):
                n = int(enc["mask"][i].sum())
                self._text_cache[t] = {"tokens": enc["tokens"][i, :n], "embed": enc["embed"][i]}

    def _text_embeddings(self, model, texts: list[str]) -> torch.Tensor:
        """Texts through the frozen CLIP text tower (as the artifact stores captions), then the head."""
        self._encode_new(texts)
        items = [self._text_cache[t] for t in texts]
        M = max(int(x["tokens"].shape[0]) for x in items)
        toks = torch.zeros(len(items), M, items[0]["tokens"].shape[-1])
        mask = torch.zeros(len(items), M, dtype=torch.bool)
        for i, x in enumerate(items):
            toks[i, : x["tokens"].shape[0]] = x["tokens"]
            mask[i, : x["tokens"].shape[0]] = True
        emb = torch.stack([x["embed"] for x in items])
        if self.cfg.text == "pooled":
            return model.encode_text(None, None, emb, self.device).cpu()
        return model.encode_text(toks, mask, None, self.device).cpu()

    def _pairs(self, sample_ids, texts):
        sids = np.asarray(sample_ids, dtype=np.int64)
        if len(sids) != len(texts):
            raise ValueError(f"score_pairs: {len(sids)} sample ids but {len(texts)} texts")
        bad = [int(s) for s in np.unique(sids) if int(s) not in self.usable]
        if bad:
            raise KeyError(f"sample {bad[0]} is not scorable by visual-tokens (not in both artifacts, or skipped)")
        uniq, inv = np.unique(sids, return_inverse=True)
        tu, tinv = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        return [int(s) for s in uniq], inv, [str(t) for t in tu], tinv

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        uniq, inv, tu, tinv = self._pairs(sample_ids, texts)
        img = self.encode_images(model, uniq)
        txt = self._text_embeddings(model, tu)
        return (img[inv] * txt[tinv]).sum(-1).double().numpy()

    def retrieval_scores(self, model, sample_ids, caption_ids, texts) -> dict:
        img = self.encode_images(model, [int(s) for s in sample_ids])
        txt = self._text_embeddings(model, list(texts))
        fi = self.frozen_images([int(s) for s in sample_ids])
        ft = self.frozen_texts(list(texts))
        return {"score": (img @ txt.t()).double().numpy(), "frozen": (fi @ ft.t()).double().numpy()}

    # --- the no-learning baselines ---------------------------------------------------------------
    baseline_protocols = {"frozen": "score"}
    frozen_note = "the frozen CLIP the job reads: cos(clip_tokens image_embed, CLIP text embed)"
    text_only_note = ("text-only bar: the job's text head against one constant image, the mean embedding of "
                      "the eval split's images")

    def has_frozen_baseline(self) -> bool:
        return True

    def frozen_images(self, sids) -> torch.Tensor:
        """The frozen CLIP's pooled image embeddings (clip_tokens ``image_embed``), L2-normalised."""
        import torch.nn.functional as F

        if not sids:
            return torch.zeros(0, self.dims["d_pooled"])
        e = np.stack([np.asarray(self.join.index.read(int(s), ("image_embed",))["image_embed"], np.float32) for s in sids])
        return F.normalize(torch.from_numpy(e), dim=-1)

    def frozen_texts(self, texts: list[str]) -> torch.Tensor:
        """The frozen CLIP text embeddings of ``texts`` (encoded as the artifact stores captions), L2-normalised."""
        import torch.nn.functional as F

        self._encode_new(texts)
        return F.normalize(torch.stack([self._text_cache[t]["embed"].float() for t in texts]), dim=-1)

    def score_pairs_frozen(self, model, sample_ids, texts, boxes=None):
        uniq, inv, tu, tinv = self._pairs(sample_ids, texts)
        return (self.frozen_images(uniq)[inv] * self.frozen_texts(tu)[tinv]).sum(-1).double().numpy()

    def constant_image(self, model) -> torch.Tensor:
        """The text-only bar's image: the mean of the encoder's embeddings of the eval split's images
        (computed once per model state: parameters updated in place bump their ``_version``)."""
        key = (id(model), tuple(p._version for p in model.parameters()))
        if getattr(self, "_const", (None,))[0] != key:
            ids = self.eval_ids() or sorted(self.usable)
            self._const = (key, self.encode_images(model, ids).mean(0))
        return self._const[1]

    def score_pairs_text_only(self, model, sample_ids, texts, boxes=None):
        _, _, tu, tinv = self._pairs(sample_ids, texts)
        return (self._text_embeddings(model, tu)[tinv] @ self.constant_image(model)).double().numpy()
