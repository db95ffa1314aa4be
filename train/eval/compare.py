"""`train compare`: one table across runs (jobs, variants, seeds) from their newest
``results.parquet`` (the harness's table, :mod:`train.eval.harness`), chance and the 95% interval
beside each value; a run whose results cannot be read is named and skipped
(:mod:`pipeline.io.run_files`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from train.eval.harness import diff_fmt, fmt_num, fmt_value


def _latest_results(path: Path) -> list[Path]:
    """The results.parquet files that describe a run's newest model: the file itself, an eval
    folder's, or, for a run folder, every eval/*/results.parquet of its highest step (a
    `train eval --bench X` of the same checkpoint adds to the end-of-training table instead of
    hiding it). A file that cannot be read raises :class:`CorruptRunFile` naming it."""
    from pipeline.io.run_files import read_parquet_file

    path = Path(path)
    if path.is_file():
        return [path]
    if (path / "results.parquet").is_file():
        return [path / "results.parquet"]
    found = list((path / "eval").glob("*/results.parquet")) if (path / "eval").is_dir() else []
    if not found:
        found = list(path.glob("**/eval/*/results.parquet"))
    if not found:
        raise FileNotFoundError(f"{path}: no eval/*/results.parquet (run `train eval <job> --checkpoint ... "
                                f"--manifest ...` first)")
    steps = {}
    for f in found:
        st = read_parquet_file(f, ["step"]).column("step").to_pylist()
        steps[f] = max(st) if st else -1
    top = max(steps.values())
    return sorted((f for f in found if steps[f] == top), key=lambda f: f.stat().st_mtime)


def _run_dir_of(res_path: Path) -> Path:
    """The run folder a results file belongs to: the nearest folder above it with a config.json, else
    the folder holding its eval/ folder, else its own folder."""
    for d in res_path.parents:
        if (d / "config.json").is_file():
            return d
    parts = res_path.parts
    if "eval" in parts:
        return Path(*parts[: len(parts) - 1 - parts[::-1].index("eval")])
    return res_path.parent


def _run_config(res_path: Path) -> dict:
    """The run's training options (the nearest config.json above its results), {} when there is none; a
    config.json that is not a JSON object raises :class:`CorruptRunFile`."""
    from pipeline.io.run_files import read_config_file

    for d in [res_path.parent, *res_path.parents]:
        cfg = d / "config.json"
        if cfg.is_file():
            return read_config_file(cfg)
    return {}


def _run_label(res_path: Path, rows: list[dict]) -> str:
    """``job/variant [control=...] sSEED``; a config.json that is not a JSON object raises :class:`CorruptRunFile`."""
    job = rows[0].get("job", "?") if rows else "?"
    variant = rows[0].get("variant", "?") if rows else "?"
    cfg = _run_config(res_path)
    seed, control = cfg.get("seed"), cfg.get("control")
    label = f"{job}/{variant}" + (f" control={control}" if control not in (None, "none") else "")
    return label + (f" s{seed}" if seed is not None else "")


def _control_tests(runs: list[tuple]) -> None:
    """A control run's (config.json ``control`` other than none) result rows with a chance level: the
    controls' exact one-sided test (:mod:`train.eval.controls`), Holm over every control row of the table;
    each row's ``control`` text set."""
    from pipeline.report.significance import baseline_target
    from train.eval.controls import control_test, includes_frozen, judge

    pending = []
    for _, files, rows in runs:
        if _run_config(Path(files.split(", ")[-1])).get("control") in (None, "none"):
            continue
        for r in rows:
            if not baseline_target(r) and r.get("chance") is not None:
                pending.append((r, control_test(r, includes_frozen(str(r.get("job"))))))
    judge([t for _, t in pending])
    for r, t in pending:
        r["control"] = t.text.replace("control", "CONTROL", 1) if t.above or t.p is None else t.text


def keep_row(r: dict, bench: Sequence[str] = (), subset: Sequence[str] = (), min_n: int = 0) -> bool:
    """``train compare``'s filters: the row's benchmark among ``bench`` and its subset among ``subset``
    (each: any when empty), at least ``min_n`` items scored."""
    return ((not bench or r.get("benchmark") in bench) and (not subset or (r.get("subset") or "") in subset)
            and int(r.get("n") or 0) >= min_n)


