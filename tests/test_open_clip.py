"""``models.clip: open_clip:<arch>[/<checkpoint>]`` (pipeline/models/open_clip_adapter.py): open_clip's
factory and tokenizer behind the CLIP adapter, checked against open_clip's own encode_image /
encode_text; random weights recorded as such, a local checkpoint file loaded and hashed; the
extract-clip-tokens stage on it; bad specs in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.models.clip import encode_images, encode_texts, load_clip, preprocess_images
from pipeline.models.provenance import weights_hash

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "ViT-S-32-alt"  # open_clip's smallest ViT CLIP: 224 px, 32 px patches (49) x 384; text 256; joint 256
TEXTS = ["A red bus parked by the road.", "two dogs, a cat and a very long caption " + "word " * 80, "x"]


@pytest.fixture(scope="module")
def random_clip():
    return load_clip(f"open_clip:{ARCH}")


def _images():
    return [Image.new("RGB", (300 + 20 * i, 200), (40 * i, 120, 200 - 30 * i)) for i in range(3)]


def test_random_weights_recorded_and_dims_from_the_arch(random_clip):
    model, proc, tok, rec = random_clip
    assert rec["random_weights"] is True and rec["backend"] == "open_clip" and rec["spec"] == f"open_clip:{ARCH}"
    assert {k: rec[k] for k in ("image_size", "patch_size", "n_patches", "vision_dim", "text_dim", "projection_dim")} == \
        {"image_size": 224, "patch_size": 32, "n_patches": 49, "vision_dim": 384, "text_dim": 256, "projection_dim": 256}
    # seeded: a second load is the same model
    assert load_clip(f"open_clip:{ARCH}")[3]["weights_sha256"] == rec["weights_sha256"]


def test_encodings_match_open_clips_own(random_clip):
    import open_clip

    model, proc, tok, _ = random_clip
    pv = preprocess_images(proc, _images())
    out = encode_images(model, pv)
    assert out["patch_tokens"].shape == (3, 49, 384) and out["image_embed"].shape == (3, 256)
    assert torch.allclose(out["image_embed"], model.model.encode_image(pv), atol=1e-5)
    assert encode_images(model, pv, project_tokens=True)["patch_tokens"].shape == (3, 49, 256)
    t = encode_texts(model, tok, TEXTS, max_tokens=77, return_offsets=True)
    ref_ids = open_clip.get_tokenizer(ARCH)(TEXTS)
    assert torch.allclose(t["text_embed"], model.model.encode_text(ref_ids), atol=1e-5)
    n = t["text_mask"].sum(1)
    assert n.tolist() == [int((r != 0).sum()) for r in ref_ids] and n[1] == 77  # the long one truncated, EOT kept
    assert t["input_ids"][1, 76] == 49407 and t["text_tokens"].shape == (3, 77, 256)
    # offsets slice each word token's text out of the caption
    off = t["offsets"][0]
    assert [TEXTS[0][a:b] for a, b in off[1:int(n[0]) - 1].tolist()] == ["A", "red", "bus", "parked", "by", "the", "road", "."]
    # at 48 tokens (the stage's default), the valid prefix is the same computation
    t48 = encode_texts(model, tok, TEXTS, max_tokens=48)
    assert t48["text_mask"].sum(1).tolist() == [10, 48, 3]
    assert torch.allclose(t48["text_tokens"][0, :10], t["text_tokens"][0, :10], atol=1e-5)


def test_local_checkpoint_file(random_clip, tmp_path):
    model, proc, tok, rec = random_clip
    ckpt = tmp_path / "b.bin"
    torch.save(model.model.state_dict(), ckpt)
    m2, p2, t2, rec2 = load_clip(f"open_clip:{ARCH}/{ckpt}")  # an absolute path: open_clip:<arch>//abs/path
    assert rec2["random_weights"] is False and rec2["weights_sha256"] == weights_hash([ckpt])
    pv = preprocess_images(p2, _images())
    assert torch.allclose(encode_images(m2, pv)["image_embed"], encode_images(model, pv)["image_embed"], atol=1e-6)


@pytest.mark.parametrize("spec,msg", [
    ("open_clip:ViT-B-61", "'open_clip:ViT-B-61': unknown open_clip arch 'ViT-B-61'; did you mean 'ViT-B-16'?"),
    ("open_clip:ViT-B-16/nowhere.bin", "'open_clip:ViT-B-16/nowhere.bin': 'nowhere.bin' is neither a checkpoint file "
                                       "nor an open_clip pretrained tag of ViT-B-16"),
    ("open_clip:RN50", "open_clip:RN50: CLIP with a ModifiedResNet image tower is not supported"),
])
def test_bad_specs_one_line(spec, msg):
    with pytest.raises(ValueError) as e:
        load_clip(spec)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_extract_clip_tokens_stage_on_open_clip(tmp_path, ray_session):
    from pipeline.io.artifacts import Artifact
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=6", "dataset.synthetic.corrupt_images=0",
                                 "dataset.synthetic.empty_captions=0", f"models.clip=open_clip:{ARCH}",
                                 "stages.extract_clip_tokens.shard_size=8", "ray.num_cpus=1"])
    ctx = RunContext(m)
    run_stage("ingest", ctx)
    s = run_stage("extract-clip-tokens", ctx)
    art = Artifact(tmp_path / "run" / "clip_tokens")
    man = art.manifest
    assert man["dims"]["n_patches"] == 49 and man["dims"]["vision_dim"] == 384 and man["dims"]["text_dim"] == 256
    assert man["random_weights"] == ["clip"] and man["models"]["clip"]["spec"] == f"open_clip:{ARCH}"
    assert man["models"]["clip"]["backend"] == "open_clip"
    assert s["captions"] == 30
    emb = np.stack(art.read("images", ["image_embed"]).column("image_embed").to_numpy(zero_copy_only=False))
    assert emb.shape == (6, 256) and np.isfinite(emb).all()
