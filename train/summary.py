"""What ``train run`` prints when it ends: a short aligned table for people (``--json``: one JSON line).

The run's folder, its steps and final training loss (the last ``train`` row of ``metrics.jsonl``)
and the headline metrics of the final evaluation, each beside its chance level. The full results
stay in the run folder (``eval/final/metrics.json``); the table shows the metrics that have a
chance level (else the first few) so that it fits on a screen.
"""

from __future__ import annotations

import json
import math
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


MAIN_SUBSETS = ("all", "overall", "", "held_out", "i2t", "t2i")


def result_rows(run_dir: Path) -> list[dict]:
    """The run's final ``results.parquet`` rows (the harness's and the job's own, with interval and n),
    each with its ``verdict`` (:func:`pipeline.report.significance.verdicts`: the paired difference from
    the strongest no-learning baseline reported beside it, else chance), that ``bar`` and ``diff_text``
    (the difference and its 95% interval): [] when the run has none."""
    from pipeline.report.significance import diff_text, judged, with_reason
    from train.seeds_table import final_rows

    rows = [r for r in final_rows(Path(run_dir)) if r.get("benchmark") != "evaluate"]
    for r, (v, bar) in zip(rows, judged(rows)):
        r["verdict"], r["bar"] = with_reason(v, r) or "", bar  # a degenerate row's reason beside it
        r["diff_text"] = diff_text(r, lambda x: ("+" if x > 0 else "") + fmt_num(x)).replace(f" vs {r.get('diff_vs')}", "")
    return rows


def _main(rows: list[dict]) -> list[dict]:
    """Result rows worth a headline: not a baseline, with a chance level, a benchmark's overall row
    (or any row of a benchmark without one)."""
    with_all = {r["benchmark"] for r in rows if (r.get("subset") or "") in ("all", "overall")}
    return [r for r in rows if r["verdict"] != "baseline" and r.get("chance") is not None
            and ((r.get("subset") or "") in MAIN_SUBSETS or r["benchmark"] not in with_all)]


def _headline(job: str, rows: list[dict]) -> dict | None:
    """The job's headline row: the first of its module's ``HEADLINE`` patterns ((benchmark, subset,
    metric), None matching any) found, else its first main row."""
    try:
        from train.registry import registry

        pats = getattr(registry().get(job), "HEADLINE", ())
    except Exception:  # an unknown job name (tests): no patterns
        pats = ()
    main = _main(rows)
    for b, s, m in pats:
        for r in main:
            if (b is None or r["benchmark"] == b) and (s is None or (r.get("subset") or "") == s) and \
                    (m is None or r["metric"] == m):
                return r
    return main[0] if main else None


def _label(r: dict) -> str:
    return "/".join(x for x in (r["benchmark"], r.get("subset") or "", r["metric"]) if x)


