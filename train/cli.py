"""The `train` command: cached-feature training and evaluation of the jobs in train/jobs/.

    train run <job> --manifest M [--set train.<job>.key=value ...] [--fresh] [--workers N]
    train sweep <job> --manifest M --grid GRID.yaml --seeds K [--max-concurrent M]
    train eval <job> --checkpoint C|RUN_DIR --manifest M [--bench NAME ...]
    train compare RUN_DIR [RUN_DIR ...] [--bench NAME] [--subset NAME] [--min-n N] [--over-seeds | --paper PAPER]
    train list [JOB]
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.cli_help import did_you_mean, typer_settings
from pipeline.errors import describe_exception

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Lean trainer over pipeline artifacts.", **typer_settings())

ManifestOpt = Annotated[Path, typer.Option("--manifest", "-m", help="run description (YAML)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a manifest key: a.b=c (repeatable)")]


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def build_job(name: str, manifest: Path | None, overrides: list[str] | None, checkpoint: Path | None = None,
              export: bool = False):
    """(job module, resolved Config, manifest, Job instance).

    Run folder: ``train.<job>.run_dir``, else ``<output>/train/<job>/<tag>`` where the tag is the
    variant (``default`` for jobs without one) when every training option is at its default, else
    ``<variant>-<6-hex hash of the options that differ>`` (TrainerConfig.run_tag): a folder holds
    one configuration. ``checkpoint`` (``train eval``): the job is built with the training options
    stored in the checkpoint (variant, d_c, ...; the manifest's evaluation-only options still
    apply) and its run folder is the checkpoint's (``<run>/checkpoints/x.pt`` -> ``<run>``);
    a ``--set`` of a training option that contradicts the checkpoint is an error. An encoder job (its
    Config has ``EXPORT``) exports where :func:`export_placement` says (``export``: ``--export``); the
    job's ``export_note`` is the line saying where, when that is not the folder the stages load."""
    from pipeline.config import ManifestError, load_manifest
    from train.registry import registry

    reg = registry()
    if name not in reg:
        _fail(did_you_mean("job", name, list(reg)))
    try:
        m = load_manifest(manifest, overrides or [])
    except ManifestError as e:
        _fail(str(e))
    mod = reg[name]
    key = name.replace("-", "_")
    cfg = getattr(m.train, key)
    from train.loop import resolve_device

    run_dir = run_folder(name, m, cfg)
    if checkpoint is not None:
        cfg, run_dir = _config_of_checkpoint(name, cfg, checkpoint, overrides or [])
        setattr(m.train, key, cfg)
    from pipeline.status import StaleArtifact, require_fresh

    try:  # an input redone since the artifacts made from it were written: stop before reading it
        from pipeline.models.required import command_args

        require_fresh(m, getattr(mod, "READS", []), name, command_args(manifest, overrides) if manifest else "")
    except StaleArtifact as e:
        _fail(str(e))
    note = export_placement(key, cfg, m, manifest, overrides or [], run_dir, export)
    try:
        job = mod.make_job(cfg, m, run_dir, resolve_device(cfg.device))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    job.export_note = note
    return mod, cfg, m, job


def export_placement(key: str, cfg, m, manifest: Path | None, overrides: list[str], run_dir: Path, export: bool) -> str | None:
    """Where an encoder job exports. ``<output>/encoders/<name>/``, the folder the manifest's ``models.*``
    load, is replaced only by a run of the manifest's own configuration of the job (no ``--set`` /
    ``--max-steps`` changes a training option but ``control``, which picks its own folder
    ``<name>-<control>``; evaluation-only options may differ) or with ``export``
    (``--export``); ``train.<job>.export_dir`` chooses a folder outright. Any other run (a smoke test
    with ``--max-steps 20``, a ``--set`` of its size) exports beside its run folder, ``<run>/export``:
    sets ``cfg.export_dir`` and returns the line that says so (None when nothing moved)."""
    name = getattr(type(cfg), "EXPORT", None)
    if not name or cfg.export_dir or export:
        return None
    from pipeline.config import ManifestError, load_manifest
    from pipeline.models.required import encoder_export_dir
    from train.config import config_differences

    own = [o for o in overrides if o.split("=", 1)[0].strip() != f"train.{key}"
           and not o.split("=", 1)[0].strip().startswith(f"train.{key}.")]
    try:
        base = getattr(load_manifest(manifest, own).train, key).training_config()  # the manifest's configuration
    except ManifestError:  # the manifest without this job's --set does not load: nothing to compare with
        base = {}
    diff = config_differences(base, cfg)
    diff.pop("control", None)  # a control run has its own folder (<name>-shuffled): the control names it
    if not diff:
        return None
    cfg.export_dir = str(Path(run_dir) / "export")
    default = encoder_export_dir(m.output, name, getattr(cfg, "control", "none"), None)  # sam-segmenter has no control
    shown = ", ".join(f"{k}={b} (manifest {a})" for k, (a, b) in list(diff.items())[:3]) + (" ..." if len(diff) > 3 else "")
    return (f"export: {cfg.export_dir}, not {default} (the folder models.* load): this run's training options differ "
            f"from the manifest's ({shown}); pass --export to replace {default} with it")


