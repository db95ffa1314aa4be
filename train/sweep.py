"""Seeded grids of ordinary runs on Ray Tune: ``train sweep <job> --grid GRID.yaml --seeds K``.

GRID.yaml maps manifest keys of the job to lists of values (``train.concept_ot.lr: [1e-4, 3e-4]``);
the trials are every combination times the seeds 0..K-1. An ablation table's rows are a list of
configurations rather than a product: ``configurations:`` is a list of {manifest key: value} mappings
(one configuration each), crossed with the product of the other keys, if any (grids/<paper>.yaml).
A trial is a normal ``train run`` in the Tune trial's process (:func:`train.cli.build_job` with the
trial's ``--set`` options, then :func:`train.loop.train`) in its own run folder (the run tag names the
options), its output in ``<run>/train.log``. Trials run in parallel as the cluster's CPUs allow (``max_concurrent``
at most); a trial that crashes is reported with its error and the others go on. A rerun skips the
trials whose run folder is finished (``checkpoints/final.pt`` and ``eval/final``) and resumes the
others from their last checkpoint; the Tune experiment itself (``<output>/train/<job>/sweeps/<name>``,
named by a hash of the grid) is restored with ``Tuner.restore`` where it exists. The sweep ends with
:func:`train.seeds_table.seeds_table` over the trials' run folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.errors import shorten


class GridError(ValueError):
    """A grid file that cannot be read (one line naming the file and key)."""


def read_grid(path: Path, job: str) -> dict[str, list]:
    """{manifest key: values} from GRID.yaml; every key under ``train.<job>.``. The key
    ``configurations`` (when given) maps to a list of {manifest key: value} mappings."""
    from pipeline.io.run_files import read_checked_bytes

    raw = read_checked_bytes(path, f"grid {path}", GridError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GridError(f"grid {path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                        "save it as UTF-8") from None
    from pipeline.config import YamlTooLarge, load_yaml

    try:
        grid = load_yaml(text)
    except YamlTooLarge as e:
        raise GridError(f"grid {path}: {e}") from None
    except yaml.YAMLError as e:
        raise GridError(f"grid {path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    prefix = f"train.{job.replace('-', '_')}."
    if not isinstance(grid, dict) or not grid:
        raise GridError(f"grid {path}: expected a mapping of {prefix}<option> to a list of values")

    def check_key(k, where: str = "") -> None:
        if not str(k).startswith(prefix):
            raise GridError(f"grid {path}: key {shorten(repr(k), 120)}{where} is not an option of {job} (expected {prefix}<option>)")

    out = {}
    for k, v in grid.items():
        if k == "configurations":
            if not isinstance(v, list) or not v or not all(isinstance(c, dict) and c for c in v):
                raise GridError(f"grid {path}: configurations must be a non-empty list of non-empty "
                                f"{{{prefix}<option>: value}} mappings")
            for i, c in enumerate(v):
                for ck in c:
                    check_key(ck, f" of configurations[{i}]")
            out[k] = [{str(ck): cv for ck, cv in c.items()} for c in v]
            continue
        check_key(k)
        if not isinstance(v, list) or not v:
            raise GridError(f"grid {path}: {k} must be a non-empty list of values (got {shorten(repr(v))})")
        seen = [json.dumps(x, sort_keys=True, default=str) for x in v]
        if (i := next((i for i in range(len(v)) if seen[i] in seen[:i]), None)) is not None:
            raise GridError(f"grid {path}: {k} lists the value {v[i]!r} twice (as YAML reads it: e.g. 0.001 and 1.0e-3 "
                            "are one number); list each value once")
        out[str(k)] = v
    clash = {ck for c in out.get("configurations", []) for ck in c} & set(out) - {"configurations"}
    if clash:
        raise GridError(f"grid {path}: {', '.join(sorted(clash))} both in configurations and as a list")
    return out


def grid_value_error(grid_path: Path, trial: "Trial", message: str, job: str, options: list[str]) -> str:
    """The manifest loader's refusal of a trial's options (``manifest M: key 'K': why`` / ``unknown key
    'K'``) as the grid's error when K is one of the grid's keys: the grid file, the key and its value
    (``options``: the job's option names, for a suggestion)."""
    import difflib
    import re

    m = re.search(r"(unknown key|key) '([^']+)'(?:: (.*))?$", message)
    if not m or m[2] not in trial.options:
        return message
    key, value = m[2], trial.options[m[2]]
    if m[1] == "unknown key":
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], options, n=1, cutoff=0.6)
        hint = f"; did you mean {key.rsplit('.', 1)[0]}.{close[0]}?" if close else ""
        return f"grid {grid_path}: key {key} is not an option of {job}{hint} (`train list {job}` lists them)"
    return f"grid {grid_path}: key {key}: value {value!r} refused: {m[3]}"


