"""Each model slot's output shapes and forward FLOPs, without downloading or loading weights.

Where the architecture comes from, in order: the adapters' random presets (``tiny-random``,
``base-random``, ``random-bert-base``: the same configs the adapters build), a local folder or the
Hugging Face cache holding the model's ``config.json`` (read with ``local_files_only``), else
:data:`PUBLISHED`: the released checkpoints' configs, copied from each hub repository's
``config.json`` (cited per entry); ``open_clip:<arch>`` specs from open_clip's own config of the arch
(in the wheel, no download). ``scene-oracle`` (the testbed instrument) is asked for its own
dims; it runs no network (FLOPs 0). SAM's three released encoders are segment-anything's own
registry (``sam_model_registry``), built on the meta device.

FLOPs are counted by :class:`torch.utils.flop_counter.FlopCounterMode` over a forward pass of the
model built from its config on the ``meta`` device: every matmul and convolution at the real
shapes, no weights allocated, no arithmetic done (a multiply-add counts 2).
"""

from __future__ import annotations

import functools
import re

# Released checkpoints' architectures (the fields of each repository's config.json that fix the shapes).
PUBLISHED = {
    # https://huggingface.co/openai/clip-vit-base-patch16/blob/main/config.json
    "openai/clip-vit-base-patch16": dict(
        kind="clip", vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                 image_size=224, patch_size=16),
        text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                  max_position_embeddings=77, vocab_size=49408), projection_dim=512),
    # https://huggingface.co/openai/clip-vit-base-patch32/blob/main/config.json
    "openai/clip-vit-base-patch32": dict(
        kind="clip", vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                 image_size=224, patch_size=32),
        text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                  max_position_embeddings=77, vocab_size=49408), projection_dim=512),
    # https://huggingface.co/openai/clip-vit-large-patch14/blob/main/config.json
    "openai/clip-vit-large-patch14": dict(
        kind="clip", vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                 image_size=224, patch_size=14),
        text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  max_position_embeddings=77, vocab_size=49408), projection_dim=768),
    # https://huggingface.co/nvidia/groupvit-gcc-yfcc/blob/main/config.json (= GroupViTConfig's defaults:
    # 384-d, depths [6, 3, 3], 64 then 8 group tokens, 224 px / 16 px patches, projection 256)
    "nvidia/groupvit-gcc-yfcc": dict(kind="groupvit", vision={}, text={}, projection_dim=256, projection_intermediate_dim=4096),
    "nvidia/groupvit-gcc-redcaps": dict(kind="groupvit", vision={}, text={}, projection_dim=256, projection_intermediate_dim=4096),
    # https://huggingface.co/bert-base-uncased/blob/main/config.json
    "bert-base-uncased": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                              intermediate_size=3072, vocab_size=30522),
    "bert-large-uncased": dict(kind="bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                               intermediate_size=4096, vocab_size=30522),
}
# torchvision fasterrcnn_resnet50_fpn_v2: TwoMLPHead / FastRCNNConvFCHead representation size 1024
DETECTOR_FEATURE_DIM = 1024


class UnknownModel(ValueError):
    """A model whose architecture is neither on this machine nor in :data:`PUBLISHED`."""


def count_flops(fn) -> int:
    """FLOPs of ``fn()`` (a forward pass), counted by torch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _on_meta(build):
    import torch

    with torch.device("meta"):
        return build().eval()  # eval: GroupViT's hard assignment (no Gumbel sampling), no dropout


def _local_config(spec: str):
    """The transformers config of a local folder or a hub id in the local cache, else None."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except Exception:
        return None


def _is(spec: str, *names: str) -> bool:
    return spec.strip().lower() in names


def words(text: str) -> int:
    return len(re.findall(r"\S+", text))


