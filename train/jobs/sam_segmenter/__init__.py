"""`sam-segmenter`: a small Segment Anything trained here, with the ``segment-anything`` package's own classes,
on the pretraining corpus's training images, exported as a SAM folder that ``models.sam`` loads.

Model: ``segment_anything.modeling.Sam`` built by :func:`pipeline.models.sam_checkpoint.build_sam` (the
registry's ``_build_sam`` with its sizes as options): an ``ImageEncoderViT`` of ``img_size`` 128 (the corpus's
128 px images, no resize), patch 8 (a 16 x 16 grid: the decoder's masks are 64 x 64, upscaled to 128; patch 16
would give 8 x 8 cells, coarser than the corpus's small objects), width 64, 4 blocks (windowed attention of
4 x 4 cells, global at blocks 1 and 3, as the released models alternate), 4 heads; ``PromptEncoder`` and
``MaskDecoder`` (``TwoWayTransformer`` depth 2) at width 64. About 0.47M parameters: one step of 4 images
with their prompts and rounds takes about 0.6 CPU-seconds on one thread (docs/jobs/sam-segmenter.md).

Training (SAM's recipe, Kirillov et al. 2023, App. A; each departure an option, docs/jobs/sam-segmenter.md):
per image up to ``max_masks`` ground-truth instances; each mask's first prompt a foreground point or a noisy
box (``box_prob``), then ``point_rounds`` rounds each adding a point from the previous prediction's error
region (foreground in a false negative, background in a false positive), the previous low-res logits fed
back as the mask prompt (``mask_prompt``), then ``mask_only_rounds`` rounds with no new point (SAM: 8
point rounds and 2 mask-only rounds; here 1 and 0 by default, for the CPU budget). A single-point prompt
gets the three multimask outputs and only the one of least loss is trained (SAM's ambiguity handling);
every other prompt the single output. Loss per mask: ``focal_weight`` focal + ``dice_weight`` dice (20 : 1)
+ ``iou_weight`` times the IoU head's squared error (all outputs' IoU predictions), averaged over masks
and rounds. AdamW, warmup + cosine, in the shared loop.

Data: the ``samples`` artifact at ``samples_artifact`` (manifests: ``corpus/samples``, ``pipeline run ingest
--corpus``), images and their ``instances`` masks of ``train_splits`` only; never a testbed image.

Evaluation (final): the export loaded through :class:`pipeline.models.sam.SamModel` (the stage's loader) and
run through its automatic mask generator (``SamModel.generate``, the options of the manifest's
``stages.extract_visual_tokens``, the path ``segmenter: sam`` runs) on ``eval_images`` held-out images
(``eval_splits``); mask recall at IoU 0.5 and mean best IoU against the ground-truth instances, 95% intervals
clustered by image, beside the connected-components baseline (train/jobs/sam_segmenter/masks_eval.py).

Export: ``<output>/encoders/sam/`` (``export_dir``): ``sam_config.json`` (architecture), ``sam.pth`` (weights),
``training.json`` (provenance). ``models.sam: "{output}/encoders/sam"``.
"""

from __future__ import annotations

from pydantic import Field

from train.config import TrainerConfig

NAME = "sam-segmenter"
READS = ["samples"]
ENCODER = True  # makes a stage input (models.sam): not one of `train run all`'s jobs


