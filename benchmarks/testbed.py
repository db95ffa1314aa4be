"""The testbed end to end: every stage, every job and its control, one table.

    .venv/bin/python benchmarks/testbed.py [--manifest manifests/testbed.yaml] [--jobs concept-ot c3 ...]
                                           [--seed 0] [--set key=value ...] [--no-stages] [--no-control] [--fresh]
                                           [--parallel 2] [--expectations FILE] [--confirm]
                                           [--no-encoders | --encoders-from runs/pixels/encoders]

1. ``pipeline run all --manifest M`` (timed; a rerun resumes, so the stages' time is 0 when nothing changed);
2. per job, the real commands a user types: ``train run <job> --manifest M --json`` and its control,
   the same job with ``--set train.<job>.control=shuffled`` (pairings shuffled once before training);
3. one table, printed and written to ``<output>/testbed.md`` (``--table-only``: ``testbed-table-only.md``, so the run's own table keeps its timings): job, benchmark/metric, value, 95% interval,
   chance, the control's value and interval, steps and wall time of the run, and a verdict per row:

   Each checked row's expected outcome is read from a committed file, ``benchmarks/expectations/testbed.yaml``
   (``<the manifest's name>.yaml`` where there is one, else ``pixels.yaml`` for a manifest whose models.* name encoder
   exports; ``--expectations`` another), whose
   header defines the vocabulary: ``above base``, ``at base`` (above chance, not above its strongest
   no-learning baseline), ``above chance``, ``chance``, ``prior``, ``measured``. ``--confirm`` is the
   confirmation run: the same testbed on the file's ``confirm_seed`` (a generator seed no tuning used) and
   ``confirm_set`` overrides (the sizes its predictions were written for, where it names any), in
   ``<output>-confirm-<seed>``, refused unless the file is committed as it is; the table's first line
   records the file's git blob hash (benchmarks/testbed_expectations.py).

   * a row expected ``above base``: ``learned`` when its paired verdict is ``above`` (:mod:`pipeline.report.significance`): with a no-learning baseline reported beside the row
     (a frozen score, a prior, one group, the untrained model: ``baseline_for`` in results.parquet), the 95%
     interval of (row - strongest baseline) over the same resampled images lies above 0 and the row's own
     interval above chance; without one, its interval lies above chance. The columns ``diff vs base`` and
     ``diff 95%`` show that difference;
   * every control row (:mod:`train.eval.controls`): an exact one-sided test that it is not above chance
     (Clopper-Pearson on its effective n), or, for a job that declares that its score includes a frozen
     term (concept-ot's g), that it is not above that term (its paired difference from it); Holm over the
     table's control rows;
   * ``above chance``: its own interval above chance (where it stands against its baseline shown, no verdict);
     ``at base``: above chance and its paired verdict against its strongest baseline not ``above``;
   * a row that must stay at chance (word order: the scene-oracle's features carry none): ``at chance``
     when its interval's lower bound is not above chance, and its control not above chance by the test.
   * a row a prior scores without the images (c3's ``type2_as_trained``: C' drawn as training draws it):
     ``prior`` when its lower bound is above chance in the trained run and in the control alike.

   An expected row that is missing, scored on fewer items than its stated minimum (``MIN_N``, or the
   pattern's own), or a benchmark the run could not score (``eval/final/errors.json``) fails the check.

``--parallel N`` (default 2, the reference machine's cores) runs N commands at once: the encoder jobs, and the
jobs with their controls (every run is its own folder; each child gets ``OMP_NUM_THREADS=1`` so that N runs
share the cores without torch's spinning threads); ``--parallel 1`` runs one command at a time.

A run whose folder had already finished training is not trained again (``train run`` resumes): the job
only re-evaluates it, and its wall column says ``re-evaluated``, not a training time. ``--fresh`` passes
``--fresh`` to every ``train run``: each run trains again from step 0 in its folder.

Exit status 1 when any verdict fails, so the script is a check as well as a benchmark. Every figure
comes from the runs' ``eval/final/results.parquet`` (the harness and the jobs' own metrics with
``chance``, ``ci_low``, ``ci_high``, ``n``). See docs/testbed.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent

JOBS = ["concept-ot", "c3", "infoground", "visual-tokens", "text-groups", "relation-head"]

# {job: [(benchmark, subset, metric, expect, min_n, why)]}: the expected outcome of each checked row, read from a
# committed file (benchmarks/expectations/testbed.yaml, pixels.yaml for the pixels testbed; its header has the
# vocabulary: above base, at base, above chance, chance, prior, measured). Every entry must match a row; rows
# not named there are shown only with --all-rows.
from benchmarks.testbed_expectations import default_file, load as load_expectations  # noqa: E402

LEARNABLE, _META = load_expectations(default_file(pixels=False))
MIN_N = _META["min_n"]


CHILD_ENV: dict[str, str] = {}  # set by main: OMP_NUM_THREADS=1 when runs share the cores


def _cli(tool: str, *args: str) -> tuple[dict | None, float, str, str]:
    """(the last JSON line of stdout, wall seconds, the last stderr line on failure else "", the whole stderr)."""
    t0 = time.perf_counter()
    p = subprocess.run([str(BIN / tool), *args], capture_output=True, text=True, env={**os.environ, **CHILD_ENV})
    wall = time.perf_counter() - t0
    last = None
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            try:
                last = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, wall, tail, p.stderr
    return last, wall, "", p.stderr


def _finished_run(tool: str, *args: str) -> tuple[dict | None, float, str, str]:
    """``--table-only``'s stand-in for :func:`_cli`: nothing runs; a ``train run`` answers with the folder that the
    same command trains into (``train.cli.run_folder``) when its final evaluation is there."""
    if tool != "train":
        return None, 0.0, "", ""
    from pipeline.config import load_manifest
    from train.cli import run_folder

    job, manifest = args[1], args[args.index("--manifest") + 1]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    m = load_manifest(manifest, sets)
    run = run_folder(job, m, getattr(m.train, job.replace("-", "_")))
    if not (run / "eval" / "final" / "results.parquet").is_file():
        return None, 0.0, f"{run}: no finished run (train it first)", ""
    return {"run_dir": str(run)}, 0.0, "", ""


def _wall(wall: float, stderr: str) -> str:
    """The wall column: a training time, or a plain word that the run was trained before."""
    from train.loop import NOTHING_TO_TRAIN  # torch: imported once a run has finished, not at start-up

    if wall == 0.0 and not stderr:  # --table-only: nothing ran
        return "-"

    return f"{wall:.0f} (re-evaluated: trained before; --fresh retrains)" if NOTHING_TO_TRAIN in stderr else f"{wall:.0f}"


def _matches(row: dict, pat: tuple) -> bool:
    b, s, m = pat[:3]
    return ((b is None or row["benchmark"] == b) and (s is None or (row.get("subset") or "") == s)
            and (m is None or row["metric"] == m))


def _interval(r: dict | None) -> str:
    if not r or r.get("ci_low") is None or r.get("ci_high") is None:
        return "-"
    return f"[{r['ci_low']:.3g}, {r['ci_high']:.3g}]"


def _num(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.4g}"


def _in(r: dict | None, x) -> bool:
    """Not above chance: the interval's lower bound is at most chance. One-sided, since a run that
    learns nothing can land a little below chance with an interval excluding it (R@1 of 0 hits: [0, 0])."""
    return bool(r) and x is not None and r.get("ci_low") is not None and r["ci_low"] <= x


def _above(r: dict | None, x) -> bool:
    """Above chance: the interval's lower bound exceeds it."""
    return bool(r) and x is not None and r.get("ci_low") is not None and r["ci_low"] > x


