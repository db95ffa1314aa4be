"""``train compare --paper <paper> [--markdown] RUN_DIRS``: the paper's table on the runs, or its whole page.

Without ``--markdown``: per column a line per row (the testbed's mean +- std over seeds, the seeds,
chance, the row's 95% interval, the published number, the ranks, the difference from the reference
row with its 95% interval and the verdict, :mod:`train.paper_orderings`), Kendall's tau per column,
the tally per row and over the table, and the runs that were not counted.

With ``--markdown``: the whole ``docs/papers/<paper>.md``: the layout and the published numbers from
``train/papers/<paper>.yaml``, how to run it, the rule, the table above, and the page's prose from
the yaml's ``page:`` (``intro``, ``before_results``, ``results_intro``, ``discussion``, ``sections``:
a list of {title, text}). The prose names numbers through placeholders the code fills, so no number
on the page is typed by hand:

==================================  ===============================================================
``{{tally}}``                       the page's tally sentence (:meth:`Tally.sentence`)
``{{count:<verdict>}}``             the comparisons with that verdict (agrees, disagrees, not
``{{count:<verdict>:<row>}}``       resolved, not testable), over the page or in one row
``{{mean:<row>:<col>}}``            the row's mean +- std over seeds
``{{interval:<row>:<col>}}``        the row's 95% interval (seeds and evaluation)
``{{diff:<row>:<col>}}``            row - reference and its 95% interval
``{{verdict:<row>:<col>}}``         the verdict
``{{kendall:<col>}}``               Kendall's tau and its p-value
``{{published:<row>:<col>}}``       the published number
``{{seeds}}``                       the runs counted per row
==================================  ===============================================================

An unknown placeholder is an error naming the yaml file. ``tests/test_paper_pages.py`` regenerates
every committed page from the committed runs (``benchmarks/results/papers/<paper>/``) and checks it
equals the file.
"""

from __future__ import annotations

import math
import re

from train.paper_orderings import (Tally, column_kendall, difference, ranks, row_interval, tally, verdict)
from train.paper_tables import Cell, Collected, Column, PaperTable, PaperTableError, collect, load_table

RESULTS_DIR = "benchmarks/results/papers"


