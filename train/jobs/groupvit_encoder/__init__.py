"""`groupvit-encoder`: a small GroupViT trained here, contrastively from the training split's pixels and captions
(GroupViT's image-text objective, Xu et al. 2022), exported as the checkpoint folder ``models.groupvit`` points at.

The model is a plain :class:`transformers.GroupViTModel` (defaults: 64 px, 8 px patches -> 64 patch tokens, width
128, stages of 2 + 2 + 1 layers with 16 then 8 group tokens, so 8 final groups; a 3-layer text tower of width 128)
with CLIP's BPE tokenizer and a ``CLIPImageProcessor``; data, loss (``return_loss=True``), splits, control and the
retrieval / zero-shot rows are the clip-encoder job's (train/jobs/clip_encoder/).

Its own evaluation adds whether grouping emerged: on each held-out image the final groups' hard assignment of the
patches (``pipeline.models.groupvit.encode_groups``' ``assign``, argmax over groups, upsampled to the image) is
compared with the ground-truth instance masks: per instance the best IoU over the groups, averaged per image then
over images (``group_mask_iou``, a fraction, bootstrap interval over images). Beside it four no-learning partitions,
each a baseline row (``group_mask_iou_<name>``, ``baseline_for="held_out/group_mask_iou"``, per-image ``est``):
``one_group`` (the whole image as the only segment), ``random`` (each patch given to one of the K groups at random,
seeded), ``grid`` (a fixed grid of K blocks) and ``kmeans`` (k-means on the patches' mean colours); chance is the
larger of one group and random.

With ``multi_label: true`` the loss adds GroupViT's multi-label image-text contrastive term (Xu et al. 2022, Sec.
3.2): the nouns of each image's step caption (the generator's shape words, singular or plural: the captions' object
nouns) prompted as "a photo of a {noun}.", one prompt per distinct noun in the batch; an image's positives are the
prompts of its caption's nouns, a prompt's positives the images whose caption names it (``multi_label_loss``). It
trains the text tower on prompts close to the zero-shot shape probe's ("a {noun}"), so that probe is then not
zero-shot in the strict sense; the group-to-mask IoU is what it is for.

Export: ``<output>/encoders/groupvit/`` (model, processor, tokenizer: the text-groups job takes the tokenizer from
the folder), checked through ``pipeline.models.groupvit.load_groupvit`` + ``encode_groups`` (image embeddings,
cosine >= 0.9999).
"""

from __future__ import annotations

from pydantic import Field

from train.jobs.clip_encoder import Config as ClipEncoderConfig

NAME = "groupvit-encoder"
READS = ["samples"]
ENCODER = True


class Config(ClipEncoderConfig):
    EXPORT = "groupvit"  # <output>/encoders/groupvit (train/encoders.py: export_dir)
    vision_layers: int = Field(5, ge=3, description="sum of the three stages' depths (depths)")
    depths: list[int] = Field(default_factory=lambda: [2, 2, 1], description="layers per grouping stage")
    group_tokens: list[int] = Field(default_factory=lambda: [16, 8], description="group tokens of the first two stages")
    projection_intermediate_dim: int = Field(256, ge=4)
    multi_label: bool = Field(False, description="add GroupViT's multi-label image-text contrastive loss (Xu et al. 2022, "
                              "Sec. 3.2): each image against the prompts 'a photo of a {noun}.' of the shape nouns its "
                              "caption names, every noun in the batch one prompt")
    export_dir: str | None = Field(None, description="default <output>/encoders/groupvit (<output>/encoders/groupvit-shuffled "
                                   "for the control)")


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.groupvit_encoder.job import GroupViTEncoderJob

    return GroupViTEncoderJob(cfg, manifest, run_dir, device)


EXPORT = Config.EXPORT
