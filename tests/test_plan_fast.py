"""`pipeline plan` in seconds (pipeline/sizing/plan.py, pipeline/cli.py): FLOPs and bytes by default, the
calibration only with --calibrate (its expected duration said first), library output in the log, aligned
columns within 120 characters; impossible sizes refused in one line, given sizes used as given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = "manifests/sizing/coco-val2017-captions.txt"


def _invoke(*args: str, manifest: str = "manifests/tiny.yaml", out: Path | None = None):
    kw = {"mix_stderr": False} if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else {}
    sets = ["--set", f"output={out}"] if out is not None else []
    return CliRunner(**kw).invoke(app, ["plan", "-m", manifest, *sets, *args])


@pytest.mark.parametrize("args, message", [
    (["--cpus", "0"], "--cpus 0: a node has at least 1 CPU; give --cpus 1 or more, or leave it out to plan for this machine"),
    (["--cpus", "-3"], "--cpus -3: a node has at least 1 CPU; give --cpus 1 or more, or leave it out to plan for this machine"),
    (["--gpus", "-1"], "--gpus -1: a node has 0 GPUs or more; give --gpus 0 for a CPU-only node"),
    (["--images", "0"], "--images 0: expected a whole number of images, 1 or more (e.g. --images 118287)"),
    (["--images", "-5", "--captions-sample", CAPTIONS], "--images -5: expected a whole number of images, 1 or more (e.g. --images 118287)"),
    (["--images", "2.5"], "--images 2.5: expected a whole number of images, 1 or more (e.g. --images 118287)"),
])
def test_impossible_sizes_are_refused_in_one_line(tmp_path, args, message):
    r = _invoke(*args, out=tmp_path / "o")
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "o").exists()


def test_a_size_that_cannot_be_listed_and_an_empty_image_folder_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    r = _invoke("--images", "1e14", "--captions-sample", CAPTIONS, out=tmp_path / "o")
    log = tmp_path / "o" / "_logs" / "plan.log"
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: plan: 100,000,000,000,000 images make 6,250,000,000,000 units of 16 in ingest (stages.ingest.shard_size 16); "
        "the plan lists each unit and takes at most 10,000,000: set stages.ingest.shard_size to 10,000,000 or more, or "
        f"plan fewer images (library messages: {log})"]
    images = tmp_path / "images"
    images.mkdir()
    (images / "captions.tsv").write_text("file\tcaption\n")
    man = tmp_path / "folder.yaml"
    man.write_text(f"output: {tmp_path / 'f'}\ndataset: {{kind: folder, images: {images}}}\n"
                   "models: {clip: tiny-random, groupvit: tiny-random, sam: tiny-random, detector: tiny-random, "
                   "mlm: tiny-random, word_encoder: tiny-random, predicate_encoder: tiny-random}\n")
    for extra in ([], ["--calibrate"]):
        r = _invoke(*extra, manifest=str(man))
        assert r.exit_code == 2, r.output
        assert r.stderr.strip().splitlines()[-1] == (
            f"error: plan: the folder dataset (dataset.images {images}) has no images (counted by the folder reader): "
            f"nothing to plan; point the manifest's dataset at a folder with images (library messages: "
            f"{tmp_path / 'f' / '_logs' / 'plan.log'})")


def test_given_cpus_and_gpus_are_used_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    base = ["--json", "--images", "1000", "--captions-sample", CAPTIONS]
    plan = json.loads(_invoke(*base, "--cpus", "1", out=tmp_path / "o").stdout)
    assert plan["cluster"] == {"cpus": 1, "gpus": 0, "source": "given: --cpus 1"}
    assert {s["workers"] for s in plan["stages"]} == {1}  # one CPU: one worker per stage
    plan = json.loads(_invoke(*base, "--gpus", "2", out=tmp_path / "o").stdout)
    assert plan["cluster"] == {"cpus": os.cpu_count(), "gpus": 2, "source": "given: --gpus 2; CPUs this machine's"}
    plan = json.loads(_invoke(*base, "--cpus", "96", "--gpus", "0", out=tmp_path / "o").stdout)
    assert plan["cluster"] == {"cpus": 96, "gpus": 0, "source": "given: --cpus 96 --gpus 0"}
    assert plan["calibrated"] is False and plan["calibration"] is None
    assert all(s["wall_seconds"] is None for s in plan["stages"])  # CPU stages: FLOPs and bytes only


def test_default_plan_calibrates_nothing_keeps_library_output_in_the_log_and_fits_120_columns(tmp_path):
    """A fresh process, as a user runs it: no cache written (nothing timed), no transformers line or
    weight-loading bar on the terminal, every line within 120 characters, the table's columns aligned."""
    out = tmp_path / "o"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "-m", "manifests/tiny.yaml", "--set", f"output={out}"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (out / "_cache" / "plan").exists()  # the calibration's cache: not made
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert not [line for line in lines if "[transformers]" in line or "Loading weights" in line or "RANDOM WEIGHTS" in line]
    log = (out / "_logs" / "plan.log").read_text()
    assert "RANDOM WEIGHTS" in log  # what the plan's tiny-random shapes would have printed
    assert lines[-1] == f"  library messages: {out / '_logs' / 'plan.log'}"
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("stage "))
    table = lines[head:head + 10]
    assert [t.split()[0] for t in table[1:]] == ["ingest", "extract-clip-tokens", "build-index", "mine-concepts",
                                                "encode-concepts", "extract-image-groups", "extract-regions",
                                                "extract-visual-tokens", "negative-captions"]
    for col in ("bytes", "GFLOP/img", "workers", "wall"):  # right-aligned: every row's cell ends where the header's does
        end = table[0].index(col) + len(col)
        assert all(t[end - 1] != " " and (len(t) == end or t[end] == " ") for t in table), col
    assert "CPU stages: FLOPs and bytes only (`pipeline plan --calibrate` times them here)" in r.stdout


