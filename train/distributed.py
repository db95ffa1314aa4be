"""Data-parallel training on Ray Train: ``train run <job> --workers N``.

A :class:`ray.train.torch.TorchTrainer` starts N workers (one CPU each, or ``gpus_per_worker``
GPUs) and sets up their process group (gloo on CPU, NCCL on GPUs). Every worker builds the same job
with its rank, the per-worker batch size (``batch_size // N``: the effective batch stays the
configured one, the paper's) and the run's folder, and runs the one shared loop
(:func:`train.loop.train`) with a :class:`Ranks`: each rank trains on its own batches of the epoch
(train/job.py), gradients are averaged over the ranks after every backward pass (what DDP does;
the jobs' losses call their models' own methods, not ``forward``, so the model is not wrapped in
``DistributedDataParallel``, whose reducer only hooks ``forward``), and rank 0 alone writes the run
folder. A worker that dies makes Ray Train restart the group (``max_failures`` times); every rank
then resumes from ``checkpoints/last.pt``, which holds the data position: the continuation is exact.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Ranks:
    """This process's place in a data-parallel run (the defaults: one process, no communication)."""

    rank: int = 0
    world_size: int = 1
    run_cfg: Any = None  # the run's configuration (full batch size): what the run folder records

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def _on(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self._on():
            torch.distributed.barrier()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's initial weights on every rank (they agree already when seeded alike; this makes sure)."""
        if self._on():
            for t in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(t.data, src=0)

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Each parameter's gradient <- its mean over the ranks, in one all-reduce (a parameter that
        no rank gave a gradient keeps none, as in one process)."""
        if not self._on() or not params:
            return
        has = [p.grad is not None for p in params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] +
                         [torch.tensor(has, dtype=torch.float32, device=grads[0].device)])
        torch.distributed.all_reduce(flat)
        flat /= self.world_size
        any_grad = flat[-len(params):] > 0
        off = 0
        for p, g, ok in zip(params, grads, any_grad.tolist()):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(g).to(g.dtype) if ok else None
            off += n

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """The ranks' mean of each value (every rank logs the same keys)."""
        if not self._on() or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist())}

    def sum(self, value: float) -> float:
        if not self._on():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item())


def worker_batch_size(batch_size: int | None, workers: int) -> int | None:
    """The per-worker batch: ``batch_size // workers`` (the effective batch stays ``batch_size``)."""
    if batch_size is None or workers <= 1:
        return batch_size
    if batch_size // workers < 2:
        raise ValueError(f"batch_size {batch_size} over {workers} workers leaves fewer than 2 samples per worker")
    if batch_size % workers:
        print(f"batch_size {batch_size} is not a multiple of {workers} workers: each worker takes "
              f"{batch_size // workers} (effective batch {batch_size // workers * workers})", file=sys.stderr)
    return batch_size // workers


def _worker(config: dict) -> None:
    """Ray Train's per-worker function: build this rank's job and run the shared loop."""
    import ray.train

    from train.loop import train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    options = {"batch_size": worker_batch_size(config["batch_size"], world), "run_dir": config["run_dir"]}
    if config["gpus_per_worker"]:
        import ray.train.torch

        options["device"] = str(ray.train.torch.get_device())
    job = config["make_job"](options)
    job.rank, job.world_size = rank, world
    train(job, resume=True, progress=config["progress"],
          dist=Ranks(rank, world, config["run_cfg"]))


def start_over(run_dir: Path) -> None:
    """``--fresh`` with workers: drop the run's checkpoint, metrics and recorded config before the
    workers start, so that they (and a restarted worker group) resume from nothing."""
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.jsonl", "config.json"):
        (run_dir / name).unlink(missing_ok=True)


def train_data_parallel(make_job: Callable[[dict], Any], run_cfg, run_dir: Path, workers: int, *,
                        gpus_per_worker: float = 0, resume: bool = True, progress: bool = True,
                        max_failures: int = 3) -> dict:
    """Train with ``workers`` Ray Train workers on the Ray that is up (pipeline.runtime.ensure_ray);
    returns the final evaluation (``eval/final/metrics.json``). The workers always resume from the
    run's ``checkpoints/last.pt`` (a restarted worker group must); ``resume=False`` removes it first.

    ``make_job(options) -> Job``: builds the job with ``options`` (``batch_size``, ``run_dir``,
    ``device``) replacing the configuration's; it runs in each worker, so it must pickle (a
    module-level function or a functools.partial of one)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = Path(run_dir).resolve()
    per_worker = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"make_job": make_job, "run_cfg": run_cfg, "run_dir": str(run_dir),
                           "progress": progress, "batch_size": run_cfg.batch_size,
                           "gpus_per_worker": gpus_per_worker},
        torch_config=TorchConfig(backend="nccl" if gpus_per_worker else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(gpus_per_worker),
                                     resources_per_worker=per_worker),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray_train"),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    if not resume:
        start_over(run_dir)
    trainer.fit()
    final = run_dir / "eval" / "final" / "metrics.json"
    return json.loads(final.read_text()) if final.is_file() else {}
