"""The `pipeline` command: run stages, list them, inspect artifacts."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Offline vision-language artifact pipeline.",
)
log = logging.getLogger("pipeline")


def setup_logging(output: Path | None = None, name: str = "pipeline", verbose: bool = False) -> None:
    root = logging.getLogger()
    if getattr(root, "_vlpipe_configured", False):
        return
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(fmt)
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


ManifestOpt = Annotated[Path, typer.Option("--manifest", "-m", help="run description (YAML)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a manifest key: a.b=c (repeatable)")]


@app.command()
def run(
    stage: Annotated[str, typer.Argument(help="stage name, or `all` for every enabled stage")],
    manifest: ManifestOpt,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="redo shards that are already complete")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", help="ingest at most N samples")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one stage (or `all`) of a manifest; complete shards are skipped unless --force."""
    from pipeline.config import ManifestError, load_manifest
    from pipeline.stage import RunContext, StageError, dependency_order, registry, run_stage

    try:
        m = load_manifest(manifest, set_ or [])
    except ManifestError as e:
        _fail(str(e))
    setup_logging(Path(m.output), f"run-{stage}", verbose)
    reg = registry()
    if stage == "all":
        names = dependency_order([s for s in reg if getattr(m.stages, reg[s].key).enabled])
    elif stage in reg:
        names = [stage]
    else:
        _fail(f"unknown stage {stage!r}; stages: all, {', '.join(reg)}")
    ctx = RunContext(m, force=force, limit=limit)
    try:
        for name in names:
            summary = run_stage(name, ctx)
            typer.echo(f"{name}: " + json.dumps(summary))
    except (StageError, ManifestError) as e:
        _fail(str(e))


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
    path: Annotated[Path, typer.Argument(help="artifact folder, e.g. runs/demo/concepts")],
    rows: Annotated[int, typer.Option("--rows", "-n", help="sample rows per table")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="print the _manifest.json")] = False,
) -> None:
    """Schema, row and shard counts, provenance and a few rows of an artifact."""
    from pipeline.io.artifacts import Artifact, ArtifactMissing
    from pipeline.io.inspect import describe

    try:
        art = Artifact(path)
    except ArtifactMissing as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(art.manifest, indent=2))
        return
    typer.echo(describe(art, rows, _fmt_value))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
