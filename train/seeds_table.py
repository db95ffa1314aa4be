"""Runs grouped by configuration, mean +- std over their seeds (``train compare --over-seeds``, the
table that ends ``train sweep``).

Each run folder's ``config.json`` gives its training options; runs whose options differ only in
``seed`` form one configuration, named by the options that vary between the configurations. Each
run's final evaluation is read from ``eval/final/results.parquet`` (the harness table: benchmark,
subset, metric, value, chance) and ``eval/final/metrics.json`` (the job's evaluate(): benchmark
``evaluate``, no chance).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path


def _options(run: Path) -> dict:
    path = run / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no config.json (not a run folder)")
    from train.config import TrainerConfig

    skip = TrainerConfig.EVAL_ONLY | {"seed"}
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in skip}


def final_rows(run: Path) -> list[dict]:
    """The run's final evaluation as rows {benchmark, subset, metric, value, chance, ci_low, ci_high, n}
    ([] when none):
    the harness table's, then the job's evaluate() metrics."""
    rows = []
    table = run / "eval" / "final" / "results.parquet"
    if table.is_file():
        import pyarrow.parquet as pq

        rows += [{k: r.get(k) for k in ("benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n")}
                 for r in pq.read_table(table).to_pylist()]
    metrics = run / "eval" / "final" / "metrics.json"
    if metrics.is_file():
        rows += [{"benchmark": "evaluate", "subset": "", "metric": k, "value": v, "chance": None}
                 for k, v in json.loads(metrics.read_text()).items() if isinstance(v, (int, float))]
    return rows


def configuration_labels(options: Sequence[dict]) -> list[str]:
    """A label per run: ``key=value`` of the options that vary between the runs (``all`` when none)."""
    keys = sorted({k for o in options for k in o})
    varying = [k for k in keys if len({json.dumps(o.get(k), sort_keys=True) for o in options}) > 1]
    return [", ".join(f"{k}={o.get(k)}" for k in varying) or "all" for o in options]


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4g}"


def seeds_table(runs: Sequence[str | Path]) -> str:
    """Markdown: a row per (configuration, benchmark, subset, metric): mean +- std over the
    configuration's seeds (sample std; 0 for one seed), the number of seeds, chance."""
    runs = [Path(r) for r in runs]
    labels = configuration_labels([_options(r) for r in runs])
    cells: dict[tuple, list[float]] = defaultdict(list)
    chance: dict[tuple, object] = {}
    missing = []
    for run, label in zip(runs, labels):
        rows = final_rows(run)
        if not rows:
            missing.append(str(run))
        for r in rows:
            if isinstance(r["value"], (int, float)) and r["value"] is not None:
                key = (label, r["benchmark"], r["subset"] or "", r["metric"])
                cells[key].append(float(r["value"]))
                chance.setdefault(key, r.get("chance"))
    lines = ["| configuration | benchmark | subset | metric | mean +- std | seeds | chance |",
             "|---|---|---|---|---:|---:|---:|"]
    for key, vals in cells.items():
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        lines.append(f"| {' | '.join(key)} | {_fmt(mean)} +- {_fmt(std)} | {n} | {_fmt(chance[key])} |")
    if missing:
        lines.append("")
        lines.append(f"without a final evaluation (not counted): {', '.join(missing)}")
    return "\n".join(lines)
