"""visual-tokens' scores: the evaluation harness's interface (train/eval/interface.py).

Image embeddings come from the trained Visual Token Encoder over the joined samples (random access
through the shard indexes); texts not in the artifact go through the frozen CLIP text tower, encoded
as ``extract-clip-tokens`` stores captions, then the job's text head. s(I, x) is the cosine of the two
(boxes are ignored: ``crop_note``)."""

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

    def _text_embeddings(self, model, texts: list[str]) -> torch.Tensor:
        """Texts through the frozen CLIP text tower (as the artifact stores captions), then the head."""
        from pipeline.models import clip

        new = sorted({t for t in texts if t not in self._text_cache})
        if new:
            enc = clip.encode_texts_like_artifact(self.manifest.models.clip, self.ct.manifest, new)
            for i, t in enumerate(new):
                n = int(enc["mask"][i].sum())
                self._text_cache[t] = {"tokens": enc["tokens"][i, :n], "embed": enc["embed"][i]}
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

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        sids = np.asarray(sample_ids, dtype=np.int64)
        if len(sids) != len(texts):
            raise ValueError(f"score_pairs: {len(sids)} sample ids but {len(texts)} texts")
        bad = [int(s) for s in np.unique(sids) if int(s) not in self.usable]
        if bad:
            raise KeyError(f"sample {bad[0]} is not scorable by visual-tokens (not in both artifacts, or skipped)")
        uniq, inv = np.unique(sids, return_inverse=True)
        img = self.encode_images(model, [int(s) for s in uniq])
        tu, tinv = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        txt = self._text_embeddings(model, [str(t) for t in tu])
        return (img[inv] * txt[tinv]).sum(-1).double().numpy()

    def retrieval_scores(self, model, sample_ids, caption_ids, texts) -> dict:
        img = self.encode_images(model, [int(s) for s in sample_ids])
        txt = self._text_embeddings(model, list(texts))
        return {"score": (img @ txt.t()).double().numpy()}