def _ci(r: dict) -> str:
    lo, hi = r.get("ci_low"), r.get("ci_high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "—"
    return f"[{fmt_num(lo)}, {fmt_num(hi)}]"


def _bar(r: dict) -> str:
    """The no-learning bar the verdict used: the strongest baseline reported beside the row (the paired
    difference is against it; the row must clear chance as well), else chance."""
    b, c = r.get("bar"), r.get("chance")
    if b is not None:
        return f"{fmt_num(b[1])} ({b[0]})"
    return f"{fmt_num(c)} (chance)" if c is not None else "—"


def summary_table(job: str, run_dir: Path, res: dict) -> str:
    """The lines ``train run`` prints at its end."""
    train_rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") == "train"]
    last = train_rows[-1] if train_rows else {}
    head = [["job", "steps", "final loss"], [job, fmt_num(last.get("step")), fmt_num(last.get("loss"))]]
    lines = [*_align(head, right={1, 2}), f"run folder: {run_dir}"]  # the path once, on its own line
    if "interrupted_at" in res:
        return "\n".join([*lines, f"interrupted at step {res['interrupted_at']}: rerun the command to resume"])
    main = _main(result_rows(run_dir))
    if main:  # held-out results with interval, n and a verdict against the no-learning bar
        shown = main[:HEADLINE_ROWS]
        table = [["metric", "value", "95% interval", "no-learning bar", "n", "verdict", "diff vs bar [95%]"],
                 *([_fit(_label(r), 36), fmt_num(r["value"]), _ci(r), _fit(_bar(r), 22), fmt_num(r.get("n")),
                    r["verdict"] or "—", _fit_diff(r)] for r in shown)]  # within 120 columns
        lines += ["", *_align(table, right={1, 4})]
        more = len(main) - len(shown)
        where = Path(run_dir) / "eval" / "final" / "results.md"
    else:
        metrics, more = headline_metrics(res)
        metrics = _with_chance(metrics, run_dir)
        if metrics:
            table = [["metric", "value", "chance"],
                     *([k, fmt_num(v), fmt_num(c) if c is not None else ""] for k, v, c in metrics)]
            lines += ["", *_align(table, right={1, 2})]
        where = Path(run_dir) / "eval" / "final" / "metrics.json"
    what = "rows" if main else "metrics"
    lines += [f"{f'{more} more {what}' if more else f'all {what}'} (--json prints the metrics on one line):", f"  {where}"]
    return "\n".join(lines)


def _fit(text: str, width: int) -> str:
    """A ``benchmark/subset/metric`` label in ``width`` columns: the start of the benchmark, an
    ellipsis, then its last two parts whole; a ``value (baseline)`` bar cut inside its parenthesis."""
    if len(text) <= width:
        return text
    if text.endswith(")"):
        return text[: width - 2] + "…)"
    tail = text[text.rfind("/", 0, text.rfind("/")):] if text.count("/") >= 2 else ""
    keep = width - 1 - len(tail)
    if keep < 4:
        tail, keep = text[-(width - 5):], 4
    return text[:keep] + "…" + tail


def _fit_diff(r: dict) -> str:
    """The paired difference from the bar and its 95% interval (the bar column names the baseline); "—"
    for a row judged against chance."""
    return r.get("diff_text") or "—"


CLOSING_WIDTH = 120  # the closing table's columns (the run folders, whole, below it)


def runs_table(done: list[tuple], failed: list[str]) -> str:
    """``train run all``'s closing table, within CLOSING_WIDTH columns: per job (``done``: (job, run
    folder, result[, wall seconds])) its headline result (value, 95% interval, the no-learning bar it
    is judged against: chance or the strongest baseline the job reports, n, verdict, the paired difference
    from that baseline with its 95% interval) and wall time of
    the whole run; the jobs that did not train; the run folders below the table, whole. Each job's own
    table above it gives the run's steps and final loss."""
    rows = [["job", "headline", "value", "95% interval", "no-learning bar", "n", "verdict", "diff vs bar [95%]", "wall"]]
    folders = []
    for job, run_dir, res, *wall in done:
        w = f"{wall[0]:.0f}s" if wall else "-"
        r = _headline(job, result_rows(run_dir))
        if r is not None:
            rows.append([job, _label(r), fmt_num(r["value"]), _ci(r), _bar(r), fmt_num(r.get("n")),
                         r["verdict"] or "—", _fit_diff(r), w])
        else:  # no results table: the job's evaluate() metric beside its chance, no interval
            head = _with_chance(headline_metrics(res, limit=1)[0], run_dir)
            k, v, c = head[0] if head else ("-", None, None)
            rows.append([job, k, fmt_num(v), "—", f"{fmt_num(c)} (chance)" if c is not None else "—", "—", "—", "—", w])
        folders.append(f"  {job}: {run_dir}")
    # the headline and bar columns share what the others leave of CLOSING_WIDTH (2 spaces between columns)
    other = sum(max(len(r[i]) for r in rows) for i in (0, 2, 3, 5, 6, 7, 8)) + 2 * 8
    room = max(CLOSING_WIDTH - other, 30)
    head_w = min(max(len(r[1]) for r in rows), max(room - max(len(r[4]) for r in rows), room * 4 // 7))
    bar_w = room - head_w
    rows = [[r[0], _fit(r[1], head_w), r[2], r[3], _fit(r[4], bar_w), *r[5:]] for r in rows]
    out = _align(rows, right={2, 5, 8})
    width = max(len(x) for x in out)
    out += [f"{job:{len(rows[0][0]) if len(rows) > 1 else len(job)}s}  did not train (see the error above)"[:width]
            for job in failed]
    return "\n".join([*out, *(["run folders:", *folders] if folders else [])])
