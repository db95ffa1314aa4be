"""A tiny in-memory regression job for the data-parallel tests (test helper): per-sample mean
squared error, so N workers with batch_size // N and averaged gradients train exactly as one process
with batch_size, within float tolerance. Importable by Ray Train workers (tests is a package)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from train.config import TrainerConfig
from train.job import Job


class ToyConfig(TrainerConfig):
    n: int = 96
    d: int = 8
    kill_rank_at_step: int | None = None  # the first run with this (marker file absent) kills that rank's worker
    raise_rank_at_step: int | None = None  # that rank's training code raises ValueError at this step (every time)


class ToyJob(Job):
    NAME = "toy"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        rng = np.random.default_rng(123)
        self.x = torch.from_numpy(rng.normal(size=(cfg.n, cfg.d)).astype(np.float32))
        self.y = self.x @ torch.arange(1.0, cfg.d + 1) + 0.1 * torch.from_numpy(rng.normal(size=cfg.n).astype(np.float32))
        self.steps_done = 0

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(self.cfg.d, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def _n_batches(self) -> int:
        return self.cfg.n // self.fit_batch(self.cfg.n)  # the jobs' short-split rule (train.job.Job.fit_batch)

    def batches_per_epoch(self) -> int:
        return self.steps_per_epoch(self._n_batches())

    def batches(self, epoch, start):
        perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(self.cfg.n)
        nb = self._n_batches()
        B = self.train_batch
        for b in self.rank_batches(nb, start):
            idx = torch.from_numpy(perm[b * B:(b + 1) * B])
            yield {"sample_id": idx, "x": self.x[idx], "y": self.y[idx]}

    def loss(self, model, batch):
        self.steps_done += 1
        k = self.cfg.kill_rank_at_step
        marker = Path(self.run_dir) / "killed-once"
        if k is not None and self.rank == 1 and self.steps_done == k and not marker.exists():
            marker.touch()
            os._exit(1)  # the worker process dies mid-epoch
        if self.cfg.raise_rank_at_step is not None and self.rank == 1 and self.steps_done == self.cfg.raise_rank_at_step:
            with (Path(self.run_dir) / "raised").open("a") as f:  # one line per time the error is raised
                f.write("x\n")
            raise ValueError(f"toy: bad sample at step {self.steps_done}")
        return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"]), {}

    def evaluate(self, model, out_dir):
        with torch.no_grad():
            return {"mse": float(torch.nn.functional.mse_loss(model(self.x).squeeze(-1), self.y))}


def make_toy(base: dict, options: dict) -> ToyJob:
    """``train_data_parallel``'s make_job: the toy job with ``options`` over ``base``."""
    cfg = ToyConfig(**{**base, **{k: v for k, v in options.items() if v is not None}})
    return ToyJob(cfg, None, Path(cfg.run_dir), torch.device(cfg.device if cfg.device != "auto" else "cpu"))
