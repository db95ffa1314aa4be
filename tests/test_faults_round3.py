"""Bad input and faults, round 3 (issue 30): a polygon that would crash the rasteriser, a worker
that dies on one sample, corrupt Parquet files, non-UTF-8 / empty manifests, an empty output key,
and the embedded Ray's processes after a kill -9 of the driver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# --- polygons ----------------------------------------------------------------------------------

_INGEST_ONE_UNIT = """
import json, sys
from pipeline.io.artifacts import Artifact, ArtifactWriter
from pipeline.stages.ingest import ingest_unit

out, records = sys.argv[1], json.loads(sys.argv[2])
w = ArtifactWriter(out, "samples", "ingest", {})
ingest_unit(dict(records=records, verify_images="none", min_caption_chars=1, has_annotations=True, image_root=None,
                 artifact_dir=str(w.dir), stage="ingest", unit="00000", fingerprint=w.unit_fingerprint("00000", 0)))
w.finalize(["00000"])
art = Artifact(w.dir)
print(json.dumps({"kept": art.read("samples")["sample_id"].to_pylist(),
                  "errors": [[e["sample_id"], e["reason"], e["detail"]] for e in art.errors().to_pylist()]}))
"""


def _record(sid: int, polygon: list[float]) -> dict:
    mask = {"segmentation": [polygon], "height": 10, "width": 10}
    return {"sample_id": sid, "first_caption_id": sid, "source_id": str(sid), "image": f"{sid}.jpg", "captions": ["a cat"],
            "split": "train", "problems": [], "relations": [], "phrases": [],
            "instances": [{"id": sid, "box": [0, 0, 1, 1], "category": "cat", "mask_rle": mask, "attributes": {}}]}


def test_polygon_far_outside_the_image_is_rejected_before_rasterising(tmp_path):
    """`[[0,0,1e9,0,1e9,1e9]]` segfaults pycocotools' rleFrPoly (in a subprocess here, so the
    crash it was is a failed assertion, not a dead test run)."""
    records = [_record(0, [0, 0, 5, 0, 5, 5]), _record(1, [0, 0, 1e9, 0, 1e9, 1e9]),
               _record(2, [0, 0, float("nan"), 0, 5, 5]), _record(3, [-2, -2, 11, 0, 11, 11])]
    r = subprocess.run([sys.executable, "-c", _INGEST_ONE_UNIT, str(tmp_path), json.dumps(records)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kept"] == [0, 3]  # slightly outside the image is fine (COCO has such vertices)
    assert [e[:2] for e in got["errors"]] == [[1, "bad_polygon"], [2, "bad_polygon"]]
    assert "vertex 1 has x=1e+09, outside [-10, 20] for a 10x10 image" in got["errors"][0][2]


def test_polygons_to_rle_checks_vertices():
    from pipeline.masks import BadPolygon, polygons_to_rle, rle_area

    assert rle_area(polygons_to_rle([[-1, -1, 12, -1, 12, 12, -1, 12]], 10, 10)) == 100
    with pytest.raises(BadPolygon, match="y=inf"):
        polygons_to_rle([[0, 0, 5, float("inf"), 5, 5]], 10, 10)
    with pytest.raises(BadPolygon, match="positive image size"):
        polygons_to_rle([[0, 0, 5, 0, 5, 5]], 0, 10)


# --- manifests ---------------------------------------------------------------------------------

BIN = REPO / ".venv" / "bin"


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    exe = BIN / args[0] if (BIN / args[0]).exists() else args[0]
    return subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, cwd=cwd or REPO, timeout=300)


def _one_line_error(r: subprocess.CompletedProcess, *parts: str) -> None:
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    for p in parts:
        assert p in err[0], err[0]


@pytest.mark.parametrize("cmd", [("pipeline", "run", "ingest"), ("train", "run", "c3"), ("pipeline", "report")])
def test_non_utf8_manifest_is_one_line_naming_file_and_offset(tmp_path, cmd):
    m = tmp_path / "latin1.yaml"
    m.write_bytes(b"name: x\noutput: runs/\xe9t\xe9\n")
    _one_line_error(_cli(*cmd, "--manifest", str(m), cwd=tmp_path), f"manifest {m}", "not UTF-8", "offset 21")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ["", "\n# nothing here yet\n"])
def test_empty_manifest_is_refused_not_run_as_the_demo(tmp_path, text):
    from pipeline.config import ManifestError, load_manifest

    m = tmp_path / "empty.yaml"
    m.write_text(text)
    with pytest.raises(ManifestError, match=f"manifest {m}: the file is empty"):
        load_manifest(m)
    _one_line_error(_cli("pipeline", "run", "ingest", "--manifest", str(m), cwd=tmp_path), "the file is empty")
    assert not (tmp_path / "runs").exists()


def test_empty_output_is_refused_naming_the_key(tmp_path):
    from pipeline.config import ManifestError, load_manifest

    with pytest.raises(ManifestError, match="key 'output': .*not be empty"):
        load_manifest(REPO / "manifests" / "demo.yaml", ["output="])
    r = _cli("pipeline", "run", "ingest", "--manifest", str(REPO / "manifests" / "demo.yaml"), "--set", "output=", cwd=tmp_path)
    _one_line_error(r, "key 'output'")
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder
