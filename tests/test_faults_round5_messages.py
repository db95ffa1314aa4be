"""Bad input and faults, round 5 (issue 49, part B): corrupt run files in tables across runs, the advice
status gives for a corrupt input, grid errors that name the grid, the workers refusal, Git LFS pointers
named as such, inf / nan training options, and encode-concepts' scene-oracle guard. Each is one line."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.test_faults_round4 import _results_run

LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234\n"


def _value_as_text(p: Path) -> None:
    t = pq.read_table(p)
    pq.write_table(t.set_column(t.schema.get_field_index("value"), "value", pa.array(["61.0"])), p)


def _no_value(p: Path) -> None:
    pq.write_table(pq.read_table(p).drop(["value"]), p)


BAD_RUN_FILES = {  # (file, how it is damaged, the problem the note names)
    "config-list": ("config.json", lambda p: p.write_text("[]"), "expected a JSON object of training options, got list"),
    "config-lfs": ("config.json", lambda p: p.write_bytes(LFS),
                   "is a Git LFS pointer, not the file: fetch it with `git lfs pull`"),
    "value-text": ("eval/final/results.parquet", _value_as_text,
                   "column value holds string, not numbers: not a results table of `train eval`; evaluate the run "
                   "again with `train eval`"),
    "value-missing": ("eval/final/results.parquet", _no_value,
                      "not a results table of `train eval` (no column value); evaluate the run again with `train eval`"),
    "results-lfs": ("eval/final/results.parquet", lambda p: p.write_bytes(LFS),
                    "is a Git LFS pointer, not the file: fetch it with `git lfs pull`"),
}


@pytest.mark.parametrize("kind", list(BAD_RUN_FILES))
def test_train_compare_leaves_out_a_run_with_a_wrong_schema_file_saying_which_and_why(tmp_path, kind):
    from train import cli

    good = [_results_run(tmp_path, f"s{s}", 60.0 + s, s) for s in range(2)]
    bad = _results_run(tmp_path, "bad", 99.0, 2)
    rel, damage, why = BAD_RUN_FILES[kind]
    damage(bad / rel)
    for extra in ([], ["--over-seeds"], ["--paper", "concept-ot"]):
        r = CliRunner().invoke(cli.app, ["compare", *map(str, good + [bad]), *extra])
        assert r.exit_code == 0 and "Traceback" not in r.output, (extra, r.output)
        notes = [x for x in r.output.splitlines() if x.startswith("skipped")]
        assert notes == [f"skipped 1 run folder(s) with a corrupt file: {bad / rel}: {why}"], (extra, r.output)
        assert "99" not in r.output.replace(str(bad), "") and "60" in r.output  # left out; the others counted


@pytest.mark.parametrize("kind", list(BAD_RUN_FILES))
def test_the_report_leaves_out_a_run_with_a_wrong_schema_file_saying_which_and_why(tmp_path, kind):
    from types import SimpleNamespace

    from pipeline.report.training import training_section

    root = tmp_path / "out" / "train" / "concept-ot"
    good, bad = _results_run(root, "good", 61.0), _results_run(root, "bad", 99.0)
    rel, damage, why = BAD_RUN_FILES[kind]
    damage(bad / rel)
    sec = training_section(tmp_path / "out", SimpleNamespace(img=tmp_path / "img", rel=str), "m.yaml")
    assert [r["dir"] for r in sec["runs"]] == [str(good)]
    assert sec["skipped"] == [f"{bad / rel}: {why}"]


# --- status: a corrupt input's own file and fix ---------------------------------------------------------------


def test_a_corrupt_samples_file_is_named_with_ingest_as_the_fix_not_a_rerun_from_it(tmp_path):
    from pipeline.io.artifacts import Artifact
    from pipeline.status import StaleArtifact, artifact_state, require_fresh
    from tests.test_status import _chain, _Manifest

    _chain(tmp_path)
    rel = Artifact(tmp_path / "samples").manifest["shards"][0]["path"]
    f = tmp_path / "samples" / rel
    f.write_bytes(f.read_bytes()[:100])
    samples = artifact_state(tmp_path, "samples")
    assert samples.detail == (f"{rel}: 100 bytes, recorded {Artifact(tmp_path / 'samples').manifest['shards'][0]['bytes']}"
                              f": `pipeline verify --fix {tmp_path / 'samples'}`, then rerun `pipeline run ingest`")
    cl = artifact_state(tmp_path, "clip_tokens")
    assert (cl.state, cl.detail) == ("stale", f"its input samples is corrupt: {samples.detail}")
    assert "extract-clip-tokens" not in cl.detail
    with pytest.raises(StaleArtifact) as e:
        require_fresh(_Manifest(tmp_path), ["clip_tokens"], "concept-ot")
    assert str(e.value) == f"concept-ot: input artifact clip_tokens is stale: its input samples is corrupt: {samples.detail}"


def test_an_lfs_pointer_as_an_artifact_manifest_is_named_as_one(tmp_path):
    from pipeline.status import artifact_state
    from tests.test_status import _chain

    _chain(tmp_path)
    (tmp_path / "index" / "_manifest.json").write_bytes(LFS)
    st = artifact_state(tmp_path, "index")
    assert (st.state, st.detail) == ("corrupt", "_manifest.json is a Git LFS pointer, not the file: fetch it with "
                                                "`git lfs pull`, or rerun `pipeline run build-index`")


# --- grids: the grid file and key are named -------------------------------------------------------------------


REPO = Path(__file__).resolve().parents[1]


def _sweep(tmp_path: Path, grid_text: str | bytes):
    from train import cli

    grid = tmp_path / "grid.yaml"
    grid.write_bytes(grid_text if isinstance(grid_text, bytes) else grid_text.encode())
    r = CliRunner().invoke(cli.app, ["sweep", "concept-ot", "-m", str(REPO / "manifests" / "tiny.yaml"), "--grid",
                                     str(grid), "--set", f"output={tmp_path / 'out'}"])
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    return grid, errors[0]


@pytest.mark.parametrize("text, message", [
    ("train.concept_ot.lrr: [0.1]\n",
     "key train.concept_ot.lrr is not an option of concept-ot; did you mean train.concept_ot.lr? "
     "(`train list concept-ot` lists them)"),
    ("train.concept_ot.lr: [-1]\n", "key train.concept_ot.lr: value -1 refused: Input should be greater than 0 (got -1)"),
    ("train.concept_ot.epochs: [.inf]\n",
     "key train.concept_ot.epochs: value inf refused: Input should be a finite number (got 'inf')"),
    ("train.concept_ot.lr: [0.001, 1.0e-3]\n",
     "train.concept_ot.lr lists the value 0.001 twice (as YAML reads it: e.g. 0.001 and 1.0e-3 are one number); list "
     "each value once"),
    (LFS, "is a Git LFS pointer, not the file: fetch it with `git lfs pull`"),
])
def test_a_bad_grid_is_blamed_on_the_grid_file_and_key(tmp_path, text, message):
    grid, err = _sweep(tmp_path, text)
    assert err == f"error: grid {grid}: {message}"


def test_two_grid_trials_that_are_one_run_say_which_value_makes_them_one(tmp_path):
    from pipeline.config import load_manifest

    cfg = load_manifest(REPO / "manifests" / "tiny.yaml", []).train.concept_ot
    grid, err = _sweep(tmp_path, f"configurations:\n  - {{train.concept_ot.lr: {cfg.lr}}}\n"
                                 f"  - {{train.concept_ot.weight_decay: {cfg.weight_decay}}}\n")
    assert err.startswith(f"error: grid {grid}: trials lr={cfg.lr}, seed=0 and weight_decay={cfg.weight_decay}, seed=0 "
                          f"are one run (train.concept_ot.lr={cfg.lr} is its default; train.concept_ot.weight_decay="
                          f"{cfg.weight_decay} is its default): both would train in "), err
    assert err.endswith("; list each value once") and "spellings?" not in err


# --- the workers refusal, inf / nan options ---------------------------------------------------------------------


@pytest.mark.parametrize("batch, workers, sizes", [(3, 4, "8"), (5, 2, "4, 6"), (3, 2, "4")])
def test_the_workers_refusal_always_lists_batch_sizes(batch, workers, sizes):
    from train.distributed import PreflightError, worker_batch_size

    with pytest.raises(PreflightError) as e:
        worker_batch_size(batch, workers)
    assert f"set batch_size to a multiple of {workers} ({sizes}) or use --workers" in str(e.value)
    assert "()" not in str(e.value)


@pytest.mark.parametrize("value, shown", [(".inf", "inf"), (".nan", "nan"), ("-.inf", "-inf")])
def test_inf_and_nan_epochs_are_refused_at_validation(value, shown):
    from pipeline.config import ManifestError, load_manifest

    tiny = REPO / "manifests" / "tiny.yaml"
    with pytest.raises(ManifestError) as e:
        load_manifest(tiny, [f"train.c3.epochs={value}"])
    assert str(e.value) == f"manifest {tiny}: key 'train.c3.epochs': Input should be a finite number (got {shown})"


# --- encode-concepts: the scene-oracle guard ------------------------------------------------------------------


def test_encode_concepts_refuses_the_scene_oracle_outside_the_generated_dataset(tmp_path):
    from pipeline.config import load_manifest
    from pipeline.errors import StageError
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stage import RunContext, run_stage
    from tests.test_faults_round4 import _samples

    _samples(tmp_path, "coco")
    w = ArtifactWriter(tmp_path, "concepts", "mine-concepts", {"n_max": 5})
    u = w.unit_writer("vocab", "fp")
    u.write_table("vocab", pa.table({"concept_id": pa.array([1, 2], pa.int64()), "text": ["red ball", "dog"],
                                     "n": pa.array([2, 1], pa.int32()), "df": pa.array([3, 4], pa.int64())}))
    u.commit()
    w.finalize(["vocab"])
    m = load_manifest(None, [f"output={tmp_path}", "dataset.kind=synthetic", "models.clip=scene-oracle"])
    with pytest.raises(StageError) as e:
        run_stage("encode-concepts", RunContext(m))
    assert str(e.value) == (f"models.clip: scene-oracle is a testbed instrument for the generated dataset (dataset.kind: "
                            f"synthetic); the samples artifact ({tmp_path / 'samples' / '_manifest.json'}) was ingested "
                            "from dataset.kind 'coco': give a real checkpoint")
    assert not (tmp_path / "concept_tokens").exists()  # refused before any work


def test_a_grid_that_is_a_fifo_is_refused_not_read(tmp_path):
    import os

    from train.sweep import GridError, read_grid

    os.mkfifo(tmp_path / "grid.yaml")
    with pytest.raises(GridError) as e:
        read_grid(tmp_path / "grid.yaml", "concept-ot")
    assert str(e.value) == f"grid {tmp_path / 'grid.yaml'}: is a FIFO (named pipe), not a regular file"



def test_a_stage_without_its_input_names_the_command_with_the_manifest_and_sets(tmp_path, monkeypatch):
    """The suggested command runs on the same manifest and overrides (it was `pipeline run ingest`, bare)."""
    from pipeline.cli import app

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    out = tmp_path / "empty"
    r = CliRunner().invoke(app, ["run", "mine-concepts", "-m", "manifests/tiny.yaml", "--set", f"output={out}"])
    assert r.exit_code != 0
    assert (f"error: input artifact 'samples' not found under {out}: run `pipeline run ingest -m manifests/tiny.yaml "
            f"--set output={out}` first") in r.output
