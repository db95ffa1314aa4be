"""The `pipeline` command: run stages, list them, inspect artifacts."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.cli_help import did_you_mean, typer_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Offline vision-language artifact pipeline.",
    **typer_settings(),
)
log = logging.getLogger("pipeline")


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged, not the stream of the moment
    logging was set up (an in-process caller, a test's capture, may have replaced and closed it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(output: Path | None = None, name: str = "pipeline", verbose: bool = False) -> None:
    root = logging.getLogger()
    if getattr(root, "_vlpipe_configured", False):
        return
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handler = _Stderr()
    handler.setFormatter(fmt)
    from pipeline.progress import terminal_filter

    handler.addFilter(terminal_filter(verbose))  # the log file's own lines (a stage's summary): with -v only
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("ray", "urllib3", "filelock", "httpx", "transformers", "PIL", "faiss", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if output is not None:
        (output / "_logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(output / "_logs" / f"{name}.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root._vlpipe_configured = True


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _require_models(m, stages: list[str], manifest: Path, sets: list[str] | None) -> None:
    """Stop (one line, exit 2) when model folders the ``stages`` load do not exist: every one named,
    with the command that makes it (pipeline/models/required.py)."""
    from pipeline.models.required import missing_message, missing_models

    missing = missing_models(m, stages)
    if missing:
        _fail(missing_message(missing, m, manifest, sets))


ManifestOpt = Annotated[Path, typer.Option("--manifest", "-m", help="run description (YAML)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a manifest key: a.b=c (repeatable)")]


@app.command()
def run(
    stage: Annotated[str, typer.Argument(help="stage name, or `all` for every enabled stage")],
    manifest: ManifestOpt,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="redo shards that are already complete")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", help="ingest at most N samples")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug lines and the log file's detail lines "
                                          "on the terminal too; tracebacks of failures")] = False,
    report: Annotated[bool, typer.Option("--report/--no-report", help="`all`: write the HTML run report at the end")] = True,
    corpus: Annotated[bool, typer.Option("--corpus", help="run the stage on the manifest's `corpus:` (the encoders' "
                                         "generated pretraining corpus), output <output>/corpus (ingest: "
                                         "<output>/corpus/samples), models.* as the manifest names them")] = False,
) -> None:
    """Run one stage (or `all`) of a manifest; complete shards are skipped unless --force."""
    from pipeline.config import ManifestError, load_manifest
    from pipeline.stage import RunContext, StageError, dependency_order, registry, run_stage

    if stage != "all" and stage not in registry():  # before any folder is made
        _fail(did_you_mean("stage", stage, ["all", *registry()]))
    try:
        m = main_m = load_manifest(manifest, set_ or [])
        if corpus:
            from pipeline.config import corpus_manifest, corpus_refusal

            from pipeline.models.required import command_args

            why = corpus_refusal(m, stage, command_args(manifest, set_))
            if why:
                _fail(why)
            m = corpus_manifest(m)
    except ManifestError as e:
        _fail(str(e))
    from pipeline.io import storage
    from pipeline.io.artifacts import OutputPathError, ensure_dir

    reg = registry()
    if stage == "all":
        names = dependency_order([s for s in reg if getattr(m.stages, reg[s].key).enabled])
    else:
        names = [stage]
    # every missing model folder at once, before Ray or a folder is made (--corpus: the same models.*, whose encoder
    # exports lie under the manifest's own output, not under <output>/corpus)
    _require_models(main_m, names, manifest, set_)
    storage.configure_from(m)
    local = storage.local_path(m.output)  # an object-storage output: its mirror in the cache (logs stay local)
    try:  # a file where the output folder should be, or no write permission: one line, exit 2
        ensure_dir(local)
        ensure_dir(local / "_logs", "log")
    except OutputPathError as e:
        _fail(str(e))
    setup_logging(local, f"run-{stage}", verbose)
    from pipeline.models.required import command_args

    ctx = RunContext(m, force=force, limit=limit, args=command_args(manifest, set_) + (" --corpus" if corpus else ""))
    from pipeline.report.build import record_stage

    try:
        for name in names:
            summary = run_stage(name, ctx)
            record_stage(local, name, summary, manifest)
            typer.echo(f"{name}: " + json.dumps(summary))
    except (StageError, ManifestError) as e:
        _fail(str(e))
    except Exception as e:  # anything unforeseen: one line; the traceback with -v
        from pipeline.errors import describe_exception

        log.debug("stage %s failed", name, exc_info=True)
        _fail(f"stage {name} failed: {describe_exception(e)}" + ("" if verbose else " (rerun with -v for the traceback)"))
    if stage == "all":
        _run_summary(ctx, names, local, manifest, report, m.output)


def _run_summary(ctx, names: list[str], output: Path, manifest: Path, report: bool, location: str | None = None) -> None:
    """The end of `run all`: each stage's rows, errors and time, where the artifacts, the log and the report are."""
    from pipeline.counts import fmt_count
    from pipeline.report.formatting import fmt_num, fmt_seconds
    from pipeline.stage import registry

    reg = registry()
    location = location or str(output)
    lines = ["", f"run all: {len(names)} stages done; artifacts under {location.rstrip('/')}/",
             f"  {'stage':24s} {'artifact':14s} {'count':>19s} {'errors':>7s} {'time':>8s}"]
    for name in names:
        s = ctx.summaries.get(name, {})
        try:  # the artifact's one count (pipeline/counts.py), as `pipeline status` and the report show it
            am = json.loads((output / reg[name].writes[0] / "_manifest.json").read_text())
            count, errors = fmt_count(am), am["errors"]["rows"]
        except (OSError, ValueError, KeyError):
            count, errors = "-", s.get("errors")
        lines.append(f"  {name:24s} {reg[name].writes[0]:14s} {count:>19s} "
                     f"{fmt_num(errors) if errors is not None else '-':>7s} {fmt_seconds(s.get('seconds', 0)):>8s}")
    total = sum(ctx.summaries.get(n, {}).get("seconds", 0) for n in names)
    from pipeline.models.scene_oracle import oracle_roles, provenance_line

    roles = oracle_roles(ctx.manifest.models)
    if roles:  # the demo and the testbed: say where the features come from
        lines.append(provenance_line(roles, indent="  "))
    lines.append(f"  total {fmt_seconds(total)}; log: {output / '_logs' / 'run-all.log'}; rejected rows: <artifact>/errors/errors.parquet")
    if report:
        from pipeline.report import build_report

        try:
            path = build_report(location, manifest, ctx.manifest)
            lines.append(f"report: {path}  (open it in a browser; rebuild with `pipeline report {location}`)")
        except Exception as e:  # the run succeeded; a report failure must not hide that
            lines.append(f"report: not written ({type(e).__name__}: {e}); try `pipeline report {location}`")
    else:
        lines.append(f"report: `pipeline report {output}` writes {output / 'report' / 'index.html'}")
    for handler in logging.getLogger().handlers:  # the summary also goes into _logs/run-all.log
        if isinstance(handler, logging.FileHandler):
            handler.stream.write("\n".join(lines) + "\n")
            handler.flush()
    typer.echo("\n".join(lines))


