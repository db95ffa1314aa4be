"""GroupViT adapter: the frozen image encoder of the text-groups paper (Sec. 2.1.2, 4.1).

Specs for :func:`load_groupvit`: a Hugging Face id or folder (default ``nvidia/groupvit-gcc-yfcc``:
224 px, 16 px patches, 12 layers of width 384, grouping blocks with 64 then 8 groups),
``tiny-random`` (32 px, 8 px patches -> 16 patches, width 32, groups 8 then 4, projection 24) and
``base-random`` (the released model's shapes) with seeded random weights.

:func:`encode_groups` returns, per image:

* ``groups`` [K, d]: the final-stage group tokens (the vision encoder's output after its final
  LayerNorm; 8 x 384 for the released model);
* ``groups_projected`` [K, P]: each group mapped into the joint space by GroupViT's visual
  projection head (z_ik = Phi(g_ik), the paper's Sec. 2.2.1 projects groups, then averages);
* ``image_embed`` [P]: GroupViT's own image embedding (mean of groups, then projected;
  ``get_image_features``), for retrieval;
* ``assign`` [K, N]: the soft assignment of the N patches to the final groups, the product of the
  grouping blocks' soft attentions (softmax over groups, no Gumbel noise, no hard one-hot: the
  eval-mode maps GroupViT draws segmentations from); each column sums to 1. Reshape to the patch
  grid [K, h, w] (``grid``) and upsample to draw group maps.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipeline.models.clip import OPENAI_MEAN, OPENAI_STD, RANDOM_SEED, _seeded_init, offline_tokenizer
from pipeline.models.provenance import model_record, state_dict_hash, weights_hash

RANDOM_PRESETS = {
    "tiny-random": dict(
        vision=dict(
            hidden_size=32,
            intermediate_size=64,
            depths=[1, 1, 1],
            num_hidden_layers=3,
            num_group_tokens=[8, 4, 0],
            num_output_groups=[8, 4, 4],
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
        projection_dim=24,
        projection_intermediate_dim=48,
    ),
    "base-random": dict(vision={}, text={}, projection_dim=256, projection_intermediate_dim=4096),  # HF defaults = released shapes
}


def build_random_groupvit(preset: str = "tiny-random"):
    from transformers import CLIPImageProcessor, GroupViTConfig, GroupViTModel

    p = RANDOM_PRESETS[preset]
    tok = offline_tokenizer()
    text = dict(p["text"], vocab_size=len(tok), bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id)
    cfg = GroupViTConfig(
        text_config=text,
        vision_config=dict(p["vision"]),
        projection_dim=p["projection_dim"],
        projection_intermediate_dim=p["projection_intermediate_dim"],
    )
    model = _seeded_init(lambda: GroupViTModel(cfg))
    size = cfg.vision_config.image_size
    processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, image_mean=OPENAI_MEAN, image_std=OPENAI_STD
    )
    return model, processor


def load_groupvit(spec: str, device: str = "cpu"):
    """Return ``(model, image_processor, record)``; eval mode (BatchNorm in the head uses running stats)."""
    spec = spec.strip()
    if spec.lower() in RANDOM_PRESETS:
        model, processor = build_random_groupvit(spec.lower())
        record = model_record("groupvit", spec, random_weights=True, weights_sha256=state_dict_hash(model), seed=RANDOM_SEED)
    else:
        from transformers import AutoImageProcessor, GroupViTModel

        from pipeline.models.hf_folder import load_model, report_to_log

        model = load_model(GroupViTModel, spec)
        with report_to_log():
            processor = AutoImageProcessor.from_pretrained(spec)
        files = [p for p in Path(spec).iterdir() if p.suffix in (".safetensors", ".bin")] if os.path.isdir(spec) else []
        record = model_record("groupvit", spec, random_weights=False, weights_sha256=weights_hash(files) if files else state_dict_hash(model))
    model.eval().to(device)
    record.update(dims(model))
    return model, processor, record


def dims(model) -> dict:
    v = model.config.vision_config
    side = v.image_size // v.patch_size
    return {
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "grid": [side, side],
        "n_patches": side * side,
        "n_groups": int([g for g in v.num_output_groups if g][-1]),
        "group_dim": v.hidden_size,
        "projection_dim": model.config.projection_dim,
    }


def _project(model, x: torch.Tensor) -> torch.Tensor:
    """Visual projection head on [..., d] (its BatchNorm1d wants 2-D input)."""
    shape = x.shape
    return model.visual_projection(x.reshape(-1, shape[-1])).reshape(*shape[:-1], -1)


@torch.no_grad()
def encode_groups(model, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    out = model.vision_model(pixel_values=pixel_values.to(device), output_attentions=True, return_dict=True)
    groups = out.last_hidden_state  # [B, K, d], after the final LayerNorm
    assign = None
    for attn in out.attentions:  # per grouping block: [B, groups_out, tokens_in], softmax over groups
        a = attn.transpose(1, 2)  # [B, tokens_in, groups_out]
        assign = a if assign is None else assign @ a
    return {
        "groups": groups,
        "groups_projected": _project(model, groups),
        "image_embed": model.visual_projection(out.pooler_output),
        "assign": assign.transpose(1, 2),  # [B, K, N]
    }


def has_text_tower(spec: str | None) -> bool:
    """Whether ``models.groupvit`` names a GroupViT with a text tower (the scene-oracle instrument has none)."""
    return bool(spec) and str(spec).strip().lower() != "scene-oracle"


def text_tokenizer(spec: str):
    """The tokenizer of the GroupViT ``spec``'s text tower: the random presets' (built with
    :func:`pipeline.models.clip.offline_tokenizer`), else the folder's or hub id's own."""
    if spec.strip().lower() in RANDOM_PRESETS:
        return offline_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec)


@torch.no_grad()
def encode_texts(model, tokenizer, texts, chunk: int = 256):
    """float32 [T, P] GroupViT text embeddings (``get_text_features``: the text tower's pooled EOS
    output, projected; not normalised), at most the tower's ``max_position_embeddings`` tokens."""
    from pipeline.models.clip import tokenize

    dev = next(model.parameters()).device
    max_tokens = int(model.config.text_config.max_position_embeddings)
    out = []
    for s in range(0, len(texts), chunk):
        enc = tokenize(tokenizer, list(texts[s:s + chunk]), max_tokens)
        f = model.get_text_features(input_ids=enc["input_ids"].to(dev), attention_mask=enc["attention_mask"].to(dev))
        out.append((f if isinstance(f, torch.Tensor) else f.pooler_output).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, model.config.projection_dim)


