"""What ``train run`` prints when it ends: a short aligned table for people (``--json``: one JSON line).

The run's folder, its steps and final training loss (the last ``train`` row of ``metrics.jsonl``)
and the headline metrics of the final evaluation, each beside its chance level. The full results
stay in the run folder (``eval/final/metrics.json``); the table shows the metrics that have a
chance level (else the first few) so that it fits on a screen.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.report.curves import COUNT_PREFIXES, chance_keys, is_count, read_metrics
from pipeline.report.formatting import fmt_num

HEADLINE_ROWS = 8


def result_json(job: str, run_dir: Path, res: dict) -> str:
    """The machine-readable line: rounded for people (4 decimals: 40.00000059604645 -> 40.0);
    metrics.jsonl keeps full precision."""
    return json.dumps({"job": job, "run_dir": str(run_dir), **{k: round(v, 4) if isinstance(v, float) else v
                                                                for k, v in res.items()}})


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def headline_metrics(res: dict, limit: int = HEADLINE_ROWS) -> tuple[list[tuple[str, float, float | None]], int]:
    """([(metric, value, chance or None)], how many numeric metrics were left out): the metrics
    with a chance level (sizes such as ``sugarcrepe/triples`` are no metric), overall figures
    (``overall``, ``avg_...``) first."""
    metrics = [k for k, v in res.items() if _numeric(v) and "chance" not in k and not k.startswith(COUNT_PREFIXES)
               and not is_count(k, [v])]
    chance_of = chance_keys(metrics, [k for k in res if "chance" in k])
    leaf = [k.rsplit("/", 1)[-1].lower() for k in metrics]
    overall = {k for k, lf in zip(metrics, leaf) if lf in ("overall", "all") or lf.startswith("avg_")}
    with_chance = sorted((k for k in metrics if k in chance_of), key=lambda k: k not in overall)
    chosen = (with_chance or metrics)[:limit]
    rows = [(k, res[k], res.get(chance_of[k]) if k in chance_of else None) for k in chosen]
    return rows, len(metrics) - len(chosen)


def results_chance(run_dir: Path) -> dict[str, float]:
    """metric -> chance from the run's final ``results.parquet`` (a job's own metrics carry their
    chance there, not in metrics.json); keyed by the metric and by ``benchmark/subset/metric``."""
    from train.seeds_table import final_rows

    out = {}
    for r in final_rows(Path(run_dir)):
        if r.get("chance") is not None:
            full = "/".join(x for x in (r["benchmark"], r.get("subset") or "", r["metric"]) if x)
            out.setdefault(full, r["chance"])
            out.setdefault(r["metric"], r["chance"])
    return out


def _with_chance(rows, run_dir: Path):
    if all(c is not None for _, _, c in rows):
        return rows
    known = results_chance(run_dir)
    return [(k, v, c if c is not None else known.get(k, known.get(k.rsplit("/", 1)[-1]))) for k, v, c in rows]


def _align(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def summary_table(job: str, run_dir: Path, res: dict) -> str:
    """The lines ``train run`` prints at its end."""
    train_rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") == "train"]
    last = train_rows[-1] if train_rows else {}
    head = [["job", "run folder", "steps", "final loss"],
            [job, str(run_dir), fmt_num(last.get("step")), fmt_num(last.get("loss"))]]
    lines = _align(head, right={2, 3})
    if "interrupted_at" in res:
        return "\n".join([*lines, f"interrupted at step {res['interrupted_at']}: rerun the command to resume"])
    metrics, more = headline_metrics(res)
    metrics = _with_chance(metrics, run_dir)
    if metrics:
        table = [["metric", "value", "chance"], *([k, fmt_num(v), fmt_num(c) if c is not None else ""] for k, v, c in metrics)]
        lines += ["", *_align(table, right={1, 2})]
    where = Path(run_dir) / "eval" / "final" / "metrics.json"
    lines.append(f"{f'{more} more metrics' if more else 'all metrics'}: {where} (--json prints them on one line)")
    return "\n".join(lines)


def runs_table(done: list[tuple], failed: list[str]) -> str:
    """``train run all``'s closing table: per job (``done``: (job, run folder, result[, wall seconds]))
    its steps, final loss, first headline metric beside chance, wall time of the whole run (training,
    evaluation, benchmarks) and run folder; the jobs that did not train."""
    rows = [["job", "steps", "final loss", "headline metric", "value", "chance", "wall", "run folder"]]
    for job, run_dir, res, *wall in done:
        train_rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") == "train"]
        last = train_rows[-1] if train_rows else {}
        head = _with_chance(headline_metrics(res, limit=1)[0], run_dir)
        k, v, c = head[0] if head else ("-", None, None)
        rows.append([job, fmt_num(last.get("step")), fmt_num(last.get("loss")), k, fmt_num(v), fmt_num(c),
                     f"{wall[0]:.0f}s" if wall else "-", str(run_dir)])
    rows += [[job, "-", "-", "did not train (see the error above)", "", "", "", ""] for job in failed]
    return "\n".join(_align(rows, right={1, 2, 4, 5, 6}))

