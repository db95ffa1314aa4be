"""Faults in the image stages (issue 18): one image the model fails on is rejected alone (recorded
with its sample id, the batch retried without it, the other samples stored as without it), for
each image stage; the shared isolation helper; the error-rate policy; errors without addresses."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pipeline.io.artifacts import Artifact, ArtifactWriter
from pipeline.io.wds import iter_shard
from pipeline.stage import StageError, check_error_rate, describe_exception, isolate_failures
from pipeline.stages._image_units import image_units, isolated_decode
from tests.test_clip_tokens import folder_records, make_image_folder


def _folder_with_extremes(root):
    """The shared test folder (5 good images, 1 corrupt) plus a 1x300 and a 2000x1 image."""
    make_image_folder(root)
    Image.fromarray(np.full((300, 1, 3), 90, np.uint8)).save(root / "g_thin.png")
    Image.fromarray(np.full((1, 2000, 3), 90, np.uint8)).save(root / "h_wide.png")
    with open(root / "captions.tsv", "a") as f:
        f.write("g_thin.png\ta thin line\nh_wide.png\ta wide line\n")
    return root


def _run_worker(worker, out_dir, artifact, stage, records, shard_size):
    writer = ArtifactWriter(out_dir, artifact, stage, {"shard_size": shard_size})
    names = []
    for name, unit_input, payload in image_units(records, shard_size):
        fp = writer.unit_fingerprint(name, unit_input)
        worker(dict(payload, artifact_dir=str(writer.dir), stage=stage, unit=name, fingerprint=fp))
        names.append(name)
    writer.finalize(names)
    return Artifact(writer.dir)


def _stored(art):
    return {int(s["__key__"]): s for p in art.files("shards") for s in iter_shard(p)}


# --- the shared helper -------------------------------------------------------------------------


class _W:
    def __init__(self):
        self.errors = []
        self.unit = "00000"

    def error(self, reason, detail="", **ids):
        self.errors.append((reason, ids.get("sample_id"), detail))


def test_isolate_failures_retries_the_batch_without_the_bad_sample():
    calls = []

    def fn(recs, xs):
        calls.append([r["sample_id"] for r in recs])
        if 13 in xs:
            raise RuntimeError("output (H: 128, W: 0) at 0x7efc12345678")
        return [x * 2 for x in xs]

    w = _W()
    recs = [{"sample_id": i, "source_id": f"s{i}"} for i in range(4)]
    kept, out = isolate_failures(w, recs, [1, 13, 3, 4], fn)
    assert [r["sample_id"] for r in kept] == [0, 2, 3] and out == [2, 6, 8]
    assert calls[-1] == [0, 2, 3]  # the survivors are run again as one batch
    assert w.errors == [("model_failed", 1, "RuntimeError: output (H: 128, W: 0)")]  # no address
    # a batch of one failing sample
    w = _W()
    assert isolate_failures(w, recs[:1], [13], fn) == ([], None)
    assert len(w.errors) == 1
    # every sample passes alone but the batch fails: the batch is rejected, each sample named
    w = _W()
    kept, out = isolate_failures(w, recs[:2], [1, 2], lambda r, x: (_ for _ in ()).throw(MemoryError()) if len(x) > 1 else x)
    assert kept == [] and out is None and [e[1] for e in w.errors] == [0, 1]
    # a numpy batch is sliced along its first axis
    w = _W()
    kept, out = isolate_failures(w, recs[:3], np.array([1, 13, 3]), lambda r, x: (_ for _ in ()).throw(ValueError("x")) if 13 in x else x)
    assert out.tolist() == [1, 3]


def test_isolated_decode_rejects_the_sample_the_processor_fails_on():
    def decode(recs):
        if any(r["sample_id"] == 1 for r in recs):
            raise ValueError("cannot resize")
        return recs, [r["sample_id"] for r in recs], []

    recs = [{"sample_id": i} for i in range(3)]
    kept, batch, failed = isolated_decode(decode, recs)
    assert batch == [0, 2] and [(r["sample_id"], why) for r, why in failed] == [(1, "ValueError: cannot resize")]


def test_describe_exception_is_one_line_without_addresses():
    e = OSError("cannot identify image file <_io.BytesIO object at 0x7efc0d2a1b20>\nmore")
    assert describe_exception(e) == "OSError: cannot identify image file <_io.BytesIO object>"


def _errors(rows):
    from pipeline.io.artifacts import ERROR_SCHEMA, error_row

    return pa.Table.from_pylist([error_row("ingest", "00000", *r[:2], **r[2]) for r in rows], schema=ERROR_SCHEMA)


def test_error_rate_policy():
    few = _errors([("unreadable_image", "x", {"sample_id": 1})])
    check_error_rate("samples", "ingest", few, 10, 9, 0.5, "E")  # 10%: fine
    many = _errors([("missing_image", "record has no image reference", {"sample_id": i}) for i in range(6)]
                   + [("empty_caption", "c", {"sample_id": 7, "caption_id": 3})])
    with pytest.raises(StageError) as e:
        check_error_rate("samples", "ingest", many, 10, 4, 0.5, "E")
    msg = str(e.value)
    assert "\n" not in msg and "rejected 6 of 10 samples (60.0% > max_error_rate 50%)" in msg
    assert msg.index("missing_image x6") < msg.index("empty_caption x1") and "see E" in msg
    with pytest.raises(StageError, match="produced no rows"):  # caption-level errors only, nothing kept
        check_error_rate("x", "negative-captions", _errors([("empty_caption", "c", {"sample_id": 7, "caption_id": 3})]), None, 0, 0.5, "E")
    check_error_rate("samples", "ingest", many, 10, 4, 0.6, "E")  # the option raises the bar


# --- each image stage, one failing image among good ones ----------------------------------------


@pytest.fixture(scope="module")
def extremes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    return tmp, folder_records(_folder_with_extremes(tmp / "imgs"))


def test_regions_extreme_aspect_image_is_rejected_alone(extremes):
    from pipeline.readers.images import open_image
    from pipeline.stages import extract_regions as st

    tmp, records = extremes
    worker = st.RegionWorker("tiny-random", "cpu", 1, 1, "detector", 30, None, None)
    thin = next(r for r in records if r["source_id"] == "g_thin.png")
    with pytest.raises(RuntimeError):  # the detector's resize cannot take it: the crash of the issue
        worker.det.detect([open_image(thin["image"])])
    # batch_size 3: the bad images share batches with good ones
    worker.batch_size = 3
    art = _run_worker(worker, tmp / "regions", "regions", st.NAME, records, shard_size=4)
    stored = _stored(art)
    bad = {r["sample_id"] for r in records if r["source_id"] in ("f.jpg", "g_thin.png", "h_wide.png")}
    assert sorted(stored) == sorted(r["sample_id"] for r in records if r["sample_id"] not in bad)
    errs = {(e["sample_id"], e["reason"]) for e in art.errors().to_pylist()}
    assert errs == {(thin["sample_id"], "model_failed"), (thin["sample_id"] + 1, "model_failed"),
                    (next(r["sample_id"] for r in records if r["source_id"] == "f.jpg"), "unreadable_image")}
    detail = next(e["detail"] for e in art.errors().to_pylist() if e["sample_id"] == thin["sample_id"])
    assert detail.startswith("RuntimeError: Input and output sizes should be greater than 0")


def _poison(monkeypatch, module, name, bad_value):
    """Make ``module.name`` (a batch encoder) raise on a batch holding an image of constant pixels."""
    import torch

    real = getattr(module, name)

    def wrapped(model, pixels, *a, **k):
        flat = pixels.reshape(len(pixels), pixels.shape[1], -1)
        if bool((flat.std(dim=2).amax(dim=1) < 1e-6).any()):
            raise RuntimeError(f"{bad_value} cannot be encoded")
        return real(model, pixels, *a, **k)

    monkeypatch.setattr(module, name, wrapped)
    return torch


@pytest.mark.slow
def test_clip_tokens_failing_image_is_rejected_alone(extremes, monkeypatch):
    import pipeline.models.clip as clip
    from pipeline.stages import extract_clip_tokens as st

    tmp, records = extremes
    _poison(monkeypatch, clip, "encode_images", "constant image")
    worker = st.ClipTokenWorker("tiny-random", "cpu", 1, 3, 3, 48, False)
    art = _run_worker(worker, tmp / "clip", "clip_tokens", st.NAME, records, shard_size=4)
    # the constant-colour thin/wide images fail in the (poisoned) encoder; the corrupt file in decoding
    bad = {r["sample_id"] for r in records if r["source_id"] in ("f.jpg", "g_thin.png", "h_wide.png")}
    stored = _stored(art)
    assert sorted(stored) == sorted(r["sample_id"] for r in records if r["sample_id"] not in bad)
    reasons = sorted(e["reason"] for e in art.errors().to_pylist())
    assert reasons == ["model_failed", "model_failed", "unreadable_image"]


@pytest.mark.slow
def test_image_groups_failing_image_is_rejected_alone(extremes, monkeypatch):
    import pipeline.models.groupvit as gv
    from pipeline.stages import extract_image_groups as st

    tmp, records = extremes
    _poison(monkeypatch, gv, "encode_groups", "constant image")
    worker = st.GroupWorker("tiny-random", "cpu", 1, 3)
    art = _run_worker(worker, tmp / "groups", "image_groups", st.NAME, records, shard_size=4)
    bad = {r["sample_id"] for r in records if r["source_id"] in ("f.jpg", "g_thin.png", "h_wide.png")}
    assert sorted(_stored(art)) == sorted(r["sample_id"] for r in records if r["sample_id"] not in bad)
    failed = {e["sample_id"] for e in art.errors().to_pylist() if e["reason"] == "model_failed"}
    assert failed == {r["sample_id"] for r in records if r["source_id"] in ("g_thin.png", "h_wide.png")}


@pytest.mark.slow
def test_visual_tokens_failing_image_is_rejected_alone(extremes):
    from pipeline.stages import extract_visual_tokens as st

    tmp, records = extremes
    cfg = st.Config(segmenter="sam", relations="geometric", embedding="mask_pool", batch_size=3, shard_size=4,
                    points_per_side=4, points_per_batch=8, pred_iou_thresh=-100, stability_score_thresh=0,
                    score_threshold=-100, min_side=1).model_dump(mode="json")
    cfg["predicates"] = "psg56"
    worker = st.VisualTokenWorker(cfg, {"sam": "tiny-random", "predicate_encoder": "tiny-random"}, 1)
    real = worker.segmenter.segment

    def segment(images, anns=None):  # a fault on the constant-colour (thin / wide) images
        if any(im.std() == 0 for im in images):
            raise RuntimeError("cannot segment a constant image")
        return real(images, anns)

    worker.segmenter.segment = segment
    art = _run_worker(worker, tmp / "vt", "visual_tokens", st.NAME, records, shard_size=4)
    bad = {r["sample_id"]: r["source_id"] for r in records if r["source_id"] in ("f.jpg", "g_thin.png", "h_wide.png")}
    assert sorted(_stored(art)) == sorted(r["sample_id"] for r in records if r["sample_id"] not in bad)
    errs = {e["sample_id"]: e["reason"] for e in art.errors().to_pylist()}
    assert errs == {sid: ("unreadable_image" if src == "f.jpg" else "segmentation_failed") for sid, src in bad.items()}


def test_unit_exception_is_contained_as_one_line_naming_the_unit(tmp_path, monkeypatch):
    import json as _json

    import pandas as pd

    import pipeline.stage as stage
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.runtime import _ActorEntry, _contained
    from pipeline.stage import RunContext, run_units

    def boom(payload):
        raise RuntimeError("Input and output sizes should be greater than 0\n<500 lines>")

    assert _contained(boom, {"unit": "00003"}) == {"unit": "00003", "failed": "RuntimeError: Input and output sizes should be greater than 0"}

    class NoModel:
        def __init__(self, spec):
            raise OSError(f"{spec} is not a local folder and is not a valid model identifier")

    entry = _ActorEntry(NoModel, {"spec": "x/y"})
    out = _json.loads(entry(pd.DataFrame({"payload": [_json.dumps({"unit": "00001"})]}))["result"].iloc[0])
    assert out == {"unit": "00001", "failed": "the worker could not start: OSError: x/y is not a local folder and is not a valid model identifier"}

    # the driver turns failed units into one StageError line naming the first
    def fake_map_units(pending, fn, **kw):
        return iter([_contained(boom, p) for p in pending])

    monkeypatch.setattr(stage, "map_units", fake_map_units)
    w = ArtifactWriter(tmp_path, "regions", "extract-regions", {})
    ctx = RunContext(manifest=None)
    ctx.stage_cfg = None
    monkeypatch.setattr(RunContext, "ray_cfg", property(lambda self: None))
    with pytest.raises(StageError) as e:
        run_units(ctx, w, [("00000", 0, {}), ("00001", 1, {})], boom)
    assert str(e.value) == ("extract-regions: unit 00000 of regions failed: RuntimeError: Input and output sizes should be "
                            "greater than 0 (and 1 more units); completed units are kept, a rerun resumes from them")


@pytest.mark.slow
def test_extreme_aspect_images_pass_clip_and_groups_unpoisoned(extremes):
    """Without an injected fault, the real (tiny-random) CLIP and GroupViT stages take the 1x300 and
    2000x1 images (their processors resize the short side and crop): stored like the good ones;
    only the corrupt file is rejected. The regions stage's detector is the one that fails on them
    (test_regions_extreme_aspect_image_is_rejected_alone)."""
    from pipeline.stages import extract_clip_tokens as sc
    from pipeline.stages import extract_image_groups as sg

    tmp, records = extremes
    corrupt = {r["sample_id"] for r in records if r["source_id"] == "f.jpg"}
    want = sorted(r["sample_id"] for r in records if r["sample_id"] not in corrupt)
    for name, worker, art_name, stage in (
            ("clip", sc.ClipTokenWorker("tiny-random", "cpu", 1, 3, 3, 48, False), "clip_tokens", sc.NAME),
            ("groups", sg.GroupWorker("tiny-random", "cpu", 1, 3), "image_groups", sg.NAME)):
        art = _run_worker(worker, tmp / f"{name}-native", art_name, stage, records, shard_size=4)
        assert sorted(_stored(art)) == want, name
        assert [(e["sample_id"], e["reason"]) for e in art.errors().to_pylist()] == [(min(corrupt), "unreadable_image")]
