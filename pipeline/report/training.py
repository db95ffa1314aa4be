"""The report's training section: every run folder under ``<output>/train/`` with its curves
(:mod:`pipeline.report.curves`), evaluation tables with chance (``eval/<step>/results.parquet``,
else ``eval/<step>/metrics.json``) and the job's own figures."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from pipeline.io.run_files import CorruptRunFile, read_config_file, read_json_file, read_results_file
from pipeline.report.curves import chance_keys, plot_metrics, read_metrics
from pipeline.report.formatting import fmt_num, fmt_value
from pipeline.report.significance import BELOW_CHANCE_NOTE, diff_text, interval, verdicts

log = logging.getLogger("pipeline")


def eval_tables(run_dir: Path) -> list[dict]:
    tables = []
    ev = run_dir / "eval"
    if not ev.is_dir():
        return tables
    for d in sorted((p for p in ev.iterdir() if p.is_dir()), key=lambda p: (p.name != "final", p.name)):
        res = d / "results.parquet"
        if res.is_file():
            rows = read_results_file(res).to_pylist()
            out_rows = []
            for r, sig in zip(rows, verdicts(rows)):
                try:
                    reasons = json.loads(r.get("skip_reasons") or "{}")
                except ValueError:
                    reasons = {"?": r.get("skip_reasons")}
                unit = r.get("unit") or ""
                ci = interval(r)
                note = r.get("note") or ""
                if ci and r.get("chance") is not None and ci[1] < r["chance"]:  # below chance, not only a baseline
                    note = f"{note}; {BELOW_CHANCE_NOTE}" if note else BELOW_CHANCE_NOTE
                out_rows.append({"benchmark": r.get("benchmark"), "subset": r.get("subset"), "metric": r.get("metric"),
                                 "value": fmt_value(r.get("value"), unit), "chance": fmt_value(r.get("chance"), unit),
                                 "ci": f"{fmt_value(ci[0], unit)} – {fmt_value(ci[1], unit)}" if ci else "",
                                 "verdict": sig or "", "above": sig == "above", "below": sig == "below",
                                 "diff": diff_text(r, lambda v: ("+" if v > 0 else "") + fmt_value(v, unit)),
                                 "n": fmt_num(r.get("n")), "skipped": fmt_num(r.get("skipped")),
                                 "reasons": ", ".join(f"{k}: {fmt_num(v)}" for k, v in reasons.items()),
                                 "note": note, "unit": unit})
            # the overall rows first; per-subset rows (relations, attribute pairs, kinds...) folded below
            # them. A benchmark without an `all` row (retrieval: one row set per protocol) is overall.
            has_all = {r["benchmark"] for r in out_rows if r["subset"] in ("all", "overall")}
            for r in out_rows:
                r["main"] = r["subset"] in ("all", "overall") or r["benchmark"] not in has_all
            head = rows[0] if rows else {}
            errors = []
            if (d / "errors.json").is_file():  # benchmarks train eval could not score (harness.write_results)
                try:
                    errors = [str(e) for e in json.loads((d / "errors.json").read_text())]
                except ValueError:
                    errors = [f"{d / 'errors.json'} is not valid JSON"]
            tables.append({"tag": d.name, "source": "results.parquet", "rows": out_rows, "kind": "results",
                           "errors": errors,
                           "n_sub": sum(not r["main"] for r in out_rows),
                           "checkpoint": head.get("checkpoint"), "step": head.get("step"), "variant": head.get("variant")})
            continue
        mj = d / "metrics.json"
        if mj.is_file():
            res = read_json_file(mj)
            if not isinstance(res, dict):
                raise CorruptRunFile(f"{mj}: expected a JSON object of metrics, got {type(res).__name__}")
            chance_of = chance_keys([k for k in res if "chance" not in k], [k for k in res if "chance" in k])
            out_rows = []
            for k, v in res.items():
                if "chance" in k:
                    continue
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    out_rows.append({"metric": k, "value": str(v)[:200], "chance": "", "unit": "", "ci": "",
                                     "above": False, "below": False, "verdict": "", "diff": ""})
                    continue
                c = res.get(chance_of[k]) if k in chance_of else None
                unit = ""  # metrics.json carries no units: numbers as logged (results.parquet has them)
                # no item count here, so no interval: no verdict either (value > chance is not evidence)
                out_rows.append({"metric": k, "value": fmt_value(v, unit), "chance": fmt_value(c, unit) if c is not None else
                                 ("n/a" if unit else ""), "unit": unit, "ci": "", "above": False, "below": False, "verdict": "", "diff": ""})
            tables.append({"tag": d.name, "source": "metrics.json", "rows": out_rows, "kind": "metrics"})
    return tables


def headline(evals: list[dict], limit: int = 6) -> dict | None:
    """The rows the report's summary shows for a run: the overall rows of its newest evaluation
    (``final``, else the highest step; a harness table before a job's own metrics.json)."""
    if not evals:
        return None
    pool = [t for t in evals if t["kind"] == "results"] or evals
    newest = next((t for t in pool if t["tag"] == "final"), None) or max(pool, key=lambda t: t["tag"])
    rows = [r for r in newest["rows"] if r.get("main", True)]
    return {"tag": newest["tag"], "rows": rows[:limit], "more": max(0, len(rows) - limit)}


def training_section(output: Path, out, manifest_path: str | None) -> dict:
    """Every run folder under ``<output>/train``; one with a corrupt config.json, results.parquet or
    metrics.json is left out, named in the log and in ``skipped``."""
    root = output / "train"
    runs, skipped = [], []
    run_dirs: set[Path] = set()
    if root.is_dir():  # a run folder holds config.json / metrics.jsonl: train/<job>/ or train/<job>/<run>/
        for marker in ("config.json", "metrics.jsonl"):
            for p in root.rglob(marker):
                rel = p.parent.relative_to(root).parts
                if rel and len(rel) <= 3 and not {"eval", "checkpoints"} & set(rel):
                    run_dirs.add(p.parent)
        for run_dir in sorted(run_dirs):
            job = run_dir.relative_to(root).as_posix()
            try:  # the files a run's entry is made of: a corrupt one leaves the run out, named
                cfg = read_config_file(run_dir / "config.json") if (run_dir / "config.json").is_file() else {}
                evals = eval_tables(run_dir)
            except CorruptRunFile as e:
                log.warning("report: run folder %s skipped: %s", run_dir, e)
                skipped.append(str(e))
                continue
            metrics = run_dir / "metrics.jsonl"
            rows = read_metrics(metrics)
            curves = None
            if rows:
                png = plot_metrics(metrics, out.img / "train" / job / "curves.png")
                curves = out.rel(png) if png else None
            figs = []
            pngs = [p for p in sorted(run_dir.rglob("*.png")) if p.name != "metrics.png" and "report" not in p.parts]
            tags = sorted({p.relative_to(run_dir).parts[1] for p in pngs if p.relative_to(run_dir).parts[0] == "eval"
                           and len(p.relative_to(run_dir).parts) > 2})
            shown_tag = "final" if "final" in tags else (tags[-1] if tags else None)  # the latest evaluation's figures
            older = sum(1 for p in pngs if len(p.relative_to(run_dir).parts) > 2 and p.relative_to(run_dir).parts[0] == "eval"
                        and p.relative_to(run_dir).parts[1] != shown_tag)
            for p in pngs:
                parts = p.relative_to(run_dir).parts
                if parts[0] == "eval" and len(parts) > 2 and parts[1] != shown_tag:
                    continue
                dst = out.img / "train" / job / "figures" / p.relative_to(run_dir).as_posix().replace("/", "__")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dst)
                figs.append({"path": out.rel(dst), "name": p.relative_to(run_dir).as_posix()})
                if len(figs) >= 12:
                    break
            ckpts = sorted((p.name for p in (run_dir / "checkpoints").glob("*.pt")), key=lambda n: (n == "final.pt", n)) \
                if (run_dir / "checkpoints").is_dir() else []
            tr = [r for r in rows if r.get("kind") == "train"]
            last = tr[-1] if tr else {}
            runs.append({
                "job": job, "dir": str(run_dir), "curves": curves, "figures": figs, "checkpoints": ckpts,
                "config": json.dumps(cfg, indent=1, sort_keys=True, default=str) if cfg else "",
                "steps": last.get("step"), "last_loss": last.get("loss"), "evals": evals,
                "figures_tag": shown_tag, "figures_older": older, "headline": headline(evals),
                "missing_metrics": not rows,
                "eval_command": f"train eval {job.split('/')[0]} --checkpoint {run_dir / 'checkpoints' / (ckpts[-1] if ckpts else 'final.pt')} "
                                f"--manifest {manifest_path or '<manifest.yaml>'}",
                "run_command": f"train run {job.split('/')[0]} --manifest {manifest_path or '<manifest.yaml>'}",
            })
    return {"runs": runs, "skipped": skipped, "root": str(root), "command": f"train run concept-ot --manifest {manifest_path or '<manifest.yaml>'}"}
