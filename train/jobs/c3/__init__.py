"""`c3`: concept-centric learning over mined concepts (Song et al. 2024, "C3", Sec. 3.1-3.3, 4.4):
triplets (I_i, I_j, C) of two images whose captions share a mined n-gram concept C, trained with
Matched Concept Prediction (MCP, Eq. 5) and/or Matched Concept Contrastive (MCC, Eq. 6) with
a frozen CLIP and small trainable parts, on cached features only. The default is the paper's main
model as far as cached features allow: ITM + MCP (Table 3 row 4, ITM + MLM + MCP, without MLM,
which cannot be computed: below); ``objectives: mcc`` is the paper's continual variant (LoRA
trained with MCC alone), ``both`` (MCP + MCC summed) a combination the paper does not train.

Reads ``clip_tokens`` (patch tokens + pooled image embedding), ``concepts`` (sample -> concept with
K1 partners; ``hard_negatives``), ``concept_tokens`` (`pipeline run encode-concepts`: the frozen
CLIP text encodings of the vocabulary and each concept's full membership) and ``samples`` (splits).

Model (:mod:`train.jobs.c3.model`):
  * adapters: the stand-in for the paper's LoRA on CLIP. Small zero-initialised low-rank residual
    adapters on the frozen pooled embeddings (image: h = e + U(gelu(D e + attn-pool(patches))), the
    concept side the same over its token states), so h = the frozen CLIP embedding at step 0,
    as LoRA starts at the frozen model; they re-read the tokens as a LoRA'd last layer's CLS would.
  * fusion: METER-shaped co-attention layers (``layers`` x [self-attention, cross-attention to the
    other modality, FFN] per modality, pre-LN) over (concept: [h_C; concept tokens], image:
    [h_I; patch tokens]); z(I, C) = [pooled text cls; pooled image cls] (Eq. 1, METER's poolers).
  * phi_MCP: MLP on z_ij^c = [z(I_i, C); z(I_j, C)] -> one logit (pairwise: on z(I, C)).
  * phi_MCC: MLP on the concept cls h_C -> psi_c, reshaped to a [P, mcc_rank] projection.

Objectives (``objectives``: mcp (default) | mcc | both; ``itm``, default true):
  * MCP (Eq. 5): binary cross-entropy over positives (I_i, I_j, C), type-1 negatives (I_i, I'_j, C),
    I'_j a training image whose captions do not contain C (full membership), and type-2 negatives
    (I_i, I_j, C'), C' a concept neither image contains; ``type2_source``: ``hard`` (default: a
    random one of C's FAISS nearest concepts in ``hard_negatives`` that neither image contains,
    else a random one) or ``random`` (drawn from the concept rows of the training split, i.e.
    weighted by occurrence like the positives' concepts, so the concept alone says nothing).
    ``negatives``: both | type1 | type2 (Table 3 rows I / C); ``formulation``: triplet |
    pairwise (Table 3 row PW: (I, C) pairs, positives (I_i, C), negatives (I'_j, C), (I_i, C')).
  * MCC (Eq. 6): s = cos(psi_c^T h_i, psi_c^T h_j) of the adapted image cls; InfoNCE of each
    positive against the batch's other (I'_j, C') triplets (softmax over b' of
    s(psi_{c_b'}^T h_{i_b}, psi_{c_b'}^T h_{j_b'}) / ``mcc_temperature``); in-batch triplets that
    are in fact positive (both images contain C') are masked out.
  * ITM (``itm``, default true): binary matching of a cached caption (clip_tokens' text tokens) with its
    image against a random other image, through the same fusion (Table 3's ITM column).
    MLM cannot be computed: the cached text states come from CLIP's causal text tower after the
    fact; masking a token would need the encoder itself. It is left out (Table 3 rows 1-4 show
    what it contributes to reasoning, not to the MCP/MCC comparison here).

Partners and negatives come from the training split only (``train_splits``); concept rows
without a partner there, without an encoding (encode-concepts' min_df) or whose image has no
clip_tokens are skipped and counted (logged at start, ``data/*`` in the eval metrics).
``control: shuffled`` trains on a fixed random permutation of the training images' features
(every sample, anchor and partner alike, reads another training image: the concept's partners are
shuffled), the chance control: it can learn which concepts tend to be positives but nothing about
images, and the held-out negatives are drawn so that this is worth nothing (below): its held-out
AUCs stay ~0.5 on every negative type. ``control: images_zeroed``: every image feature (patch
tokens and pooled embedding) is zero in training, evaluation and scoring, so the model can use
the concept (and caption) alone: the concept prior. It is 0.5 on the concept-matched rows by
construction and shows on ``type2_as_trained`` (below).

Epochs (``epoch_unit``): the paper trains "1 epoch" on each dataset (Sec. 4.1), a pass over the
dataset's images; its concept database (Eq. 3) holds per image i its concepts C_ik. So an epoch
(``images``, default) takes each training image that anchors a concept row once, with one of its
concepts drawn uniformly; ``concept_rows`` (the former meaning) takes every (image, concept) row
once, several times as many triplets.

Evaluation (held-out ``eval_splits`` only, partners and negatives from that split, full
membership): MCP accuracy (%) and AUC per negative type with chance 50% / 0.5 and the frozen
global-cosine baseline (cos(e_i, t_C) + cos(e_j, t_C)). type1: (I_i, I'_j, C), I'_j a held-out
image without C. Type 2 is concept-matched: the negative of a positive (I_i, I_j, C) is
(I_k, I_l, C), the image pair of another held-out positive (I_k, I_l, C_d) neither of whose images
contains C, i.e. the type-2 negative (I_k, I_l, C' = C) of that positive; negatives thus carry
the concepts of the positives they are ranked against (scoring the concept alone gives AUC 0.5
exactly; drawing C' independently, as training does, let a model that never saw an image reach
0.69-0.81, since C' of the hard and binding kinds are longer and rarer than positives' concepts);
that is measured beside them: type2_as_trained, the positive's pair with C' drawn as training draws
it (``type2_source``, from the training rows' concepts).
type2_random: any such pair; type2_hard: C is one of the FAISS nearest concepts of C_d
(``hard_negatives``); type2_binding: C has >= 2 words, all of them words of I_k's captions (the
attribute-binding swap: C = "blue circle" for "a red circle and a blue square"). Then
concept-conditioned retrieval (MCC): precision@k of images containing C among the top k by
cos(psi_c^T h_q, psi_c^T h_k), with its base rate, per concept length n, overall, and over the
rare concepts (``rare``: in <= 10% of the held-out images; precision@k is capped at 1/base rate
times the base rate, so a multiple of the base rate is readable only there); and the
harness's scoring interface (score_pairs: arbitrary texts are encoded by ``models.clip``'s text
tower, as concept_tokens was; s(I, T) = phi_MCP([z(I,T); z(I,T)]) (pairwise: phi_MCP(z(I,T))),
with ``objectives: mcc`` the cosine of the adapted cls).

Defaults: the paper gives no lr, batch or widths for the continual setting (1 epoch, ~1.2% of
CLIP trainable); METER's cross-modal layers are 6 x 768 wide. Lean choices, all options: 2
co-attention layers of 256, 4 heads, adapters of rank 16, psi rank 64, AdamW 1e-4, batch 64,
1 epoch (of images), MCC temperature 0.07.

This module stays importable without torch. The method by role: ``model.py`` (adapters, fusion,
heads), ``batches.py`` (training triplets, negatives, batch layout), ``losses.py`` (MCP, MCC,
ITM), ``metrics.py`` (held-out evaluation), ``scoring.py`` (the harness interface), ``data.py``
(the image store); ``job.py`` the lifecycle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "c3"
READS = ["clip_tokens", "concepts", "concept_tokens", "samples"]


class Config(TrainerConfig):
    epochs: float = Field(1.0, gt=0, description="passes over the training data (paper: 1 epoch continual); "
                          "what a pass counts: epoch_unit")
    epoch_unit: Literal["images", "concept_rows"] = Field(
        "images", description="images (default, the paper's 1 epoch over the dataset): each training image that "
        "anchors a concept row is an anchor once per epoch, with one of its concepts drawn; concept_rows: every "
        "(image, concept) row once per epoch (the former meaning, ~n concepts per image times longer)")
    objectives: Literal["mcp", "mcc", "both"] = Field("mcp", description="MCP (Eq. 5; default with itm: Table 3 "
                                                       "row 4 without MLM), MCC (Eq. 6: the paper's continual "
                                                       "variant) or both (summed; not a configuration of the paper)")
    negatives: Literal["both", "type1", "type2"] = Field("both", description="MCP negatives: type 1 (mismatched image), "
                                                          "type 2 (mismatched concept) or both (Table 3)")
    formulation: Literal["triplet", "pairwise"] = Field("triplet", description="MCP input: (I_i, I_j, C) or (I, C) (Table 3 PW)")
    type2_source: Literal["hard", "random"] = Field("hard", description="C' of type-2 negatives: hard (hard_negatives "
                                                      "table, random fallback) or random (occurrence-weighted)")
    itm: bool = Field(True, description="ITM on cached caption tokens beside the concept objective (Table 3's ITM "
                                        "column; on in the paper's main model, row 4)")
    control: Literal["none", "shuffled", "images_zeroed"] = Field(
        "none", description="shuffled: training images' features permuted (the chance control); images_zeroed: every "
        "image feature (patch tokens, pooled embedding) zero in training, evaluation and scoring, so only the "
        "concept can be used (the concept prior)")
    artifact: str = Field("clip_tokens", description="clip_tokens folder, relative to `output` (or absolute)")
    concepts_artifact: str = "concepts"
    concept_tokens_artifact: str = "concept_tokens"
    samples_artifact: str = "samples"
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    d_model: int = Field(256, ge=8, description="co-attention width (METER: 768)")
    layers: int = Field(2, ge=1, description="co-attention layers (METER: 6)")
    heads: int = Field(4, ge=1)
    ffn_mult: int = Field(4, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    adapter_rank: int = Field(16, ge=1, description="rank of the zero-initialised residual adapters (LoRA stand-in)")
    mcc_rank: int = Field(64, ge=1, description="psi_c is a [P, mcc_rank] projection")
    mcc_hidden: int = Field(256, ge=1, description="hidden width of phi_MCC")
    mcc_temperature: float = Field(0.07, gt=0, description="MCC temperature (the paper gives none)")
    w_mcp: float = Field(1.0, ge=0)
    w_mcc: float = Field(1.0, ge=0)
    w_itm: float = Field(1.0, ge=0)
    neg_tries: int = Field(16, ge=1, description="random draws per negative before a row's negative is dropped (counted)")
    image_cache: Literal["auto", "memory", "random"] = Field(
        "auto", description="memory: hold the used images' tokens in RAM; random: read each batch's images by random "
        "access from the shards; auto: memory when the shards fit in half the available RAM")
    eval_max_triplets: int = Field(2000, ge=1, description="held-out positives (each with one negative per type)")
    eval_max_concepts: int = Field(500, ge=1, description="concepts queried in concept-conditioned retrieval")
    retrieval_k: int = Field(5, ge=1)
    eval_chunk: int = Field(256, ge=1, description="fusion pairs per forward in evaluation / scoring")


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.c3.job import C3Job

    return C3Job(cfg, manifest, run_dir, device)