def shared_run_error(grid_path: Path, a: "Trial", b: "Trial", run: str) -> str:
    """Two trials of a grid that are one run (the same folder): which options make them the same."""
    same = []
    for k in sorted(set(a.options) | set(b.options)):
        x, y = a.options.get(k), b.options.get(k)
        if json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True):
            continue
        same.append(f"{k}={x if k in a.options else y!r} is its default" if k not in a.options or k not in b.options
                    else f"{k}: {x!r} and {y!r} are one value")
    what = "; ".join(same) if same else "the same options twice"
    return (f"grid {grid_path}: trials {a.label} and {b.label} are one run ({what}): both would train in {run}; "
            "list each value once")


def _set_value(v) -> str:
    """A grid value as a ``--set`` value (YAML-parsed again by the manifest loader)."""
    return json.dumps(v) if isinstance(v, (list, dict, str)) else str(v).lower() if isinstance(v, bool) else str(v)


@dataclass
class Trial:
    options: dict  # grid key -> value
    seed: int
    run_dir: str = ""
    sets: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.options.items()) + f", seed={self.seed}"


def configurations(grid: dict[str, list]) -> list[dict]:
    """The grid's configurations: each of ``configurations`` (or one empty one) crossed with the
    product of the other keys' values."""
    product = {k: v for k, v in grid.items() if k != "configurations"}
    return [{**c, **dict(zip(product, combo))} for c in grid.get("configurations", [{}])
            for combo in itertools.product(*product.values())]


def trials(grid: dict[str, list], seeds: int, job: str) -> list[Trial]:
    key = f"train.{job.replace('-', '_')}"
    out = []
    for opts in configurations(grid):
        for s in range(seeds):
            out.append(Trial(opts, s, sets=[f"{k}={_set_value(v)}" for k, v in opts.items()] + [f"{key}.seed={s}"]))
    return out


def finished(run_dir: Path) -> bool:
    """The run trained and was evaluated to the end: the loop writes eval/final/metrics.json after the
    final benchmarks (a trial killed while scoring them is rerun, not skipped)."""
    return (run_dir / "checkpoints" / "final.pt").is_file() and (run_dir / "eval" / "final" / "metrics.json").is_file()


def stored_differences(job: str, manifest: str | Path, sets: list[str], run_dir: Path) -> dict:
    """{option: (stored, the trial's)}: how the training options stored in a run folder (its
    config.json) differ from the trial's ({}: the same configuration; a folder without a readable
    config.json counts as different)."""
    from pipeline.config import load_manifest
    from train.config import config_differences

    cfg = getattr(load_manifest(Path(manifest), sets).train, job.replace("-", "_"))
    try:
        stored = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {"config.json": ("(unreadable)", "")}
    return config_differences(stored, cfg) if isinstance(stored, dict) else {"config.json": ("(not a mapping)", "")}


def reusable(job: str, manifest: str | Path, sets: list[str], run_dir: Path) -> bool:
    """A finished run folder whose stored configuration is the trial's: reused, not retrained."""
    return finished(Path(run_dir)) and not stored_differences(job, manifest, sets, run_dir)


