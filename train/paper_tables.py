"""Each paper's ablation table beside the testbed's runs: ``train compare --paper <paper> RUN_DIRS...``.

The tables live in ``train/papers/<paper>.yaml`` (package data): the published numbers transcribed
from the paper (row and column names as printed, ``notes`` where the text is ambiguous), per row the
job's options that make its configuration (``options``, short names of ``train.<job>.<option>``;
``options: null`` with ``no_option: <why>`` where the job has no such configuration), and per column
the row of the run's ``eval/final/results.parquet`` it reads (``benchmark``, ``subset``, ``metric``;
``*`` globs, a list of subsets = the first one the run has; ``scale`` multiplies the testbed's value,
chance and interval into the paper's unit). ``reference`` names the row the ordering is judged against.

Grouping: a run belongs to the row whose options it has, every key that any row of the table sets
compared (every runnable row sets the same keys); runs of one row differ only in ``seed``. The options
the runs set beyond their row's defaults (a sweep's ``--set``: steps, batch size) must be the same
across the table: the set shared by the runs of most rows is kept and printed, runs with other ones
(a control, another learning rate) are listed and not counted, as are runs that match no row.

Per row and column the table prints the testbed's mean +- sample std over the row's seeds, the seeds
counted, chance, and the 95% interval: the mean over the seeds of each run's own interval
(``ci_low``/``ci_high`` of the harness: the evaluation-sampling interval of one run, the interval
every metric carries beside chance), not an interval of the mean over seeds (with 3 seeds that one
is mostly the t quantile); seed-to-seed spread is the std. Then the published number, the row's rank
among the rows with both numbers (testbed / paper, 1 = highest), and against the reference row:
``agrees`` when the testbed's difference row - reference is resolved and has the paper's sign,
``disagrees`` when it is resolved and has the opposite sign, ``unresolved: ...`` otherwise: the
difference is no larger than the larger of the two rows' std over seeds (``within the seeds' spread``),
or, with a single seed on either side (no std), the two rows' 95% intervals overlap (``intervals
overlap``); the way it leans is said (``would agree`` / ``would disagree``). An exact testbed tie,
or a paper tie with a testbed difference, is unresolved too. A closing table counts the agreeing,
unresolved and disagreeing columns per row: only resolved columns are counted as agreements.

The grid ``grids/<paper>.yaml`` for ``train sweep`` is :func:`grid_of` of the table (the runnable
rows as ``configurations``).
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PAPERS_DIR = Path(__file__).resolve().parent / "papers"


class PaperTableError(ValueError):
    """A table that cannot be read or does not hold together (one line naming the file)."""


@dataclass
class Column:
    id: str
    paper: str
    benchmark: str
    subset: list[str]
    metric: str
    scale: float = 1.0
    note: str = ""


@dataclass
class Row:
    id: str
    paper: str
    options: dict | None
    published: dict[str, float]
    published_std: dict[str, float] = field(default_factory=dict)
    no_option: str = ""
    note: str = ""


@dataclass
class PaperTable:
    paper: str
    title: str
    job: str
    tables: str
    reference: str
    columns: list[Column]
    rows: list[Row]
    notes: list[str]

    @property
    def keys(self) -> list[str]:
        """The option keys the rows set (the same for every runnable row)."""
        return sorted({k for r in self.rows if r.options for k in r.options})

    def row(self, row_id: str) -> Row:
        return next(r for r in self.rows if r.id == row_id)


def papers() -> list[str]:
    return sorted(p.stem for p in PAPERS_DIR.glob("*.yaml"))


def load_table(paper: str | Path) -> PaperTable:
    """The table of ``paper`` (a name of :func:`papers`, or a YAML file), checked: unique ids, the
    same option keys in every runnable row, published numbers only for known columns, a runnable
    reference row."""
    path = Path(paper) if str(paper).endswith((".yaml", ".yml")) else PAPERS_DIR / f"{paper}.yaml"
    if not path.is_file():
        raise PaperTableError(f"no table for paper {str(paper)!r}; papers: {', '.join(papers())}")
    try:
        d = yaml.safe_load(path.read_text())
        cols = [Column(c["id"], c.get("paper", c["id"]), c["benchmark"],
                       c["subset"] if isinstance(c["subset"], list) else [c["subset"]], c["metric"],
                       float(c.get("scale", 1.0)), c.get("note", "")) for c in d["columns"]]
        rows = [Row(r["id"], r.get("paper", r["id"]), r.get("options"), dict(r.get("published") or {}),
                    dict(r.get("published_std") or {}), r.get("no_option", ""), r.get("note", "")) for r in d["rows"]]
        t = PaperTable(d["paper"], d.get("title", ""), d["job"], d.get("tables", ""), d["reference"], cols, rows,
                       list(d.get("notes") or []))
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise PaperTableError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    col_ids = [c.id for c in cols]
    problems = []
    if len(set(col_ids)) < len(col_ids) or len({r.id for r in rows}) < len(rows):
        problems.append("duplicate column or row ids")
    for r in rows:
        if r.options is None and not r.no_option:
            problems.append(f"row {r.id}: options: null needs no_option (why the job cannot run it)")
        if r.options is not None and sorted(r.options) != t.keys:
            problems.append(f"row {r.id}: sets {sorted(r.options)}, the table's rows set {t.keys}")
        unknown = (set(r.published) | set(r.published_std)) - set(col_ids)
        if unknown:
            problems.append(f"row {r.id}: published numbers for unknown columns {sorted(unknown)}")
    if t.reference not in {r.id for r in rows if r.options is not None}:
        problems.append(f"reference {t.reference!r} is not a runnable row")
    runnable = [json.dumps(r.options, sort_keys=True) for r in rows if r.options is not None]
    if len(set(runnable)) < len(runnable):
        problems.append("two rows have the same options")
    if problems:
        raise PaperTableError(f"{path}: {'; '.join(problems)}")
    return t


def grid_of(table: PaperTable) -> dict:
    """The ``train sweep`` grid of the table's runnable rows: {configurations: [{train.<job>.<k>: v}]}."""
    key = f"train.{table.job.replace('-', '_')}"
    return {"configurations": [{f"{key}.{k}": v for k, v in r.options.items()} for r in table.rows if r.options]}


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def match_row(table: PaperTable, options: dict) -> str | None:
    """The id of the runnable row whose options the run's ``options`` (its config.json) has, else None."""
    for r in table.rows:
        if r.options is not None and all(k in options and _same(options[k], v) for k, v in r.options.items()):
            return r.id
    return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def column_value(col: Column, rows: list[dict]) -> dict | None:
    """The run's results row for ``col`` (the first of the column's subsets the run has), scaled."""
    for sub in col.subset:
        hit = [r for r in rows if fnmatch.fnmatchcase(str(r.get("benchmark")), col.benchmark)
               and fnmatch.fnmatchcase(str(r.get("subset") or ""), sub) and r.get("metric") == col.metric
               and _finite(r.get("value"))]
        if hit:
            r = hit[0]
            return {k: (float(r[k]) * col.scale if _finite(r.get(k)) else None)
                    for k in ("value", "chance", "ci_low", "ci_high")}
    return None


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    chance: list[float] = field(default_factory=list)
    ci_low: list[float] = field(default_factory=list)
    ci_high: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / self.n if self.values else None

    @property
    def std(self) -> float | None:
        if not self.values:
            return None
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1)) if self.n > 1 else 0.0

    @staticmethod
    def _avg(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    @property
    def interval(self) -> tuple[float | None, float | None]:
        return self._avg(self.ci_low), self._avg(self.ci_high)


@dataclass
class Collected:
    cells: dict[tuple[str, str], Cell]  # (row id, column id) -> cell
    runs: dict[str, list[str]]          # row id -> run folders
    unmatched: list[str]
    without_eval: list[str]
    other: list[str] = field(default_factory=list)  # "<run> (<key>=<value>, ...)": outside the common options
    shared: dict = field(default_factory=dict)      # the options the counted runs set outside the rows' keys
    not_runs: list[str] = field(default_factory=list)  # folders without config.json
    corrupt: list[str] = field(default_factory=list)   # "<file>: <problem>": run folders skipped (issue 40)


def _defaults(table: PaperTable) -> tuple[dict[str, dict], frozenset[str]]:
    """(per runnable row, the job's training options at their defaults for that row's options (a
    default may depend on the row: concept-ot's epochs per variant), {} where the job cannot say;
    the job's evaluation-only options, never compared)."""
    from train.registry import registry

    cls = getattr(registry().get(table.job), "Config", None)
    out = {}
    for r in table.rows:
        if r.options is not None:
            try:
                out[r.id] = cls.model_validate(r.options).training_config() if cls else {}
            except ValueError:
                out[r.id] = {}
    return out, frozenset(getattr(cls, "EVAL_ONLY", ()))


def _set_options(options: dict, skip: set[str], base: dict) -> dict:
    """The run's options outside ``skip`` that are not at the row's defaults ``base``."""
    return {k: v for k, v in options.items() if k not in skip and not (k in base and _same(base[k], v))}


def collect(table: PaperTable, runs: list[str | Path]) -> Collected:
    """The runs' final evaluations grouped by the table's rows and columns. The runs of a table
    share the options they set outside the rows' keys (``--set`` of the sweep: steps, batch size):
    the set shared by the runs of most rows (then most runs) is kept, runs with other ones (a
    control, another learning rate) are listed in ``other`` and not counted."""
    from pipeline.io.run_files import CorruptRunFile
    from train.seeds_table import _options, final_rows

    out = Collected({}, {}, [], [])
    defaults, eval_only = _defaults(table)
    skip = set(table.keys) | eval_only
    matched = []
    for run in map(Path, runs):
        if not (run / "config.json").is_file():  # e.g. <job>/sweeps (Tune's folder) in a glob of run folders
            out.not_runs.append(str(run))
            continue
        try:
            opts = _options(run)
        except CorruptRunFile as e:
            out.corrupt.append(str(e))
            continue
        row = match_row(table, opts)
        if row is None:
            out.unmatched.append(str(run))
        else:
            matched.append((run, row, _set_options(opts, skip, defaults.get(row, {}))))
    groups: dict[str, list] = {}
    for m in matched:
        groups.setdefault(json.dumps(m[2], sort_keys=True), []).append(m)
    common = max(groups, key=lambda g: (len({m[1] for m in groups[g]}), len(groups[g]))) if groups else "{}"
    out.shared = json.loads(common)
    for run, row, rest in matched:
        if json.dumps(rest, sort_keys=True) != common:
            diff = {k: v for k, v in rest.items() if not _same(out.shared.get(k), v)}
            diff.update({k: "(default)" for k in out.shared if k not in rest})
            out.other.append(f"{run} ({', '.join(f'{k}={v}' for k, v in sorted(diff.items()))})")
            continue
        try:
            results = final_rows(run)
        except CorruptRunFile as e:
            out.corrupt.append(str(e))
            continue
        if not results:
            out.without_eval.append(str(run))
            continue
        out.runs.setdefault(row, []).append(str(run))
        for col in table.columns:
            v = column_value(col, results)
            if v is None:
                continue
            cell = out.cells.setdefault((row, col.id), Cell())
            cell.values.append(v["value"])
            for k in ("chance", "ci_low", "ci_high"):
                if v[k] is not None:
                    getattr(cell, k).append(v[k])
    return out


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def verdict(table: PaperTable, got: Collected, row: Row, col: Column) -> str:
    """The row's ordering against the reference row in one column (see the module docstring)."""
    if row.options is None:
        return "no job option"
    if row.id == table.reference:
        return "reference"
    ref = table.row(table.reference)
    c, cr = got.cells.get((row.id, col.id)), got.cells.get((ref.id, col.id))
    p, pr = row.published.get(col.id), ref.published.get(col.id)
    if c is None or cr is None:
        return "not run" if row.id not in got.runs or ref.id not in got.runs else "no result"
    if p is None or pr is None:
        return "no published number"
    d, dp = c.mean - cr.mean, p - pr
    if _sign(d) == 0 and _sign(dp) != 0:
        return f"unresolved: tie (paper: {'higher' if dp > 0 else 'lower'})"
    if _sign(dp) == 0 and _sign(d) != 0:
        return "unresolved: paper tie"
    direction = "agrees" if _sign(d) == _sign(dp) else "disagrees"
    if c.n > 1 and cr.n > 1:
        if abs(d) <= max(c.std, cr.std):
            return f"unresolved: within the seeds' spread (would {direction[:-1]})"
    elif _overlap(c.interval, cr.interval):
        return f"unresolved: intervals overlap (would {direction[:-1]})"
    return direction


def _overlap(a: tuple[float | None, float | None], b: tuple[float | None, float | None]) -> bool:
    """Two 95% intervals share a point (a single seed has no std: its evaluation interval is the yardstick)."""
    return None not in (*a, *b) and a[0] <= b[1] and b[0] <= a[1]


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 = highest; ties share the better rank."""
    return {k: 1 + sum(1 for w in values.values() if w > v) for k, v in values.items()}


def _f(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def column_table(table: PaperTable, got: Collected, col: Column) -> list[str]:
    """One column of the paper's table: a line per row."""
    both = [r.id for r in table.rows if (r.id, col.id) in got.cells and r.published.get(col.id) is not None]
    t_rank = ranks({r: got.cells[(r, col.id)].mean for r in both})
    p_rank = ranks({r: table.row(r).published[col.id] for r in both})
    where = f"{col.benchmark} / {'|'.join(col.subset)} / {col.metric}" + (f" x {col.scale:g}" if col.scale != 1 else "")
    lines = [f"### {col.id}: {col.paper} ({where})", *([f"note: {col.note}"] if col.note else []), "",
             "| row | paper's row | testbed mean +- std | seeds | chance | 95% interval | published | "
             "rank testbed/paper | vs reference |",
             "|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in table.rows:
        c = got.cells.get((r.id, col.id))
        pub = r.published.get(col.id)
        pub_s = _f(pub) + (f" +- {_f(r.published_std[col.id])}" if col.id in r.published_std else "")
        if c is None:
            mean, n, chance, ci = "-", "0", "-", "-"
        else:
            lo, hi = c.interval
            mean, n = f"{_f(c.mean)} +- {_f(c.std)}", str(c.n)
            chance = _f(Cell._avg(c.chance))
            ci = f"[{_f(lo)}, {_f(hi)}]" if lo is not None and hi is not None else "-"
        rank = f"{t_rank[r.id]}/{p_rank[r.id]}" if r.id in t_rank else "-"
        lines.append(f"| {r.id} | {r.paper} | {mean} | {n} | {chance} | {ci} | {pub_s} | {rank} | "
                     f"{verdict(table, got, r, col)} |")
    return lines


def summary_lines(table: PaperTable, got: Collected) -> list[str]:
    """Per row: the columns where its order against the reference agrees with the paper's."""
    lines = ["### ordering against the reference row, per row", "",
             "agrees / disagrees: the testbed's difference from the reference row is resolved (beyond the seeds' "
             "spread, or disjoint intervals for one seed) and its sign matches / opposes the paper's; "
             "unresolved: not resolved (or a tie), whichever way it leans.", "",
             "| row | agrees | unresolved | disagrees | columns that disagree | columns unresolved |",
             "|---|---:|---:|---:|---|---|"]
    for r in table.rows:
        if r.options is None or r.id == table.reference:
            what = "no job option: " + " ".join(r.no_option.split()) if r.options is None else "reference"
            lines.append(f"| {r.id} | - | - | - | {what} | |")
            continue
        v = {c.id: verdict(table, got, r, c) for c in table.columns}
        ok = [k for k, x in v.items() if x == "agrees"]
        bad = [k for k, x in v.items() if x == "disagrees"]
        open_ = [k for k, x in v.items() if x.startswith("unresolved")]
        lines.append(f"| {r.id} | {len(ok)} | {len(open_)} | {len(bad)} | {', '.join(bad) or '-'} | "
                     f"{', '.join(open_) or '-'} |")
    return lines


def compare_paper(paper: str, runs: list[str | Path]) -> str:
    """Markdown: the paper's table on the runs (``train compare --paper``)."""
    table = load_table(paper)
    got = collect(table, runs)
    seeds = {row: len(rs) for row, rs in got.runs.items()}
    lines = [f"## {table.paper}: {table.title}", "",
             f"{table.tables}; job `{table.job}`; reference row `{table.reference}`; "
             f"runs per row: {', '.join(f'{k} {v}' for k, v in seeds.items()) or 'none matched'}.",
             "options the counted runs set besides the rows': "
             + (", ".join(f"{k}={v}" for k, v in sorted(got.shared.items())) or "none (job defaults)") + ".",
             "mean +- std over seeds (sample std); 95% interval: mean over the seeds of each run's own interval; "
             "rank 1 = highest.", ""]
    for col in table.columns:
        lines += column_table(table, got, col) + [""]
    lines += summary_lines(table, got)
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
    return "\n".join(lines)
