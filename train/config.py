"""Options every training job shares (no torch import here: the manifest loader imports the job
``Config`` classes, which subclass :class:`TrainerConfig`)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from pipeline.config import Section


class TrainerConfig(Section):
    """The loop's options (train/loop.py); a job's Config subclasses this and adds its own. No float
    option of a training run takes inf or nan (``epochs: .inf`` would plan an endless run)."""

    model_config = {**Section.model_config, "allow_inf_nan": False}

    epochs: float = Field(3.0, gt=0, description="passes over the training data (fractional allowed)")
    max_steps: int | None = Field(None, ge=0, description="stop after this many optimizer steps (overrides epochs)")
    batch_size: int = Field(64, ge=2)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(1e-2, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_frac: float = Field(0.05, ge=0, le=1, description="linear warmup, fraction of total steps")
    min_lr_frac: float = Field(0.0, ge=0, le=1, description="cosine decays to lr * min_lr_frac")
    grad_clip: float | None = Field(1.0, gt=0, description="max global gradient norm (None: off)")
    amp: Literal["auto", "off", "fp16", "bf16"] = Field(
        "auto",
        description="auto: fp16 autocast + loss scaling on CUDA, bf16 autocast on CPUs with native bf16 (AVX512-BF16 "
        "/ AMX), off on other CPUs; bf16: bfloat16 autocast (concept-ot then also runs its OT score products in bf16)",
    )
    flush_denormal: bool = Field(
        True, description="CPU: flush denormal floats to zero while training (denormals slowed the OT products up to 10x)"
    )
    seed: int = 0
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch default)")
    num_workers: int = Field(0, ge=0, description="data-loading worker processes")
    shuffle_buffer: int = Field(512, ge=1, description="samples held by the streaming shuffle buffer")
    log_every: int = Field(10, ge=1, description="steps between metric lines")
    eval_every: int | None = Field(None, ge=1, description="steps between evaluations (None: at the end only)")
    ckpt_every: int = Field(200, ge=1, description="steps between checkpoints (always one at the end)")
    best_metric: str | None = Field(None, description="model selection: an evaluate() key; at each evaluation that "
                                    "improves it, checkpoints/best.pt is written beside last.pt (None: off)")
    best_mode: Literal["max", "min"] = Field("max", description="whether a larger or a smaller best_metric is better")
    run_dir: str | None = Field(None, description="default <output>/train/<job>")
    # a training option: with N workers a contrastive loss sees N batches of batch_size // N (the
    # gradients of the effective batch are averaged), not one batch of batch_size
    workers: int = Field(1, ge=1, description="data-parallel workers on Ray Train (train run --workers); batch_size "
                         "stays the effective batch, split exactly: each worker takes batch_size / workers")
    gpus_per_worker: float = Field(0, ge=0, description="GPUs per Ray Train worker (0: CPU workers, gloo)")
    logger: Literal["none", "mlflow", "wandb"] = Field(
        "none", description="experiment tracker beside the TensorBoard event files every run writes (train/tracking.py): "
        "mlflow (local file store <output>/train/mlruns unless MLFLOW_TRACKING_URI) or wandb (offline unless WANDB_MODE); "
        "each an optional extra: pip install -e '.[mlflow]' / '.[wandb]'")
    benchmarks_at_end: bool = Field(True, description="after training, score the final model on the manifest's "
                                    "eval.benchmarks and the job's own metrics (eval/final/results.parquet)")

    @field_validator("amp", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        # YAML 1.1 reads a bare `amp: off` (or `--set ...amp=off`) as the boolean false
        return "off" if v is False else v

    # --- which options define a run (run folder name, resume check) ---------------------------
    # Options that change neither the trained model nor its data order: they may differ between
    # a run and its resume, and are left out of the run folder's hash. A job adds its evaluation-only
    # options with ``EVAL_ONLY = TrainerConfig.EVAL_ONLY | {...}``.
    EVAL_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"run_dir", "device", "threads", "num_workers", "log_every", "eval_every", "ckpt_every", "best_metric",
         "best_mode", "benchmarks_at_end", "gpus_per_worker", "logger",
         "batch_per_step"})  # not an option: the batch that trained, recorded in config.json (train.job.batch_record)
    # Options named in the run folder instead of hashed (a job's ``variant``)
    NAMED: ClassVar[tuple[str, ...]] = ("variant",)
    # A frozen-encoder job: the name of the folder it exports, <output>/encoders/<EXPORT> (the stages' models.*
    # load it; pipeline/models/required.py finds the job that makes a missing folder through this)
    EXPORT: ClassVar[str | None] = None

    def training_config(self) -> dict[str, Any]:
        """The options that define the trained model (JSON values), i.e. all but ``EVAL_ONLY``."""
        d = self.model_dump(mode="json")
        return {k: v for k, v in d.items() if k not in self.EVAL_ONLY}

    def default_training_config(self, named: dict[str, Any]) -> dict[str, Any]:
        """The job's default training options for these NAMED values ({} when the Config has
        required options: then every option counts as set)."""
        try:
            return type(self).model_validate(named).training_config()
        except ValueError:
            return {}

    def run_tag(self) -> str:
        """The default run folder's name: the ``variant`` (``default`` for jobs without one) when
        every training option is at the job's default (for that variant), else the variant followed
        by the options that differ, readable (``dense-uot-lr1e-4``; as many whole option words as
        fit in 48 characters, never a word cut), and a 6-hex-digit hash of those options as a suffix (``dense-uot-lr1e-4-1a2b3c``). So one
        folder holds one configuration and its name says which; :func:`train.loop.train` still
        refuses to resume a checkpoint of another configuration (e.g. after a default changed)."""
        named = {k: getattr(self, k) for k in self.NAMED if k in type(self).model_fields}
        base = self.default_training_config(named)
        mine = self.training_config()
        diff = {k: v for k, v in mine.items() if k not in named and base.get(k) != v}
        name = "-".join(str(v) for v in named.values()) or "default"
        if not diff:
            return name
        h = hashlib.sha1(json.dumps(diff, sort_keys=True).encode()).hexdigest()[:6]
        return f"{name}-{_fit_words([_option_word(k, v) for k, v in sorted(diff.items())], 48)}-{h}"


def _fit_words(words: list[str], width: int) -> str:
    """The first ``words`` joined by ``-`` that fit in ``width`` characters, each whole
    (``epoch_unit_concept_rows``, never ``epoch_unit_conce``); a first word longer than ``width``
    alone is cut after its last ``_`` that fits (its key's words), else at ``width``."""
    out = ""
    for w in words:
        joined = f"{out}-{w}" if out else w
        if len(joined) > width:
            break
        out = joined
    if not out and words:
        head = words[0][:width]
        out = head[: head.rfind("_")] if "_" in head[1:] else head
    return out


def _option_word(key: str, value: Any) -> str:
    """``lr`` 0.0001 -> ``lr1e-4``; ``hard_negatives`` "index" -> ``hard_negatives_index``; a bool ->
    the key or ``no_<key>``; lists joined by ``+``. Only [A-Za-z0-9_.+-] survive (a folder name)."""
    if isinstance(value, bool):
        word = key if value else f"no_{key}"
    elif isinstance(value, float):
        word = f"{key}{_short_float(value)}"
    elif isinstance(value, int) or value is None:
        word = f"{key}{value}"
    elif isinstance(value, (list, tuple)):
        word = f"{key}_" + "+".join(_short_float(x) if isinstance(x, float) else str(x) for x in value)
    else:
        word = f"{key}_{value}"
    return re.sub(r"[^A-Za-z0-9_.+-]", "", word.replace(" ", "_").replace("/", "_"))


def _short_float(x: float) -> str:
    s = f"{x:g}"
    m = re.fullmatch(r"(-?[0-9.]+)e([+-])0*([0-9]+)", s)
    return f"{m[1]}e{'-' if m[2] == '-' else ''}{m[3]}" if m else s


def config_differences(stored: dict[str, Any], cfg: TrainerConfig) -> dict[str, tuple[Any, Any]]:
    """{option: (stored value, current value)} over the training options of ``cfg`` (EVAL_ONLY
    ones are ignored; an option missing from ``stored`` counts as different unless it is at its
    default now: an option added to the job since)."""
    now = cfg.training_config()
    base = cfg.default_training_config({k: getattr(cfg, k) for k in cfg.NAMED if k in type(cfg).model_fields})
    old = {k: v for k, v in stored.items() if k not in cfg.EVAL_ONLY}
    for k, v in now.items():
        if k not in old and base.get(k) == v:
            old[k] = v
    return {k: (old.get(k, "(absent)"), now.get(k, "(absent)"))
            for k in sorted(set(now) | set(old)) if k not in old or k not in now or old[k] != now[k]}
