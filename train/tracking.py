"""Experiment tracking through the ecosystem's own tools: every run folder gets TensorBoard event
files, and ``train.<job>.logger`` adds MLflow or Weights & Biases.

The loop's metric lines (``metrics.jsonl``: train rows with the losses, learning rate and rates;
eval rows with every metric the job's ``evaluate()`` returns) go, as they are written, to

- TensorBoard (always; tensorboardX, which Ray installs): ``<run>/tensorboard/events.out.tfevents.*``.
  Tags: ``train/<key>`` and ``eval/<key>`` for each number of the row, and ``eval_chance/<metric>``
  for each evaluation metric whose chance level the row carries (named as the report finds it:
  :func:`pipeline.report.curves.chance_keys`). At the end of the run the harness table of the final
  model (``eval/final/results.parquet``) is added: ``final/<benchmark>/<subset>/<metric>`` and its
  ``final_chance/...`` beside it. ``tensorboard --logdir <output>/train`` shows every run.
- ``logger: mlflow`` (extra ``.[mlflow]``): the run as an MLflow run with the same metrics (``/``
  is kept; MLflow allows it) and the run's options as parameters, in the tracking store of
  ``MLFLOW_TRACKING_URI``, by default a local file store ``<output>/train/mlruns`` (:func:`mlflow_store`;
  MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for it, set here; ``mlflow ui --backend-store-uri
  <that folder>`` with the full ``mlflow`` package). Experiment: the job's name.
- ``logger: wandb`` (extra ``.[wandb]``): a W&B run (project ``vlpipe-<job>``) in offline mode
  unless ``WANDB_MODE`` says otherwise, written under ``<run>/wandb`` (``wandb sync`` uploads it).

Only the writing rank logs (rank 0 with ``--workers``; :func:`train.loop.train`); a tracker that
fails to start is said in one line and the run trains on (metrics.jsonl and the report do not depend
on it). The report keeps drawing its curves from metrics.jsonl.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.errors import describe_exception

LOGGERS = ("none", "mlflow", "wandb")  # train.<job>.logger; TensorBoard is always on


def _numbers(row: dict) -> dict[str, float]:
    return {str(k): float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
            and k not in ("step", "epoch")}


def scalars(row: dict) -> dict[str, float]:
    """A metric line's scalars, tagged: ``train/<k>``, ``eval/<k>``, ``eval_chance/<metric>``
    (``best`` lines: ``best/<metric>``)."""
    kind = row.get("kind", "train")
    nums = _numbers(row)
    if kind == "best":
        return {f"best/{row.get('metric')}": float(row["value"])} if isinstance(row.get("value"), (int, float)) else {}
    out = {f"{kind}/{k}": v for k, v in nums.items()}
    if kind == "eval":
        from pipeline.report.curves import chance_keys

        chances = [k for k in nums if "chance" in k]
        for metric, c in chance_keys([k for k in nums if "chance" not in k], chances).items():
            out[f"eval_chance/{metric}"] = nums[c]
    return out


def final_scalars(run_dir: Path) -> dict[str, float]:
    """The final model's harness table (eval/final/results.parquet) as scalars with their chance."""
    table = Path(run_dir) / "eval" / "final" / "results.parquet"
    if not table.is_file():
        return {}
    import pyarrow.parquet as pq

    out = {}
    for r in pq.read_table(table).to_pylist():
        tag = "/".join(str(x) for x in (r.get("benchmark"), r.get("subset"), r.get("metric")) if x not in (None, ""))
        for prefix, key in (("final", "value"), ("final_chance", "chance")):
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{prefix}/{tag}"] = float(v)
    return out


