"""A reduced testbed for the slow learning tests: the testbed manifest with fewer images, a chosen
subset of its benchmarks, written to a YAML file under the test's folder; its stages run through
``pipeline.stage.run_stage`` (what ``pipeline run <stage>`` calls) in the test's Ray session, and a job
through the ``train run`` command in a subprocess, whose final ``results.parquet`` is read back."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# the testbed manifest (its train.visual_tokens / train.relation_head settings)
TESTBED = REPO / "manifests" / "testbed.yaml"


def reduced_testbed(tmp_path: Path, n_images: int, benchmarks: list[str] | None, shard_size: int | None = 200,
                    output: str = "testbed", name: str = "testbed-reduced.yaml",
                    object_store_memory: int | None = 134217728) -> Path:
    """The testbed with ``n_images`` generated images, held-out 0.1 (the split the slow tests' margins
    were calibrated on), only the named ``eval.benchmarks`` (None: all of them), every stage's
    ``shard_size`` set (None: the manifest's), Ray on 2 CPUs; written to ``tmp_path / name`` with its
    output in ``tmp_path / output``."""
    m = yaml.safe_load(TESTBED.read_text())
    m["output"] = str(tmp_path / output)
    m["ray"] = {**(m.get("ray") or {}), "address": None, "num_cpus": 2}
    if object_store_memory is not None:
        m["ray"]["object_store_memory"] = object_store_memory
    m["dataset"]["synthetic"]["n_images"] = int(n_images)
    m["dataset"]["synthetic"]["heldout"] = 0.1
    for st in m["stages"].values():
        if shard_size is not None and isinstance(st, dict) and "shard_size" in st:
            st["shard_size"] = shard_size
    if benchmarks is not None:
        m["eval"]["benchmarks"] = [b for b in m["eval"]["benchmarks"] if b["name"] in benchmarks]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def reduced_testbed_from(made: Path, tmp_path: Path, n_images: int, benchmarks: list[str] | None) -> Path:
    """:func:`reduced_testbed` (default shard size, output and name) whose output starts as a copy of
    the one of ``made`` (a manifest of :func:`reduced_testbed` with the same ``n_images`` whose stages
    ran): the stages it already has are complete in the copy, so :func:`run_stages` skips them."""
    import shutil

    path = reduced_testbed(tmp_path, n_images, benchmarks)
    src = yaml.safe_load(Path(made).read_text())
    assert src["dataset"]["synthetic"]["n_images"] == n_images, (made, n_images)
    shutil.copytree(src["output"], yaml.safe_load(path.read_text())["output"],
                    ignore=shutil.ignore_patterns("_logs", "_lock"))
    return path


def run_stages(manifest_path: Path, stages: list[str], sets: list[str] = ()) -> None:
    """Run ``stages`` in order on the manifest (with ``--set``-style overrides ``sets``, e.g.
    ``stages.encode_concepts.min_df=3``), as ``pipeline run <stage> -m <manifest> --set ...`` does."""
    from pipeline.config import load_manifest
    from pipeline.stage import RunContext, run_stage

    m = load_manifest(manifest_path, list(sets))
    for s in stages:
        run_stage(s, RunContext(m))


def _train_cmd(manifest_path: Path, job: str, run_dir: Path, sets) -> list[str]:
    key = job.replace("-", "_")
    return [sys.executable, "-m", "train.cli", "run", job, "-m", str(manifest_path), "--no-progress", "--fresh",
            "--set", f"train.{key}.run_dir={run_dir}", *[x for s in sets for x in ("--set", f"train.{key}.{s}")]]


def _results(run_dir: Path) -> dict:
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(run_dir) / "eval" / "final" / "results.parquet").to_pylist()
    return {(x["benchmark"], x["subset"], x["metric"]): x for x in rows}


def train_run(manifest_path: Path, job: str, run_dir: Path, *sets: str, timeout: int = 600) -> tuple[dict, float]:
    """``train run <job> -m <manifest> --set train.<job>.run_dir=... [--set ...]`` in a subprocess;
    returns ({(benchmark, subset, metric): row of results.parquet}, wall seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run(_train_cmd(manifest_path, job, run_dir, sets), cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return _results(run_dir), wall


def side_by_side(cmds: list[list[str]], timeout: int, env: dict | None = None) -> list[str]:
    """Run the commands at once, one process each, from the project root (for training runs at
    ``threads: 1``: each run's numbers are the ones it has alone; the wall time is the longest
    run's on 2 cores); every one must succeed; returns their stdouts, in order. On a timeout all
    are killed."""
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for c, (so, se), p in zip(cmds, outs, procs):
        assert p.returncode == 0, f"{' '.join(c[2:])}\n{so[-2000:]}\n{se[-4000:]}"
    return [so for so, _ in outs]


def train_runs_side_by_side(manifest_path: Path, job: str, *runs: tuple, timeout: int = 600) -> list[dict]:
    """:func:`train_run` of each ``(run_dir, *sets)`` at once (:func:`side_by_side`); returns each
    run's rows, in order."""
    side_by_side([_train_cmd(manifest_path, job, rd, sets) for rd, *sets in runs], timeout)
    return [_results(rd) for rd, *_ in runs]


# --- the small oracle testbed: the structural tests' data, made by the real stages (no test-written features) ---
SMALL_IMAGES = 100  # 90 train, 5 val, 5 test; sample ids 0..99 (source ids / file names 1..100)
SMALL_SHARD = 25  # 4 shards per artifact: multi-shard reads, resume positions across shard boundaries
SMALL_STAGES = ["ingest", "extract-clip-tokens", "build-index"]
SMALL_CAPTIONS = 2  # captions per image (the testbed's 5 cost stage time the structural tests do not need)


def small_oracle_testbed(root: Path, stages: list[str] = SMALL_STAGES, n_images: int = SMALL_IMAGES,
                         shard_size: int = SMALL_SHARD) -> Path:
    """``manifests/testbed.yaml`` (the scene-oracle in place of the frozen encoders) at ``n_images``
    images, ``SMALL_CAPTIONS`` captions each, held-out 0.1, shards of ``shard_size``;
    runs ``stages`` through the stages' own code (:func:`run_stages`) and returns the manifest path
    (its ``output`` is ``root / "testbed"``: samples, clip_tokens, index, source/synthetic)."""
    path = reduced_testbed(Path(root), n_images, [], shard_size=shard_size)
    m = yaml.safe_load(path.read_text())
    m["dataset"]["synthetic"]["captions_per_image"] = SMALL_CAPTIONS
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    run_stages(path, stages)
    return path


def copy_testbed(manifest_path: Path, dest: Path) -> tuple[Path, Path]:
    """A private copy of a small testbed (its output folder, and a manifest of its data only, pointing
    at the copy: no ``train`` / ``eval`` sections, so a test's jobs run at the jobs' defaults plus its
    own ``--set`` options): tests that write run folders or extra artifacts do not see each other's.
    Returns (output folder, manifest path)."""
    import shutil

    m = yaml.safe_load(Path(manifest_path).read_text())
    out = Path(dest) / "testbed"
    shutil.copytree(m["output"], out, ignore=shutil.ignore_patterns("_logs", "_lock"))
    m = {k: v for k, v in m.items() if k not in ("train", "eval")}
    m["output"] = str(out)
    mp = Path(dest) / "testbed-small.yaml"
    mp.write_text(yaml.safe_dump(m, sort_keys=False))
    return out, mp