# ------------------------------------------------------------------ CLIP
@functools.cache
def clip(spec: str) -> dict:
    """dims as extract-clip-tokens records them, ``flops_image``, ``flops_text`` (one caption of
    ``text_len`` tokens), ``text_len`` and ``tokenizer`` (a callable text -> token count incl.
    BOS/EOS, or None: words + 2)."""
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(spec):
        from pipeline.models.clip import load_clip

        rec = load_clip(spec)[3]
        return dict(_clip_dims(rec), flops_image=0, flops_text=0, text_len=0, tokenizer=None, source="scene-oracle instrument")
    from pipeline.models.open_clip_adapter import is_open_clip_spec

    if is_open_clip_spec(spec):
        return _open_clip(spec)
    import torch
    from transformers import CLIPConfig, CLIPModel

    from pipeline.models import clip as adapter

    tok, source = None, None
    if adapter.is_random_spec(spec):
        p = adapter.RANDOM_PRESETS[spec.strip().lower()]
        t = adapter.offline_tokenizer()
        cfg = CLIPConfig(text_config=dict(p["text"], vocab_size=len(t)), vision_config=dict(p["vision"]),
                         projection_dim=p["projection_dim"])
        tok, source = t, f"adapter preset {spec}"
    elif (cfg := _local_config(spec)) is not None:
        source = "config.json on this machine"
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except Exception:
            tok = None
    elif spec in PUBLISHED and PUBLISHED[spec]["kind"] == "clip":
        p = PUBLISHED[spec]
        cfg = CLIPConfig(text_config=dict(p["text"]), vision_config=dict(p["vision"]), projection_dim=p["projection_dim"])
        source = f"published config ({spec})"
    else:
        raise UnknownModel(f"models.clip {spec!r}: no config.json on this machine and not in the published table "
                           f"(pipeline/sizing/shapes.py); give a local folder")
    model = _on_meta(lambda: CLIPModel(cfg))
    v, t_cfg = cfg.vision_config, cfg.text_config
    px = torch.empty(1, 3, v.image_size, v.image_size, device="meta")
    flops_image = count_flops(lambda: model.get_image_features(pixel_values=px))
    n = (v.image_size // v.patch_size) ** 2
    rec = dict(image_size=v.image_size, patch_size=v.patch_size, n_patches=n, vision_dim=v.hidden_size,
               text_dim=t_cfg.hidden_size, projection_dim=cfg.projection_dim)
    text_len = 16
    ids = torch.zeros(1, text_len, dtype=torch.long, device="meta")
    flops_text = count_flops(lambda: model.get_text_features(input_ids=ids))
    counter = (lambda s: len(tok(s, truncation=False)["input_ids"])) if tok is not None else None
    return dict(rec, flops_image=flops_image, flops_text=flops_text, text_len=text_len, tokenizer=counter, source=source)


def _open_clip(spec: str) -> dict:
    """``open_clip:<arch>[/...]``: open_clip's own config of the arch (``get_model_config``, in the wheel),
    the model built on the meta device and run through the adapter (pipeline/models/open_clip_adapter.py)."""
    import open_clip
    import torch
    from open_clip.factory import get_model_config

    from pipeline.models.clip_bpe import fast_clip_tokenizer
    from pipeline.models.open_clip_adapter import OpenClip, parse_spec

    arch, _ = parse_spec(spec)
    cfg = get_model_config(arch)
    if cfg is None:
        raise UnknownModel(f"models.clip {spec!r}: open_clip has no arch {arch!r} (open_clip.list_models())")
    wrapped = OpenClip(_on_meta(lambda: open_clip.CLIP(**cfg)), arch)
    c = wrapped.config
    v = c.vision_config
    px = torch.empty(1, 3, v.image_size, v.image_size, device="meta")
    flops_image = count_flops(lambda: wrapped.encode_images(px))
    text_len = 16
    ids = torch.zeros(1, text_len, dtype=torch.long, device="meta")
    flops_text = count_flops(lambda: wrapped.encode_texts(ids, torch.ones_like(ids)))
    tok = fast_clip_tokenizer(arch)
    rec = dict(image_size=v.image_size, patch_size=v.patch_size, n_patches=(v.image_size // v.patch_size) ** 2,
               vision_dim=v.hidden_size, text_dim=c.text_config.hidden_size, projection_dim=c.projection_dim)
    return dict(rec, flops_image=flops_image, flops_text=flops_text, text_len=text_len,
                tokenizer=lambda s: len(tok(s, truncation=False)["input_ids"]), source=f"open_clip config ({arch})")


def _clip_dims(rec: dict) -> dict:
    return {k: rec[k] for k in ("image_size", "patch_size", "n_patches", "vision_dim", "text_dim", "projection_dim")}


def caption_tokens(shape: dict, text: str, cap: int) -> int:
    """Tokens extract-clip-tokens stores for one caption (BOS/EOS included, at most ``cap``)."""
    n = shape["tokenizer"](text) if shape.get("tokenizer") else words(text) + 2
    return min(int(n), cap)


# ------------------------------------------------------------------ GroupViT
@functools.cache
def groupvit(spec: str, image_size: int = 128) -> dict:
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(spec):
        from pipeline.models.groupvit import oracle_dims
        from pipeline.models.scene_oracle import SceneOracle

        d = oracle_dims(SceneOracle(), image_size)
        return dict(d, flops_image=0, source="scene-oracle instrument")
    import torch
    from transformers import GroupViTConfig, GroupViTModel

    from pipeline.models import groupvit as adapter

    if spec.strip().lower() in adapter.RANDOM_PRESETS:
        p, source = adapter.RANDOM_PRESETS[spec.strip().lower()], f"adapter preset {spec}"
        cfg = GroupViTConfig(text_config=dict(p["text"]), vision_config=dict(p["vision"]), projection_dim=p["projection_dim"],
                             projection_intermediate_dim=p["projection_intermediate_dim"])
    elif (cfg := _local_config(spec)) is not None:
        source = "config.json on this machine"
    elif spec in PUBLISHED and PUBLISHED[spec]["kind"] == "groupvit":
        p, source = PUBLISHED[spec], f"published config ({spec})"
        cfg = GroupViTConfig(projection_dim=p["projection_dim"], projection_intermediate_dim=p["projection_intermediate_dim"])
    else:
        raise UnknownModel(f"models.groupvit {spec!r}: no config.json here and not in the published table")
    model = _on_meta(lambda: GroupViTModel(cfg))
    v = cfg.vision_config
    px = torch.empty(1, 3, v.image_size, v.image_size, device="meta")
    flops = count_flops(lambda: model.get_image_features(pixel_values=px))
    side = v.image_size // v.patch_size
    return dict(n_patches=side * side, n_groups=int([g for g in v.num_output_groups if g][-1]), group_dim=v.hidden_size,
                projection_dim=cfg.projection_dim, flops_image=flops, source=source)


# ------------------------------------------------------------------ SAM
def _clip_pool(spec: str) -> dict | None:
    """A ``clip-pool:<CLIP>`` slot (pipeline/models/clip_grid.py) is that CLIP's vision tower: its shapes, else None."""
    from pipeline.models.clip_grid import clip_spec_of, is_clip_pool

    return clip(clip_spec_of(spec)) if is_clip_pool(spec) else None


@functools.cache
def sam(spec: str) -> dict:
    """``image_feature_dim`` (pooled global-attention blocks + neck, as pipeline.models.sam) and the
    image encoder's FLOPs per image (the automatic mask decoder's point grid is not counted)."""
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(spec):
        from pipeline.models.scene_oracle import SceneOracle

        o = SceneOracle()
        return dict(image_feature_dim=o.proj, flops_image=0, source="scene-oracle instrument")
    if (c := _clip_pool(spec)) is not None:
        return dict(image_feature_dim=c["projection_dim"], flops_image=c["flops_image"], image_size=c["image_size"],
                    source=f"clip-pool: {c['source']}")
    import torch

    from pipeline.models import sam as adapter

    if _is(spec, "tiny-random"):
        t = adapter.TINY
        build, size, layers = adapter.build_tiny_sam, t["img_size"], len(t["global_attn"])
        source = "adapter preset tiny-random"
    else:
        from segment_anything import sam_model_registry

        kind, _ = adapter.parse_spec(spec)
        kind = "vit_h" if kind == "default" else kind
        build, size, layers = sam_model_registry[kind], 1024, len(adapter.SAM_GLOBAL_ATTN[kind])
        source = f"segment-anything registry ({kind})"
    model = _on_meta(build)
    enc = model.image_encoder
    x = torch.empty(1, 3, size, size, device="meta")
    flops = count_flops(lambda: enc(x))
    width, neck = enc.pos_embed.shape[-1], enc.neck[0].out_channels
    return dict(image_feature_dim=layers * width + neck, flops_image=flops, image_size=size, source=source)


# ------------------------------------------------------------------ text models (MLM, word encoder)
@functools.cache
def text_model(spec: str) -> dict:
    """``hidden`` width and ``flops_token`` (FLOPs per token of a 32-token forward)."""
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(spec):
        from pipeline.models.scene_oracle import SceneOracle

        return dict(hidden=SceneOracle().d_t, flops_token=0, source="scene-oracle instrument")
    import torch
    from transformers import AutoModel, BertConfig

    from pipeline.models import mlm as adapter

    if adapter.is_random_spec(spec):
        dims = adapter.TINY_BERT if adapter.is_tiny_random(spec) else adapter.BERT_BASE
        cfg, source = BertConfig(vocab_size=30522, **dims), f"adapter preset {spec}"
    elif (path := adapter.package_model_path(spec)) is not None and (cfg := _local_config(str(path))) is not None:
        source = "packaged model's config.json"
    elif (cfg := _local_config(spec)) is not None:
        source = "config.json on this machine"
    elif spec in PUBLISHED and PUBLISHED[spec]["kind"] == "bert":
        cfg = BertConfig(**{k: v for k, v in PUBLISHED[spec].items() if k != "kind"})
        source = f"published config ({spec})"
    else:
        raise UnknownModel(f"text model {spec!r}: no config.json here and not in the published table")
    model = _on_meta(lambda: AutoModel.from_config(cfg))
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    flops = count_flops(lambda: model(input_ids=ids))
    return dict(hidden=cfg.hidden_size, flops_token=flops // 32, source=source)


# ------------------------------------------------------------------ detector
@functools.cache
def detector(spec: str) -> dict:
    """``feature_dim`` of the ROI features; FLOPs are not counted (a data-dependent proposal stage)."""
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(spec):
        from pipeline.models.scene_oracle import SceneOracle

        return dict(feature_dim=SceneOracle().d_v, flops_image=0, source="scene-oracle instrument")
    if (c := _clip_pool(spec)) is not None:
        return dict(feature_dim=c["projection_dim"], flops_image=c["flops_image"], source=f"clip-pool: {c['source']}")
    if _is(spec, "tiny-random"):
        from pipeline.models.detector import load_detector

        return dict(feature_dim=int(load_detector(spec).dim), flops_image=None, source="adapter tiny-random")
    flops = None
    try:  # backbone + FPN at 800 x 1067 (torchvision's COCO resize) and the box head over its 1000 test proposals
        import torch
        from torchvision.models import detection

        from pipeline.models.detector import parse_spec

        backend, arch, _ = parse_spec(spec)
        if backend == "torchvision":
            model = _on_meta(lambda: getattr(detection, arch)(weights=None, weights_backbone=None, num_classes=91))
            x = torch.empty(1, 3, 800, 1067, device="meta")
            rois = torch.empty(model.rpn._post_nms_top_n["testing"], 256, 7, 7, device="meta")
            flops = count_flops(lambda: model.backbone(x)) + count_flops(lambda: model.roi_heads.box_head(rois))
    except Exception:
        flops = None
    return dict(feature_dim=DETECTOR_FEATURE_DIM, flops_image=flops,
                source="torchvision box head (1024); FLOPs: backbone + FPN + box head, RPN and NMS not counted")