def run_folder(name: str, m, cfg) -> Path:
    """``train.<job>.run_dir``, else ``<output>/train/<job>/<run tag>`` (an object-storage output:
    training runs, checkpoints and logs, go to its local mirror)."""
    from pipeline.io import storage

    storage.configure_from(m)  # artifacts under an object-storage output are read through the cache
    return Path(cfg.run_dir) if cfg.run_dir else storage.local_path(m.output) / "train" / name / cfg.run_tag()


def _config_of_checkpoint(name: str, cfg, checkpoint: Path, overrides: list[str]):
    """(cfg with the checkpoint's training options, the checkpoint's run folder)."""
    from pipeline.io.checkpoint import CheckpointError
    from train.config import config_differences
    from train.loop import load_checkpoint

    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        _fail(f"checkpoint {checkpoint} does not exist")
    try:
        stored = load_checkpoint(checkpoint).get("config") or {}
    except CheckpointError as e:  # its bytes are not the ones written, or it is not a checkpoint: says what it is
        prev = checkpoint.with_name("previous.pt")
        _fail(f"{e}" + (f"; the checkpoint before it: -c {prev}" if prev.is_file() and prev != checkpoint else ""))
    except Exception as e:  # a truncated or foreign file
        _fail(f"checkpoint {checkpoint} cannot be read ({describe_exception(e, 160)})")
    prefix = f"train.{name.replace('-', '_')}."
    set_here = {o.split("=", 1)[0][len(prefix):] for o in overrides if o.startswith(prefix)}
    diff = config_differences(stored, cfg)
    clash = {k: v for k, v in diff.items() if k in set_here}
    if clash:
        _fail(f"--set {', '.join(f'{k}={v[1]}' for k, v in clash.items())} contradicts checkpoint {checkpoint} "
              f"({', '.join(f'{k}={v[0]}' for k, v in clash.items())}); drop the --set")
    update = {k: stored[k] for k in cfg.training_config() if k in stored and k in diff}
    try:
        cfg = type(cfg).model_validate({**cfg.model_dump(mode="json"), **update})
    except ValueError as e:
        _fail(f"checkpoint {checkpoint}: its config does not validate for {name} ({str(e).splitlines()[0]})")
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    return cfg, run_dir