def _f(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _signed(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.2f}"


def _mean_std(c: Cell | None) -> str:
    return "-" if c is None else f"{_f(c.mean)} +- {_f(c.std)}"


def _interval(got: Collected, row: str, col: str) -> str:
    ri = row_interval(got, row, col)
    return "-" if ri is None or not math.isfinite(ri.low) else f"[{_f(ri.low)}, {_f(ri.high)}]"


def _diff(table: PaperTable, got: Collected, row: str, col: str) -> str:
    if row == table.reference or (row, col) not in got.cells or (table.reference, col) not in got.cells:
        return "-"
    d = difference(got, row, table.reference, col)
    if d is None:
        c, cr = got.cells[(row, col)], got.cells[(table.reference, col)]
        return f"{_signed(c.mean - cr.mean)} (no interval)"
    ci = f" [{_f(d.low)}, {_f(d.high)}]" if math.isfinite(d.low) else " (no interval)"
    return f"{_signed(d.diff)}{ci}"


def _df(table: PaperTable, got: Collected, row: str, col: str) -> str:
    if row == table.reference or (row, col) not in got.cells or (table.reference, col) not in got.cells:
        return "-"
    d = difference(got, row, table.reference, col)
    return "-" if d is None or not math.isfinite(d.df) else f"{d.df:.1f}"


def _kendall_text(k) -> str:
    if not math.isfinite(k.tau):
        return f"not defined ({k.n} rows with both numbers)"
    how = f"all {k.orderings:,} orderings" if k.exact else f"{k.orderings:,} random orderings"
    return f"tau {k.tau:+.2f} over {k.n} rows, one-sided permutation p = {k.p:.3f} ({how})"


def column_table(table: PaperTable, got: Collected, col: Column, level: str = "###") -> list[str]:
    """One column of the paper's table: a line per row, then Kendall's tau."""
    both = [r.id for r in table.rows if (r.id, col.id) in got.cells and r.published.get(col.id) is not None]
    t_rank = ranks({r: got.cells[(r, col.id)].mean for r in both})
    p_rank = ranks({r: table.row(r).published[col.id] for r in both})
    where = f"{col.benchmark} / {'|'.join(col.subset)} / {col.metric}" + (f" x {col.scale:g}" if col.scale != 1 else "")
    lines = [f"{level} {col.id}: {col.paper} ({where})", *([f"note: {col.note}"] if col.note else []), "",
             "| row | paper's row | testbed mean +- std | seeds | chance | 95% interval | published | "
             "rank testbed/paper | row - reference [95%] | df | vs reference |",
             "|---|---|---:|---:|---:|---|---:|---|---|---:|---|"]
    for r in table.rows:
        c = got.cells.get((r.id, col.id))
        pub = r.published.get(col.id)
        pub_s = _f(pub) + (f" +- {_f(r.published_std[col.id])}" if col.id in r.published_std else "")
        n, chance = ("0", "-") if c is None else (str(c.n), _f(c.chance_level))
        ci = "-" if c is None else _interval(got, r.id, col.id)
        rank = f"{t_rank[r.id]}/{p_rank[r.id]}" if r.id in t_rank else "-"
        lines.append(f"| {r.id} | {r.paper} | {_mean_std(c)} | {n} | {chance} | {ci} | {pub_s} | {rank} | "
                     f"{_diff(table, got, r.id, col.id)} | {_df(table, got, r.id, col.id)} | "
                     f"{verdict(table, got, r, col)} |")
    lines += ["", f"Kendall's tau-b, the testbed's order against the paper's: {_kendall_text(column_kendall(table, got, col))}."]
    return lines


def summary_lines(table: PaperTable, got: Collected, t: Tally, level: str = "###") -> list[str]:
    """Per row: its comparisons with the reference by verdict; then the page's tally."""
    lines = [f"{level} ordering against the reference row, per row", "",
             "| row | agrees | disagrees | not resolved | not testable | columns that disagree | columns not resolved |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in table.rows:
        if r.options is None or r.id == table.reference:
            what = "no job option" if r.options is None else "reference"
            lines.append(f"| {r.id} | - | - | - | - | {what} | |")
            continue
        per = t.rows[r.id]
        lines.append(f"| {r.id} | {len(per.get('agrees', []))} | {len(per.get('disagrees', []))} | "
                     f"{len(per.get('not resolved', []))} | {len(per.get('not testable', []))} | "
                     f"{', '.join(per.get('disagrees', [])) or '-'} | {', '.join(per.get('not resolved', [])) or '-'} |")
    lines += ["", f"**Tally: {t.sentence()}.**"]
    return lines


def _seeds_text(got: Collected) -> str:
    return ", ".join(f"{k} {len(v)}" for k, v in got.runs.items()) or "none matched"


def result_lines(table: PaperTable, got: Collected, t: Tally, level: str = "###") -> list[str]:
    """The table on the runs: header, a table per column, the tally, the runs not counted."""
    lines = [f"{table.tables}; job `{table.job}`; reference row `{table.reference}`; runs per row: {_seeds_text(got)}.",
             "options the counted runs set besides the rows': "
             + (", ".join(f"{k}={v}" for k, v in sorted(got.shared.items())) or "none (job defaults)") + ".",
             "mean +- std over seeds (sample std); 95% interval and row - reference: seeds and evaluation combined "
             "(train/paper_orderings.py; df: Satterthwaite's degrees of freedom); rank 1 = highest.", ""]
    for col in table.columns:
        lines += column_table(table, got, col, level) + [""]
    lines += summary_lines(table, got, t, level)
    if got.unmatched:
        lines += ["", f"runs matching no row of the table (not counted; rows set {', '.join(table.keys)}): "
                  + ", ".join(got.unmatched)]
    if got.other:
        lines += ["", "runs whose options outside the table's rows differ from the other runs' (not counted): "
                  + "; ".join(got.other)]
    if got.not_runs:
        lines += ["", "not run folders (no config.json), skipped: " + ", ".join(got.not_runs)]
    if got.without_eval:
        lines += ["", "runs without a final evaluation (not counted): " + ", ".join(got.without_eval)]
    if got.corrupt:
        from pipeline.io.run_files import skipped_line

        lines += ["", skipped_line(got.corrupt)]
    return lines


def compare_paper(paper: str, runs: list, markdown: bool = False) -> str:
    """``train compare --paper``: the table on the runs, or (``markdown``) the whole page."""
    table = load_table(paper)
    got = collect(table, runs)
    t = tally(table, got)
    if markdown:
        return page(table, got, t)
    return "\n".join([f"## {table.paper}: {table.title}", "", *result_lines(table, got, t)])


# ------------------------------------------------------------------------------------- the page


RULE = """\
`train compare --paper` groups the run folders by the table's rows (each run's `config.json` options
against the row's options; runs with other options, such as a `control: shuffled` run, are listed and
not counted) and reads each run's final evaluation and its per-item outcomes (`eval/final/results.parquet`,
`items.parquet`). Per column and row it prints the testbed's mean +- std over seeds, the seeds counted,
chance, the row's 95% interval, the published number, the row's rank among the rows with both numbers
(testbed / paper), and the difference from the reference row `{reference}` with its 95% interval:

- the difference is the mean over the row's seeds minus the mean over the reference's; its variance
  adds the variance between seeds (of the per-seed differences, seeds paired, / S) and the evaluation
  bootstrap's (the same images resampled for every run of both rows: the images all seeds share, whose
  sampling no number of seeds averages away); the interval is t with Satterthwaite's degrees of freedom
  (`df`: 2 with 3 seeds when the seeds dominate, C - 1 images when the evaluation does) (docs/evaluation.md);
- `agrees` / `disagrees` (the testbed's sign against the paper's) only when that interval excludes 0;
  `not testable` when both rows' own intervals contain chance; `not resolved` otherwise (which way it
  leans is said), and for a tie in the paper, a row with one seed, or runs without per-item outcomes;
- Kendall's tau-b between the testbed's order and the paper's per column, with its exact one-sided
  permutation p-value (every ordering of the testbed's values; with 3 rows p cannot go below 1/6);
- the tally counts the comparisons (row, column) with a published number on both sides by verdict.
"""

_PLACEHOLDER = re.compile(r"\{\{([^{}]+)\}\}")


def fill(text: str, table: PaperTable, got: Collected, t: Tally, where: str) -> str:
    """``text`` with its placeholders (module doc) replaced; PaperTableError naming ``where`` for an unknown one."""
    rows, cols = {r.id for r in table.rows}, {c.id for c in table.columns}

    def one(m: re.Match) -> str:
        parts = m.group(1).strip().split(":")
        kind, args = parts[0], parts[1:]
        ok_rc = len(args) == 2 and args[0] in rows and args[1] in cols
        if kind == "tally" and not args:
            return t.sentence()
        if kind == "seeds" and not args:
            return _seeds_text(got)
        if kind == "count" and args and args[0] in ("agrees", "disagrees", "not resolved", "not testable") \
                and (len(args) == 1 or (len(args) == 2 and args[1] in t.rows)):
            return str(t.count(args[0], args[1] if len(args) == 2 else None))
        if kind == "kendall" and len(args) == 1 and args[0] in cols:
            return _kendall_text(column_kendall(table, got, next(c for c in table.columns if c.id == args[0])))
        if kind == "mean" and ok_rc:
            return _mean_std(got.cells.get((args[0], args[1])))
        if kind == "interval" and ok_rc:
            return _interval(got, args[0], args[1])
        if kind == "diff" and ok_rc:
            return _diff(table, got, args[0], args[1])
        if kind == "verdict" and ok_rc:
            return str(verdict(table, got, table.row(args[0]), next(c for c in table.columns if c.id == args[1])))
        if kind == "published" and ok_rc:
            return _f(table.row(args[0]).published.get(args[1]))
        raise PaperTableError(f"{where}: unknown placeholder {m.group(0)} (kinds: tally, seeds, count:<verdict>[:<row>], "
                              f"kendall:<col>, mean|interval|diff|verdict|published:<row>:<col>; rows {sorted(rows)}, "
                              f"columns {sorted(cols)})")

    return _PLACEHOLDER.sub(one, text.strip())


def page(table: PaperTable, got: Collected, t: Tally) -> str:
    """The whole docs/papers/<paper>.md (module doc)."""
    where = f"train/papers/{table.paper}.yaml"
    pg = table.page

    def prose(key: str) -> list[str]:
        return [fill(pg[key], table, got, t, f"{where} page.{key}"), ""] if pg.get(key) else []

    lines = [f"# {pg.get('heading') or table.paper}", "",
             f"<!-- printed by `train compare --paper {table.paper} --markdown {RESULTS_DIR}/{table.paper}/*`; "
             f"edit {where}, not this file -->", "", *prose("intro"),
             "The table, its published numbers, the job options of each row and the results row of each column are",
             f"data: [`{where}`](../../{where}) (read by [`train/paper_tables.py`](../../train/paper_tables.py));",
             f"the sweep grid is [`grids/{table.paper}.yaml`](../../grids/{table.paper}.yaml), the table's runnable "
             "rows as a `configurations:` list.", "", "## Layout", "", f"{table.tables}.", "",
             "| column | paper | testbed results row (benchmark / subset / metric) |", "|---|---|---|"]
    for c in table.columns:
        lines.append(f"| {c.id} | {c.paper} | {c.benchmark} / {'|'.join(c.subset)} / {c.metric}"
                     + (f" x {c.scale:g}" if c.scale != 1 else "") + " |")
    lines += ["", "## Published numbers", "", "Transcribed from the paper's text extraction; `-`: not published for "
              f"that row. Options are `train.{table.job.replace('-', '_')}.<option>` values.", "",
              "| row | paper's row | job options | " + " | ".join(c.id for c in table.columns) + " |",
              "|---|---|---|" + "---:|" * len(table.columns)]
    for r in table.rows:
        opts = "none (see below)" if r.options is None else ", ".join(f"`{k}: {v}`" for k, v in r.options.items())
        nums = [_f(r.published.get(c.id)) + (f" +- {_f(r.published_std[c.id])}" if c.id in r.published_std else "")
                for c in table.columns]
        lines.append(f"| {r.id} | {r.paper} | {opts} | " + " | ".join(nums) + " |")
    explained = [r for r in table.rows if r.options is None or r.note]
    if explained or table.notes:
        lines += ["", "Rows without a job option, notes on rows, and where the paper is ambiguous:", ""]
        lines += [f"- `{r.id}` ({r.paper}): {' '.join((r.no_option or r.note).split())}" for r in explained]
        lines += [f"- {' '.join(n.split())}" for n in table.notes]
    lines += ["", "## Running it on the testbed", "", "```bash",
              ".venv/bin/pipeline run all --manifest manifests/testbed.yaml --set output=runs/testbed-1400",
              f"OMP_NUM_THREADS=1 .venv/bin/train sweep {table.job} --manifest manifests/testbed.yaml "
              "--set output=runs/testbed-1400 \\",
              f"    --grid grids/{table.paper}.yaml --seeds 3 --max-concurrent 2",
              f".venv/bin/train compare --paper {table.paper} runs/testbed-1400/train/{table.job}/*", "```", "",
              RULE.format(reference=table.reference).rstrip(), "", *prose("before_results"), "## Testbed result", "",
              *prose("results_intro"), *result_lines(table, got, t, "###"), "", *prose("discussion")]
    for s in pg.get("sections") or []:
        lines += [f"## {s['title']}", "", fill(s["text"], table, got, t, f"{where} page.sections[{s['title']}]"), ""]
    return "\n".join(lines).rstrip()
