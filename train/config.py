"""Options every training job shares (no torch import here: the manifest loader imports the job
``Config`` classes, which subclass :class:`TrainerConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline.config import Section


class TrainerConfig(Section):
    """The loop's options (train/loop.py); a job's Config subclasses this and adds its own."""

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
    run_dir: str | None = Field(None, description="default <output>/train/<job>")

    @field_validator("amp", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        # YAML 1.1 reads a bare `amp: off` (or `--set ...amp=off`) as the boolean false
        return "off" if v is False else v
