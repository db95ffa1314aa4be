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
from pathlib import Path
from typing import Any

from train.ranks import Ranks


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