def compare(paths: Sequence[str | Path], bench: Sequence[str] = (), subset: Sequence[str] = (), min_n: int = 0) -> str:
    """One Markdown table: a row per (benchmark, subset, metric), a column per run holding
    ``value [ci_low, ci_high] (n=N; verdict; diff [lo, hi] vs baseline)`` (the 95% interval; results
    written before intervals existed show the value alone; the verdict, and the paired difference from
    the strongest no-learning baseline the run reports beside the row with its 95% interval,
    :mod:`pipeline.report.significance`; in a control run, the controls' test: ``control not above chance
    (one-sided p, Holm)`` over every control row of the table, :mod:`train.eval.controls`), chance beside. A run whose results
    cannot be read is named and skipped. ``bench``, ``subset``, ``min_n``: only the rows
    :func:`keep_row` keeps (a filter that keeps none is an error naming what there is)."""
    from pipeline.io.run_files import CorruptRunFile, read_results_file, skipped_line

    runs, corrupt = [], []
    for p in paths:
        try:
            files = _latest_results(Path(p))
            merged: dict[tuple, dict] = {}
            for f in files:  # oldest first: a newer evaluation of the same row wins
                for r in read_results_file(f).to_pylist():
                    merged[(r["benchmark"], r["subset"], r["metric"])] = r
            rows = list(merged.values())
            label = _run_label(files[-1], rows)
        except CorruptRunFile as e:
            corrupt.append(str(e))
            continue
        runs.append((label, ", ".join(str(f) for f in files), rows))
    if not runs and corrupt:
        raise CorruptRunFile(skipped_line(corrupt))
    base = [r[0] for r in runs]
    n_of = Counter(base)
    # identical labels (two runs of one variant with other options): name their run folders
    labels = [f"{lab} ({_run_dir_of(Path(files.split(', ')[-1])).name})" if n_of[lab] > 1 else lab
              for lab, (_, files, _) in zip(base, runs)]
    n_of, seen = Counter(labels), Counter()
    for i, lab in enumerate(labels):  # still identical (the same folder twice): number them
        if n_of[lab] > 1:
            seen[lab] += 1
            labels[i] = f"{lab} #{seen[lab]}"
    from pipeline.report.significance import diff_text, verdicts, with_reason

    _control_tests(runs)
    keys: list[tuple] = []
    cell: dict[tuple, dict[int, dict]] = {}
    for j, (_, _, rows) in enumerate(runs):
        for r, v in zip(rows, verdicts(rows)):  # verdicts over the whole evaluation (baselines), then the filter
            r["verdict"] = with_reason(v, r)  # "below: 462 of 462 items tied"
            if not keep_row(r, bench, subset, min_n):
                continue
            k = (r["benchmark"], r["subset"], r["metric"])
            if k not in cell:
                keys.append(k)
                cell[k] = {}
            cell[k][j] = r
    if not keys and (bench or subset or min_n):
        every = [r for _, _, rows in runs for r in rows]
        subsets = sorted({r["subset"] for r in every if r["benchmark"] in bench})
        raise FileNotFoundError(
            "no result row matches" + "".join(f" {o} {', '.join(map(str, v))}" for o, v in
                                              (("--bench", bench), ("--subset", subset)) if v)
            + (f" --min-n {min_n}" if min_n else "") + f"; the runs' benchmarks: {', '.join(sorted({r['benchmark'] for r in every}))}"
            + (f"; subsets of {', '.join(bench)}: {', '.join(subsets)}" if subsets else ""))
    head = "| benchmark | subset | metric | chance | " + " | ".join(labels) + " |"
    sep = "|---|---|---|---:|" + "---:|" * len(labels)
    lines = [head, sep]
    for k in keys:
        rs = cell[k]
        any_r = next(iter(rs.values()))
        unit = any_r.get("unit") or ""
        suffix = " %" if unit == "%" else ""  # the unit beside each number (AUCs, IoUs: fractions, bare)
        chances = {fmt_num(r.get("chance"), unit) for r in rs.values()}
        chance = " / ".join(c + (suffix if c != "-" else "") for c in sorted(chances))
        vals = []
        for j in range(len(runs)):
            r = rs.get(j)
            vals.append("-" if r is None else f"{fmt_value(r, unit)}{suffix} (n={int(r['n']):,}"
                        + (f"; {r['verdict']}" if r.get("verdict") else "")
                        + (f"; {d}" if (d := diff_text(r, diff_fmt(unit))) else "")
                        + (f"; {r['control']}" if r.get("control") else "") + ")")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {chance} | " + " | ".join(vals) + " |")
    src = "\n".join(f"- {lab}: {f}" for lab, (_, f, _) in zip(labels, runs))
    return "\n".join(lines) + "\n\n" + src + (f"\n\n{skipped_line(corrupt)}" if corrupt else "")