class _TensorBoard:
    def __init__(self, run_dir: Path, cfg, first_step: int):
        from tensorboardX import SummaryWriter

        # purge_step: a resumed (or --fresh) run hides the events an earlier run wrote from its first step on
        # the file name holds only the second and the host: a run resumed (or redone) within the same
        # second would overwrite the earlier file; a nanosecond suffix keeps every writer's file, in order
        self.w = SummaryWriter(logdir=str(run_dir / "tensorboard"), flush_secs=10, purge_step=first_step,
                               filename_suffix=f".{time.time_ns()}")
        self.w.add_text("config", "```\n" + json.dumps(cfg.model_dump(mode="json"), indent=1) + "\n```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


def mlflow_store(run_dir: Path) -> Path:
    """The default MLflow file store: ``<output>/train/mlruns`` for a run in ``<output>/train/<job>/<tag>``
    (every job's runs in one store), else ``<run>/mlruns``."""
    run_dir = Path(run_dir)
    return (run_dir.parent.parent if run_dir.parent.parent.name == "train" else run_dir) / "mlruns"


class _MLflow:
    def __init__(self, run_dir: Path, cfg, job: str):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps the file store in maintenance mode behind this switch: a local folder, no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(mlflow_store(run_dir).resolve().as_uri())
        mlflow.set_experiment(job or "vlpipe")
        self.run = mlflow.start_run(run_name=run_dir.name, tags={"run_dir": str(run_dir)})
        params = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in cfg.training_config().items()}
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _mlflow_key(k: str) -> str:
    """MLflow metric names: alphanumerics, ``_ - . / space``; the rest (``@``) spelt out."""
    return "".join(c if c.isalnum() or c in "_-./ " else {"@": "_at_", "+": "_plus_"}.get(c, "_") for c in k)


class _WandB:
    def __init__(self, run_dir: Path, cfg, job: str):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=f"vlpipe-{job or 'run'}", name=run_dir.name, dir=str(run_dir),
                              config=cfg.training_config(), reinit="finish_previous")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """The run's trackers: TensorBoard, plus the one of ``cfg.logger``."""

    def __init__(self, run_dir: Path, cfg, job: str = "", first_step: int = 0):
        self.run_dir = Path(run_dir)
        self.sinks: list[Any] = []
        self.last_step = 0
        choice = getattr(cfg, "logger", "none") or "none"
        makers = [("tensorboard", lambda: _TensorBoard(self.run_dir, cfg, first_step))]
        if choice == "mlflow":
            makers.append(("mlflow", lambda: _MLflow(self.run_dir, cfg, job)))
        elif choice == "wandb":
            makers.append(("wandb", lambda: _WandB(self.run_dir, cfg, job)))
        for name, make in makers:
            try:
                self.sinks.append(make())
            except ImportError:
                extra = f" (pip install -e '.[{name}]')" if name != "tensorboard" else ""
                print(f"tracking: {name} is not installed{extra}; the run logs to metrics.jsonl and TensorBoard",
                      file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a run
                print(f"tracking: {name} did not start ({describe_exception(e, 200)})", file=sys.stderr)

    def log(self, row: dict) -> None:
        step = int(row.get("step") or 0)
        self.last_step = max(self.last_step, step)
        self._send(scalars(row), step)

    def _send(self, values: dict[str, float], step: int) -> None:
        if not values:
            return
        for s in list(self.sinks):
            try:
                s.log(values, step)
            except Exception as e:  # noqa: BLE001
                print(f"tracking: {type(s).__name__.strip('_')} stopped ({type(e).__name__}: {e})", file=sys.stderr)
                self.sinks.remove(s)

    def close(self) -> None:
        self._send(final_scalars(self.run_dir), self.last_step)
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - said, never raised: the run itself is complete
                print(f"tracking: {type(s).__name__.strip('_')} did not close ({type(e).__name__}: {e})", file=sys.stderr)
        self.sinks = []


_OPEN: dict[Path, Tracker] = {}


def record(run_dir: Path, row: dict, cfg, job: str = "") -> None:
    """Send one metric line of the run in ``run_dir`` to its trackers (opened on its first line)."""
    key = Path(run_dir).resolve()
    t = _OPEN.get(key)
    if t is None:
        t = _OPEN[key] = Tracker(key, cfg, job, int(row.get("step") or 0))
    t.log(row)


def close(run_dir: Path) -> None:
    """End the run's trackers (the final harness table is added first); a no-op when none is open."""
    t = _OPEN.pop(Path(run_dir).resolve(), None)
    if t is not None:
        t.close()


@atexit.register
def _close_all() -> None:
    for key in list(_OPEN):
        close(key)
