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
