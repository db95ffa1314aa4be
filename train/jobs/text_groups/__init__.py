"""`text-groups`: the Text Group Transformer (Behjati & Henderson, "Discovering Meaningful Units
with Visually Grounded Semantics from Image Captions") against frozen GroupViT image groups.

A text transformer groups the CLIP-BPE tokens of a caption into K units (K learnable group tokens,
6 layers over [tokens; groups], GroupViT's grouping block with a padding mask, 3 layers over the
groups; width 128, 4 heads). Its groups are aligned contrastively with the frozen GroupViT groups of
the `image_groups` artifact (Linear -> 256 on each side, mean-pooled, cosine, symmetric InfoNCE,
tau = 0.07 fixed) and decoded back into the caption by a 1-layer decoder (causal self-attention +
cross-attention to the groups, 1 head each, embeddings tied; reconstruction cross-entropy over the
real tokens). Loss = contrastive + lambda * reconstruction (lambda = 1). One random caption per
image per step. Model details: :mod:`train.jobs.text_groups.model`.

``control: shuffled`` (the testbed's training-time control) pairs every training image's groups with
the captions of another image (a fixed seeded permutation drawn once before training); its held-out
retrieval must stay at chance. ``reconstruction_reduction`` reads Eq. 10 (default ``sum``: a caption's
cross-entropy sums its tokens; ``mean`` averages over tokens, 1/M of the paper's weight).

Variants (``variant:``): ``grouped`` (the paper's model), ``no-reconstruction``,
``no-contrastive`` (Table 5 ablations), ``vanilla`` (the paper's baseline: 9 layers over tokens,
CLIP's causal mask, pooled at EOT, same objectives; the decoder cross-attends to that one vector).
``n_groups`` K in {1, 2, 4, 8, 16} (Table 6).

Defaults (Sec. 4.1, and GroupViT's configs/default.yml where the paper is silent): AdamW lr 1.6e-3,
betas (0.9, 0.999), linear warmup 2 epochs (warmup_frac 2/30), cosine decay to GroupViT's min_lr 4e-5
(min_lr_frac 0.025), 30 epochs; weight decay 0.05 and gradient clipping at global norm 5.0 are
GroupViT's (the paper does not state them); batch 4096 in the paper (GPU, cached image groups):
``batch_size: null`` picks 4096 on CUDA and 64 on CPU, capped at the number of training images.

Evaluation: phrase discovery (tIoU / P / R / F1 with Hungarian matching; ``discovery.py``) on the
``phrases`` table of the samples artifact (the generated dataset, or a Flickr30k Entities ingest)
and on every extra samples artifact in ``discovery_artifacts``, on all captions and on captions
with >= 2 gold phrases, beside its baselines (untrained model, random assignment, one group,
contiguous chunks; k-means / spectral / mean-shift over the trained `vanilla` run's token features
when ``vanilla_run`` holds one); token-to-group figures in the eval folder; the harness's
pairwise scoring (``score_pairs``: cosine of the mean-pooled projected groups).

This module stays importable without torch; the implementation is in :mod:`train.jobs.text_groups.job`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "text-groups"
READS = ["image_groups", "samples"]
# the closing tables' headline (train/summary.py): the first (benchmark, subset, metric) found, None any.
# Held-out retrieval: what the job learns on the testbed (benchmarks/expectations/testbed.yaml); phrase discovery
# (tIoU beside its baselines) does not form there (docs/jobs/text-groups.md) and stays in the per-run table
HEADLINE = [("retrieval/held-out", "i2t", "R@1")]

Variant = Literal["grouped", "no-reconstruction", "no-contrastive", "vanilla"]


class Config(TrainerConfig):
    EVAL_ONLY: ClassVar[frozenset[str]] = TrainerConfig.EVAL_ONLY | frozenset(
        {"discovery_splits", "discovery_artifacts", "discovery_max_captions", "vanilla_run", "figures",
         "baselines", "eval_chunk"})

    variant: Variant = "grouped"
    groups_artifact: str = Field("image_groups", description="image_groups artifact folder, relative to `output` (or absolute)")
    samples_artifact: str = Field("samples", description="captions, splits and gold phrases")
    train_splits: list[str] = ["train"]
    # paper / GroupViT defaults (see the module docstring)
    epochs: float = Field(30.0, gt=0)
    batch_size: int | None = Field(None, ge=2, description="None: 4096 (the paper's) on CUDA, 64 on CPU; capped at the "
                                   "number of training images")
    lr: float = Field(1.6e-3, gt=0)
    weight_decay: float = Field(0.05, ge=0, description="GroupViT's (the paper does not state it)")
    grad_clip: float | None = Field(5.0, gt=0, description="GroupViT's clip_grad (the paper does not state it)")
    warmup_frac: float = Field(2 / 30, ge=0, le=1, description="2 warmup epochs of 30 (Sec. 4.1)")
    min_lr_frac: float = Field(0.025, ge=0, le=1, description="GroupViT's min_lr 4e-5 / 1.6e-3")
    # model (Sec. 4.1)
    n_groups: int = Field(4, ge=1, description="K text groups (Table 6: 1, 2, 4, 8, 16)")
    width: int = Field(128, ge=8)
    heads: int = Field(4, ge=1)
    layers_pre: int = Field(6, ge=1, description="layers over [tokens; groups] before the grouping block")
    layers_post: int = Field(3, ge=0, description="layers over the groups after it")
    vanilla_layers: int = Field(9, ge=1, description="layers of the vanilla baseline")
    d_proj: int = Field(256, ge=1, description="joint space width of the Linear projections")
    tau: float = Field(0.07, gt=0, description="InfoNCE temperature (fixed)")
    lambda_rec: float = Field(1.0, ge=0, description="reconstruction weight lambda")
    reconstruction_reduction: Literal["sum", "mean"] = Field(
        "sum", description="Eq. 10: sum: each caption's cross-entropy is the sum over its tokens (the paper's CE of a "
        "caption), averaged over the batch like the InfoNCE of Eq. 6-7; mean: averaged over the batch's real tokens "
        "(the earlier reading: 1/M of the paper's weight)")
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: the training images' groups are paired with another image's captions (one fixed "
        "permutation drawn from the seed before training); retrieval must stay at chance")
    gumbel: bool = Field(True, description="Gumbel noise on the assignment logits in training (Eq. 2; GroupViT's "
                         "`gumbel`); false: hard argmax of the noiseless softmax over groups, still straight-through")
    gumbel_tau: float = Field(1.0, gt=0, description="Gumbel-softmax temperature (GroupViT's)")
    assign_eps: float = Field(1.0, gt=0, description="assignment normalisation eps (GroupViT's)")
    pre_assign_attn: bool = Field(True, description="GroupViT's cross-attention block (groups attend to tokens) before "
                                  "the assignment; the paper's Eq. 4 does not mention it")
    hard_assignment: bool = Field(True, description="GroupViT's `hard_assignment`: one-hot + straight-through in "
                                  "training (Eq. 3); false: train on the soft assignment (evaluation is the argmax)")
    isolate_groups: bool = Field(False, description="group tokens attend only to group tokens in the layers before the "
                                 "grouping block, so the caption reaches the groups through the assignment (Eq. 4) only")
    group_init_std: float = Field(0.02, gt=0, description="std of the learnable group tokens at init (GroupViT's 0.02)")
    pos_init_std: float = Field(0.01, gt=0, description="std of the encoder's learned positions at init (CLIP's 0.01)")
    max_len: int = Field(77, ge=3, le=77, description="M: SOT + tokens + EOT (longer captions are truncated, counted)")
    full_logits: bool = Field(False, description="decoder logits at every position of B x 77 (the benchmark's reference) "
                              "instead of at the real tokens of a trimmed batch")
    recon_vocab: Literal["full", "corpus"] = Field(
        "full", description="full: the decoder's softmax over all 49,408 ids (the paper); corpus: over the ids that occur "
        "in the training captions only (a CPU shortcut for small corpora: the softmax ignores never-seen ids)")
    # evaluation
    discovery_splits: list[str] = Field(["val"], description="splits scored for phrase discovery (Flickr30k Entities val in the paper)")
    discovery_artifacts: list[str] = Field([], description="extra samples artifacts with a phrases table (e.g. a "
                                           "Flickr30k Entities ingest), relative to `output` or absolute")
    discovery_max_captions: int = Field(1000, ge=1, description="captions scored per artifact (the first ones by id)")
    vanilla_run: str | None = Field("auto", description="the trained `vanilla` run whose token features the clustering "
                                    "baselines use: auto = the run folder `train run text-groups --set "
                                    "train.text_groups.variant=vanilla` writes with the same manifest and options; "
                                    "else a run folder (relative to `output`, or absolute); null: no clustering "
                                    "baselines")
    baselines: bool = True
    figures: int = Field(6, ge=0, description="captions drawn in eval/<tag>/assignments.png")
    eval_chunk: int = Field(256, ge=1)


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.text_groups.job import TextGroupsJob

    return TextGroupsJob(cfg, manifest, run_dir, device)
