"""`infoground`: word-region grounding by contrastive learning with context-preserving negative
captions (Gupta et al. 2020, "Contrastive Learning for Weakly Supervised Phrase Grounding").

Reads the `regions` artifact (detector or ground-truth boxes with ROI features, extract-regions),
the `negatives` artifact (contextual word features of every noun/adjective and the in-context
features of each noun's 25 negatives, negative-captions) and `samples` (splits; phrases and
instances for the grounding evaluation).

Model (Sec. 2.3): k_r, v_r (regions) and q_w, v_w (words), each ``hidden_layers`` x (Linear ->
BatchNorm -> ReLU) + Linear, hidden width = input width, output d = d_w / 2 (384 for BERT);
attention a(r|w) = softmax_r q_w(w).k_r(r) / sqrt(d) (Eq. 6), v_att = sum_r a v_r(r) (Eq. 7),
phi(R, w) = v_w(w).v_att. Widths come from the artifacts' ``_manifest.json``. Padded regions and
word slots are masked out of the attention and of the BatchNorm statistics (the reference code
does not mask them; see ``model.py``). An image with 0 regions is skipped and counted.

Losses: L_img (Eq. 8, InfoNCE of every noun/adjective word over the batch's images) + L_lang
(Eq. 9, one noun per caption, redrawn every epoch from the seed, against its 25 negatives in
context); reductions as the reference code (mean over a caption's words, then over captions;
L_lang: mean over captions with a noun). Variants (``negatives:``): ``contextual`` (the
negatives artifact's context-preserving negatives, default), ``random`` (Table 2's ablation: 25
nouns of other captions of the batch, each in its own caption's context, from the stored word
features), ``none`` (L_img only).

Defaults (paper Sec. 2.5 and the reference ``exp/ground``): Adam (AdamW with weight_decay 0), lr
1e-5, batch 50 image-caption pairs, no schedule, no warmup, no gradient clipping, 10 epochs over
captions, 1 hidden layer, model selection by the best validation pointing accuracy
(``best_metric: val_pointing_accuracy`` -> ``checkpoints/best.pt``).

Control (``control: shuffled``, not in the paper): before training, the training images' region
sets are permuted once against their captions (a fixed permutation seeded by ``seed``; each image's
captions are trained with another training image's regions), so nothing ties words to regions;
evaluation is unchanged. Grounding metrics (pointing accuracy, R@k) must then stay within their
interval of chance; ``noun vs its negatives`` may still rise by the word prior alone.

Evaluation (Flickr30k Entities protocol, Sec. 3.1): a phrase's score for a region is the max
attention any of its words gives the region; R@1/5/10 = one of the top-k regions has IoU >= 0.5
with a ground-truth box of the phrase (+1-pixel box widths as the reference code,
``iou_plus_one``); pointing accuracy = the centre of the top region lies in one of the phrase's
boxes. Exact chance levels (uniformly random ranking of the image's regions) are reported beside
every figure, and beside the held-out noun-vs-negatives check also a prior-only baseline (no image:
the true noun more frequent in the training captions than all its negatives); phrases without a
box, without word features, or of images without regions are skipped and counted by reason.
Attention heatmaps of a few captions are saved as PNG in the eval folder. ``eval_output``
evaluates on another run's artifacts (train on COCO, evaluate on Flickr30k Entities).

Harness scoring (train/eval/interface.py): s(I, text) = mean over the text's noun/adjective words
of phi(R_I, w). Texts are encoded like the negatives stage does (spaCy tags, ``models.word_encoder``
word pieces mean-pooled per word), see ``scoring.TextWords``.

This module stays importable without torch. The method by role: ``model.py`` (phi),
``losses.py`` (L_img, L_lang), ``batches.py`` (caption items -> batches), ``metrics.py``
(grounding), ``scoring.py`` (the harness interface); ``job.py`` the lifecycle.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "infoground"
READS = ["regions", "negatives", "samples"]
# the closing tables' headline (train/summary.py): the first (benchmark, subset, metric) found, None any
HEADLINE = [(None, None, "pointing accuracy")]  # the paper's phrase grounding, held out


class Config(TrainerConfig):
    # evaluation-only options: they may change between a run and its resume (train/config.py)
    EVAL_ONLY: ClassVar[frozenset[str]] = getattr(TrainerConfig, "EVAL_ONLY", frozenset()) | {
        "eval_per_epoch", "val_splits", "test_splits", "eval_output", "eval_max_images", "iou_threshold", "iou_plus_one",
        "heatmaps"}
    NAMED: ClassVar[tuple[str, ...]] = ("negatives",)

    # the paper's optimisation (Sec. 2.5): Adam lr 1e-5, batches of 50, no schedule/clipping, 10 epochs
    epochs: float = Field(10.0, gt=0, description="passes over the training captions (paper: 10)")
    batch_size: int = Field(50, ge=2, description="image-caption pairs per batch (paper: 50)")
    lr: float = Field(1e-5, gt=0, description="Adam learning rate (paper: 1e-5)")
    weight_decay: float = Field(0.0, ge=0, description="0: plain Adam as the paper and the reference")
    warmup_frac: float = Field(0.0, ge=0, le=1, description="0: no warmup (paper)")
    min_lr_frac: float = Field(1.0, ge=0, le=1, description="1.0: constant learning rate (paper: no schedule)")
    grad_clip: float | None = Field(None, gt=0, description="None: no clipping (paper)")
    amp: Literal["auto", "off", "fp16", "bf16"] = Field("off", description="off: float32 as the paper (no mixed precision)")
    best_metric: str | None = Field("val_pointing_accuracy", description="model selection (paper: validation pointing accuracy)")
    best_mode: Literal["max", "min"] = "max"
    eval_per_epoch: bool = Field(True, description="evaluate (and select best.pt) after every epoch when eval_every is unset")

    negatives: Literal["contextual", "random", "none"] = Field(
        "contextual", description="L_lang negatives: contextual (paper), random (Table 2 ablation: nouns of other "
        "captions in their own context), none (L_img only)")
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: the training images' region sets permuted once against their captions (seeded; "
        "the chance control)")
    hidden_layers: int = Field(1, ge=0, le=2, description="hidden layers of k_r, v_r, q_w, v_w (paper: 1; Fig. 4: 0, 1, 2)")
    d: int | None = Field(None, ge=1, description="output width of the four MLPs (None: word width / 2, paper 384)")
    n_negatives: int = Field(25, ge=1, description="negatives per noun in L_lang (paper: 25)")
    max_words_per_caption: int | None = Field(
        None, ge=1, description="noun/adjective words of a caption in L_img (None: all; the reference keeps the first 6 "
        "sub-word tokens, we keep whole words, each the mean of its pieces)")
    max_regions: int | None = Field(None, ge=1, description="regions per image (None: all the artifact holds, <= 30)")
    regions_artifact: str = Field("regions", description="relative to `output` (or absolute)")
    negatives_artifact: str = Field("negatives", description="relative to `output` (or absolute)")
    samples_artifact: str = Field("samples", description="splits, phrases and instances")
    train_splits: list[str] = ["train"]
    val_splits: list[str] = Field(["val"], description="model selection (paper: Flickr30k Entities val)")
    test_splits: list[str] = Field(["test"], description="reported figures (paper: Flickr30k Entities test)")
    eval_output: str | None = Field(None, description="evaluate on another run's output folder (its regions, negatives, samples)")
    eval_max_images: int | None = Field(None, ge=1, description="cap on evaluated images per split")
    iou_threshold: float = Field(0.5, gt=0, le=1, description="R@k hit: IoU with a ground-truth box (paper: 0.5)")
    iou_plus_one: bool = Field(
        True, description="IoU of integer-pixel boxes, width x1 - x0 + 1 (the reference code's utils/bbox_utils.py, "
        "default, so figures compare with the paper's); false: continuous boxes (x1 - x0). Changes R@k only for "
        "region-box pairs whose IoU lies near iou_threshold")
    heatmaps: int = Field(4, ge=0, description="captions whose attention heatmaps are saved as PNG at each evaluation")


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.infoground.job import InfoGroundJob

    return InfoGroundJob(cfg, manifest, run_dir, device)
