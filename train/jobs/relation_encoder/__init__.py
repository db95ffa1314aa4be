"""`relation-encoder`: the RAM-style relation model trained here, from pixels, on the pretraining corpus, and
exported where ``models.relation_head`` points (docs/jobs/relation-encoder.md).

RAM (Relate Anything) trains its relation head on PSG: a segmenter's instances, the dataset's scene graphs as
labels. This job does the same on the manifest's generated corpus (never a testbed image): the inputs are the
corpus's ``visual_tokens`` (``artifact``, default ``corpus/visual_tokens``: ``pipeline run extract-visual-tokens
--corpus``), i.e. the instances that the manifest's ``segmenter`` predicts and their tangible tokens; the labels are
the corpus's ground-truth scene graphs (``samples_artifact``, default ``corpus/samples``: its ``instances`` and
``relations`` tables), put on the predicted instances by matching their masks to the ground-truth instances at IoU
>= ``match_iou`` (``labels.py``). The model, its loss, its training, its held-out recall@K with the boxes-only
classifier beside it and the control are relation-head's (``train/jobs/relation_head/``, imported): train split
only (``train_splits``), held out the corpus's val + test.

After the final evaluation it exports ``<output>/encoders/relations/`` (``export_dir`` to choose; a control run
``encoders/relations-shuffled``): ``relation_head.pt`` (the file ``pipeline.models.relations.load_relation_checkpoint``
loads; a folder is accepted for it) with its ``.sha256``, and ``training.json`` (provenance: trained here on the
corpus, the labels' matching and what it kept, the metrics, a hash of the weights). Then::

    stages.extract_visual_tokens.relations: learned
    models.relation_head: "{output}/encoders/relations"

predicts the testbed's relations from pixels (manifests/pixels.yaml).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.jobs.relation_head import Config as RelationHeadConfig

NAME = "relation-encoder"
READS = ["corpus/visual_tokens", "corpus/samples"]
HEADLINE = [("relation-encoder", "held_out", "recall@1")]
# a frozen-model job: its export is a stage input (models.relation_head), so `train run all` leaves it out
ENCODER = True
# what it needs run on the corpus first (benchmarks/testbed.py: relation_corpus_steps), with the --set each needs
CORPUS_STAGES = {"extract-visual-tokens": ["stages.extract_visual_tokens.relations=geometric"]}


class Config(RelationHeadConfig):
    EXPORT = "relations"  # <output>/encoders/relations (train/encoders.py: export_dir)
    artifact: str = Field("corpus/visual_tokens", description="the corpus's visual_tokens (the segmenter's predicted "
                          "instances and tangible tokens; `pipeline run extract-visual-tokens --corpus`)")
    samples_artifact: str = Field("corpus/samples", description="the corpus's samples: the split of each image and "
                                  "the ground-truth instances and scene graphs (the labels)")
    labels: Literal["matched"] = Field("matched", description="always the corpus's scene graphs matched to the "
                                       "predicted instances at match_iou (relation-head's labels: matched)")
    recall_k: list[int] = Field(default_factory=lambda: [1, 3, 5])
    export_dir: str | None = Field(None, description="default <output>/encoders/relations (relations-shuffled for the "
                                   "control)")
    EVAL_ONLY = RelationHeadConfig.EVAL_ONLY | {"export_dir", "recall_k"}


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.relation_encoder.job import RelationEncoderJob

    return RelationEncoderJob(cfg, manifest, run_dir, device)


EXPORT = Config.EXPORT