@app.command()
def run(
    job: Annotated[str, typer.Argument(help="job name (train list), or `all`: every job, one after another")],
    manifest: ManifestOpt,
    set_: SetOpt = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="ignore an existing checkpoint and start over")] = False,
    resume_from: Annotated[str, typer.Option("--resume", help="last: resume from checkpoints/last.pt; previous: from "
                                             "checkpoints/previous.pt, the one before (when last.pt is refused)")] = "last",
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="end with the result as one JSON line instead of a table")] = False,
    workers: Annotated[Optional[int], typer.Option("--workers", min=1, help="data-parallel workers on Ray Train "
                                                   "(default train.<job>.workers; 1: in this process, no Ray)")] = None,
    gpus_per_worker: Annotated[Optional[float], typer.Option("--gpus-per-worker", min=0, help="GPUs per worker "
                                                             "(default train.<job>.gpus_per_worker)")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", min=1, help="stop after N optimizer steps "
                                                     "(sets train.<job>.max_steps; with `all`, for every job)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="a line per benchmark of the final evaluation "
                                          "(items scored, skipped and why; always in eval/final/benchmarks.log)")] = False,
    export: Annotated[bool, typer.Option("--export", help="an encoder job: replace <output>/encoders/<name>/ (the folder "
                                         "models.* load) even when --set/--max-steps change its training options "
                                         "(without it such a run exports to <run folder>/export)")] = False,
) -> None:
    """Train a job on the manifest's artifacts (resumes from the run's last checkpoint when it has
    the same training configuration; another configuration's checkpoint is refused). With
    --workers N (N > 1): data-parallel on Ray Train (train/distributed.py). The job's own options
    (train.<job>.<option>, set with --set) and their defaults: train list <job>."""
    from train.eval.harness import set_verbose

    set_verbose(verbose)
    if job == "all":
        return _run_all(manifest, list(set_ or []), fresh, progress, max_steps, verbose)
    from pipeline.io.checkpoint import CheckpointError
    from pipeline.io.lock import FolderBusy
    from pipeline.io.artifacts import CorruptArtifact
    from pipeline.io.run_files import CorruptRunFile
    from train.loop import EvaluationInputCorrupt, NotARunFolder, RunMismatch, claim_run_folder, fresh_hint, \
        restore_previous, train

    key = f"train.{job.replace('-', '_')}"
    set_ = list(set_ or []) + ([f"{key}.workers={workers}"] if workers is not None else []) + \
        ([f"{key}.gpus_per_worker={gpus_per_worker}"] if gpus_per_worker is not None else []) + \
        ([f"{key}.max_steps={max_steps}"] if max_steps is not None else [])
    if resume_from not in ("last", "previous") or (resume_from == "previous" and fresh):
        _fail(f"--resume {resume_from}: expected last or previous (and not with --fresh)")
    _, cfg, m, j = build_job(job, manifest, set_, export=export)
    typer.echo(f"run folder: {j.run_dir}", err=True)
    if "export_dir" in type(cfg).model_fields and getattr(j, "export_path", None) is not None:
        # an encoder job's workers export where this process decided (relation-head's export_path is its run's own file)
        set_ = set_ + [f"{key}.export_dir={j.export_path}"]
    if getattr(j, "export_note", ""):
        typer.echo(j.export_note, err=True)
    try:
        claim_run_folder(j.run_dir, job)  # before anything is written there (train.log of --workers, --resume previous)
        if resume_from == "previous":
            typer.echo(restore_previous(j.run_dir), err=True)
        if cfg.workers > 1:
            res = _train_on_workers(job, manifest, set_, cfg, m, j, fresh, progress)
        else:
            res = train(j, resume=not fresh, progress=progress)
    except (RunMismatch, FolderBusy, NotARunFolder, CorruptRunFile) as e:
        _fail(str(e))
    except CheckpointError as e:  # a truncated, foreign or refused checkpoints/last.pt
        _fail(f"{e}; the run cannot resume from it: {fresh_hint(job, j.run_dir)}")
    except (EvaluationInputCorrupt, CorruptArtifact) as e:  # an input changed since it was written: named, with the fix
        _fail(str(e))
    except OSError as e:
        from pipeline.io.run_files import unwritable
        from train.run_folder import read_only_line

        if unwritable(e):  # a read-only run folder (a shared results copy, a read-only mount)
            _fail(read_only_line(j.run_dir, e, job))
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        _fail(f"{e.filename or j.run_dir}: {e.strerror}; free space and run again (it resumes from the last complete "
              "checkpoint, if any)")
    from train.summary import result_json, summary_table

    typer.echo(result_json(job, j.run_dir, res) if json_out else summary_table(job, j.run_dir, res))
    if getattr(j, "export_note", ""):  # said again at the end, where it is read
        typer.echo(j.export_note, err=True)
    return j.run_dir, res