def test_calibrate_says_how_long_first_and_then_what_the_last_took(tmp_path, monkeypatch):
    from pipeline.sizing import plan

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(plan, "calibrate", lambda spec, cache: {"model": "fixed", "flops": 1e9, "seconds": 0.1,
                                                                "flops_per_s": 1e10, "measured_at": "-"})
    monkeypatch.setattr(plan, "MEASURE", False)
    out = tmp_path / "o"
    args = ["--calibrate", "--json", "--images", "1000", "--captions-sample", CAPTIONS]
    r = _invoke(*args, out=out)
    assert r.exit_code == 0, r.output
    first = r.stderr.splitlines()
    assert first[0] == (f"calibrating: expected about 6m 00s (9 stages x ~40 s on 2 cores: each stage's own worker timed "
                        f"on the first records, then cached); cached in {out / '_cache' / 'plan'}")
    assert first[1:] == [f"calibrating {s['stage']} ..." for s in json.loads(r.stdout)["stages"]]
    p = json.loads(r.stdout)
    assert p["calibrated"] is True and p["calibration"]["model"] == "fixed"
    assert all(s["wall_seconds"] is not None for s in p["stages"] if s["flops_per_image"])  # FLOPs / the CPU's rate
    took = json.loads((out / "_cache" / "plan" / "durations.json").read_text())
    (entry,) = took.values()
    again = _invoke(*args, out=out).stderr.splitlines()[0]
    assert again.startswith(f"calibrating: expected about {plan.fmt_seconds(entry['seconds'])} (the last calibration of "
                            f"these 9 stages here, {entry['at']}; measurements it cached are reused)")


def test_a_calibration_step_that_times_out_is_one_line(tmp_path, monkeypatch):
    import subprocess

    from pipeline.sizing import plan

    def slow(*a, **k):
        raise subprocess.TimeoutExpired(["python", "-c", "..."], 600)

    monkeypatch.setattr(plan, "build_plan", slow)
    r = _invoke("--calibrate", out=tmp_path / "o")
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: plan: a calibration step did not finish within 600 s (is the machine busy?); rerun --calibrate later "
        f"(what it measured is cached), or plan without it (library messages: {tmp_path / 'o' / '_logs' / 'plan.log'})")
