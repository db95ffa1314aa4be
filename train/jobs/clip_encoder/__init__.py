"""`clip-encoder`: a small CLIP trained here, contrastively, from the pixels and captions of the training
split, and exported as a Hugging Face checkpoint folder that ``models.clip`` points at.

The model is a plain :class:`transformers.CLIPModel` (defaults: 64 px images, 8 px patches -> 64 patch
tokens, a 4-layer vision tower and a 3-layer text tower of width 128, projection 128; about 11M
parameters, 6.3M of them CLIP's 49,408-token embedding table) with CLIP's own BPE tokenizer (open_clip.get_tokenizer's
vocabulary and merges, train/jobs/text_groups/tokenizer.py) and a ``CLIPImageProcessor`` (resize +
centre crop to ``image_size``, OpenAI mean/std). Training: CLIP's symmetric InfoNCE loss with the learnt
temperature (``CLIPModel(..., return_loss=True)``), one caption per image per step drawn at random from its
captions, in the shared loop (AdamW, warmup + cosine, clipping, checkpoints, exact resume).
``hard_batches`` (default 0, CLIP's random batches) makes that share of each epoch's batches from images sorted by
their objects' colour sets, so that colour cannot tell them apart; ``hard_order: grouped`` keeps each colour set's
images together and the sets in random order, so that on a corpus of twin scenes (``corpus.twins``) each image meets
its twin, which differs only in its shapes. Sorted on the plain corpus it bought no shape; grouped on the twins corpus
(manifests/pixels-gt.yaml's setting) the CLIP's zero-shot shape rose above chance (docs/jobs/encoders.md, "Twin scenes").

Data: the ``samples`` artifact of ``pipeline run ingest`` (``samples_artifact``; manifests/pixels-gt.yaml: ``corpus/samples``,
the generated pretraining corpus apart from the testbed, ``pipeline run ingest --corpus``): images (decoded as the
image stages decode them) and captions of ``train_splits`` only. The held-out images (``eval_splits``) are never trained on.

Evaluation (each beside its chance level and a 95% interval; ``n`` images, ``skipped`` counted):

* held-out image -> caption R@1 over all the held-out captions (an image's query is right when its top
  caption is one of its own; chance its captions' share of the pool; Wilson interval over images) and
  caption -> image R@1 (chance 1 / images; bootstrap over images);
* zero-shot colour and shape: each held-out image scored against the prompts "a {colour} shape" (12
  colours) and "a {shape}" (10 shapes); right when the top prompt names a colour (shape) of one of its
  ground-truth objects (the samples' ``instances``); chance the mean share of prompts that are right;
* export exactness: the exported folder loaded through the pipeline's own adapter
  (:func:`pipeline.models.clip.load_clip`, ``encode_images`` / ``encode_texts``) reproduces the training-time
  model's pooled embeddings of the held-out images and captions (the minimum cosine is reported).

Export: after the final evaluation, ``save_pretrained`` of the model, image processor and tokenizer to
``<output>/encoders/clip/`` (``export_dir`` to choose; a control run: ``encoders/clip-shuffled``), with
``training.json`` (config, data, metrics). Plain ``CLIPModel.from_pretrained`` / ``AutoProcessor.from_pretrained``
load it; ``models.clip: "{output}/encoders/clip"`` puts it under every stage.

Control (``control: shuffled``): before training, each training image's captions are replaced, once, by
those of another training image (a seeded permutation); held-out retrieval must stay at chance.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "clip-encoder"
READS = ["samples"]
# a frozen-encoder job: it makes a stage input (models.*), so `train run all` (the jobs on the stages' artifacts)
# leaves it out; benchmarks/testbed.py runs it before the stages
ENCODER = True


class Config(TrainerConfig):
    EXPORT = "clip"  # <output>/encoders/clip (train/encoders.py: export_dir)
    max_steps: int | None = Field(600, ge=0, description="optimizer steps (600 of 64: ~46 passes over 840 images)")
    batch_size: int = Field(64, ge=2)
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_frac: float = Field(0.05, ge=0, le=1)
    threads: int | None = Field(1, ge=1, description="torch threads (1: reproducible, and kind to a shared CPU)")
    samples_artifact: str = Field("samples", description="the ingest artifact: images, captions, splits")
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    image_size: int = Field(64, ge=16, description="the processor's resize / crop side (the model's image_size)")
    patch_size: int = Field(8, ge=2)
    vision_width: int = Field(128, ge=8)
    vision_layers: int = Field(4, ge=1)
    text_width: int = Field(128, ge=8)
    text_layers: int = Field(3, ge=1)
    heads: int = Field(4, ge=1)
    mlp_ratio: int = Field(4, ge=1)
    projection_dim: int = Field(128, ge=4)
    max_text_tokens: int = Field(48, ge=8, description="captions truncated to this many tokens (SOT and EOT included), "
                                 "as extract-clip-tokens encodes them")
    export_dir: str | None = Field(None, description="default <output>/encoders/clip (<output>/encoders/clip-shuffled for "
                                   "the control)")
    hard_batches: float = Field(0.0, ge=0, le=1, description=(
        "share of each epoch's batches made of images sorted by their objects' colour sets (the samples' instances), "
        "so that colour cannot tell a batch's images apart and the contrastive loss rewards what else the captions "
        "name (shape); 0: CLIP's random batches (the paper's recipe). A departure from CLIP, documented in "
        "docs/jobs/encoders.md"))
    hard_order: Literal["sorted", "grouped"] = Field("sorted", description=(
        "how hard_batches orders its images: sorted = by colour set, so a batch holds neighbours in that order; "
        "grouped = the images of one colour set kept together, the sets in random order, so a batch holds a few "
        "images of each set and random sets otherwise (with the corpus's twins: each image beside its twin)"))
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: every training image's captions replaced, once, by another training image's")
    EVAL_ONLY = TrainerConfig.EVAL_ONLY | {"export_dir"}


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.clip_encoder.job import ClipEncoderJob

    return ClipEncoderJob(cfg, manifest, run_dir, device)


EXPORT = Config.EXPORT
