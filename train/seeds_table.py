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

from pipeline.io.run_files import CorruptRunFile, read_config_file, read_json_file, read_results_file, skipped_line


def _options(run: Path) -> dict:
    path = run / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no config.json (not a run folder)")
    from train.config import TrainerConfig

    skip = TrainerConfig.EVAL_ONLY | {"seed"}
    stored = read_config_file(path)
    return {k: v for k, v in stored.items() if k not in skip}


def final_rows(run: Path) -> list[dict]:
    """The run's final evaluation as rows {benchmark, subset, metric, value, chance, ci_low, ci_high, n,
    unit, baseline_for, note} ([] when none):
    the harness table's, then the job's evaluate() metrics."""
    rows = []
    table = run / "eval" / "final" / "results.parquet"
    if table.is_file():
        rows += [{k: r.get(k) for k in ("benchmark", "subset", "metric", "value", "chance", "ci_low", "ci_high", "n",
                                        "unit", "baseline_for", "diff_vs", "diff", "diff_low", "diff_high", "note")}
                 for r in read_results_file(table).to_pylist()]
    metrics = run / "eval" / "final" / "metrics.json"
    if metrics.is_file():
        res = read_json_file(metrics)
        if not isinstance(res, dict):
            raise CorruptRunFile(f"{metrics}: expected a JSON object of metrics, got {type(res).__name__}")
        rows += [{"benchmark": "evaluate", "subset": "", "metric": k, "value": v, "chance": None}
                 for k, v in res.items() if isinstance(v, (int, float))]
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
    read, corrupt = [], []
    for run in map(Path, runs):  # a run folder with a corrupt file is named and skipped
        try:
            read.append((run, _options(run), final_rows(run)))
        except CorruptRunFile as e:
            corrupt.append(str(e))
    if not read and corrupt:
        raise CorruptRunFile(skipped_line(corrupt))
    labels = configuration_labels([o for _, o, _ in read])
    cells: dict[tuple, list[float]] = defaultdict(list)
    chance: dict[tuple, object] = {}
    missing = []
    for (run, _, rows), label in zip(read, labels):
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
    if corrupt:
        lines += ["", skipped_line(corrupt)]
    return "\n".join(lines)
