"""C3's side of the evaluation harness (train/eval/interface.py): s(I, T) for arbitrary texts.

Texts are encoded by the frozen text tower of ``models.clip`` (through :func:`pipeline.models.clip.load_clip`,
which must be the CLIP that encoded ``concept_tokens``) exactly as encode-concepts stores concepts;
s(I, T) = phi_MCP([z(I, T); z(I, T)]) (pairwise: phi_MCP(z(I, T))), and with ``objectives: mcc``
the cosine of the adapted cls embeddings. Cached features have no crops: the whole image is scored.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

CROP_NOTE = "c3 scores the whole image (cached features have no crops)"


class TextScorer:
    """``store``: the clip_tokens ImageStore; ``ct``: the concept encodings (their format and the
    CLIP weights they came from)."""

    def __init__(self, cfg, store, ct, manifest, device):
        self.cfg, self.store, self.ct, self.manifest, self.device = cfg, store, ct, manifest, device
        self._clip = None

    def _text_encoder(self):
        if self._clip is None:
            from pipeline.models.clip import load_clip

            model, _, tok, record = load_clip(self.manifest.models.clip)
            want = (self.ct.clip_record or {}).get("weights_sha256")
            if want and record.get("weights_sha256") != want:
                raise ValueError(f"models.clip ({self.manifest.models.clip}) is not the CLIP that encoded "
                                 f"{self.ct.art.dir}; score_pairs needs the same text tower")
            self._clip = (model, tok)
        return self._clip

    def encode_texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text tower for arbitrary texts, stored as concept_tokens would store them."""
        from pipeline.concepts.concept_tokens import encode_concepts

        model, tok = self._text_encoder()
        proj = bool(self.ct.art.manifest.get("parameters", {}).get("project_tokens", False))
        return encode_concepts(model, tok, texts, self.ct.max_tokens, 256, self.ct.pooled_only, proj)

    def score_pairs(self, model, sample_ids, texts, encoded: dict | None = None) -> np.ndarray:
        """s(I, T) for arbitrary texts (see the module docstring); ``encoded`` (tests, benchmarks):
        precomputed encodings of ``texts`` in encode_texts' format."""
        sids = np.asarray(sample_ids, np.int64)
        rows = self.store.index(sids)
        if (rows < 0).any():
            bad = int(sids[rows < 0][0])
            raise ValueError(f"c3.score_pairs: sample {bad} has no clip_tokens features")
        uniq, t_idx = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        enc = encoded if encoded is not None else self.encode_texts([str(t) for t in uniq])
        if encoded is not None:
            t_idx = np.arange(len(texts))
        dev = self.device
        out = np.zeros(len(sids), np.float64)
        ch = self.cfg.eval_chunk
        model.eval()
        with torch.no_grad():
            for s in range(0, len(sids), ch):
                r, ti = rows[s:s + ch], t_idx[s:s + ch]
                p, e = self.store.get(r)
                patches, embed = torch.from_numpy(p).to(dev), torch.from_numpy(e).to(dev)
                hI = model.image_cls(embed, patches)
                pooled = torch.from_numpy(enc["pooled"][ti]).to(dev)
                tok = msk = None
                if "tokens" in enc:
                    n = enc["n_tokens"][ti]
                    M = int(n.max())
                    tok = torch.from_numpy(enc["tokens"][ti, :M]).to(dev)
                    msk = torch.from_numpy(np.arange(M)[None] < n[:, None]).to(dev)
                hT = model.concept_cls(pooled, tok, msk)
                if self.cfg.objectives == "mcc":
                    out[s:s + ch] = F.cosine_similarity(hI, hT, dim=-1).cpu().numpy()
                    continue
                z = model.fuse(hI, patches, hT, tok, msk)
                lg = model.mcp_logit(z, z) if self.cfg.formulation == "triplet" else model.mcp_logit(z)
                out[s:s + ch] = lg.float().cpu().numpy()
        return out