def _run_all(manifest: Path, overrides: list[str], fresh: bool, progress: bool, max_steps: int | None,
             verbose: bool = False) -> None:
    """``train run all``: every registered job on the manifest's artifacts, one after another (a job
    that fails or whose artifacts are missing is reported in one line and the others go on), then
    the run report rebuilt with the runs in it. Exit 2 when any job did not train."""
    import gc
    import time

    from pipeline.config import ManifestError, load_manifest
    from pipeline.io import storage
    from train.registry import feature_jobs

    try:
        m = load_manifest(manifest, overrides)
    except ManifestError as e:
        _fail(str(e))
    done, failed = [], []
    for name in feature_jobs():  # the frozen-encoder jobs make stage inputs: run before the stages, not here
        typer.echo(f"== train run {name}", err=True)
        t0 = time.perf_counter()
        try:
            run_dir, res = run(name, manifest, overrides, fresh=fresh, progress=progress, json_out=False, workers=None,
                               gpus_per_worker=None, max_steps=max_steps, verbose=verbose)
            done.append((name, run_dir, res, time.perf_counter() - t0))
        except typer.Exit as e:  # build_job / train already printed the one-line error
            if e.exit_code:
                failed.append(name)
        except Exception as e:  # noqa: BLE001 - one job's failure must not stop the others
            typer.echo(f"error: {name}: {describe_exception(e)}",
                       err=True)
            failed.append(name)
        gc.collect()
    from pipeline.report.build import build_report
    from train.summary import runs_table

    typer.echo("\n" + runs_table(done, failed))
    from pipeline.models.scene_oracle import oracle_roles, provenance_line

    if oracle_roles(m.models):  # the demo and the testbed: where the features the jobs learnt from come from
        typer.echo(provenance_line(oracle_roles(m.models)))

    try:
        typer.echo(f"report: {build_report(storage.local_path(m.output), str(manifest), m)}")
    except (OSError, ValueError) as e:  # the runs stand; only the page is missing
        typer.echo(f"report: not rebuilt ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})",
                   err=True)
    if failed:
        raise typer.Exit(2)


def _train_on_workers(job: str, manifest: Path, overrides: list[str], cfg, m, j, fresh: bool, progress: bool) -> dict:
    """``train run --workers N``: the run on Ray Train workers (the manifest's ``ray``: embedded or a
    cluster). The workers get the manifest and every path of it absolute (train/paths.py); Ray's
    and the workers' output go to ``<run>/train.log``; what cannot train is refused before a
    worker starts (train.distributed.preflight), a worker's error is one line."""
    import functools

    from pipeline.config import ManifestError
    from pipeline.runtime import RayStartError, ensure_ray
    from train.distributed import PreflightError, WorkerFailed, check_config, run_log, train_data_parallel
    from train.paths import absolute_inputs

    run_dir = Path(j.run_dir).resolve()
    try:
        manifest, overrides = absolute_inputs(manifest, overrides, job)
        check_config(cfg, cfg.workers, cfg.gpus_per_worker)  # the batch split, the device: before Ray starts
    except (ManifestError, PreflightError) as e:
        _fail(str(e))
    if not fresh:  # another configuration's checkpoint (RunMismatch): refused here, not in every worker
        from train.loop import check_run_folder

        check_run_folder(run_dir, cfg, job)
    make = functools.partial(worker_job, job, manifest, overrides)
    with run_log(run_dir) as log_path:
        try:
            ensure_ray(m.ray)
            return train_data_parallel(make, cfg, run_dir, cfg.workers, gpus_per_worker=cfg.gpus_per_worker,
                                       resume=not fresh, progress=progress, job=j, embedded=not m.ray.address)
        except (RayStartError, PreflightError) as e:
            _fail(str(e))
        except WorkerFailed as e:
            _fail(f"{job} on {cfg.workers} workers: {e}; the full traceback is in {log_path}; the run folder resumes "
                  "from its last checkpoint")


def worker_job(name: str, manifest: Path, overrides: list[str], options: dict):
    """The job of one Ray Train worker: ``build_job`` with ``options`` (per-worker batch size, the
    run's folder, the worker's device) set over the manifest's training options."""
    key = f"train.{name.replace('-', '_')}"
    extra = [f"{key}.{k}={v}" for k, v in options.items() if v is not None]
    return build_job(name, manifest, list(overrides) + extra)[3]


