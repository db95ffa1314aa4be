"""The pixels testbed's parts of benchmarks/testbed.py: the frozen-encoder phase before the stages, and the
column with the oracle testbed's figure.

* :func:`encoder_jobs`: the encoder jobs (``ENCODER = True`` in their package: clip-encoder, mlm-encoder)
  whose export folder a ``models.*`` slot of the manifest points at (``clip: "{output}/encoders/clip"``);
  none for the oracle testbed, so its run is unchanged.
* :func:`run_encoders`: ``pipeline run ingest`` (the testbed) and, where the manifest has a ``corpus:`` block,
  ``pipeline run ingest --corpus`` (the encoders' data: the generated pretraining corpus, ``<output>/corpus``),
  then ``train run <encoder job>`` for each, timed, as a user types them. Their own held-out figures are rows
  of the table like any job's (expected outcomes: benchmarks/expectations/pixels.yaml).
* :func:`oracle_rows`: the same job's run folder under another manifest (``--compare``, by default
  manifests/testbed.yaml: the scene-oracle testbed), found as ``train run`` names it (the job's options
  there), and its final results rows, so each row of the pixels table shows the oracle testbed's value.
"""

from __future__ import annotations

from pathlib import Path

def encoder_jobs(manifest: str, sets: list[str]) -> list[str]:
    """The encoder jobs whose export folder one of the manifest's ``models.*`` names, in registry order."""
    import os

    from pipeline.config import load_manifest
    from train.encoders import export_dir
    from train.registry import registry

    m = load_manifest(manifest, sets)
    specs = {os.path.abspath(v) for v in m.models.model_dump().values() if isinstance(v, str) and v}
    out = []
    for name, mod in registry().items():
        if getattr(mod, "ENCODER", False):
            cfg = getattr(m.train, name.replace("-", "_"))
            control = getattr(cfg, "control", "none")  # a segmenter has no shuffled control
            if os.path.abspath(export_dir(m, mod.EXPORT, control, cfg.export_dir)) in specs:
                out.append(name)
    return out


def run_encoders(cli, manifest: str, sets: list[str], jobs: list[str], pool=None) -> tuple[list[tuple[str, dict | None, float, str, str]], float]:
    """``pipeline run ingest`` then ``train run <job>`` for each of ``jobs`` through ``cli`` (benchmarks/testbed.py's
    ``_cli``), on ``pool`` (an executor: as many at once as it has workers) or one after another. Returns
    ([(job, result line, wall s, error, stderr)], ingest wall s)."""
    from pipeline.config import load_manifest

    _, t_ingest, err, _ = cli("pipeline", "run", "ingest", "--manifest", manifest, *sets)
    if err:
        return [(j, None, 0.0, f"pipeline run ingest failed: {err}", "") for j in jobs], t_ingest
    if load_manifest(manifest, [s for s in sets if s != "--set"]).corpus is not None:
        _, t_corpus, err, _ = cli("pipeline", "run", "ingest", "--corpus", "--manifest", manifest, *sets)
        t_ingest += t_corpus
        if err:
            return [(j, None, 0.0, f"pipeline run ingest --corpus failed: {err}", "") for j in jobs], t_ingest
    # --export: these runs make the folders the manifest's models.* load, whatever --set the testbed was given
    calls = [("train", "run", job, "--manifest", manifest, "--json", "--no-progress", "--export", *sets) for job in jobs]
    if pool is None:
        results = [cli(*c) for c in calls]
    else:
        results = [f.result() for f in [pool.submit(cli, *c) for c in calls]]
    return [(job, *r) for job, r in zip(jobs, results)], t_ingest


def link_encoders(output: str | Path, source: str | Path) -> str:
    """``<output>/encoders`` as a link to ``source`` (another run's encoders folder): the models that learn from the
    corpus alone (the encoders, the SAM, the relation encoder) are the same for every testbed seed, so a confirmation
    run can read seed 0's instead of training them again. The relation checkpoints name their SAM / CLIP by weights
    hash, so the linked folder is accepted. A link to the same folder is kept; anything else already at
    ``<output>/encoders`` is an error (nothing is replaced). Returns what was done, one line."""
    out, src = Path(output) / "encoders", Path(source).resolve()
    if not src.is_dir():
        raise ValueError(f"--encoders-from {source}: no such folder")
    if out.is_symlink() or out.exists():
        if out.resolve() == src:
            return f"{out} already links to {src}"
        raise ValueError(f"--encoders-from: {out} already exists and is not a link to {src}; remove it or drop the option")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(src, target_is_directory=True)
    return f"{out} -> {src} (linked: the corpus-trained models are not trained again)"


def oracle_rows(job: str, compare: str | None, sets: list[str]) -> dict:
    """{(benchmark, subset, metric): value} of ``job``'s finished run under the ``compare`` manifest ({} when it
    has none: run benchmarks/testbed.py on that manifest first)."""
    if not compare or not Path(compare).is_file():
        return {}
    from pipeline.config import ManifestError, load_manifest
    from train.cli import run_folder
    from train.summary import result_rows

    try:
        m = load_manifest(compare, [s for s in sets if not s.startswith(("output=", "models.", "dataset."))])
        cfg = getattr(m.train, job.replace("-", "_"))
    except (ManifestError, AttributeError):
        return {}
    run = run_folder(job, m, cfg)
    if not (run / "eval" / "final" / "results.parquet").is_file():
        return {}
    return {oracle_key((r["benchmark"], r.get("subset") or "", r["metric"])): r.get("value") for r in result_rows(run)}


def oracle_key(key: tuple | None) -> tuple | None:
    """A row's key across manifests: infoground names its grounding benchmark after the manifest
    (``grounding:testbed``, ``grounding:pixels``), so that part is dropped."""
    if not key:
        return key
    bench = key[0].split(":", 1)[0] if key[0].startswith("grounding:") else key[0]
    return (bench, *key[1:])
