"""extract-image-groups: stored groups equal a direct tiny-GroupViT forward (fp16 tolerance), with
the group maps checked against transformers' own get_grouping_from_attentions; stage on Ray + resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import Artifact
from pipeline.io.wds import iter_shard
from tests.test_clip_tokens import folder_records, make_image_folder


def run_in_process(out_dir, records, shard_size=2, batch_size=3):
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages import extract_image_groups as st
    from pipeline.stages._image_units import image_units

    worker = st.GroupWorker("tiny-random", "cpu", 1, batch_size)
    writer = ArtifactWriter(out_dir, "image_groups", st.NAME, {"shard_size": shard_size}, models={"groupvit": worker.record})
    names = []
    for name, unit_input, payload in image_units(records, shard_size):
        fp = writer.unit_fingerprint(name, unit_input)
        worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint=fp))
        names.append(name)
    writer.finalize(names, schema=st.SCHEMA)
    return Artifact(writer.dir)


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    records = folder_records(make_image_folder(tmp / "imgs"))
    return records, run_in_process(tmp / "out", records)


def test_groups_equal_direct_forward(direct):
    from transformers.models.groupvit.modeling_groupvit import get_grouping_from_attentions

    from pipeline.models.groupvit import load_groupvit
    from pipeline.readers.images import open_image

    records, art = direct
    model, processor, rec = load_groupvit("tiny-random")
    stored = {int(s["__key__"]): s for p in art.files("shards") for s in iter_shard(p)}
    good = [r for r in records if not r["image"].endswith("f.jpg")]
    assert sorted(stored) == [r["sample_id"] for r in good]
    errs = art.errors().to_pylist()
    assert len(errs) == 1 and errs[0]["reason"] == "unreadable_image"
    k, n, d, p = rec["n_groups"], rec["n_patches"], rec["group_dim"], rec["projection_dim"]
    for r in good:
        s = stored[r["sample_id"]]
        pv = processor(images=[open_image(r["image"])], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.vision_model(pixel_values=pv, output_attentions=True)
            maps = get_grouping_from_attentions(out.attentions, rec["grid"])  # HF's own group maps
            emb = model.get_image_features(pixel_values=pv).pooler_output[0]
            proj = torch.stack([model.visual_projection(g[None])[0] for g in out.last_hidden_state[0]])
        assert s["groups.npy"].shape == (k, d) and s["groups.npy"].dtype == np.float16
        assert s["assign.npy"].shape == (k, n) and s["groups_projected.npy"].shape == (k, p)
        tol = dict(rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(s["groups.npy"].astype(np.float32), out.last_hidden_state[0].numpy(), **tol)
        np.testing.assert_allclose(s["groups_projected.npy"].astype(np.float32), proj.numpy(), **tol)
        np.testing.assert_allclose(s["image_embed.npy"].astype(np.float32), emb.numpy(), **tol)
        np.testing.assert_allclose(s["assign.npy"].astype(np.float32), maps[0].reshape(k, n).numpy(), **tol)
        np.testing.assert_allclose(s["assign.npy"].astype(np.float32).sum(0), 1.0, atol=3e-3)  # soft assignment per patch
    tab = {r["sample_id"]: r for r in art.read("images").to_pylist()}
    for sid, s in stored.items():
        np.testing.assert_array_equal(np.array(tab[sid]["image_embed"], np.float16), s["image_embed.npy"])


@pytest.mark.slow
def test_stage_on_ray_and_resume(tmp_path, ray_session):
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    folder = make_image_folder(tmp_path / "imgs")
    ov = [
        "ray.actors=1",
        "dataset.kind=folder",
        f"dataset.images={folder}",
        "stages.ingest.verify_images=none",
        "stages.extract_image_groups.shard_size=2",
    ]
    m = make_manifest(tmp_path, ov)
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-image-groups", RunContext(m))
    assert summary["samples"] == 5 and summary["errors"] == 1
    art = Artifact(tmp_path / "run" / "image_groups")
    assert art.manifest["random_weights"] == ["groupvit"] and art.manifest["dims"]["grid"] == [4, 4]
    markers = {p.name: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")}
    run_stage("extract-image-groups", RunContext(m))
    assert {p.name: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")} == markers


def test_scene_oracle_groups_are_the_objects():
    """`scene-oracle` groups: one per object (its vector + the sample's noise), background noise after,
    merged smallest-first past K; the assignment follows the boxes on the patch grid."""
    from pipeline.models.groupvit import ORACLE_GROUPS, oracle_groups
    from pipeline.models.scene_oracle import SceneObject, SceneOracle

    o = SceneOracle()
    objs = [SceneObject("circle", "red", "large", (0, 0, 60, 60)), SceneObject("square", "blue", "small", (96, 96, 128, 128))]
    f = oracle_groups(o, objs, 128, 128, sample_id=3)
    assert f["groups"].shape == (ORACLE_GROUPS, o.d_v) and f["assign"].shape == (ORACLE_GROUPS, o.grid ** 2)
    assert f["groups_projected"].shape == (ORACLE_GROUPS, o.proj) and f["image_embed"].shape == (o.proj,)
    cos = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    assert cos(f["groups"][0], o.object_vector(objs[0])) > 0.8 and cos(f["groups"][1], o.object_vector(objs[1])) > 0.8
    assert np.linalg.norm(f["groups"][2:], axis=1).max() < 0.5 * np.linalg.norm(o.object_vector(objs[0]))
    np.testing.assert_allclose(f["assign"].sum(0), 1.0, atol=1e-5)
    assert f["assign"][:, 0].argmax() == 0 and f["assign"][:, 15].argmax() == 1  # top-left: the circle; bottom-right: the square
    many = [SceneObject("circle", "red", "small", (0, 0, 10 + i, 10 + i)) for i in range(ORACLE_GROUPS + 2)]
    g = oracle_groups(o, many, 128, 128, sample_id=1)
    assert g["groups"].shape[0] == ORACLE_GROUPS  # the two smallest merged, twice
    np.testing.assert_allclose(g["assign"].sum(0), 1.0, atol=1e-5)


def test_scene_oracle_stage(tmp_path, ray_session):
    from pipeline.errors import StageError
    from pipeline.models.groupvit import oracle_groups
    from pipeline.models.scene_oracle import SceneOracle, objects_of
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    m = make_manifest(tmp_path, ["ray.actors=1", "models.groupvit=scene-oracle", "dataset.synthetic.n_images=12",
                                 "dataset.synthetic.corrupt_images=0", "stages.extract_image_groups.shard_size=6"])
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-image-groups", RunContext(m))
    assert summary["samples"] == 12
    art = Artifact(tmp_path / "run" / "image_groups")
    rec = art.manifest["models"]["groupvit"]
    assert rec["testbed_instrument"] is True and art.manifest["dims"]["n_groups"] == 8
    samples = Artifact(tmp_path / "run" / "samples")
    inst = samples.read("instances", ["sample_id", "instance_id", "category", "box", "attributes"]).to_pylist()
    wh = {r["sample_id"]: (r["width"], r["height"]) for r in samples.read("samples", ["sample_id", "width", "height"]).to_pylist()}
    shard = sorted((art.dir / "shards").glob("*.tar"))[0]
    fields = next(iter(iter_shard(shard)))
    sid = int(fields["__key__"])
    want = oracle_groups(SceneOracle(), objects_of(sorted((r for r in inst if r["sample_id"] == sid), key=lambda r: r["instance_id"])),
                         *wh[sid], sid)
    np.testing.assert_allclose(fields["groups.npy"].astype(np.float32), want["groups"], atol=2e-3)
    bad = make_manifest(tmp_path / "f", ["dataset.kind=folder", f"dataset.images={tmp_path}", "models.groupvit=scene-oracle"])
    with pytest.raises(StageError, match="scene-oracle is a testbed instrument"):
        run_stage("extract-image-groups", RunContext(bad))
