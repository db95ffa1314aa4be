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


# --- corrupt Parquet files ---------------------------------------------------------------------


def _artifact_with_a_corrupt_file(out, which: str):
    import pyarrow as pa

    from pipeline.io.artifacts import Artifact, ArtifactWriter

    w = ArtifactWriter(out, "things", "mine-concepts", {})
    u = w.unit_writer("00000", w.unit_fingerprint("00000", None))
    u.write_table("things", pa.table({"sample_id": pa.array(range(5), pa.int64())}))
    u.error("bad", "x", sample_id=9)
    u.commit({"rows": 5})
    w.finalize(["00000"])
    art = Artifact(w.dir)
    bad = art.dir / (art.manifest["shards"][0]["path"] if which == "table" else art.manifest["errors"]["path"])
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # truncated: "File out of specification" in polars
    return art, bad


def test_corrupt_parquet_file_is_one_line_naming_it_and_the_fix(tmp_path):
    from pipeline.io.artifacts import CorruptArtifact

    art, bad = _artifact_with_a_corrupt_file(tmp_path, "table")
    for read in (lambda: art.read("things"), lambda: art.scan("things").collect()):
        with pytest.raises(CorruptArtifact) as e:
            read()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{bad}: corrupt or unreadable Parquet file (")
        assert "magic bytes" in msg and f"`pipeline verify --fix {art.location}`" in msg and "`pipeline run mine-concepts`" in msg
    r = _cli("pipeline", "inspect", str(art.location))
    _one_line_error(r, str(bad), "corrupt", "pipeline verify --fix")


def test_corrupt_errors_table_names_the_rerun(tmp_path):
    from pipeline.io.artifacts import CorruptArtifact

    art, bad = _artifact_with_a_corrupt_file(tmp_path, "errors")
    with pytest.raises(CorruptArtifact, match=f"^{bad}: corrupt .*; `pipeline run mine-concepts` writes it again$"):
        art.errors()
    _one_line_error(_cli("pipeline", "inspect", str(art.location)), str(bad))


# --- a worker that dies on one sample ----------------------------------------------------------


@pytest.mark.parametrize("actor", [False, True], ids=["task", "actor"])
def test_sample_that_kills_its_worker_is_isolated_and_the_run_goes_on(tmp_path, ray_session, monkeypatch, actor):
    """A unit function that segfaults (ctypes) on sample 13: Ray's retries are bounded, the unit is
    taken apart, sample 13 alone kills its worker and is recorded as worker_crashed, the unit's
    other samples and the other units are written, and the stage ends. ``actor``: the same in an
    actor pool (a dying actor also loses the unit queued on it, which is run again)."""
    import time

    from pipeline.config import RayConfig
    from pipeline.crashes import RECORDS
    from pipeline.io.artifacts import Artifact, ArtifactWriter
    from pipeline.stage import RunContext, run_units

    def unit(payload):  # local: pickled by value into the workers
        import ctypes

        import pyarrow as pa

        from pipeline.stage import unit_writer

        w = unit_writer(payload)
        for r in payload["records"]:
            if r["sample_id"] == 13:
                ctypes.string_at(0)  # segfault, as pycocotools' rleFrPoly did on a 1e9 polygon
        ids = [r["sample_id"] for r in payload["records"]]
        w.write_table("things", pa.table({"sample_id": pa.array(ids, pa.int64())}))
        return {"unit": w.commit({"rows": len(ids)}).unit, "stats": {"rows": len(ids)}}

    class Worker:  # the actor-pool form of the same unit
        def __call__(self, payload):
            return unit(payload)

    ctx = RunContext(manifest=None)
    ctx.stage_cfg = None
    ray_cfg = RayConfig(num_cpus=2, object_store_memory=128 * 1024**2)
    w = ArtifactWriter(tmp_path, "things", "ingest", {})
    ids = [[0, 1, 2], [3, 13, 5], [6], [7]]
    units = [(f"{u:05d}", u, {"records": [{"sample_id": i, "source_id": f"s{i}"} for i in chunk]}) for u, chunk in enumerate(ids)]
    monkeypatch.setattr(RunContext, "ray_cfg", property(lambda self: ray_cfg))
    t0 = time.perf_counter()
    names = run_units(ctx, w, units, Worker if actor else unit, actor=actor, split=RECORDS)
    seconds = time.perf_counter() - t0
    w.finalize(names)
    art = Artifact(w.dir)
    assert sorted(art.read("things")["sample_id"].to_pylist()) == [0, 1, 2, 3, 5, 6, 7]
    errors = art.errors().to_pylist()
    assert [(e["unit"], e["sample_id"], e["source_id"], e["reason"]) for e in errors] == [("00001", 13, "s13", "worker_crashed")]
    assert "died running this sample alone" in errors[0]["detail"]
    assert not list(w.dir.glob(".probe-*"))  # the probes' scratch folders are gone
    assert seconds < 240, seconds


# --- kill -9 of the driver ---------------------------------------------------------------------

_DRIVER = """
import sys, time
from pathlib import Path
from pipeline.config import RayConfig
from pipeline.runtime import map_units

def unit(payload):  # a unit of a stage at work when the driver is killed
    Path(payload["started"]).write_text("1")
    time.sleep(120)
    return {"unit": payload["unit"]}

import ray
cfg = RayConfig(num_cpus=1, object_store_memory=128 * 1024**2)
for _ in map_units([{"unit": "00000", "started": sys.argv[1]}], unit, ray_cfg=cfg):
    pass
"""


def test_kill9_of_the_driver_leaves_no_ray_process(tmp_path):
    """`pipeline run` killed with -9 mid-stage: every process of its embedded Ray session (all its
    descendants, the raylet's dashboard and runtime-env agents included) is gone within 60 s."""
    import os
    import signal
    import time

    import psutil

    started = tmp_path / "started"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(started)], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs: dict[int, psutil.Process] = {}
    try:
        t0 = time.time()
        while not started.exists():
            assert driver.poll() is None and time.time() - t0 < 240, "the driver did not start its unit"
            time.sleep(0.5)
        time.sleep(2)  # the agents are up by now; note the session's processes as the test sees them
        for p in psutil.Process(driver.pid).children(recursive=True):
            procs[p.pid] = p
        names = {p.name() for p in procs.values() if p.is_running()}
        assert {"raylet", "gcs_server"} <= names and any("Agent" in n for n in names), names
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        t1 = time.time()
        while time.time() - t1 < 60:
            alive = [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(1)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        for p in procs.values():  # only the processes this test's driver started
            try:
                p.kill()
            except psutil.Error:
                pass
        if driver.poll() is None:
            driver.kill()


def test_image_stage_units_split_by_sample(tmp_path):
    """The image stages' planned units (a sample-id range over the samples files) taken apart by
    sample: the ids of a unit, and a unit of just some of them read by the worker."""
    import pyarrow as pa

    from pipeline.io.artifacts import Artifact, ArtifactWriter
    from pipeline.stages._image_units import IMAGE_UNITS, read_slice

    w = ArtifactWriter(tmp_path, "samples", "ingest", {})
    u = w.unit_writer("00000", w.unit_fingerprint("00000", None))
    u.write_table("samples", pa.table({"sample_id": pa.array([3, 4, 5, 6], pa.int64()), "source_id": ["a", "b", "c", "d"],
                                       "image": ["a.jpg", "b.jpg", "c.jpg", "d.jpg"], "width": pa.array([8] * 4, pa.int32()),
                                       "height": pa.array([8] * 4, pa.int32()), "split": ["train"] * 4}))
    u.commit({"rows": 4})
    w.finalize(["00000"])
    art = Artifact(w.dir)
    desc = {"location": str(art.location), "image_root": str(tmp_path), "range": [4, 6], "rows": 3,
            "files": {"samples": [art.manifest["shards"][0]["path"]]}, "attach": []}
    payload = {"slice": desc, "unit": "00001"}
    assert IMAGE_UNITS.ids(payload) == [{"sample_id": 4, "source_id": "b"}, {"sample_id": 5, "source_id": "c"},
                                        {"sample_id": 6, "source_id": "d"}]
    part = IMAGE_UNITS.keep(payload, [6, 4])
    assert part["unit"] == "00001" and [r["sample_id"] for r in read_slice(part["slice"])] == [4, 6]
    assert [s["sample_id"] for s in IMAGE_UNITS.ids(part)] == [4, 6]
    assert [r["sample_id"] for r in read_slice(desc)] == [4, 5, 6]  # the whole unit as before
    records = {"records": [{"sample_id": 1, "source_id": "x"}, {"sample_id": 2, "source_id": "y"}]}  # image_units' payloads
    assert IMAGE_UNITS.keep(records, [2]) == {"records": [{"sample_id": 2, "source_id": "y"}]}
