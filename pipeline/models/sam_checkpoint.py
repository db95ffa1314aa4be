"""A SAM checkpoint *folder*: the architecture in ``sam_config.json`` beside the weights ``sam.pth``.

segment-anything's registry (``sam_model_registry``, ``build_sam.py: _build_sam``) fixes the image size
(1024), patch (16), prompt width (256) and decoder sizes, and takes only the encoder's width, depth,
heads and global-attention blocks; a model of another size (the small SAM trained here by
``train run sam-segmenter``, 128 px) needs those numbers written down. :func:`build_sam` is
``_build_sam`` with every one of its constants read from the config instead (same classes, same
arguments, same order: ``Sam(ImageEncoderViT(...), PromptEncoder(...), MaskDecoder(TwoWayTransformer(...)))``,
``eval()``, then ``load_state_dict`` of ``torch.load`` of the weights file, strict), so a folder is loaded
exactly as the registry loads a released checkpoint. ``tiny-random`` (:mod:`pipeline.models.sam`) is
built by the same function.

Folder layout::

    sam_config.json   {"format": "segment-anything-folder", "architecture": {ARCH_KEYS...}}
    sam.pth           the state dict (torch.save), as the released sam_vit_*.pth
    training.json     what trained it (job, options, data, metrics; weights_state_sha256)

A folder whose config does not fit its weights is refused with one line naming the folder, the
first tensors that differ and the fix (:func:`load_sam_folder`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

CONFIG = "sam_config.json"
WEIGHTS = "sam.pth"
TRAINING = "training.json"
FORMAT = "segment-anything-folder"

# _build_sam's arguments and constants, by name (registry values in the comments)
ARCH_KEYS = {
    "img_size": int,                        # image_size = 1024
    "patch_size": int,                      # vit_patch_size = 16
    "encoder_embed_dim": int,               # 768 / 1024 / 1280
    "encoder_depth": int,                   # 12 / 24 / 32
    "encoder_num_heads": int,               # 12 / 16 / 16
    "encoder_global_attn_indexes": list,    # [2, 5, 8, 11] ...
    "window_size": int,                     # 14
    "prompt_embed_dim": int,                # 256
    "mask_in_chans": int,                   # 16
    "decoder_depth": int,                   # TwoWayTransformer depth = 2
    "decoder_mlp_dim": int,                 # 2048
    "decoder_num_heads": int,               # 8
    "iou_head_depth": int,                  # 3
    "iou_head_hidden_dim": int,             # 256
    "num_multimask_outputs": int,           # 3
    "pixel_mean": list,                     # [123.675, 116.28, 103.53]
    "pixel_std": list,                      # [58.395, 57.12, 57.375]
}
REGISTRY_PIXELS = {"pixel_mean": [123.675, 116.28, 103.53], "pixel_std": [58.395, 57.12, 57.375]}


def check_arch(arch: dict, where: str) -> dict:
    """``arch`` with exactly :data:`ARCH_KEYS`, each of its type; ValueError (one line) otherwise."""
    if not isinstance(arch, dict):
        raise ValueError(f"{where}: 'architecture' must be an object of {sorted(ARCH_KEYS)}")
    missing = sorted(set(ARCH_KEYS) - set(arch))
    extra = sorted(set(arch) - set(ARCH_KEYS))
    if missing or extra:
        raise ValueError(f"{where}: architecture keys missing {missing}, unknown {extra} (expected {sorted(ARCH_KEYS)})")
    for k, t in ARCH_KEYS.items():
        v = arch[k]
        if not isinstance(v, t) or isinstance(v, bool):
            raise ValueError(f"{where}: architecture.{k} = {v!r} is not a{'n' if t is int else ''} {t.__name__}")
    if arch["img_size"] % arch["patch_size"]:
        raise ValueError(f"{where}: img_size {arch['img_size']} is not a multiple of patch_size {arch['patch_size']}")
    return arch


def build_sam(arch: dict):
    """segment-anything's ``_build_sam`` with its constants from ``arch`` (:data:`ARCH_KEYS`); eval mode, weights
    as the classes initialise them."""
    from segment_anything.modeling import ImageEncoderViT, MaskDecoder, PromptEncoder, Sam, TwoWayTransformer

    a = arch
    grid = a["img_size"] // a["patch_size"]
    sam = Sam(
        image_encoder=ImageEncoderViT(
            depth=a["encoder_depth"],
            embed_dim=a["encoder_embed_dim"],
            img_size=a["img_size"],
            mlp_ratio=4,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
            num_heads=a["encoder_num_heads"],
            patch_size=a["patch_size"],
            qkv_bias=True,
            use_rel_pos=True,
            global_attn_indexes=list(a["encoder_global_attn_indexes"]),
            window_size=a["window_size"],
            out_chans=a["prompt_embed_dim"],
        ),
        prompt_encoder=PromptEncoder(
            embed_dim=a["prompt_embed_dim"],
            image_embedding_size=(grid, grid),
            input_image_size=(a["img_size"], a["img_size"]),
            mask_in_chans=a["mask_in_chans"],
        ),
        mask_decoder=MaskDecoder(
            num_multimask_outputs=a["num_multimask_outputs"],
            transformer=TwoWayTransformer(
                depth=a["decoder_depth"],
                embedding_dim=a["prompt_embed_dim"],
                mlp_dim=a["decoder_mlp_dim"],
                num_heads=a["decoder_num_heads"],
            ),
            transformer_dim=a["prompt_embed_dim"],
            iou_head_depth=a["iou_head_depth"],
            iou_head_hidden_dim=a["iou_head_hidden_dim"],
        ),
        pixel_mean=list(a["pixel_mean"]),
        pixel_std=list(a["pixel_std"]),
    )
    sam.eval()
    return sam


def is_sam_folder(spec) -> bool:
    """A ``models.sam`` spec naming a folder with ``sam_config.json`` (the form :func:`load_sam_folder` loads)."""
    if not isinstance(spec, str) or not spec.strip():
        return False
    p = Path(spec.strip()).expanduser()
    return p.is_dir() and (p / CONFIG).is_file()


def read_config(folder) -> dict:
    """The architecture of a SAM folder, checked (one-line ValueError naming the file)."""
    path = Path(folder) / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable SAM config ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise ValueError(f"{path}: 'format' is not {FORMAT!r}: not a SAM folder written by `train run sam-segmenter`")
    return check_arch(cfg.get("architecture"), str(path))


def _mismatch(sam, state: dict) -> list[str]:
    own = sam.state_dict()
    out = [f"{k}: weights {list(v.shape)} vs config {list(own[k].shape)}" for k, v in state.items()
           if k in own and tuple(v.shape) != tuple(own[k].shape)]
    out += [f"{k}: in the weights, not in the config's model" for k in state if k not in own]
    out += [f"{k}: in the config's model, not in the weights" for k in own if k not in state]
    return out


def load_sam_folder(folder):
    """(Sam in eval mode, its architecture, the training provenance dict or {}) of a SAM folder."""
    folder = Path(folder).expanduser()
    arch = read_config(folder)
    wfile = folder / WEIGHTS
    if not wfile.is_file():
        raise FileNotFoundError(f"{folder}: no {WEIGHTS} beside {CONFIG} (export the folder again: train run sam-segmenter)")
    sam = build_sam(arch)
    with open(wfile, "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    bad = _mismatch(sam, state)
    if bad:
        more = f" (and {len(bad) - 2} more)" if len(bad) > 2 else ""
        raise ValueError(f"{folder}: {CONFIG} does not match {WEIGHTS}: {'; '.join(bad[:2])}{more}; "
                         "export config and weights together (train run sam-segmenter)")
    sam.load_state_dict(state)
    try:
        training = json.loads((folder / TRAINING).read_text())
    except (OSError, ValueError):
        training = {}
    return sam, arch, training


def write_sam_folder(folder, sam, arch: dict, training: dict | None = None) -> None:
    """Write ``sam``'s state dict and ``arch`` (and ``training``) into ``folder`` (which exists)."""
    folder = Path(folder)
    check_arch(arch, "write_sam_folder")
    (folder / CONFIG).write_text(json.dumps({"format": FORMAT, "architecture": arch}, indent=1))
    torch.save({k: v.detach().cpu().contiguous() for k, v in sam.state_dict().items()}, folder / WEIGHTS)
    if training is not None:
        (folder / TRAINING).write_text(json.dumps(training, indent=1, default=str))
