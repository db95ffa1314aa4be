"""Issue 40, item 1: a byte changed in one file of each artifact kind a trainer reads is refused by
the job that reads it, before it trains on it: one line naming the file and `pipeline verify --fix`,
exit 2. The artifacts are the small oracle testbed's, made by the real stages (tests/conftest.py
``small_testbed``: samples, clip_tokens, index; here also concepts and concept_tokens); the change is
an ordinary write (the file's mtime moves, as any rewrite's does; a change that keeps the mtime is
`pipeline verify`'s, tests/test_faults_io.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.testbed_reduced import copy_testbed, run_stages

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

C3 = ["train.c3.max_steps=2", "train.c3.batch_size=16", "train.c3.d_model=32", "train.c3.layers=1", "train.c3.heads=2",
      "train.c3.mcc_rank=8", "train.c3.mcc_hidden=32", "train.c3.adapter_rank=4", "train.c3.threads=1",
      "train.c3.amp=off", "train.c3.eval_max_triplets=32", "train.c3.eval_max_concepts=10"]
COT = ["train.concept_ot.max_steps=2", "train.concept_ot.batch_size=8", "train.concept_ot.threads=1",
       "train.concept_ot.amp=off", "train.concept_ot.hard_negatives=index"]

def _small(job: str) -> list[str]:
    key = f"train.{job.replace('-', '_')}"
    return [f"{key}.max_steps=2", f"{key}.threads=1", f"{key}.amp=off"]


# artifact -> (job that reads it, its --set options)
KINDS = {"samples": ("c3", C3), "clip_tokens": ("c3", C3), "concepts": ("c3", C3),
         "concept_tokens": ("c3", C3), "index": ("concept-ot", COT),
         "regions": ("infoground", _small("infoground")), "negatives": ("infoground", _small("infoground")),
         "image_groups": ("text-groups", _small("text-groups")),
         "visual_tokens": ("visual-tokens", _small("visual-tokens"))}
STAGES = ["mine-concepts", "encode-concepts", "extract-regions", "negative-captions", "extract-image-groups",
          "extract-visual-tokens"]


@pytest.fixture(scope="module")
def data(small_testbed, tmp_path_factory):
    out, mp = copy_testbed(small_testbed, tmp_path_factory.mktemp("kinds"))
    run_stages(mp, STAGES)
    return out, mp


def _flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("artifact", list(KINDS))
def test_a_changed_byte_in_any_artifact_a_job_reads_is_refused_naming_the_file(data, tmp_path, artifact):
    import train.cli

    out, mp = copy_testbed(data[1], tmp_path)
    job, sets = KINDS[artifact]
    man = json.loads((out / artifact / "_manifest.json").read_text())
    shards = [s["path"] for s in man["shards"]]
    rel = next((p for p in shards if p.endswith((".npy", ".tar"))), shards[0])  # an array or shard file where there is one
    _flip(out / artifact / rel)
    args = ["run", job, "--manifest", str(mp), "--no-progress", *[x for s in sets for x in ("--set", s)],
            "--set", f"train.{job.replace('-', '_')}.benchmarks_at_end=false"]
    r = CliRunner().invoke(train.cli.app, args)
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2, r.output[-3000:]
    assert len(errors) == 1 and str(out / artifact / rel) in errors[0], r.output[-3000:]
    assert f"pipeline verify --fix {out / artifact}" in errors[0] and "Traceback" not in r.output
