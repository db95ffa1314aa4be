"""Data-parallel training on Ray Train: ``train run <job> --workers N``.

A :class:`ray.train.torch.TorchTrainer` starts N workers (one CPU each, or ``gpus_per_worker``
GPUs) and sets up their process group (gloo on CPU, NCCL on GPUs). Every worker builds the same job
with its rank (:data:`train.job.PLACE`, set before the job is built), the per-worker batch size
(``batch_size / N``, exact: the effective batch stays the configured one, the paper's) and the run's
folder, in the user's working directory (the paths of the command line were made absolute by the
driver, and the others, inside the manifest, mean what they meant there), and runs the one shared
loop (:func:`train.loop.train`) with a :class:`Ranks`: each rank trains on its own batches of the
epoch (train/job.py), gradients are averaged over the ranks after every backward pass (what DDP
does; the jobs' losses call their models' own methods, not ``forward``, so the model is not wrapped
in ``DistributedDataParallel``, whose reducer only hooks ``forward``), and rank 0 alone writes the
run folder.

Before any worker starts, :func:`preflight` refuses (one line, exit 2) what no retry can fix: more
workers than the cluster can place, a batch that does not split exactly over the workers, a
training split with fewer samples than workers. Ray Train retries only faults: a worker process or
node lost (:class:`FaultsOnly`, at most ``max_failures`` times); an exception raised by the
training code (a bug, bad data) ends the run at once. After a retry every rank resumes from
``checkpoints/last.pt``, which holds the data position: the continuation is exact. Ray's output and
the workers' (tracebacks included) go to ``<run>/train.log``; the terminal gets a progress line
and, on failure, one line naming the worker and the cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import shorten
from train.ranks import Ranks


class PreflightError(ValueError):
    """A data-parallel run that cannot start as configured (one line: what, and what would work)."""


def worker_batch_size(batch_size: int | None, workers: int) -> int | None:
    """The per-worker batch: ``batch_size / workers``, exactly (the effective batch stays
    ``batch_size``); a batch that does not split is refused."""
    if batch_size is None or workers <= 1:
        return batch_size
    if batch_size % workers:
        lo, hi = batch_size // workers * workers, (batch_size // workers + 1) * workers
        sizes = [b for b in (lo, hi) if b >= 2 * workers] or [2 * workers]  # 2 samples a worker at least
        divisors = [w for w in range(2, min(batch_size, 64) + 1) if batch_size % w == 0][:6]
        raise PreflightError(
            f"batch_size {batch_size} does not split exactly over {workers} workers: set batch_size to a multiple of "
            f"{workers} ({', '.join(map(str, sizes))}) or use --workers {' / '.join(map(str, divisors)) or '1'}")
    if batch_size // workers < 2:
        raise PreflightError(f"batch_size {batch_size} over {workers} workers leaves fewer than 2 samples per worker: "
                             f"use --workers {batch_size // 2} or fewer")
    return batch_size // workers


def placeable_workers(gpus_per_worker: float = 0) -> tuple[int, str]:
    """(how many workers of 1 CPU (+ ``gpus_per_worker`` GPUs) the Ray cluster's live nodes can hold
    at once, the cluster's resources in words)."""
    import ray

    n, cpus, gpus = 0, 0.0, 0.0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources") or {}
        c, g = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        cpus, gpus = cpus + c, gpus + g
        k = int(c + 1e-9)
        if gpus_per_worker:
            k = min(k, int(g / gpus_per_worker + 1e-9))
        n += k
    what = f"{cpus:g} CPUs" + (f", {gpus:g} GPUs at {gpus_per_worker:g} per worker" if gpus_per_worker else "")
    return n, what


def check_config(run_cfg, workers: int, gpus_per_worker: float = 0) -> int:
    """The configuration's part of :func:`preflight` (no Ray needed); returns the per-worker batch."""
    per_worker = worker_batch_size(run_cfg.batch_size, workers)
    device = str(getattr(run_cfg, "device", "auto"))
    if device.startswith("cuda") and not gpus_per_worker:
        raise PreflightError(f"device {device} with gpus_per_worker 0: the workers would get no GPU; pass "
                             "--gpus-per-worker 1, or device auto / cpu")
    return per_worker


def preflight(run_cfg, workers: int, gpus_per_worker: float = 0, job=None) -> int:
    """Refuse, before any worker starts, a run that cannot train as configured (:func:`check_config`,
    then the cluster and the data); returns the per-worker batch. ``job``: the run's job built in this
    process (one rank): its training split's size (:meth:`train.job.Job.fit_batch`) must give every
    worker a sample."""
    per_worker = check_config(run_cfg, workers, gpus_per_worker)
    can, what = placeable_workers(gpus_per_worker)
    if workers > can:
        raise PreflightError(f"--workers {workers}: the Ray cluster can place {can} worker{'s' * (can != 1)} "
                             f"({what}, 1 CPU per worker): use --workers {max(1, can)} or fewer")
    if job is not None:
        job.batches_per_epoch()  # the job counts its training split (cached)
        n = job.train_items
        if n is not None and n < workers:
            raise PreflightError(f"the training split has {n} samples, fewer than the {workers} workers (each needs "
                                 f"at least 1): use --workers {max(1, n)} or fewer")
    return per_worker


def _worker(config: dict) -> None:
    """Ray Train's per-worker function: build this rank's job and run the shared loop."""
    import ray.train

    from train import job as job_module
    from train.loop import train

    if os.path.isdir(config["cwd"]):  # Ray Train starts workers elsewhere: relative paths are the user's
        os.chdir(config["cwd"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job_module.PLACE = (rank, world)
    options = {"batch_size": config["per_worker"], "run_dir": config["run_dir"]}
    if config["gpus_per_worker"]:
        import ray.train.torch

        options["device"] = str(ray.train.torch.get_device())
    job = config["make_job"](options)
    job.rank, job.world_size = rank, world
    train(job, resume=True, progress=config["progress"], dist=Ranks(rank, world, config["run_cfg"]))


def start_over(run_dir: Path) -> None:
    """``--fresh`` with workers: drop the run's checkpoint, metrics and recorded config before the
    workers start, so that they (and a restarted worker group) resume from nothing."""
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.jsonl", "config.json"):
        (run_dir / name).unlink(missing_ok=True)


def _faults_only_policy(failure_config):
    """Ray Train's default failure policy, retrying only a lost worker or node (and a worker group
    that could not start, bounded by ``controller_failure_limit``), never an exception of the
    training code: that one would fail again on every retry."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    class FaultsOnly(DefaultFailurePolicy):
        def make_decision(self, training_failed_error):
            if isinstance(training_failed_error, WorkerGroupError) and not any(
                    isinstance(e, (RayActorError, WorkerHealthCheckFailedError))
                    for e in training_failed_error.worker_failures.values()):
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

    return FaultsOnly(failure_config)


def _trainer_class(embedded: bool):
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        """TorchTrainer with :func:`_faults_only_policy`; on an embedded Ray (no dashboard, its
        processes end with this one) without the placement-group cleaner, whose state-API polling
        needs a dashboard."""

        def _initialize_and_run_controller(self, **kw):
            kw["failure_policy"] = _faults_only_policy(self.run_config.failure_config)
            if embedded:
                from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

                kw["callbacks"] = [c for c in kw.get("callbacks", []) if not isinstance(c, PlacementGroupCleanerCallback)]
            return super()._initialize_and_run_controller(**kw)

    return Trainer


class WorkerFailed(RuntimeError):
    """A data-parallel run ended by a worker's error: ``str()`` is one line naming the worker and the cause."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    last = text.splitlines()[-1].strip() if text else ""
    return f"{type(e).__name__}: {shorten(last)}" if last else type(e).__name__


def _collateral(e: BaseException) -> bool:
    """A rank's error that follows another rank's (a collective whose peer went away)."""
    t = f"{type(e).__name__} {e}".lower()
    return any(w in t for w in ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                                "distbackenderror", "peer"))


def describe_failure(err: BaseException) -> str:
    """One line: the first worker whose own error ended the run, and that error."""
    failures = getattr(err, "worker_failures", None)
    if not failures:
        cause = getattr(err, "controller_failure", None) or err.__cause__ or err
        return f"the Ray Train controller failed ({_one_line(cause)})"
    rank = sorted(failures, key=lambda r: (_collateral(failures[r]), r))[0]
    e = failures[rank]
    if hasattr(e, "health_check_failure"):
        e = e.health_check_failure
    others = len(failures) - 1
    return f"worker {rank} failed ({_one_line(e)})" + (f"; {others} other worker{'s' * (others > 1)} stopped with it"
                                                        if others else "")


@contextlib.contextmanager
def run_log(run_dir: Path):
    """``<run>/train.log`` (yielded) as a log file of the process while the block runs: Ray's output and
    the workers' lines (their tracebacks) go there instead of the terminal
    (:func:`pipeline.runtime.route_ray_output`, which :func:`pipeline.runtime.ensure_ray` applies)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "train.log"
    root = logging.getLogger()
    fh = logging.FileHandler(path)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    fh.setLevel(logging.INFO)
    root.addHandler(fh)
    level = root.level
    if level > logging.INFO or level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield path
    finally:
        root.removeHandler(fh)
        fh.close()
        root.setLevel(level)


class _Progress:
    """A line on the terminal every ``every`` seconds: the run's latest step and loss (metrics.jsonl)."""

    def __init__(self, run_dir: Path, every: float, enabled: bool):
        self.run_dir, self.every, self.enabled = run_dir, every, enabled
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from train.sweep import _latest

        while not self.stop.wait(self.every):
            print(f"{self.run_dir.name}: {_latest(self.run_dir)}", file=sys.stderr, flush=True)

    def __enter__(self):
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.enabled:
            self.thread.join(timeout=5)


def train_data_parallel(make_job: Callable[[dict], Any], run_cfg, run_dir: Path, workers: int, *,
                        gpus_per_worker: float = 0, resume: bool = True, progress: bool = True,
                        max_failures: int = 3, job=None, embedded: bool = True,
                        progress_every: float = 30.0) -> dict:
    """Train with ``workers`` Ray Train workers on the Ray that is up (pipeline.runtime.ensure_ray);
    returns the final evaluation (``eval/final/metrics.json``). :func:`preflight` first (``job``:
    the run's job built here, for its training split's size). The workers always resume from the
    run's ``checkpoints/last.pt`` (a restarted worker group must); ``resume=False`` removes it first.
    Raises :class:`PreflightError` before any worker starts, :class:`WorkerFailed` (one line) when a
    worker's error ended the run.

    ``make_job(options) -> Job``: builds the job with ``options`` (``batch_size``, ``run_dir``,
    ``device``) replacing the configuration's; it runs in each worker, so it must pickle (a
    module-level function or a functools.partial of one)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from train.run_folder import claim_run_folder

    run_dir = Path(run_dir).resolve()
    per_worker = preflight(run_cfg, workers, gpus_per_worker, job)
    claim_run_folder(run_dir, getattr(job, "NAME", ""))  # before Ray Train writes ray_train/ there
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # _worker moves to the user's folder itself
    resources = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    trainer = _trainer_class(embedded)(
        _worker,
        train_loop_config={"make_job": make_job, "run_cfg": run_cfg, "run_dir": str(run_dir), "cwd": os.getcwd(),
                           "progress": False, "per_worker": per_worker, "gpus_per_worker": gpus_per_worker},
        torch_config=TorchConfig(backend="nccl" if gpus_per_worker else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(gpus_per_worker),
                                     resources_per_worker=resources),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray_train"),
                             failure_config=FailureConfig(max_failures=max_failures, controller_failure_limit=2)),
    )
    if not resume:
        start_over(run_dir)
    try:
        with _Progress(run_dir, progress_every, progress):
            trainer.fit()
    except Exception as e:  # ray.train's TrainingFailedError: WorkerGroupError / ControllerError
        logging.getLogger("train").error("data-parallel run in %s failed:\n%s", run_dir, e, exc_info=e)
        raise WorkerFailed(describe_failure(e)) from None
    final = run_dir / "eval" / "final" / "metrics.json"
    return json.loads(final.read_text()) if final.is_file() else {}
