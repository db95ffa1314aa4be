"""The image stages plan units from columnar metadata and each worker reads its own slice (issue 17):
the driver builds no Python object per sample (no polars ``to_dicts`` / ``rows`` outside a worker, no sample in a unit payload); the slices a worker reads are the records
the whole-table read gave (captions, boxes, instances with masks, relations; ``--limit``); an
edit of one ingest shard redoes only the units that read it."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from pipeline.stage import RunContext, run_stage
from pipeline.stages._image_units import plan_image_units, unit_records
from tests.conftest import make_manifest
from tests.test_rerun_cheap import _in_process

SMALL = [
    "dataset.synthetic.n_images=12",
    "dataset.synthetic.captions_per_image=2",
    "stages.ingest.shard_size=4",
    "stages.extract_clip_tokens.shard_size=3",  # units straddle the ingest files of 4 samples
    "stages.extract_regions.shard_size=5",
    "stages.extract_visual_tokens.shard_size=5",
    "stages.extract_image_groups.shard_size=3",
]


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    _in_process(mp, [])
    m = make_manifest(tmp_path_factory.mktemp("slices"), SMALL)
    run_stage("ingest", RunContext(m))
    mp.undo()
    return m


def _reference(out: Path, limit=None) -> list[dict]:
    """The records as the whole-table read in the driver built them before issue 17."""
    from pipeline.loaders.samples import image_resolver

    d = out / "samples"
    scan = lambda t: pl.scan_parquet(sorted(str(p) for p in (d / t).glob("*.parquet")))  # noqa: E731
    s = scan("samples").select("sample_id", "source_id", "image", "width", "height").sort("sample_id").collect()
    if limit is not None:
        s = s.head(limit)
    recs = s.to_dicts()
    resolve = image_resolver(d)
    ids = s["sample_id"].implode()
    caps = scan("captions").filter(pl.col("sample_id").is_in(ids)).sort("caption_id").group_by("sample_id", maintain_order=True).agg("caption_id", "text").collect()
    caps = {r["sample_id"]: [[c, t] for c, t in zip(r["caption_id"], r["text"])] for r in caps.to_dicts()}
    inst = scan("instances").filter(pl.col("sample_id").is_in(ids)).select("sample_id", "instance_id", "category", "box", "mask_rle").sort("sample_id", "instance_id").collect()
    rel = scan("relations").filter(pl.col("sample_id").is_in(ids)).collect()
    for r in recs:
        sid = r["sample_id"]
        r["image_path"] = resolve(r["image"])
        r["captions"] = caps.get(sid, [])
        rows = [dict(x, box=[float(v) for v in x["box"]]) for x in inst.to_dicts() if x["sample_id"] == sid]
        for x in rows:
            x.pop("sample_id")
        r["boxes"] = {"instance_ids": [x["instance_id"] for x in rows], "boxes": [x["box"] for x in rows], "categories": [x["category"] for x in rows]}
        r["instances"] = rows
        r["relations"] = [{k: v for k, v in x.items() if k != "sample_id"} for x in rel.to_dicts() if x["sample_id"] == sid]
    return recs


@pytest.mark.parametrize("limit", [None, 5])
def test_slices_are_the_whole_table_records(ingested, limit):
    m = ingested
    ref = _reference(Path(m.output), limit)
    assert len(ref) >= 5 and any(r["instances"] for r in ref) and any(r["relations"] for r in ref)
    for attach, key in [(("captions",), "captions"), (("boxes",), "boxes"), (("instances", "relations"), None)]:
        plan = plan_image_units(RunContext(m, limit=limit), 3, attach)
        assert plan.rows == len(ref)
        got = [r for _, _, payload in plan.units for r in unit_records(payload)]
        base = ["sample_id", "source_id", "image", "width", "height", "image_path"]
        want = [{k: r[k] for k in base} for r in ref]
        for w, r in zip(want, ref):
            if key == "captions":
                w["captions"] = r["captions"]
            elif key == "boxes":
                w["instances"] = r["boxes"]
            else:
                w["instances"], w["relations"] = r["instances"], r["relations"]
        assert got == want


def test_driver_builds_no_per_sample_records(ingested, monkeypatch):
    """Every polars `to_dicts` / `rows` of the image stages runs inside a worker call; the unit
    payloads name files and an id range, never a sample."""
    m = ingested
    in_worker = [False]
    payloads: list[dict] = []
    cache: dict = {}

    def local_map(units, fn, *, ray_cfg=None, actor=False, constructor_kwargs=None, **kw):
        key = fn.__qualname__
        if actor and key not in cache:
            cache[key] = fn(**(constructor_kwargs or {}))
        worker = cache[key] if actor else fn
        for u in units:
            payloads.append(u)
            in_worker[0] = True
            try:
                yield json.loads(json.dumps(worker(json.loads(json.dumps(u)))))
            finally:
                in_worker[0] = False

    import pipeline.runtime
    import pipeline.stage

    monkeypatch.setattr(pipeline.stage, "map_units", local_map)
    monkeypatch.setattr(pipeline.runtime, "map_units", local_map)
    driver_calls = []
    for name in ["to_dicts", "rows", "iter_rows"]:  # polars: what the driver used to build records with
        orig = getattr(pl.DataFrame, name)

        def guarded(self, *a, _orig=orig, _name=name, **k):
            if not in_worker[0]:
                driver_calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(pl.DataFrame, name, guarded)
    # the demo's backends: regions from the ground-truth boxes, visual tokens from the
    # ground-truth masks and scene graphs (every attachment a slice can carry)
    assert m.stages.extract_regions.backend == "annotations" and m.stages.extract_visual_tokens.relations == "annotations"
    for stage in ["extract-clip-tokens", "extract-regions", "extract-visual-tokens"]:
        run_stage(stage, RunContext(m))
    assert driver_calls == [], f"per-sample Python objects built in the driver: {driver_calls}"
    sources = [s for s in pl.read_parquet(str(Path(m.output) / "samples" / "samples" / "*.parquet"))["source_id"]]
    assert len(payloads) >= 3 * 2
    for p in payloads:
        text = json.dumps(p)
        assert "records" not in p and not any(json.dumps(s) in text for s in sources), text
        assert len(p["slice"]["files"]["samples"]) <= 2  # a unit of <= 5 samples reads <= 2 files of 4


def test_edit_of_one_ingest_shard_redoes_only_its_units(ingested, monkeypatch):
    m = ingested
    _in_process(monkeypatch, [])
    out = Path(m.output)
    run_stage("extract-clip-tokens", RunContext(m))
    state = out / "clip_tokens" / "_state"
    before = {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
    assert len(before) >= 4
    ids_before = set(pl.read_parquet(str(out / "samples" / "captions" / "*.parquet"))["caption_id"])
    # edit one caption of the last image in the dataset, ingest again: one ingest shard changes
    cap_file = out / "source" / "synthetic" / "annotations" / "captions.json"
    data = json.loads(cap_file.read_text())
    last = max(a["image_id"] for a in data["annotations"])
    ann = next(a for a in data["annotations"] if a["image_id"] == last and a["caption"].strip())
    ann["caption"] = "an edited caption of the last image"
    cap_file.write_text(json.dumps(data))
    shards = {p.name: p.stat().st_mtime_ns for p in (out / "samples" / "captions").glob("*.parquet")}
    run_stage("ingest", RunContext(m))
    changed = {n for n, t in shards.items() if (out / "samples" / "captions" / n).stat().st_mtime_ns != t}
    assert len(changed) == 1
    plan = plan_image_units(RunContext(m), m.stages.extract_clip_tokens.shard_size, ("captions",))
    readers = {name for name, _, p in plan.units if any(Path(f).name in changed for f in p["slice"]["files"]["captions"])}
    run_stage("extract-clip-tokens", RunContext(m))
    after = {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
    redone = {n.removesuffix(".json") for n in before if after[n] != before[n]}
    assert redone == readers and 0 < len(redone) < len(before)
    # the redone units read the new captions (the edit broke the caption's phrase spans: ingest
    # now rejects it, so its caption id is gone from the slices as from the table)
    table = pl.read_parquet(str(out / "samples" / "captions" / "*.parquet"))
    read = {cid for _, _, p in plan.units for r in unit_records(p) for cid, _ in r["captions"]}
    assert read == set(table["caption_id"]) and read != ids_before


def _samples_artifact(out: Path, files: list[list[int]]):
    """A samples artifact whose unit files hold these sample ids (in this manifest order)."""
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages.ingest import CAPTIONS_SCHEMA, SAMPLES_SCHEMA

    w = ArtifactWriter(out, "samples", "ingest", {"hand": True})
    for u, ids in enumerate(files):
        uw = w.unit_writer(f"{u:05d}", "fp")
        uw.write_table("samples", pa.table({"sample_id": ids, "source_id": [f"s{i}" for i in ids], "image": [f"{i}.jpg" for i in ids],
                                            "width": [8] * len(ids), "height": [8] * len(ids), "split": ["train"] * len(ids)},
                                           schema=SAMPLES_SCHEMA))
        uw.write_table("captions", pa.table({"caption_id": [10 * i for i in ids], "sample_id": ids, "text": [f"caption {i}" for i in ids]},
                                            schema=CAPTIONS_SCHEMA))
        uw.commit({"rows": len(ids)})
    w.finalize([f"{u:05d}" for u in range(len(files))], extra={"image_root": "imgs"})


def test_files_out_of_id_order_and_duplicate_ids(tmp_path):
    from pipeline.stage import StageError

    m = make_manifest(tmp_path)
    _samples_artifact(Path(m.output), [[4, 5, 6, 7], [0, 1, 2, 3], [], [8, 9]])
    plan = plan_image_units(RunContext(m), 3, ("captions",))
    assert [u[2]["slice"]["range"] for u in plan.units] == [[0, 2], [3, 5], [6, 8], [9, 9]]
    assert [u[2]["slice"]["files"]["samples"] for u in plan.units] == [
        ["samples/samples-00001.parquet"], ["samples/samples-00000.parquet", "samples/samples-00001.parquet"],
        ["samples/samples-00000.parquet", "samples/samples-00003.parquet"], ["samples/samples-00003.parquet"]]
    recs = [r for _, _, p in plan.units for r in unit_records(p)]
    assert [(r["sample_id"], r["captions"]) for r in recs] == [(i, [[10 * i, f"caption {i}"]]) for i in range(10)]
    assert recs[0]["image_path"] == str(Path(m.output).resolve() / "imgs" / "0.jpg")
    plan = plan_image_units(RunContext(m, limit=4), 3)
    assert plan.rows == 4 and [u[2]["slice"]["range"] for u in plan.units] == [[0, 2], [3, 3]]
    _samples_artifact(tmp_path / "dup", [[0, 1], [1, 2]])
    with pytest.raises(StageError, match="sample_id twice"):
        plan_image_units(RunContext(make_manifest(tmp_path / "dup", [f"output={tmp_path / 'dup'}"])), 3)