@app.command()
def report(
    output: Annotated[Optional[str], typer.Argument(help="a run's output folder or URL (or give --manifest)")] = None,
    manifest: Annotated[Optional[Path], typer.Option("--manifest", "-m", help="run description (YAML)")] = None,
    set_: SetOpt = None,
) -> None:
    """Write a static HTML report of a run (<output>/report/index.html): every artifact, with pictures."""
    from pipeline.config import ManifestError, load_manifest
    from pipeline.report import build_report

    m = None
    if manifest is not None:
        try:
            m = load_manifest(manifest, set_ or [])
        except ManifestError as e:
            _fail(str(e))
        output = output or m.output
    if output is None:
        _fail("give a run's output folder or --manifest")
    setup_logging(None)
    from pipeline.io.run_files import unwritable, unwritable_line

    try:
        path = build_report(output, manifest, m)
    except FileNotFoundError as e:
        _fail(str(e))
    except OSError as e:
        if not unwritable(e):
            raise
        _fail(unwritable_line(Path(str(output)) / "report", e, f"make it writable, or copy {output} somewhere writable "
                              "and report that copy"))
    typer.echo(f"report: {path}")


@app.command("list")
def list_stages() -> None:
    """Stages, what each reads and writes."""
    from pipeline.stage import dependency_order, registry

    reg = registry()
    for name in dependency_order(list(reg)):
        s = reg[name]
        reads = ", ".join(s.reads) or "dataset"
        typer.echo(f"{name:24s} reads: {reads:28s} writes: {', '.join(s.writes):16s} {s.description}")


