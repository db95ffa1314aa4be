"""`concept-ot`: ConceptOT (Kumar, low-rank unbalanced OT between CLIP patches and text tokens)
and its baselines, trained on the `clip_tokens` artifact (frozen CLIP, Sec. 2.1 / App. G.1).

Variants (``variant:``), Sec. 3.2:
  conceptot    low-rank UOT through r learned anchors (Eq. 4-8, Alg. 1), anchor diversity (beta)
  dense-uot    full-rank entropic UOT (Eq. 3), score = transported-mass-normalised similarity
  balanced-ot  entropic OT with exact marginals mu, nu
  filip        token-wise max similarity (FILIP late interaction), both directions averaged
  text-attn    text-conditioned attention pooling over patches (extra query/key projections)
  global-patch average patch-token cosine similarity
  global-only  frozen pooled CLIP embeddings only (nothing to train: `train run` just evaluates)

Hard negatives (``hard_negatives:``): ``batch`` (default) mines them inside random mini-batches,
as Alg. 2 does. ``index`` keeps that mining and the loss but composes each batch from
``batch_size // (1 + index_neighbours)`` seeds of the shuffled stream plus, for each seed,
``index_neighbours`` samples drawn from its dataset-level hard negatives in the `index` artifact
(`pipeline run build-index`): the owners of its top-``index_top`` hard captions and its
top-``index_top`` hard images, training split only (see :mod:`train.jobs.concept_ot.index_negatives`). Every
train log line records ``hn_index_hit``, the share of the mined in-batch negatives (both
directions) that are index neighbours of their anchor, whenever an index artifact is present
(also in batch mode, for comparison); in index mode also ``hn_index_hit_seeds`` (the same over
the seed rows) and ``seed_batch_share``. A missing index is an error naming the folder; an index
whose image ids are mostly (> 50%) not in the clip_tokens shards is an error (built for another
artifact), a few unknown ids are skipped with a logged count.

Loss (Eq. 9-10): L_global (symmetric InfoNCE on the frozen pooled embeddings; constant, logged)
+ lambda_l (L_I->X + L_X->I)/2 + beta Omega_div, with K_h hard negatives mined both ways from the
global scores of the batch. Defaults are the paper's Tables 6-7 (AdamW lr 1e-4, wd 1e-2, batch
64, 5% warmup + cosine, clip 1.0, 3 epochs; eps 0.07, tau 0.2, lambda_l 0.5, beta 1e-3,
tau_l 0.07, L 5, r 32, K_h 4, d_c 256) and Appendix H's stabilisation for the low-rank solver.

Control (``control: shuffled``): the image-text pairings of the training split are shuffled once
before training: every training sample reads its patch tokens and pooled image embedding from
another training image, by a permutation of the training images drawn from ``[seed, 777]``
(:meth:`~train.jobs.concept_ot.batches.ConceptOTBatches.control_partners`), and keeps its own
captions; batches, mining, loss and evaluation are the same job's. Nothing ties a caption to its
image any more, so the trained local score carries nothing about the held-out pairs: its metrics
stay within their interval of chance (the frozen global score's own share stays what it is; see
docs/jobs/concept-ot.md, Testbed).

Epochs (``epochs``): per variant as the paper (Sec. 3.2, App. G): 3 for the transport variants,
8 for filip / text-attn / global-patch. ``epoch_unit: captions`` makes an epoch one pass over the
(image, caption) pairs (round(mean captions per image) image passes; in pass k an image takes
caption perm[k % c] of a permutation seeded by (seed, epoch, sample_id), so one caption per image
per batch, as Alg. 2's batches, and every pair once per epoch when c == passes).
``train_subset: N``: a seeded (``train_subset_seed``) subset of N training images (the paper's 20K
COCO setting). A configuration whose ``eval_splits`` hold no images is an error at start.

Evaluation (App. G.4 and Sec. 2.6): retrieval R@1/5/10 both ways, global only and two-stage
(global top-128, rerank by g + lambda_l * s_local); SugarCrepe-format pairwise accuracy on every
folder of ``sugarcrepe_dirs`` (default: the generated dataset's ``sugarcrepe/``; the published
SugarCrepe only where configured), read and scored by the evaluation harness through
``score_pairs`` (train/eval/in_job.py: images matched to the ``samples`` artifact, texts encoded
with the frozen CLIP text tower of ``models.clip``, since negatives are not in the artifact;
``sugarcrepe_global/*``: the same with g alone); phrase heatmaps h_i(J) = sum_{j in J} Pi_ij saved as PNG; Sec. 2.6 box
prediction (``job_metrics``: threshold ``box_threshold`` x max, patch envelope; accuracy@IoU0.5 and
mean IoU against the union box of each phrase's instances, for the dataset's phrase spans, chance =
the whole-image box; see :mod:`train.jobs.concept_ot.boxes`).

The harness interface (train/eval/interface.py): ``score_pairs`` = g + lambda_l * s_local
(global-only: g), images by random access into the shards, texts through the frozen CLIP text
tower (cached per text); a box restricts the local score to the patches it overlaps (masses
renormalised over them; g stays the whole image's pooled embedding, said in ``crop_note``);
``retrieval_scores`` = ``global`` and the G.4 rerank per direction (``rerank/i2t``,
``rerank/t2i``), with the artifact's stored encodings for its own captions.

This module stays importable without torch (the manifest loader reads ``Config``); the
lifecycle is :mod:`train.jobs.concept_ot.job`, the pieces beside it are named by role (batches,
losses, model, scoring, grounding, boxes, index_negatives, ot).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from train.config import TrainerConfig

NAME = "concept-ot"
READS = ["clip_tokens", "samples", "index"]  # `index` only with hard_negatives: index (else optional, for hn_index_hit)
# the closing tables' headline (train/summary.py): the first (benchmark, subset, metric) found, None any;
# SugarCrepe overall is judged against the frozen global score alone (what training adds)
HEADLINE = [("sugarcrepe", "all", "accuracy"), ("retrieval", "rerank", "i2t_R@1")]
# its score is the frozen global cosine g plus a trained term: a control (shuffled pairings) keeps g, so its
# rows are tested against g, not chance (train/eval/controls.py)
SCORE_INCLUDES_FROZEN = True

Variant = Literal["conceptot", "dense-uot", "balanced-ot", "filip", "text-attn", "global-patch", "global-only"]


TRANSPORT_VARIANTS = ("conceptot", "dense-uot", "balanced-ot")


def default_epochs(variant: str) -> float:
    """Sec. 3.2 / App. G: transport methods train 3 epochs, the simpler baselines 8 (global-only
    trains nothing)."""
    return 3.0 if variant in TRANSPORT_VARIANTS else 8.0


class Config(TrainerConfig):
    # options that do not change the trained model (left out of the run folder's hash and of the
    # resume check, train/config.py)
    EVAL_ONLY: ClassVar[frozenset[str]] = TrainerConfig.EVAL_ONLY | {
        "eval_splits", "rerank_top_k", "eval_max_images", "eval_pairs_chunk", "sugarcrepe_dirs",
        "sugarcrepe_max_per_kind", "heatmaps", "box_threshold", "grounding_max_phrases", "ot_chunk"}

    variant: Variant = "conceptot"
    epochs: float | None = Field(
        None, gt=0, description="passes over the training data (fractional allowed); default per variant as the paper: "
        "3 for the transport variants (conceptot, dense-uot, balanced-ot), 8 for filip, text-attn, global-patch")
    epoch_unit: Literal["images", "captions"] = Field(
        "images", description="images: an epoch is one pass over the training images (one random caption each); "
        "captions: one pass over the (image, caption) pairs, as round(captions per image) image passes in which each "
        "image takes its captions in a seeded order (COCO: 5 passes)")
    train_subset: int | None = Field(
        None, ge=2, description="train on a seeded subset of this many training images (the paper's 20K-image "
        "COCO setting: 20000); None: all")
    train_subset_seed: int = Field(0, description="seed of the train_subset draw (fixed across training seeds)")
    artifact: str = Field("clip_tokens", description="clip_tokens artifact folder, relative to `output` (or absolute)")
    samples_artifact: str = Field("samples", description="for splits, captions texts and image files")
    train_splits: list[str] = ["train"]
    # the paper's protocol (App. G.4): the 5K Karpathy test split; the testbed and small datasets widen it to [val, test]
    eval_splits: list[str] = ["test"]
    d_c: int = Field(256, ge=1, description="concept-space width (App. G.1)")
    eps: float = Field(0.07, gt=0, description="entropic regularisation (Table 7)")
    tau_v: float = Field(0.2, gt=0)
    tau_t: float = Field(0.2, gt=0)
    lambda_local: float = Field(0.5, ge=0, description="local loss weight, also the rerank weight (G.4)")
    beta_div: float = Field(1e-3, ge=0, description="anchor diversity weight")
    tau_local: float = Field(0.07, gt=0, description="local temperature of Eq. 9")
    n_iter: int = Field(5, ge=1, description="Sinkhorn iterations L")
    rank: int = Field(32, ge=2, description="anchors r (conceptot)")
    k_hard: int = Field(4, ge=1, description="hard negatives per direction K_h")
    hard_negatives: Literal["batch", "index"] = Field(
        "batch", description="batch: random mini-batches (Alg. 2 as is); index: each batch = seeds + index_neighbours "
        "of each seed's dataset-level hard negatives from the `index` artifact (same in-batch mining and loss)")
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: the chance control; each training caption is paired for the whole run with "
        "another training image's features (a permutation of the training images drawn once from [seed, 777]); "
        "evaluation is unchanged")
    index_artifact: str = Field("index", description="build-index artifact folder, relative to `output` (or absolute)")
    index_neighbours: int = Field(1, ge=1, description="m: index neighbours brought into the batch per seed "
                                  "(batch_size // (1 + m) seeds per batch)")
    index_top: int = Field(8, ge=1, le=32, description="neighbours are drawn from the first index_top entries of the "
                           "stored lists (also the list hn_index_hit is measured against)")
    anchor_init_std: float = Field(0.02, gt=0, description="anchors ~ N(0, std) (App. G.1)")
    global_temperature: float = Field(
        0.01, gt=0, description="temperature of L_global on the frozen embeddings (CLIP's logit scale 100)"
    )
    # Appendix H stabilisation of the low-rank solver (all on, as in the paper's runs)
    kpp_reg: float = Field(1e-2, ge=0, description="K_PP diagonal regularisation")
    lr_center: bool = Field(True, description="centre the log-scalings every iteration")
    lr_clamp: float | None = Field(20.0, gt=0, description="clamp the log-scalings to [-c, c]")
    score_tanh: bool = Field(True, description="tanh soft-clamp of the conceptot score")
    ot_gemm_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the conceptot score's N x r x d / M x r x d products (the bulk of its arithmetic; "
        "sub-kernels, Sinkhorn iterations and reductions stay float32). auto: bfloat16 when the trainer runs "
        "mixed precision in bf16 (amp: bf16, or auto on a CPU with native bf16), else float32. bf16 is 3-5x faster on CPUs with native bf16 "
        "(AVX512-BF16/AMX) and GPUs; scores agree to ~1e-4 relative, patch/token gradients to ~1%, anchor "
        "gradients only to cosine 0.75-0.94 (BENCHMARKS.md)",
    )
    ot_chunk: int | None = Field(None, ge=1, description="pairs per dense solver chunk (None: ~1 MiB kernels)")
    exclude_duplicate_captions: bool = Field(
        True, description="never mine a negative caption identical to the positive (same text embedding)"
    )
    # evaluation
    rerank_top_k: int = Field(128, ge=1)
    eval_max_images: int = Field(5000, ge=1, description="held-out images retrieved over (the paper: COCO 5K test)")
    eval_pairs_chunk: int = Field(1024, ge=1)
    sugarcrepe_dirs: list[str] | None = Field(None, description="folders of SugarCrepe-format JSON (None: auto)")
    sugarcrepe_max_per_kind: int | None = Field(None, ge=1)
    heatmaps: int = Field(4, ge=0, description="eval images with phrase heatmaps saved as PNG")
    box_threshold: float = Field(0.5, gt=0, le=1, description="Sec. 2.6 box prediction: patches whose heatmap value "
                                 "is >= box_threshold * the heatmap's max; the box is their patch envelope")
    grounding_max_phrases: int = Field(2000, ge=1, description="phrases scored by the grounding evaluation (first "
                                       "ones of the eval images, in sample order)")

    @model_validator(mode="before")
    @classmethod
    def _variant_epochs(cls, data):
        if isinstance(data, dict) and data.get("epochs") is None:
            data = {**data, "epochs": default_epochs(data.get("variant") or "conceptot")}
        return data


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.concept_ot.job import ConceptOTJob

    return ConceptOTJob(cfg, manifest, run_dir, device)