def _trial(config: dict, build_job=None) -> None:
    """One Tune trial: the ordinary run of the job with the trial's options (``build_job``, i.e.
    train.cli.build_job, then the shared loop), output in <run>/train.log. A finished run folder
    whose stored configuration is the trial's is reused; one of another configuration is retrained
    from the start."""
    import typer
    from ray import tune

    from train.loop import claim_run_folder, train

    trial = config["trial"]
    os.chdir(trial["cwd"])  # Tune starts trials in their own folder: the manifest's relative paths need ours
    run_dir = Path(trial["run_dir"])
    claim_run_folder(run_dir, trial["job"])  # a folder of other files: the trial fails in one line, nothing deleted
    retrain = False
    if finished(run_dir):
        diff = stored_differences(trial["job"], trial["manifest"], trial["sets"], run_dir)
        if not diff:
            tune.report({"reused": 1})
            return
        retrain = True
        with (run_dir / "train.log").open("a") as log:
            log.write(f"{run_dir} holds a finished run of another configuration ("
                      + ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in list(diff.items())[:4]) + "): retraining it\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    with log_path.open("a") as log, contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
        try:
            _, _, _, j = build_job(trial["job"], Path(trial["manifest"]), trial["sets"])
        except typer.Exit:  # build_job's one-line error, written to the log
            log.flush()
            lines = [x for x in log_path.read_text().splitlines() if x.startswith("error: ")]
            raise RuntimeError(lines[-1][len("error: "):] if lines else f"the job could not be built (see {log_path})") from None
        res = train(j, resume=not retrain, progress=False)
    tune.report({**{k: v for k, v in res.items() if isinstance(v, (int, float))}, "trained": 1})


def _latest(run_dir: Path) -> str:
    """``step N/T, <metric> v`` from the run's metrics.jsonl (its last line)."""
    path = run_dir / "metrics.jsonl"
    try:
        last = json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return "starting"
    metric = next((k for k in ("loss",) if k in last), None) or next(
        (k for k, v in last.items() if k not in ("kind", "step", "epoch") and isinstance(v, (int, float))), None)
    return f"step {last.get('step')}" + (f", {last['kind']} {metric} {last[metric]:.4g}" if metric else "")


class _ProgressLines:
    """One line per trial (configuration, step, latest metric) every ``every`` seconds while Tune runs."""

    def __init__(self, trials: list[Trial], every: float = 30.0):
        self.trials, self.every = trials, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.print()

    def print(self) -> None:
        for t in self.trials:
            run = Path(t.run_dir)
            state = "done" if finished(run) else _latest(run) if run.is_dir() else "waiting for a CPU"
            print(f"trial {t.label}: {state}", file=sys.stderr, flush=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)


def _stamp(run: str) -> int | None:
    """The finished run's final.pt time (None: not finished)."""
    return (Path(run) / "checkpoints" / "final.pt").stat().st_mtime_ns if finished(Path(run)) else None


