"""The frozen CLIP text tower for texts that are not in a ``clip_tokens`` artifact (benchmark
captions and negatives), encoded exactly as ``extract-clip-tokens`` stored the artifact's captions:
the same ``models.clip`` model, the artifact's ``max_text_tokens`` and ``project_tokens``, and the
artifact's float16 rounding. Shared by every job that scores arbitrary texts (concept-ot,
visual-tokens)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=2)
def _clip(spec: str):
    from pipeline.models.clip import load_clip

    model, _, tokenizer, _ = load_clip(spec)
    return model, tokenizer


def encode_texts_like_artifact(clip_spec: str, art_manifest: dict, texts: list[str], chunk: int = 128) -> dict:
    """``{"tokens": float [N, M, d_t], "mask": bool [N, M], "embed": float [N, P]}`` for ``texts``
    (M = the longest valid length), as the ``clip_tokens`` artifact whose ``_manifest.json`` is
    ``art_manifest`` stores them (text tokens, mask and pooled embedding, rounded to float16)."""
    from pipeline.models.clip import encode_texts

    model, tokenizer = _clip(clip_spec)
    params = art_manifest.get("parameters", {})
    max_tokens = int(params.get("max_text_tokens", 48))
    project = bool(params.get("project_tokens", False))
    toks, masks, embs = [], [], []
    with torch.no_grad():
        for s in range(0, len(texts), chunk):
            o = encode_texts(model, tokenizer, list(texts[s:s + chunk]), max_tokens, project)
            toks.append(o["text_tokens"].half().float())  # as stored in the artifact (fp16)
            masks.append(o["text_mask"].bool())
            embs.append(o["text_embed"].half().float())
    if not toks:
        raise ValueError("no texts to encode")
    M = max(t.shape[1] for t in toks)
    toks = [F.pad(t, (0, 0, 0, M - t.shape[1])) for t in toks]
    masks = [F.pad(m, (0, M - m.shape[1])) for m in masks]
    return {"tokens": torch.cat(toks), "mask": torch.cat(masks), "embed": torch.cat(embs)}