class Config(TrainerConfig):
    EXPORT = "sam"  # <output>/encoders/sam (train/encoders.py: export_dir)
    max_steps: int | None = Field(300, ge=0, description="optimizer steps (300 of 4 images: 1200 of the 3200 training images; the budget of a shared 2-core machine)")
    batch_size: int = Field(4, ge=2, description="images per step (each with up to max_masks prompted masks)")
    lr: float = Field(2e-3, gt=0, description="SAM: 8e-4 at batch 256 for a ViT-H; a small model from scratch here")
    weight_decay: float = Field(0.1, ge=0, description="SAM: 0.1")
    warmup_frac: float = Field(0.05, ge=0, le=1)
    threads: int | None = Field(1, ge=1, description="torch threads (1: reproducible, and kind to a shared CPU)")
    benchmarks_at_end: bool = Field(False, description="no image-text benchmarks: a segmenter is measured by its masks")
    samples_artifact: str = Field("samples", description="the ingest artifact with images, splits and instances")
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    # architecture (pipeline/models/sam_checkpoint.py ARCH_KEYS; the rest are the registry's constants)
    img_size: int = Field(128, ge=16, description="ImageEncoderViT img_size (the corpus's images are 128 px)")
    patch_size: int = Field(8, ge=2)
    encoder_width: int = Field(64, ge=8)
    encoder_depth: int = Field(4, ge=1)
    encoder_heads: int = Field(4, ge=1)
    global_attn: list[int] = Field([1, 3], description="blocks with global attention; the others windowed")
    window_size: int = Field(4, ge=1, description="windowed attention's window, in patches")
    prompt_dim: int = Field(64, ge=8, description="prompt encoder / mask decoder width (registry: 256)")
    decoder_mlp_dim: int = Field(256, ge=8, description="TwoWayTransformer MLP width (registry: 2048)")
    decoder_heads: int = Field(4, ge=1, description="registry: 8")
    mask_in_chans: int = Field(16, ge=1, description="registry: 16")
    iou_head_hidden_dim: int = Field(64, ge=8, description="registry: 256")
    # SAM's training recipe
    max_masks: int = Field(4, ge=1, description="prompted masks per image (SAM: up to 64 per GPU image)")
    box_prob: float = Field(0.5, ge=0, le=1, description="first prompt a box with this probability, else a point")
    box_noise_frac: float = Field(0.1, ge=0, description="box noise std as a fraction of the side (SAM: 10%)")
    box_noise_max: float = Field(2.5, ge=0, description="box noise cap in input pixels (SAM: 20 px at 1024 = 2.5 at 128)")
    point_rounds: int = Field(1, ge=0, description="rounds adding an error-region point (SAM: 8)")
    mask_only_rounds: int = Field(0, ge=0, description="final rounds with only the previous mask as new input (SAM: 2)")
    mask_prompt: bool = Field(True, description="feed the previous round's low-res logits as the mask prompt (SAM)")
    focal_weight: float = Field(20.0, ge=0, description="SAM: focal : dice = 20 : 1")
    focal_alpha: float = Field(0.25, description="focal loss alpha (DETR / MaskFormer: 0.25; the SAM paper gives none); <0: none")
    focal_gamma: float = Field(2.0, ge=0, description="focal loss gamma")
    dice_weight: float = Field(1.0, ge=0)
    iou_weight: float = Field(1.0, ge=0, description="IoU head MSE weight")
    # evaluation
    eval_images: int | None = Field(100, ge=1, description="held-out images the AMG is measured on (None: all)")
    baseline_min_area: int = Field(16, ge=1, description="connected-components baseline: smallest component kept")
    export_dir: str | None = Field(None, description="default <output>/encoders/sam")
    EVAL_ONLY = TrainerConfig.EVAL_ONLY | {"export_dir", "eval_images", "baseline_min_area"}

    def architecture(self) -> dict:
        """The exported ``sam_config.json`` architecture (pipeline.models.sam_checkpoint.ARCH_KEYS)."""
        from pipeline.models.sam_checkpoint import REGISTRY_PIXELS

        return dict(img_size=self.img_size, patch_size=self.patch_size, encoder_embed_dim=self.encoder_width,
                    encoder_depth=self.encoder_depth, encoder_num_heads=self.encoder_heads,
                    encoder_global_attn_indexes=list(self.global_attn), window_size=self.window_size,
                    prompt_embed_dim=self.prompt_dim, mask_in_chans=self.mask_in_chans, decoder_depth=2,
                    decoder_mlp_dim=self.decoder_mlp_dim, decoder_num_heads=self.decoder_heads, iou_head_depth=3,
                    iou_head_hidden_dim=self.iou_head_hidden_dim, num_multimask_outputs=3, **REGISTRY_PIXELS)


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.sam_segmenter.job import SamSegmenterJob

    return SamSegmenterJob(cfg, manifest, run_dir, device)


EXPORT = Config.EXPORT
