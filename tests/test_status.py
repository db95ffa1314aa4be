"""`pipeline status` and stale inputs: an artifact whose input was redone since it was written is
stale (and so is everything made from it); `train run` refuses a stale input with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.status import StaleArtifact, artifact_state, output_states, require_fresh

REPO = Path(__file__).resolve().parents[1]


def _write(out: Path, artifact: str, stage: str, value: int, inputs: dict | None = None) -> str:
    w = ArtifactWriter(out, artifact, stage, {"v": value}, inputs=inputs, force=True)
    u = w.unit_writer(unit_name(0), f"fp{value}")
    u.write_table("t", pa.table({"sample_id": pa.array([1, 2], pa.int64()), "x": [value, value]}))
    u.commit()
    return w.finalize([unit_name(0)])["fingerprint"]


def _chain(out: Path, samples_value: int = 0):
    fs = _write(out, "samples", "ingest", samples_value)
    fc = _write(out, "clip_tokens", "extract-clip-tokens", 1, {"samples": fs})
    _write(out, "index", "build-index", 2, {"clip_tokens": fc})


def test_fresh_chain_is_complete_and_a_redone_input_makes_the_chain_stale(tmp_path):
    _chain(tmp_path)
    assert [artifact_state(tmp_path, a).state for a in ("samples", "clip_tokens", "index")] == ["complete"] * 3
    _write(tmp_path, "samples", "ingest", 5)  # re-ingested with other options (--force)
    cl, ix = artifact_state(tmp_path, "clip_tokens"), artifact_state(tmp_path, "index")
    assert cl.state == "stale" and "samples changed" in cl.detail and "pipeline run extract-clip-tokens" in cl.detail
    assert ix.state == "stale" and "clip_tokens is stale" in ix.detail and "pipeline run build-index" in ix.detail
    with pytest.raises(StaleArtifact, match=r"^concept-ot: input artifact clip_tokens is stale: samples changed"):
        require_fresh(_Manifest(tmp_path), ["samples", "clip_tokens"], "concept-ot")
    require_fresh(_Manifest(tmp_path), ["samples"], "x")  # the redone input itself is fine


def test_missing_input_and_missing_and_incomplete_artifacts(tmp_path):
    _chain(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "samples")
    assert artifact_state(tmp_path, "samples").state == "missing"
    st = artifact_state(tmp_path, "clip_tokens")
    assert st.state == "stale" and "input samples is missing" in st.detail
    (tmp_path / "index" / "_manifest.json").unlink()  # units done, never finished
    assert artifact_state(tmp_path, "index").state == "incomplete"


def test_verify_finds_a_flipped_byte(tmp_path):
    _chain(tmp_path)
    f = next((tmp_path / "clip_tokens").rglob("*.parquet"))
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 1
    f.write_bytes(bytes(b))
    assert artifact_state(tmp_path, "clip_tokens").state == "complete"  # without --verify: sizes only
    st = artifact_state(tmp_path, "clip_tokens", verify=True)
    assert st.state == "corrupt" and "sha256" in st.detail and "pipeline verify --fix" in st.detail


def test_status_cli_lists_every_artifact(tmp_path):
    _chain(tmp_path / "run")
    man = tmp_path / "m.yaml"
    man.write_text(f"name: t\noutput: {tmp_path / 'run'}\ndataset: {{kind: synthetic}}\n")
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "-m", str(man)], capture_output=True, text=True)
    lines = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines()[1:]}
    assert lines["samples"] == "complete" and lines["clip_tokens"] == "complete" and lines["index"] == "complete"
    assert lines["concepts"] == "missing" and r.returncode == 1, r.stdout + r.stderr
    _write(tmp_path / "run", "samples", "ingest", 9)
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "-m", str(man)], capture_output=True, text=True)
    lines = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines()[1:]}
    assert lines["clip_tokens"] == "stale" and lines["index"] == "stale" and lines["samples"] == "complete"


class _Manifest:
    def __init__(self, out):
        self.output = str(out)


def test_train_run_refuses_a_stale_input_in_one_line(tmp_path):
    _chain(tmp_path / "run")
    _write(tmp_path / "run", "samples", "ingest", 9)
    man = tmp_path / "m.yaml"
    man.write_text(f"name: t\noutput: {tmp_path / 'run'}\ndataset: {{kind: synthetic}}\n")
    r = subprocess.run([sys.executable, "-m", "train.cli", "run", "concept-ot", "-m", str(man)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: concept-ot: input artifact clip_tokens is stale: samples "
                                                        "changed since it was written"), r.stderr
