"""text-groups on the reduced testbed, through the real commands (issue 24): `pipeline run all` on
manifests/testbed.yaml (generated scenes, `models.groupvit: scene-oracle`, whose image groups are
the scenes' objects) with 300 images, then `train run text-groups` twice, the second with
`control=shuffled` (the image groups paired with another image's captions, fixed before training).

Learnable here: held-out image -> text retrieval R@1 (30 held-out images, chance 3.3%). Measured with
exactly these commands and options (width 32, 1 + 1 layers, 120 steps of 64, corpus softmax) on the
300-image testbed, seeds 0 / 1 / 2 (seed 2 and the control's seeds 1-2 on 2026-11-27, issue 37, with
the test's own commands and ``train.text_groups.seed``): learnt R@1 56.7% [39.2, 72.6] / 63.3% [45.5,
78.1] / 53.3% [36.1, 69.8]; control 6.7% [1.8, 21.3] / 0.0% [0.0, 11.4] / 10.0% [3.5, 25.6]. The
control's seed 2 (3 of 30 hits) has a Wilson lower bound of 3.5, just above chance: a pairing-blind
model lands 3 or more hits of 30 with probability 7.7%, so "chance inside the 95% interval" is the
wrong test for a control at this n. Asserted: the learnt run's R@1 lower 95% bound is above chance and
its value >= MARGIN = 20% (less than half the lowest seed); the control is not significantly above
chance by the exact one-sided binomial test at 1% (at most 4 of 30 hits: a pairing-blind model fails
that with probability 0.3%) and its value <= CONTROL_MAX = 14%. The test runs seed 0 (deterministic
on one machine).
Phrase discovery (tIoU) is reported beside its baselines but not asserted: the grouping does not
form at this budget (docs/jobs/text-groups.md, issue 27).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the stages alone took 4 min at load ~40 (600 s default hit)

MARGIN = 20.0       # % R@1 the learnt run reaches at least (calibrated: see the docstring)
CONTROL_MAX = 14.0  # % R@1 the control stays under
STEPS = 120
OPTS = dict(width=32, layers_pre=1, layers_post=1, recon_vocab="corpus", max_steps=STEPS, vanilla_run="null",
            figures=0, threads=1, seed=0)


def _env() -> dict:
    env = dict(os.environ)
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    return env


def _run(args: list[str]) -> None:
    p = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _retrieval(run_dir):
    import polars as pl

    df = pl.read_parquet(run_dir / "eval" / "final" / "results.parquet")
    r = df.filter(pl.col("benchmark") == "retrieval/held-out").row(0, named=True)
    tiou = df.filter((pl.col("benchmark") == "phrase-discovery/samples") & (pl.col("metric") == "tIoU")
                     & (pl.col("subset") == "ge2_phrases"))
    assert tiou.height == 1 and tiou["chance"][0] is not None  # reported beside chance (random assignment)
    return r


def test_text_groups_learns_and_control_stays_at_chance(tmp_path):
    manifest = str(REPO / "manifests" / "testbed.yaml")
    base = ["--manifest", manifest, "--set", f"output={tmp_path / 'tb'}", "--set", "dataset.synthetic.n_images=300",
            "--set", "dataset.synthetic.heldout=0.1",
            "--set", "stages.ingest.shard_size=150", "--set", "stages.extract_image_groups.shard_size=150"]
    for stage in ("ingest", "extract-image-groups"):  # what text-groups reads
        _run(["pipeline.cli", "run", stage, *base])
    sets = [x for k, v in OPTS.items() for x in ("--set", f"train.text_groups.{k}={v}")]
    procs = {}
    for name, extra in (("learnt", []), ("control", ["--set", "train.text_groups.control=shuffled"])):
        # the two trainings side by side (threads=1 each: a run's numbers are the ones it has alone)
        argv = [sys.executable, "-m", "train.cli", "run", "text-groups", *base, *sets, *extra,
                "--set", f"train.text_groups.run_dir={tmp_path / name}", "--no-progress"]
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                       cwd=REPO)
    runs = {}
    for name, p in procs.items():
        so, se = p.communicate(timeout=900)
        assert p.returncode == 0, so[-3000:] + se[-3000:]
        runs[name] = _retrieval(tmp_path / name)
    learnt, control = runs["learnt"], runs["control"]
    assert learnt["n"] == 30 and abs(learnt["chance"] - 100 / 30) < 1e-9
    assert learnt["ci_low"] > learnt["chance"] and learnt["value"] >= MARGIN, learnt
    from scipy.stats import binomtest

    hits = round(control["value"] * control["n"] / 100)
    assert binomtest(hits, control["n"], control["chance"] / 100, alternative="greater").pvalue > 0.01, control
    assert control["value"] <= CONTROL_MAX, control
