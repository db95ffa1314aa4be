"""`relation-head`: the Relate-Anything-style relation classifier used by extract-visual-tokens.

Reads a ``visual_tokens`` artifact extracted with ``relations: annotations`` (so its triplets are
the dataset's scene graphs, e.g. the generated dataset's, mapped into the predicate vocabulary)
and learns ``pipeline.models.relations.RelationHead``: per image, the tangible tokens (+ boxes)
-> sigmoid score of every (subject, object, predicate). Loss: binary cross-entropy over every
valid (subject != object, non-padding) entry, as RAM trains (``loss_type='bce'``).

Evaluation is RAM's ``get_recall_N``: per held-out image, the K highest-scoring
(subject, object, predicate) triples are compared with the ground-truth triplets;
recall@K = hits / |ground truth|, averaged over images that have ground truth, in percent, with a 95%
bootstrap interval over images. *Chance* is the expected recall of the best ranking that ignores the
image but for its instance count: the predicates in the order of their training frequency, overall
or at that count, whichever scores higher (``chance_prior``), the ordered pairs of an image tied within a predicate (what a head learns
from the graphs alone; see ``metrics.py``). The recall of a
uniformly random ranking (min(K, N) / N per image, N = V (V - 1) C) is below it and is kept in the
note and in ``metrics.json`` (``chance_random_recall@K``). Every run's ``eval/final/results.parquet``
holds the held-out recall@K rows (the job has no image-text scorer, so the manifest's benchmarks
are not scored by it).

Control (``control: shuffled``): once before training, every training image's ground-truth graph is
replaced by that of another training image with the same number of instances (a seeded
permutation within each instance count), its subject and object indices relabelled by a random
permutation of the image's instances (so the triplets stay valid and carry nothing of the order the
instances come in: a segmenter's masks sorted by score or area put the largest objects first, and
without the relabelling the control learned from the sizes which pairs are related, recall@1 23.4
against chance 11.72 on pixels.yaml); the tokens and boxes no longer match their graph, the
predicates' frequencies are unchanged. Its held-out recall must stay within its interval of chance.

The relation head's inputs are small (V x width per image), so the job holds them in memory.

Training runs in the shared loop (``train/loop.py``: AdamW, warmup + cosine, clipping,
checkpoints and exact resume, metrics.jsonl). Split: the samples artifact's ``split`` column
(``train_splits`` / ``eval_splits``); without one, ``val_fraction`` of the ids by hash.

After the final evaluation the job exports ``<run_dir>/relation_head.pt`` (tensors + plain data, loaded with ``weights_only=True``; a dict:
``state_dict``, the head's ``config``, the ``predicates`` vocabulary and the ``embedding``
settings of the artifact it was trained on -- the stage refuses it on other embeddings --,
``metrics``, ``provenance``). Point ``models.relation_head`` at it and set
``stages.extract_visual_tokens.relations: learned``::

    pipeline run extract-visual-tokens -m manifests/demo.yaml      # demo: relations = annotations
    train run relation-head -m manifests/demo.yaml --set train.relation_head.run_dir=runs/demo/relation-head
    pipeline run extract-visual-tokens -m manifests/demo.yaml \
        --set stages.extract_visual_tokens.relations=learned \
        --set models.relation_head=runs/demo/relation-head/relation_head.pt
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "relation-head"
READS = ["visual_tokens"]
# the closing tables' headline (train/summary.py): the first (benchmark, subset, metric) found, None any
HEADLINE = [("relation-head", "held_out", "recall@1")]  # RAM's recall of held-out triples


class Config(TrainerConfig):
    # loop options (train/config.py) with this job's defaults
    epochs: float = Field(40.0, gt=0)
    batch_size: int = Field(32, ge=2)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    warmup_frac: float = Field(0.05, ge=0, le=1)
    threads: int | None = Field(1, ge=1, description="torch threads (1 is fastest for this small model on a shared CPU)")
    # job options
    artifact: str = Field("visual_tokens", description="visual_tokens artifact (folder under the manifest's output, or a path)")
    samples_artifact: str = Field("samples", description="where the train/val/test split of each sample is read (and, "
                                  "with labels: matched, its ground-truth instances and scene graphs)")
    labels: Literal["auto", "artifact", "matched"] = Field(
        "auto", description="artifact: the artifact's own triplets (the scene graphs when it was extracted with "
        "relations: annotations); matched: the samples' scene graphs put on the artifact's instances by mask matching "
        "at match_iou (relation-encoder's labels); auto: artifact when the artifact's relations are annotations, "
        "else matched, so a head is never trained or scored on another model's predictions")
    match_iou: float = Field(0.5, gt=0, le=1, description="labels: matched: a predicted instance takes a ground-truth "
                             "instance's relations when their masks' IoU is at least this (one to one, the summed IoU maximal)")
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    val_fraction: float = Field(0.2, ge=0, lt=1, description="held-out fraction by sample-id hash when the samples have no split")
    width: int = Field(256, ge=8, description="transformer width (RAM: 768, BERT; smaller here)")
    layers: int = Field(2, ge=1, description="transformer layers (RAM: 2)")
    heads: int = Field(4, ge=1)
    cls_dim: int = Field(64, ge=1, description="per-predicate bilinear width (RAM: 512)")
    use_boxes: bool = Field(True, description="append 8 normalised box numbers to each instance (not in RAM)")
    unit_tokens: bool = Field(False, description="L2-normalise each tangible token before the head (not in RAM): for "
                              "features whose scale drowns the box numbers (the pixels testbed's CLIP pools)")
    dropout: float = Field(0.1, ge=0, lt=1)
    recall_k: list[int] = Field(default_factory=lambda: [20, 50, 100])
    boxes_only_steps: int = Field(300, ge=0, description="the boxes-only baseline's training steps (batches of 256 "
                                  "training images; 0: no baseline): a pair MLP on the box geometry alone, the bar of recall@K")
    chance_prior: Literal["strongest", "instance_count", "global"] = Field(
        "strongest", description="chance: predicates by their training frequency over all training images (global: "
        "the chance before 2026-11-29), or at the image's instance count (what the shuffled control keeps); "
        "strongest: per K, whichever of the two scores higher on the images scored")
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: the chance control: every training image's scene graph is replaced, once before "
        "training, by that of another training image with the same number of instances (a fixed seeded permutation), "
        "its instances relabelled by a random permutation")


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.relation_head.job import RelationHeadJob

    return RelationHeadJob(cfg, manifest, run_dir, device)
