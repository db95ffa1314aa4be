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


def reduced_testbed(tmp_path: Path, n_images: int, benchmarks: list[str], shard_size: int = 200) -> Path:
    """The testbed with ``n_images`` generated images and only the named ``eval.benchmarks``."""
    m = yaml.safe_load(TESTBED.read_text())
    m["output"] = str(tmp_path / "testbed")
    m["ray"] = {"address": None, "num_cpus": 2, "object_store_memory": 134217728}
    m["dataset"]["synthetic"]["n_images"] = n_images
    m["dataset"]["synthetic"]["heldout"] = 0.1  # the split the margins were calibrated on
    for st in m["stages"].values():
        if isinstance(st, dict) and "shard_size" in st:
            st["shard_size"] = shard_size
    m["eval"]["benchmarks"] = [b for b in m["eval"]["benchmarks"] if b["name"] in benchmarks]
    path = tmp_path / "testbed-reduced.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def run_stages(manifest_path: Path, stages: list[str]) -> None:
    from pipeline.config import load_manifest
    from pipeline.stage import RunContext, run_stage

    m = load_manifest(manifest_path)
    for s in stages:
        run_stage(s, RunContext(m))


def train_run(manifest_path: Path, job: str, run_dir: Path, *sets: str, timeout: int = 600) -> tuple[dict, float]:
    """``train run <job> -m <manifest> --set train.<job>.run_dir=... [--set ...]`` in a subprocess;
    returns ({(benchmark, subset, metric): row of results.parquet}, wall seconds)."""
    import pyarrow.parquet as pq

    key = job.replace("-", "_")
    cmd = [sys.executable, "-m", "train.cli", "run", job, "-m", str(manifest_path), "--no-progress", "--fresh",
           "--set", f"train.{key}.run_dir={run_dir}", *[x for s in sets for x in ("--set", f"train.{key}.{s}")]]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = pq.read_table(Path(run_dir) / "eval" / "final" / "results.parquet").to_pylist()
    return {(x["benchmark"], x["subset"], x["metric"]): x for x in rows}, wall