def _fmt_value(v, width: int = 60) -> str:
    if isinstance(v, float):
        text = f"{v:.4g}"
    elif isinstance(v, list) and len(v) > 8:
        text = json.dumps(v[:8], default=str)[:-1] + f", ... ({len(v)} items)]"
    else:
        text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= width else text[: width - 3] + "..."


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="artifact folder or URL, e.g. runs/demo/concepts, s3://bucket/run/samples")],
    rows: Annotated[int, typer.Option("--rows", "-n", help="sample rows per table")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="print the _manifest.json")] = False,
) -> None:
    """Schema, row and shard counts, provenance and a few rows of an artifact."""
    from pipeline.io.artifacts import Artifact, ArtifactMissing, CorruptArtifact
    from pipeline.io.inspect import describe

    from pipeline.io import storage

    try:
        art = Artifact(path)
    except ArtifactMissing as e:
        inside = _artifacts_in(path)
        if inside:  # a run's output folder, not one artifact
            _fail(f"{path} is a run folder, not an artifact: `pipeline report {path}` writes its report; "
                  f"inspect one of its artifacts with `pipeline inspect {storage.join(path, inside[0])}` ({', '.join(inside)})")
        _fail(str(e))
    except (OSError, RuntimeError) as e:  # an unreachable store, a missing fsspec backend
        _fail(f"{path}: {e}")
    if as_json:
        typer.echo(json.dumps(art.manifest, indent=2))
        return
    try:
        typer.echo(describe(art, rows, _fmt_value))
    except CorruptArtifact as e:
        _fail(str(e))


@app.command()
def verify(
    paths: Annotated[list[str], typer.Argument(help="artifact folders or URLs (or an output folder: every artifact in it)")],
    fix: Annotated[bool, typer.Option("--fix", help="forget the units of bad files, so the next run redoes them")] = False,
) -> None:
    """Check every file of finished artifacts against the sizes and sha256s in _manifest.json."""
    from pipeline.io.artifacts import Artifact, ArtifactMissing, forget_units_of

    from pipeline.io import storage

    arts = []
    for p in paths:
        if _is_artifact(p):
            arts.append(p)
        else:
            found = [storage.join(p, a) for a in _artifacts_in(p)]
            if not found:
                _fail(f"{p} is not a finished artifact and holds none")
            arts.extend(found)
    bad = 0
    for a in arts:
        try:
            art = Artifact(a)
        except ArtifactMissing as e:
            _fail(str(e))
        problems = art.verify()
        bad += len(problems)
        typer.echo(f"{a}: {'ok' if not problems else f'{len(problems)} bad files'} ({len(art.recorded)} files)")
        for line in problems:
            typer.echo(f"  {line}")
        if problems and fix:
            n = forget_units_of(art)
            typer.echo(f"  forgot {n} units: `pipeline run` redoes them")
    if bad:
        raise typer.Exit(1)


@app.command()
def status(
    manifest: ManifestOpt,
    set_: SetOpt = None,
    verify_files: Annotated[bool, typer.Option("--verify", help="also check every shard's sha256 (reads every byte; without it each shard's presence and size are checked)")] = False,
) -> None:
    """Each artifact of the manifest's output: complete, stale (an input changed since it was
    written), incomplete, corrupt (a shard missing or of another size; with --verify, of another sha256) or
    missing, and what to run. Exit 1 when any is not complete."""
    from pipeline.config import ManifestError, load_manifest
    from pipeline.status import format_states, output_states

    try:
        m = load_manifest(manifest, set_ or [])
    except ManifestError as e:
        _fail(str(e))
    from pipeline.models.required import command_args, missing_message, missing_models
    from pipeline.stage import registry

    states = output_states(m, verify=verify_files, args=command_args(manifest, set_))
    typer.echo(format_states(states))
    reg = registry()
    todo = [s.stage for s in states if s.state != "complete" and s.stage in reg]
    missing = missing_models(m, todo)  # the stages still to run need these first
    if missing:
        typer.echo("models: " + missing_message(missing, m, manifest, set_))
    if any(s.state != "complete" for s in states):
        raise typer.Exit(1)