@app.command("eval")
def eval_(
    job: Annotated[str, typer.Argument(help="job name")],
    manifest: ManifestOpt,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", "-c", help="checkpoint file (.pt), or a run "
                                                       "folder: its best.pt, else final.pt, else last.pt (default: "
                                                       "the run folder `train run` uses with the same manifest and "
                                                       "--set)")] = None,
    set_: SetOpt = None,
    bench: Annotated[Optional[list[str]], typer.Option("--bench", help="only this benchmark of eval.benchmarks "
                                                       "(repeatable)")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="folder for the results (default "
                                                "<run_dir>/eval/step<N>)")] = None,
    job_eval: Annotated[bool, typer.Option("--job-eval/--no-job-eval", help="also run the job's own evaluate() "
                                           "(its metrics.json, heatmaps)")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="a line per benchmark (items scored, skipped and "
                                          "why; always in <out>/benchmarks.log)")] = False,
) -> None:
    """Score a checkpoint on every benchmark of the manifest's eval.benchmarks and the job's own
    evaluations: one table (metric, value, chance, n, skipped) in <out>/results.parquet and .md."""
    from train.eval.harness import markdown_table, run_harness, set_verbose
    from train.loop import load_model_for_eval

    set_verbose(verbose)

    if checkpoint is None:  # the run `train run <job>` trains with this manifest and these --set options
        checkpoint = Path(build_job(job, manifest, set_)[3].run_dir)
        if not checkpoint.is_dir():
            _fail(f"no run of {job} with these options yet ({checkpoint}): `train run {job}` with the same manifest "
                  "and --set trains it, or pass --checkpoint")
    checkpoint = _checkpoint_file(checkpoint)
    _, _, m, j = build_job(job, manifest, set_, checkpoint=checkpoint)  # the checkpoint's training options and run folder
    try:
        model, step = load_model_for_eval(j, checkpoint)
    except (KeyError, RuntimeError, ValueError) as e:
        _fail(f"checkpoint {checkpoint} does not fit job {job} ({describe_exception(e, 200)})")
    out_dir = out or j.run_dir / "eval" / f"step{step:06d}"
    from pipeline.io.run_files import unwritable, unwritable_line

    try:
        if job_eval:
            import torch

            if getattr(j, "export_note", "") and out_dir.name == "final":  # an encoder job exports from its final evaluation
                typer.echo(j.export_note, err=True)
            with torch.no_grad():
                res = j.evaluate(model, out_dir)
            (out_dir / "metrics.json").write_text(json.dumps(res, indent=1))
        table, errors = run_harness(j, model, m, out_dir, checkpoint=str(checkpoint), step=step, only=bench)
    except ValueError as e:
        _fail(str(e))
    except OSError as e:
        if not unwritable(e):
            raise
        _fail(unwritable_line(out_dir, e, "make it writable, or pass --out with a writable folder"))
    typer.echo(markdown_table(table))
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    typer.echo(f"results: {out_dir / 'results.parquet'} ({len(table)} rows; {out_dir / 'results.md'})")
    if not table or errors:
        raise typer.Exit(2)


def _checkpoint_file(path: Path) -> Path:
    """``--checkpoint``: a checkpoint file, or a run folder (or its checkpoints/ folder): there the
    first of best.pt, final.pt, last.pt, saying which."""
    if path.is_file():
        return path
    if not path.is_dir():
        _fail(f"checkpoint {path} does not exist")
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    names = ("best.pt", "final.pt", "last.pt")
    for name in names:
        if (folder / name).is_file():
            typer.echo(f"checkpoint: {folder / name} (the first of {', '.join(names)} in {path})", err=True)
            return folder / name
    _fail(f"{path} is a folder without checkpoints (no {', '.join(names)} in {folder}): pass a checkpoint file "
          "or the folder of a run that has trained")


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(help="run folders (their newest eval/*/results.parquet), eval "
                                               "folders or results.parquet files")],
    over_seeds: Annotated[bool, typer.Option("--over-seeds", help="group run folders by configuration: mean +- std "
                                             "of the final evaluation over their seeds")] = False,
    paper: Annotated[Optional[str], typer.Option("--paper", help="the paper's ablation table (train/papers/<paper>"
                                                 ".yaml): run folders grouped by its rows, published numbers beside, "
                                                 "ordering against the paper's")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="with --paper: the whole docs/papers/<paper>.md page "
                                           "(train/paper_pages.py)")] = False,
    bench: Annotated[Optional[list[str]], typer.Option("--bench", help="only this benchmark's rows (repeatable)")] = None,
    subset: Annotated[Optional[list[str]], typer.Option("--subset", help="only rows of this subset, e.g. all "
                                                        "(repeatable)")] = None,
    min_n: Annotated[int, typer.Option("--min-n", min=0, help="only rows scored on at least N items")] = 0,
) -> None:
    """One table across runs (jobs, variants, seeds), chance level beside each metric; --bench,
    --subset and --min-n keep a part of it. With --paper: the paper's ablation table on the runs
    (train/paper_tables.py), --markdown its whole page."""
    from pipeline.io.run_files import CorruptRunFile
    from train.eval.compare import compare as _compare
    from train.paper_pages import compare_paper
    from train.paper_tables import PaperTableError
    from train.seeds_table import seeds_table

    try:
        if (bench or subset or min_n) and (paper or over_seeds):
            _fail("--bench, --subset and --min-n filter the table of runs side by side, not --paper or --over-seeds")
        if markdown and not paper:
            _fail("--markdown prints a paper's page: give --paper <paper> (train/papers/*.yaml)")
        typer.echo(compare_paper(paper, runs, markdown) if paper else seeds_table(runs) if over_seeds else
                   _compare(runs, bench or (), subset or (), min_n))
    except (FileNotFoundError, PaperTableError, CorruptRunFile) as e:  # CorruptRunFile: every run was skipped
        _fail(str(e))