def _diff(r: dict | None) -> tuple[str, str]:
    """(the baseline the row's paired difference is against, ``diff [lo, hi]``) or ("-", "-")."""
    if not r or not r.get("diff_vs"):
        return "-", "-"
    lo, hi = r.get("diff_low"), r.get("diff_high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return r["diff_vs"], f"{_num(r.get('diff'))} (no paired interval)"
    return r["diff_vs"], f"{r['diff']:+.3g} [{lo:+.3g}, {hi:+.3g}]"


def _learned(r: dict) -> tuple[bool, str]:
    """(ok, verdict text) of a learnable row: its paired verdict (train.summary.result_rows)."""
    v, bar = r.get("verdict") or "", r.get("bar")
    if v == "above":
        return True, "learned"
    if bar is not None and not v:
        return False, f"NO PAIRED INTERVAL vs {bar[0]}"
    if v == "below" and bar is not None:
        return False, f"BELOW BASELINE {bar[0]}"
    return False, f"NOT LEARNED ({v or 'no interval'})"


def settle_controls(rows: list[dict]) -> list[dict]:
    """Each row's ``verdict`` and ``ok`` from its own part and its control's test, Holm over ``rows`` (a
    table's rows: one job's, or the whole table's); rows without a control test keep their own part."""
    from train.eval.controls import judge

    tests = [r.get("ctest") for r in rows]
    judge(tests)
    for r, t in zip(rows, tests):
        r["verdict"], r["ok"] = r["own_verdict"], r["own_ok"]
        if t is not None:
            bad = t.above or t.p is None
            r["verdict"] += ", " + (t.text.replace("control", "CONTROL", 1) if bad else t.text)
            r["ok"] = r["ok"] and not bad
    return rows


def _steps(run_dir: Path) -> int | None:
    from pipeline.report.curves import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return rows[-1].get("step") if rows else None


def _failure(job: str, what: str, verdict: str) -> dict:
    return {"job": job, "row": what, "value": None, "ci": "-", "chance": None, "n": None, "control": None,
            "control_ci": "-", "diff_vs": "-", "diff": "-", "own_verdict": verdict, "own_ok": False}


def benchmark_errors(run: Path) -> list[str]:
    """The benchmarks the run's final evaluation could not score (the harness's errors.json)."""
    path = run / "eval" / "final" / "errors.json"
    if not path.is_file():
        return []
    try:
        errs = json.loads(path.read_text())
    except ValueError:
        return [f"{path}: not valid JSON"]
    if not isinstance(errs, list):
        return [f"{path}: not a list"]
    # a job with no image-text scorer (relation-head, mlm-encoder) is not a benchmark that failed:
    # its own rows are its measure, and the harness says so in errors.json
    return [str(e) for e in errs if "does not implement the scoring interface" not in str(e)]


def corpus_encoders(jobs: list[str]) -> list[str]:
    """The encoder jobs among ``jobs`` that learn from stage outputs on the corpus (``CORPUS_STAGES`` in their package:
    relation-encoder, on the corpus's visual tokens), so they run after the other encoders, whose exports those
    stages load."""
    from train.registry import registry

    return [j for j in jobs if getattr(registry().get(j), "CORPUS_STAGES", None)]


def run_corpus_encoders(cli, manifest: str, sets: list[str], jobs: list[str]) -> list[tuple[str, dict | None, float, str, str]]:
    """For each of ``jobs`` (:func:`corpus_encoders`): ``pipeline run <stage> --corpus`` for every stage its
    ``CORPUS_STAGES`` names (with the ``--set`` it lists there), then ``train run <job> --export``, timed, as a user
    types them; [(job, result line, wall s (the job's; the corpus stages' in its stderr column), error, stderr)]."""
    from train.registry import registry

    out = []
    for job in jobs:
        err, t_stages = "", 0.0
        for stage, extra in registry()[job].CORPUS_STAGES.items():
            _, wall, err, _ = cli("pipeline", "run", stage, "--corpus", "--manifest", manifest, *sets,
                                  *sum((["--set", x] for x in extra), []))
            t_stages += wall
            if err:
                err = f"pipeline run {stage} --corpus failed: {err}"
                break
        if err:
            out.append((job, None, t_stages, err, ""))
            continue
        res, wall, err, log = cli("train", "run", job, "--manifest", manifest, "--json", "--no-progress", "--export", *sets)
        out.append((job, res, wall, err, log))
    return out


def job_rows(job: str, run: Path, control: Path | None, all_rows: bool) -> list[dict]:
    from train.eval.controls import control_test, includes_frozen
    from train.summary import result_rows

    got = [r for r in result_rows(run) if isinstance(r.get("value"), (int, float))]
    ctl = {(r["benchmark"], r.get("subset") or "", r["metric"]): r for r in (result_rows(control) if control else [])}
    pats = LEARNABLE.get(job, [])
    frozen = includes_frozen(job)
    out = [_failure(job, f"benchmark not scored: {e}", "BENCHMARK FAILED") for e in benchmark_errors(run)]
    for pat in pats:
        if not any(_matches(r, pat) for r in got):
            out.append(_failure(job, "/".join(x or "*" for x in pat[:3]) + " (expected row absent)", "MISSING"))
    for r in got:
        pat = next((p for p in pats if _matches(r, p)), None)
        if pat is None and not (all_rows and r.get("chance") is not None):
            continue
        c = ctl.get((r["benchmark"], r.get("subset") or "", r["metric"]))
        expect = pat[3] if pat else "-"
        chance = r.get("chance")
        min_n = (pat[4] if pat and len(pat) > 4 else MIN_N) if pat else 0
        why = pat[5] if pat and len(pat) > 5 else ""
        bar = r.get("bar")
        # the control must not be above what needs no learning (train.eval.controls; Holm in settle_controls)
        ctest = control_test(c or {}, frozen) if control is not None and expect in (
            "above base", "above chance", "at base", "chance", "measured") else None
        if pat and (r.get("n") or 0) < min_n:
            ok, verdict = False, f"TOO FEW ITEMS (n {r.get('n')} < {min_n})"
        elif expect == "above base":  # the paired verdict: above chance and above its strongest baseline
            ok, verdict = _learned(r)
        elif expect == "above chance":  # where it stands against its baseline is shown, no verdict on it
            ok = _above(r, chance)
            verdict = "above chance" if ok else "NOT ABOVE CHANCE"
            if bar is not None:
                verdict += f" ({r.get('verdict') or 'no paired verdict'} vs {bar[0]}" + (f": {why}" if why else "") + ")"
        elif expect == "at base":  # above chance, not above the frozen model / prior / boxes it is compared with
            if bar is None:
                ok, verdict = False, "NO BASELINE ROW (expected at base)"
            elif not r.get("verdict"):  # no paired interval: not judged against its baseline either way
                ok, verdict = False, f"NO PAIRED INTERVAL vs {bar[0]}"
            else:
                above_base = r.get("verdict") == "above"
                ok = _above(r, chance) and not above_base
                verdict = (f"at base ({bar[0]})" if ok else "NOT ABOVE CHANCE" if not _above(r, chance)
                           else f"ABOVE BASE {bar[0]}, expected at base")
        elif expect == "prior":  # a row a prior without the images scores: above chance, the control too
            ok = _above(r, chance) and (control is None or _above(c, chance))
            verdict = "prior: above chance, the control too" if ok else "PRIOR NOT ABOVE CHANCE"
        elif expect == "chance":
            ok = _in(r, chance)
            verdict = "at chance" if ok else "OFF CHANCE"
        elif expect == "measured":  # shown with what it is, no learning verdict (a sixth element: why)
            verdict = ("measured: " + ("above chance" if _above(r, chance) else "not above chance")
                       + (f" ({why})" if why else ""))
            ok = True
        else:
            ok, verdict = True, ""
        vs, diff = _diff(r)
        out.append({"job": job, "row": "/".join(x for x in (r["benchmark"], r.get("subset") or "", r["metric"]) if x),
                    "key": (r["benchmark"], r.get("subset") or "", r["metric"]),
                    "value": r["value"], "ci": _interval(r), "chance": chance, "n": r.get("n"),
                    "control": None if c is None else c["value"], "control_ci": _interval(c),
                    "diff_vs": vs, "diff": diff, "own_verdict": verdict, "own_ok": ok, "ctest": ctest})
    return settle_controls(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=str(REPO / "manifests" / "testbed.yaml"))
    ap.add_argument("--jobs", nargs="*", default=JOBS)
    ap.add_argument("--seed", type=int, default=None, help="train.<job>.seed for every run")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra manifest override (repeatable)")
    ap.add_argument("--no-stages", action="store_true", help="the artifacts exist: skip `pipeline run all`")
    ap.add_argument("--no-control", action="store_true", help="skip the control runs")
    ap.add_argument("--fresh", action="store_true", help="retrain every run from step 0 (train run --fresh)")
    ap.add_argument("--all-rows", action="store_true", help="every result row with a chance level, not only the main ones")
    ap.add_argument("--compare", default=str(REPO / "manifests" / "testbed.yaml"),
                    help="the oracle column: each row's value in this manifest's run of the job (benchmarks/testbed_encoders.py)")
    ap.add_argument("--no-encoders", action="store_true", help="the encoders exist: skip training the ones models.* point at")
    ap.add_argument("--encoders-from", default=None, metavar="DIR", help="link <output>/encoders to DIR (another run's "
                    "encoders folder, e.g. runs/pixels/encoders) and train no encoder: a confirmation run on the models "
                    "seed 0's run trained on the corpus (implies --no-encoders)")
    ap.add_argument("--table-only", action="store_true", help="train nothing, run no stage: the table of the runs that "
                    "the same command trained before (their folders as `train run` names them)")
    ap.add_argument("--parallel", type=int, default=2, help="commands at once (encoders; each job beside its control); "
                    "each child gets OMP_NUM_THREADS=1 when above 1")
    ap.add_argument("--expectations", default=None, help="the expected outcome of each row (default: "
                    "benchmarks/expectations/<the manifest's name>.yaml where there is one, else pixels.yaml for a manifest with "
                    "encoder exports, else testbed.yaml)")
    ap.add_argument("--confirm", action="store_true", help="the confirmation run: the expectations file's confirm_seed "
                    "as dataset.synthetic.seed (and its confirm_set overrides), in <output>-confirm-<seed>; refused "
                    "unless the file is committed as it is")
    args = ap.parse_args(argv)
    from benchmarks.testbed_encoders import encoder_jobs, oracle_key, oracle_rows, run_encoders
    from benchmarks.testbed_expectations import ExpectationsError, committed_blob, confirm_sets

    encoders = encoder_jobs(args.manifest, args.sets)
    exp_path = Path(args.expectations) if args.expectations else default_file(pixels=bool(encoders), manifest=args.manifest)
    try:
        table, meta = load_expectations(exp_path)
        blob = committed_blob(exp_path) if args.confirm else None
    except ExpectationsError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2
    LEARNABLE.clear()
    LEARNABLE.update(table)
    exp_line = f"expectations: {exp_path}"
    if args.confirm:
        seed = meta.get("confirm_seed")
        if seed is None:
            print(f"testbed: {exp_path}: no confirm_seed; add one (a generator seed no tuning has used)", file=sys.stderr)
            return 2
        from pipeline.config import load_manifest

        extra = meta["confirm_set"]
        args.sets = [*args.sets, *confirm_sets(load_manifest(args.manifest, [*args.sets, *extra]).output, int(seed), extra)]
        exp_line = (f"confirmation run: {', '.join(extra) + ', ' if extra else ''}dataset.synthetic.seed={seed}; "
                    f"expectations {exp_path.relative_to(REPO)} "
                    f"committed as git blob {blob} (`git log --find-object={blob}` names the commit)")
    if args.encoders_from:
        from benchmarks.testbed_encoders import link_encoders
        from pipeline.config import load_manifest

        try:
            print(f"testbed: {link_encoders(load_manifest(args.manifest, args.sets).output, args.encoders_from)}")
        except ValueError as e:
            print(f"testbed: {e}", file=sys.stderr)
            return 2
        args.no_encoders = True
    t_start = time.perf_counter()
    CHILD_ENV.clear()
    CHILD_ENV.update({"OMP_NUM_THREADS": "1"} if args.parallel > 1 else {})
    pool = ThreadPoolExecutor(max(1, args.parallel))
    sets = sum((["--set", s] for s in args.sets), [])
    cli = _finished_run if args.table_only else _cli
    compare = None if Path(args.compare).resolve() == Path(args.manifest).resolve() else args.compare
    encoders = [] if args.no_encoders else encoders
    later = corpus_encoders(encoders)  # after the others: they learn from corpus stages that load the others' exports
    first = [j for j in encoders if j not in later]
    enc_runs, t_ingest = run_encoders(cli, args.manifest, sets, first, pool) if encoders else ([], 0.0)
    enc_runs += run_corpus_encoders(cli, args.manifest, sets, later) if later else []
    t_encoders = time.perf_counter() - t_start  # elapsed: the encoder runs may overlap
    t_stages = 0.0
    if not args.no_stages:
        _, t_stages, err, _ = cli("pipeline", "run", "all", "--manifest", args.manifest, *sets)
        if err:
            print(f"testbed: pipeline run all failed: {err}", file=sys.stderr)
            return 1
    lines = [exp_line, ""]
    if not args.table_only:
        if enc_runs:
            lines.append(f"encoders: {t_encoders:.0f} s elapsed (`pipeline run ingest` {t_ingest:.0f} s, "
                         + ", ".join(f"`train run {j}` {w:.0f} s" for j, _, w, _, _ in enc_runs) + ")")
        lines += [f"stages: {t_stages:.0f} s (`pipeline run all --manifest {args.manifest}`)", ""]
    lines += ["| job | metric | value | 95% interval | chance | n | diff vs base | diff 95% | control | control 95% | "
              "oracle testbed | verdict | steps | wall s |",
              "|---|---|---:|---|---:|---:|---|---|---:|---|---:|---|---:|---:|"]
    ok_all = True
    table: list[str | tuple[dict, Callable[[dict], str]]] = []  # a line, or a row and how to print it once judged
    for job, res, wall, err, log in enc_runs:  # each encoder's own held-out quality (no control run)
        if err or not res:
            table.append(f"| {job} | run failed: {err or 'no result line'} | | | | | | | | | | FAILED | | {wall:.0f} |")
            ok_all = False
            continue
        run = Path(res["run_dir"])
        for r in job_rows(job, run, None, args.all_rows):
            table.append((r, lambda r, job=job, run=run, wall=wall, log=log: (
                f"| {job} | {r['row']} | {_num(r['value'])} | {r['ci']} | {_num(r['chance'])} | {_num(r['n'])} | "
                f"{r['diff_vs']} | {r['diff']} | - | - | - | {r['verdict']} | {_num(_steps(run))} | {_wall(wall, log)} |")))
    runs = {}  # job -> (future of the run, future of its control or None), all submitted at once
    for job in args.jobs:
        key = job.replace("-", "_")
        jsets = sets + (["--set", f"train.{key}.seed={args.seed}"] if args.seed is not None else [])
        jsets += ["--fresh"] if args.fresh else []
        cmd = ("train", "run", job, "--manifest", args.manifest, "--json", "--no-progress", *jsets)
        runs[job] = (pool.submit(cli, *cmd),
                     None if args.no_control else pool.submit(cli, *cmd, "--set", f"train.{key}.control=shuffled"))
    for job, (fut, cfut) in runs.items():
        res, wall, err, log = fut.result()
        if err or not res:
            table.append(f"| {job} | run failed: {err or 'no result line'} | | | | | | | | | | FAILED | | {wall:.0f} |")
            ok_all = False
            continue
        oracle = oracle_rows(job, compare, args.sets)
        control = None
        if cfut is not None:
            cres, _, cerr, _ = cfut.result()
            if cerr or not cres:
                table.append(f"| {job} | control failed: {cerr or 'no result line'} | | | | | | | | | | FAILED | | |")
                ok_all = False
            else:
                control = Path(cres["run_dir"])
        run = Path(res["run_dir"])
        steps = _steps(run)
        for r in job_rows(job, run, control, args.all_rows):
            table.append((r, lambda r, job=job, oracle=oracle, steps=steps, wall=wall, log=log: (
                f"| {job} | {r['row']} | {_num(r['value'])} | {r['ci']} | {_num(r['chance'])} | {_num(r['n'])} | "
                f"{r['diff_vs']} | {r['diff']} | {_num(r['control'])} | {r['control_ci']} | "
                f"{_num(oracle.get(oracle_key(r.get('key'))))} | {r['verdict']} | {_num(steps)} | {_wall(wall, log)} |")))
    pool.shutdown()
    settle_controls([x[0] for x in table if isinstance(x, tuple)])  # Holm over the whole table's control rows
    for x in table:
        if isinstance(x, tuple):
            ok_all &= x[0]["ok"]
        lines.append(x[1](x[0]) if isinstance(x, tuple) else x)
    t_all = time.perf_counter() - t_start
    lines.append("")
    lines.append("table of earlier runs (--table-only): nothing was trained" if args.table_only
                 else f"whole run: {t_all:.0f} s ({args.parallel} command(s) at once)")
    text = "\n".join(lines)
    print(text)
    from pipeline.config import load_manifest

    out = Path(load_manifest(args.manifest, args.sets).output)
    if out.is_dir():  # --table-only beside the run's own table, which keeps its timings
        (out / ("testbed-table-only.md" if args.table_only else "testbed.md")).write_text(text + "\n")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