def sweep(job: str, manifest: Path, overrides: list[str], grid_path: Path, seeds: int, trial_runs: list[str],
          storage: Path, build_job, max_concurrent: int | None = None, cpus_per_trial: float = 1.0,
          progress_every: float = 30.0, fresh: bool = False) -> tuple[str, list[str]]:
    """Run the grid on Ray Tune; returns (the seeds table, one error line per crashed trial).
    ``trial_runs[i]``: the run folder of ``trials(...)[i]``; ``build_job(job, manifest, overrides)``
    -> (module, cfg, manifest, Job) builds a trial's job (train.cli.build_job). ``manifest`` and
    ``overrides`` reach the trials as they are: the caller makes their paths absolute
    (train.paths.absolute_inputs). The Tune experiment is restored only after its files pass
    train.sweep_state.check (:class:`train.sweep_state.StateError` otherwise); ``fresh``: it starts over."""
    import shutil

    from ray import tune

    from train.sweep_state import FIX, StateError, check, seal

    grid = read_grid(grid_path, job)
    ts = trials(grid, seeds, job)
    for t, run in zip(ts, trial_runs):
        t.run_dir = str(run)
    configs = [{"job": job, "manifest": str(Path(manifest).resolve()), "sets": list(overrides) + t.sets,
                "run_dir": t.run_dir, "cwd": os.getcwd(), "label": t.label} for t in ts]
    name = "sweep-" + hashlib.sha1(json.dumps([job, configs], sort_keys=True).encode()).hexdigest()[:8]
    trainable = tune.with_resources(tune.with_parameters(_trial, build_job=build_job), {"cpu": cpus_per_trial})
    space = {"trial": tune.grid_search(configs)}
    exp = Path(storage).resolve() / name
    stale = [c["label"] for c in configs if finished(Path(c["run_dir"]))
             and stored_differences(job, c["manifest"], c["sets"], Path(c["run_dir"]))]
    if stale and exp.exists() and not fresh:  # a restored experiment would not rerun its finished trials
        print(f"sweep: {len(stale)} finished trial(s) hold another configuration than theirs now ({stale[0]}"
              f"{', ...' if len(stale) > 1 else ''}): they retrain; the Tune experiment starts over", file=sys.stderr)
        fresh = True
    if fresh and exp.exists():
        shutil.rmtree(exp)
    check(exp)  # before anything in it is read (Tuner.can_restore / restore unpickle it)
    before = {t.run_dir: _stamp(t.run_dir) for t in ts}
    if tune.Tuner.can_restore(str(exp)):
        try:
            tuner = tune.Tuner.restore(str(exp), trainable, resume_unfinished=True, restart_errored=True,
                                       param_space=space)
        except Exception as e:  # noqa: BLE001 - checked but unreadable (a Ray upgrade): one line, the fix
            raise StateError(f"sweep state {exp}: cannot be restored ({type(e).__name__}: "
                             f"{shorten(str(e).strip().splitlines()[-1], 200) if str(e).strip() else ''}); {FIX}") from None
    else:
        tuner = tune.Tuner(
            trainable, param_space=space,
            tune_config=tune.TuneConfig(max_concurrent_trials=max_concurrent),
            run_config=tune.RunConfig(name=name, storage_path=str(Path(storage).resolve()), verbose=0))
    t0 = time.time()
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    tune_log.setLevel(logging.CRITICAL)  # a crashed trial's traceback: reported below as one line
    try:
        # Tune's own status boxes go to stderr: stdout is the table
        with _ProgressLines(ts, progress_every) as lines, contextlib.redirect_stdout(sys.stderr):
            results = tuner.fit()
    finally:
        tune_log.setLevel(level)
        seal(exp)  # Tune has written its state: record it, so that a rerun reads only what this run wrote
    lines.print()
    errors = []
    for r in results:
        if r.error is not None:
            label = (r.config or {}).get("trial", {}).get("label", "?")
            err = getattr(r.error, "cause", None) or r.error.__cause__ or r.error
            msg = shorten(str(err).strip().splitlines()[-1]) if str(err).strip() else ""
            errors.append(f"trial {label}: failed ({type(err).__name__}: {msg})")
    after = {t.run_dir: _stamp(t.run_dir) for t in ts}
    failed = {t.run_dir for t in ts if any(e.startswith(f"trial {t.label}: ") for e in errors)}
    reused = sum(1 for r in after if r not in failed and after[r] is not None and after[r] == before[r])
    trained = sum(1 for r in after if r not in failed and after[r] is not None and after[r] != before[r])
    print(f"sweep: {len(ts)} trials in {time.time() - t0:.1f}s: trained {trained}, reused {reused}, "
          f"failed {len(errors)}; Tune experiment {exp}", file=sys.stderr)
    # the trials' run folders, for `train compare [--paper P]` (the job's folder also holds other runs)
    print("run folders: " + " ".join(t.run_dir for t in ts), file=sys.stderr)
    from train.seeds_table import seeds_table

    done = [t.run_dir for t in ts if finished(Path(t.run_dir))]
    return (seeds_table(done) if done else "(no finished trial)"), errors
