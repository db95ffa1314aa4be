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

Each run's per-item estimates (``eval/final/items.parquet``, :mod:`train.eval.items`) are collected
beside its values, so that rows can be differenced over the same items: the differences, verdicts,
Kendall's tau and the tally are :mod:`train.paper_orderings`; the printed table and the whole
``docs/papers/<paper>.md`` page (``--markdown``) are :mod:`train.paper_pages`.

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
    page: dict = field(default_factory=dict)  # the page's prose (train/paper_pages.py), with {{...}} placeholders

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
                       list(d.get("notes") or []), dict(d.get("page") or {}))
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
    """The run's results row for ``col`` (the first of the column's subsets the run has), scaled; ``key``
    its (benchmark, subset, metric) and ``est_scale`` what its per-item estimate's value is multiplied by."""
    for sub in col.subset:
        hit = [r for r in rows if fnmatch.fnmatchcase(str(r.get("benchmark")), col.benchmark)
               and fnmatch.fnmatchcase(str(r.get("subset") or ""), sub) and r.get("metric") == col.metric
               and _finite(r.get("value"))]
        if hit:
            r = hit[0]
            out = {k: (float(r[k]) * col.scale if _finite(r.get(k)) else None)
                   for k in ("value", "chance", "ci_low", "ci_high")}
            out["key"] = (str(r.get("benchmark")), str(r.get("subset") or ""), str(r.get("metric")))
            out["est_scale"] = (100.0 if r.get("unit") == "%" else 1.0) * col.scale
            return out
    return None


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    chance: list[float] = field(default_factory=list)
    ci_low: list[float] = field(default_factory=list)
    ci_high: list[float] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    ests: list = field(default_factory=list)  # each run's per-item Estimate (items.parquet), None where it has none
    est_scale: float = 1.0                    # an estimate's value times this is the cell's value
    no_items: list[str] = field(default_factory=list)  # why a run has no per-item estimate

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
    def chance_level(self) -> float | None:
        return self._avg(self.chance)

    @property
    def has_items(self) -> bool:
        return bool(self.ests) and all(e is not None for e in self.ests)


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
    cache: dict = field(default_factory=dict, repr=False)  # intervals computed once (train/paper_orderings.py)


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
    from pipeline.io.run_files import CorruptRunFile, read_config_file
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
        try:
            items, why = _items(run)
        except CorruptRunFile as e:
            items, why = {}, str(e)
        seed = read_config_file(run / "config.json").get("seed")
        for col in table.columns:
            v = column_value(col, results)
            if v is None:
                continue
            cell = out.cells.setdefault((row, col.id), Cell())
            cell.values.append(v["value"])
            cell.seeds.append(seed if isinstance(seed, int) else None)
            for k in ("chance", "ci_low", "ci_high"):
                if v[k] is not None:
                    getattr(cell, k).append(v[k])
            est = items.get(v["key"])
            cell.est_scale = v["est_scale"]
            if est is None:
                cell.no_items.append(f"{run.name}: {why or 'no items of ' + '/'.join(v['key'])}")
            elif abs(v["est_scale"] * est.value - v["value"]) > 1e-6 * max(1.0, abs(v["value"])):
                cell.no_items.append(f"{run.name}: its items of {'/'.join(v['key'])} do not give its value")
                est = None
            cell.ests.append(est)
    return out


def _items(run: Path) -> tuple[dict, str]:
    """The run's per-item estimates of its final evaluation ({} and why when it has none)."""
    from train.eval.items import ITEMS_FILE, read_items

    path = run / "eval" / "final" / ITEMS_FILE
    if not path.is_file():
        return {}, (f"no {ITEMS_FILE} (evaluated before per-item estimates were kept: `train eval <job> --manifest M "
                    f"--checkpoint {run} --out {run}/eval/final` writes it)")
    return read_items(path), ""