@app.command()
def sweep(
    job: Annotated[str, typer.Argument(help="job name (train list)")],
    manifest: ManifestOpt,
    grid: Annotated[Path, typer.Option("--grid", help="YAML: train.<job>.<option>: [values, ...]")],
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="seeds 0..K-1 per configuration")] = 1,
    max_concurrent: Annotated[Optional[int], typer.Option("--max-concurrent", min=1, help="trials at once (default: "
                                                          "as the cluster's CPUs allow)")] = None,
    set_: SetOpt = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="start the Tune experiment over (its saved state is not "
                                        "read; finished trials are still reused)")] = False,
) -> None:
    """A grid of ordinary runs as Ray Tune trials (train/sweep.py), ending with the table of
    `train compare --over-seeds` over them. A rerun reuses a finished trial whose stored
    configuration is its own, and resumes the others."""
    from pipeline.config import ManifestError, load_manifest
    from pipeline.runtime import RayStartError, ensure_ray
    from train.paths import absolute_inputs
    from train.sweep import GridError, grid_value_error, read_grid, shared_run_error, sweep as run_sweep, trials
    from train.sweep_state import StateError

    key = job.replace("-", "_")
    try:
        ts = trials(read_grid(grid, job), seeds, job)
        # the trials run in Tune's folders: every path of the command line and the manifest made absolute here
        manifest, set_ = absolute_inputs(manifest, list(set_ or []), job)
        m = load_manifest(manifest, set_ or [])
        runs = []
        for t in ts:
            try:
                cfg = getattr(load_manifest(manifest, list(set_ or []) + t.sets).train, key)
            except ManifestError as e:  # a grid key or value: the grid's error, not the manifest's
                from train.registry import registry

                _fail(grid_value_error(grid, t, str(e), job, list(registry()[job].Config.model_fields)))
            if cfg.run_dir:
                _fail(f"train.{key}.run_dir is set ({cfg.run_dir}): a sweep's trials need their own run folders")
            runs.append(run_folder(job, m, cfg))
    except (GridError, ManifestError) as e:
        _fail(str(e))
    except AttributeError:
        from train.registry import registry

        _fail(did_you_mean("job", job, list(registry())))
    first: dict = {}
    for t, r in zip(ts, runs):
        if r in first:
            _fail(shared_run_error(grid, first[r], t, str(r)))
        first[r] = t
    try:
        ensure_ray(m.ray)
    except RayStartError as e:
        _fail(str(e))
    storage = run_folder(job, m, getattr(m.train, key).model_copy(update={"run_dir": None})).parent / "sweeps"
    try:
        table, errors = run_sweep(job, manifest, list(set_ or []), grid, seeds, [str(r) for r in runs], storage,
                                  build_job, max_concurrent=max_concurrent, fresh=fresh)
    except StateError as e:
        _fail(str(e))
    typer.echo(table)
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    if errors:
        raise typer.Exit(1)


@app.command("list")
def list_(job: Annotated[Optional[str], typer.Argument(help="a job: its options, defaults and what each does")] = None) -> None:
    """Jobs and what they read; with a job, its options (train.<job>.<option>) and their defaults."""
    import textwrap

    from pipeline.cli_help import help_width, option_lines
    from train.registry import registry

    reg = registry()
    if job is None:
        for name, mod in reg.items():
            typer.echo(f"{name:16s} reads {', '.join(getattr(mod, 'READS', []))}")
        return
    if job not in reg:
        _fail(did_you_mean("job", job, list(reg)))
    key = job.replace("-", "_")
    typer.echo(textwrap.fill(f"{job}: reads {', '.join(getattr(reg[job], 'READS', []))}. Its options, set under "
                             f"train.{key} in the manifest or with --set train.{key}.<option>=<value> (option, default, "
                             "what it does):", help_width(), break_on_hyphens=False))
    typer.echo("\n".join(option_lines(reg[job].Config)))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
