"""The `train` command: cached-feature training and evaluation of the jobs in train/jobs/.

    train run <job> --manifest M [--set train.<job>.key=value ...] [--fresh]
    train eval <job> --checkpoint C --manifest M
    train list
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Lean trainer over pipeline artifacts.")

ManifestOpt = Annotated[Path, typer.Option("--manifest", "-m", help="run description (YAML)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="override a manifest key: a.b=c (repeatable)")]


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def build_job(name: str, manifest: Path | None, overrides: list[str] | None):
    """(job module, resolved Config, manifest, Job instance)."""
    from pipeline.config import ManifestError, load_manifest
    from train.registry import registry

    reg = registry()
    if name not in reg:
        _fail(f"unknown job {name!r}; jobs: {', '.join(reg) or '(none)'}")
    try:
        m = load_manifest(manifest, overrides or [])
    except ManifestError as e:
        _fail(str(e))
    mod = reg[name]
    cfg = getattr(m.train, name.replace("-", "_"))
    from train.loop import resolve_device

    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path(m.output) / "train" / name
    try:
        job = mod.make_job(cfg, m, run_dir, resolve_device(cfg.device))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return mod, cfg, m, job


@app.command()
def run(
    job: Annotated[str, typer.Argument(help="job name (train list)")],
    manifest: ManifestOpt,
    set_: SetOpt = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="ignore an existing checkpoint and start over")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Train a job on the manifest's artifacts (resumes from the run's last checkpoint)."""
    from train.loop import train

    _, cfg, _, j = build_job(job, manifest, set_)
    res = train(j, resume=not fresh, progress=progress)
    # rounded for people (4 decimals: 40.00000059604645 -> 40.0); metrics.jsonl keeps full precision
    typer.echo(json.dumps({"job": job, "run_dir": str(j.run_dir), **{k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}}))


@app.command("eval")
def eval_(
    job: Annotated[str, typer.Argument(help="job name")],
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-c", help="checkpoint file (.pt)")],
    manifest: ManifestOpt,
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="folder for the eval report")] = None,
) -> None:
    """Evaluate a checkpoint (retrieval, compositionality, heatmaps: whatever the job reports)."""
    from train.loop import evaluate_checkpoint

    if not checkpoint.is_file():
        _fail(f"checkpoint {checkpoint} does not exist")
    _, _, _, j = build_job(job, manifest, set_)
    res = evaluate_checkpoint(j, checkpoint, out)
    typer.echo(json.dumps({"job": job, **res}))


@app.command("list")
def list_() -> None:
    """Jobs and what they read."""
    from train.registry import registry

    for name, mod in registry().items():
        typer.echo(f"{name:16s} reads {', '.join(getattr(mod, 'READS', []))}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