@app.command()
def plan(
    manifest: ManifestOpt,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="also time the CPU stages here (each stage's own worker "
                                            "on the first records, Ray's and the pools' fixed costs): wall times for "
                                            "CPU stages; minutes the first time (it says how long first), then cached")] = False,
    cpus: Annotated[Optional[int], typer.Option("--cpus", help="size for a node of this many CPUs, 1 or more (default: Ray's, or this machine's)")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="size for a node of this many GPUs, 0 or more (default: Ray's, or this machine's)")] = None,
    images: Annotated[Optional[float], typer.Option("--images", help="a dataset not on this machine: this many images, 1 or more (1.2e6 works; with the caption options)")] = None,
    captions_per_image: Annotated[float, typer.Option("--captions-per-image", help="with --images")] = 5.0,
    captions_sample: Annotated[Optional[Path], typer.Option("--captions-sample", help="with --images: captions of the same kind (text, one per line; or JSON items with `caption`)")] = None,
    words_per_caption: Annotated[Optional[float], typer.Option("--words-per-caption", help="with --images: run the sample captions together, cut into captions of this many words (longer alt-texts)")] = None,
    instances_per_image: Annotated[float, typer.Option("--instances-per-image", help="with --images: annotated instances")] = 0.0,
) -> None:
    """Rows, bytes on disk and forward GFLOPs of every enabled stage, before a run, in seconds (no weights
    downloaded, no stage run; pipeline/sizing/); wall time for GPU stages from FLOPs at a stated A100 rate,
    for CPU stages with --calibrate. Library messages go to <output>/_logs/plan.log. Warns when the
    output's disk is too small."""
    import math
    import subprocess

    from pipeline.config import ManifestError, load_manifest

    if cpus is not None and cpus < 1:  # a value given is used as given: one that cannot be a node is refused
        _fail(f"--cpus {cpus}: a node has at least 1 CPU; give --cpus 1 or more, or leave it out to plan for this machine")
    if gpus is not None and gpus < 0:
        _fail(f"--gpus {gpus}: a node has 0 GPUs or more; give --gpus 0 for a CPU-only node")
    if images is not None and not (math.isfinite(images) and images >= 1 and images == int(images)):
        _fail(f"--images {images:g}: expected a whole number of images, 1 or more (e.g. --images 118287)")
    try:
        m = load_manifest(manifest, set_ or [])
    except ManifestError as e:
        _fail(str(e))
    from pipeline.stage import dependency_order, registry

    reg = registry()
    names = dependency_order([s for s in reg if getattr(m.stages, reg[s].key).enabled])
    _require_models(m, names, manifest, set_)
    from pipeline.io import storage
    from pipeline.library_output import library_output_to, log_path
    from pipeline.sizing.dataset import given_size, read_captions
    from pipeline.sizing.plan import build_plan, calibration_estimate, format_plan, space_warning
    from pipeline.sizing.shapes import UnknownModel

    sample = None
    if images is not None:
        if captions_sample is None:
            _fail("--images needs --captions-sample (captions like the dataset's: their tokens and nouns size the text artifacts)")
        try:
            sample = read_captions(captions_sample)
        except (OSError, ValueError) as e:
            _fail(f"--captions-sample {captions_sample}: {e}")
    output = storage.local_path(m.output)
    if calibrate:  # its duration first
        typer.echo(f"calibrating: expected {calibration_estimate(output, names)}; cached in {output / '_cache' / 'plan'}",
                   err=True)
    log = log_path(output, "plan")
    setup_logging(None)
    error, result = None, None
    with library_output_to(log) as say:  # transformers' warnings, weight-loading bars: to the log
        try:
            size = None if images is None else given_size(int(images), captions_per_image, sample, words_per_caption,
                                                          instances_per_image)
            result = build_plan(m, cpus=cpus, gpus=gpus, size=size, calibrate_cpu=calibrate, say=say)
        except (UnknownModel, OSError, ValueError) as e:
            error = f"plan: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        except MemoryError:
            error = "plan: out of memory sizing this dataset; plan fewer images or raise the stages' shard_size"
        except subprocess.TimeoutExpired as e:  # a calibration child on a machine too busy to finish it
            error = (f"plan: a calibration step did not finish within {e.timeout:.0f} s (is the machine busy?); "
                     "rerun --calibrate later (what it measured is cached), or plan without it")
    if error:
        _fail(f"{error} (library messages: {log})")
    warning = space_warning(result)
    if warning:
        typer.echo(warning, err=True)
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        typer.echo(format_plan(result) + f"\n  library messages: {log}")


def _is_artifact(path: str) -> bool:
    from pipeline.io import storage

    if storage.is_remote(path):
        return storage.Remote(path).size("_manifest.json") is not None
    return (Path(path) / "_manifest.json").is_file()


def _artifacts_in(path: str) -> list[str]:
    """Names of the finished artifacts directly inside a folder or URL."""
    from pipeline.io import storage

    if storage.is_remote(path):
        try:
            rels = storage.Remote(path).listing()
        except Exception:
            return []
        return sorted({r.split("/")[0] for r in rels if r.count("/") == 1 and r.endswith("/_manifest.json")})
    p = Path(path)
    return sorted(d.parent.name for d in p.glob("*/_manifest.json")) if p.is_dir() else []


def main() -> None:
    app()


if __name__ == "__main__":
    main()