# --- scene-oracle (a testbed instrument on the generated dataset; pipeline/models/scene_oracle.py) ---------------
ORACLE_GROUPS = 8  # K final groups, as the released GroupViT's second grouping stage


def oracle_dims(oracle, image_size: int) -> dict:
    """``dims`` of the scene-oracle's groups: K = 8, d = the oracle's object width, P its pooled width,
    the patch grid its ``grid`` (``patch_size`` = image side / grid)."""
    g = oracle.grid
    return {"image_size": int(image_size), "patch_size": int(image_size) // g, "grid": [g, g], "n_patches": g * g,
            "n_groups": ORACLE_GROUPS, "group_dim": oracle.d_v, "projection_dim": oracle.proj}


def oracle_projection(oracle):
    """The fixed linear map [d_v, P] standing for GroupViT's visual projection head (seeded)."""
    import numpy as np

    rng = np.random.default_rng([oracle.seed, 4242])
    return (rng.normal(size=(oracle.d_v, oracle.proj)) / np.sqrt(oracle.d_v)).astype(np.float32)


def oracle_groups(oracle, objects, width: float, height: float, sample_id: int, n_groups: int = ORACLE_GROUPS) -> dict:
    """GroupViT's four fields for one scene from its ground truth (the ``encode_groups`` schema, numpy).

    Groups: one per object (its vector, :meth:`SceneOracle.object_vectors`, with the sample's noise);
    with more objects than ``n_groups`` the two smallest (box area) are merged until they fit (vectors
    summed, cells united); the remaining groups are background: noise only, at the oracle's ``noise``
    scale. ``groups_projected`` = groups @ a fixed linear map; ``image_embed`` = the mean group through
    it (as ``get_image_features``). ``assign`` [K, N]: each patch-grid cell goes to the groups whose
    object box covers it (:meth:`SceneOracle.cells`), a cell no object covers to the background groups
    (to all groups when there is none), 5% spread uniformly, each column normalised to sum 1.
    """
    import numpy as np

    rng = oracle.sample_rng(sample_id)
    vecs = list(oracle.object_vectors(objects, rng)) if objects else []
    cells = [set(oracle.cells(o.box, width, height)) for o in objects]
    area = [max(0.0, (o.box[2] - o.box[0]) * (o.box[3] - o.box[1])) for o in objects]
    while len(vecs) > n_groups:  # merge the two smallest objects
        i, j = sorted(np.argsort(area, kind="stable")[:2].tolist())
        vecs[i], cells[i], area[i] = vecs[i] + vecs[j], cells[i] | cells[j], area[i] + area[j]
        del vecs[j], cells[j], area[j]
    n_obj = len(vecs)
    bg = oracle.noise * rng.normal(size=(n_groups - n_obj, oracle.d_v)).astype(np.float32) / np.sqrt(oracle.d_v)
    groups = np.concatenate([np.stack(vecs) if vecs else np.zeros((0, oracle.d_v), np.float32), bg]).astype(np.float32)
    N = oracle.grid * oracle.grid
    assign = np.zeros((n_groups, N), np.float32)
    for k, cs in enumerate(cells):
        assign[k, sorted(cs)] = 1.0
    empty = assign.sum(0) == 0
    assign[n_obj:, empty] = 1.0
    if n_obj == n_groups:
        assign[:, empty] = 1.0
    assign = assign / assign.sum(0, keepdims=True)
    assign = 0.95 * assign + 0.05 / n_groups
    W = oracle_projection(oracle)
    return {"groups": groups, "groups_projected": groups @ W, "image_embed": groups.mean(0) @ W, "assign": assign}
