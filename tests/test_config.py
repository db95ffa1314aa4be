"""Manifest loading: defaults, overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from pipeline.config import ManifestError, load_manifest
from tests.conftest import REPO


def test_demo_and_coco_manifests_load():
    demo = load_manifest(REPO / "manifests" / "demo.yaml")
    assert demo.dataset.kind == "synthetic" and demo.ray.address is None
    coco = load_manifest(REPO / "manifests" / "coco.yaml")
    # COCO through Karpathy's split file: trains on train + restval, evaluates on the 5K test split
    assert coco.dataset.kind == "karpathy" and coco.ray.address == "auto"
    assert {b.format for b in coco.eval.benchmarks} >= {"retrieval"}
    assert coco.models.clip == "openai/clip-vit-base-patch16"


def test_set_overrides_use_yaml_scalars():
    m = load_manifest(REPO / "manifests" / "demo.yaml", ["dataset.synthetic.n_images=7", "ray.address=null", "name=x y"])
    assert m.dataset.synthetic.n_images == 7 and m.ray.address is None and m.name == "x y"


def test_trainer_amp_off_survives_yaml(tmp_path):
    """YAML 1.1 reads a bare `off` as false: `amp: off` must still mean "off", from a file or --set."""
    m = load_manifest(None, ["train.concept_ot.amp=off"])
    assert m.train.concept_ot.amp == "off"
    f = tmp_path / "m.yaml"
    f.write_text("train:\n  concept_ot:\n    amp: off\n")
    assert load_manifest(f).train.concept_ot.amp == "off"
    assert load_manifest(None, ["train.concept_ot.amp=bf16"]).train.concept_ot.amp == "bf16"
    with pytest.raises(ManifestError, match="amp"):
        load_manifest(None, ["train.concept_ot.amp=true"])


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: x\nstages:\n  ingest: {shard_sise: 3}\n")
    with pytest.raises(ManifestError, match=r"unknown key 'stages\.ingest\.shard_sise'"):
        load_manifest(p)


def test_unknown_top_level_and_wrong_type(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("nmae: x\n")
    with pytest.raises(ManifestError, match="unknown key 'nmae'"):
        load_manifest(p)
    with pytest.raises(ManifestError, match=r"key 'dataset\.synthetic\.n_images'.*integer"):
        load_manifest(None, ["dataset.synthetic.n_images=many"])
    with pytest.raises(ManifestError, match="kind"):
        load_manifest(None, ["dataset.kind=imagenet"])


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(p)
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "nope.yaml")
    with pytest.raises(ManifestError, match="KEY=VALUE"):
        load_manifest(None, ["stages.ingest"])
