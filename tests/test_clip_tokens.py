"""extract-clip-tokens: stored tokens equal a direct forward pass of tiny CLIP (fp16 tolerance),
shapes/dtypes/masks, truncation to 48 tokens, errors, resume, and the batch loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.io.artifacts import Artifact
from pipeline.io.wds import iter_shard
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest

LONG = " ".join(["a small red cube sits to the left of a large blue sphere"] * 8)  # > 48 tokens


def make_image_folder(root):
    """Real image files of mixed sizes and modes, one corrupt file, captions.tsv."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    specs = [
        ("a.jpg", (120, 90), "RGB"),
        ("b.png", (64, 64), "RGBA"),
        ("c.png", (50, 140), "L"),
        ("d.jpg", (200, 100), "RGB"),
        ("e.jpg", (33, 47), "RGB"),
    ]
    for name, (w, h), mode in specs:
        arr = rng.integers(0, 255, (h, w, {"RGB": 3, "RGBA": 4, "L": 1}[mode]), dtype=np.uint8)
        Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode).save(root / name)
    (root / "f.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    lines = [
        "a.jpg\ta red square",
        "a.jpg\ttwo blue circles near a green triangle",
        "b.png\ta photo",
        "c.png\t" + LONG,
        "c.png\tgrey noise",
        "d.jpg\tthe quick brown fox jumps over the lazy dog",
        "e.jpg\ttiny",
        "f.jpg\ta broken file",
    ]
    (root / "captions.tsv").write_text("\n".join(lines) + "\n")
    return root


def folder_records(folder):
    """What ingest would hand over for the folder (sample ids in file order), built by hand."""
    caps: dict[str, list[str]] = {}
    for line in (folder / "captions.tsv").read_text().splitlines():
        f, t = line.split("\t")
        caps.setdefault(f, []).append(t)
    recs, cid = [], 0
    for sid, f in enumerate(sorted(caps)):
        recs.append({"sample_id": sid, "source_id": f, "image": str(folder / f), "captions": [[cid + k, t] for k, t in enumerate(caps[f])]})
        cid += len(caps[f])
    return recs


def run_in_process(out_dir, records, shard_size=2, batch_size=3, text_batch_size=3):
    """The stage's worker called directly (no Ray): same code path as one actor."""
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages import extract_clip_tokens as st
    from pipeline.stages._image_units import image_units

    worker = st.ClipTokenWorker("tiny-random", "cpu", 1, batch_size, text_batch_size, 48, False)
    writer = ArtifactWriter(out_dir, "clip_tokens", st.NAME, {"shard_size": shard_size}, models={"clip": worker.record})
    names = []
    for name, unit_input, payload in image_units(records, shard_size):
        fp = writer.unit_fingerprint(name, unit_input)
        worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint=fp))
        names.append(name)
    writer.finalize(names, schema=st.SCHEMA)
    return Artifact(writer.dir)


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clipdirect")
    folder = make_image_folder(tmp / "imgs")
    records = folder_records(folder)
    return records, run_in_process(tmp / "out", records)


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("clip")
    folder = make_image_folder(tmp / "imgs")
    ov = [
        "ray.actors=1",
        "dataset.kind=folder",
        f"dataset.images={folder}",
        "stages.ingest.verify_images=none",  # let the corrupt file through, so the CLIP stage must catch it
        "stages.ingest.shard_size=4",
        "stages.extract_clip_tokens.shard_size=2",
        "stages.extract_clip_tokens.batch_size=3",
        "stages.extract_clip_tokens.text_batch_size=3",
    ]
    m = make_manifest(tmp, ov)
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-clip-tokens", RunContext(m))
    return m, summary, Artifact(tmp / "run" / "clip_tokens"), Artifact(tmp / "run" / "samples")


def _stored(art):
    out = {}
    for p in art.files("shards"):
        for s in iter_shard(p):
            out[int(s["__key__"])] = s
    return out


def test_errors_name_the_sample(direct):
    records, art = direct
    errs = art.errors().to_pylist()
    assert [e["reason"] for e in errs] == ["unreadable_image"]
    bad = next(r for r in records if r["image"].endswith("f.jpg"))
    assert errs[0]["sample_id"] == bad["sample_id"] and "f.jpg" in errs[0]["detail"]
    assert art.manifest["tables"]["shards"]["files"] == 3  # 6 samples / shard_size 2: bounded shards
    assert art.manifest["tables"]["shards"]["rows"] == 5


@pytest.mark.slow
def test_stage_on_ray_summary_errors_and_provenance(clip_run):
    _, summary, art, samples = clip_run
    assert summary["samples"] == 5 and summary["captions"] == 7
    errs = art.errors().to_pylist()
    assert [e["reason"] for e in errs] == ["unreadable_image"]
    bad = samples.read("samples").to_pylist()
    bad_id = next(r["sample_id"] for r in bad if r["image"].endswith("f.jpg"))
    assert errs[0]["sample_id"] == bad_id and "f.jpg" in errs[0]["detail"]
    m = art.manifest
    assert m["random_weights"] == ["clip"] and m["models"]["clip"]["spec"] == "tiny-random"
    assert m["dims"]["n_patches"] == 16 and m["schema"]["patch_tokens.npy"].startswith("float16")
    assert m["tables"]["shards"]["files"] == 3  # 6 samples / shard_size 2: bounded shards


def test_stored_features_equal_direct_forward(direct):
    """Independent path: the HF model's own get_image_features / get_text_features, one input at a time."""
    from pipeline.models.clip import load_clip
    from pipeline.readers.images import open_image

    records, art = direct
    model, processor, tok, _ = load_clip("tiny-random")
    stored = _stored(art)
    caps = [{"caption_id": c, "sample_id": r["sample_id"], "text": t} for r in records for c, t in r["captions"]]
    refs = {r["sample_id"]: r["image"] for r in records}
    assert len(stored) == 5
    for sid, s in stored.items():
        pv = processor(images=[open_image(refs[sid])], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            vout = model.vision_model(pixel_values=pv, output_hidden_states=True)
            img = model.get_image_features(pixel_values=pv).pooler_output[0]
        # the encoder's last hidden state, independently: the last element of hidden_states
        ref_patches = vout.hidden_states[-1][0, 1:]
        assert s["patch_tokens.npy"].dtype == np.float16 and s["patch_tokens.npy"].shape == (16, 48)
        np.testing.assert_allclose(s["patch_tokens.npy"].astype(np.float32), ref_patches.numpy(), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(s["image_embed.npy"].astype(np.float32), img.numpy(), rtol=2e-3, atol=2e-3)
        mine = [c for c in caps if c["sample_id"] == sid]
        assert s["caption_ids.npy"].tolist() == [c["caption_id"] for c in mine]
        for j, c in enumerate(mine):
            enc = tok([c["text"]], truncation=True, max_length=48, return_tensors="pt")
            n = enc["input_ids"].shape[1]
            with torch.no_grad():
                tout = model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            assert s["text_mask.npy"][j].sum() == n and s["text_mask.npy"][j, :n].all()
            np.testing.assert_array_equal(s["token_ids.npy"][j, :n], enc["input_ids"][0].numpy())
            np.testing.assert_allclose(
                s["text_tokens.npy"][j, :n].astype(np.float32), tout.last_hidden_state[0].numpy(), rtol=2e-3, atol=2e-3
            )
            np.testing.assert_allclose(s["text_embed.npy"][j].astype(np.float32), tout.pooler_output[0].numpy(), rtol=2e-3, atol=2e-3)
            assert not s["text_tokens.npy"][j, n:].any()  # zero beyond the mask


def test_truncation_offsets_and_tables(direct):
    from pipeline.models.clip import offline_tokenizer

    records, art = direct
    tok = offline_tokenizer()
    stored = _stored(art)
    caps = {c: {"sample_id": r["sample_id"], "text": t} for r in records for c, t in r["captions"]}
    long_cid = next(cid for cid, c in caps.items() if c["text"] == LONG)
    sid = caps[long_cid]["sample_id"]
    s = stored[sid]
    j = s["caption_ids.npy"].tolist().index(long_cid)
    assert s["text_mask.npy"][j].sum() == 48 and s["text_mask.npy"].shape[1] == 48
    assert s["token_ids.npy"][j, 47] == tok.sep_token_id  # EOS kept after truncation
    # offsets point at the token's characters in the caption
    text = caps[long_cid]["text"]
    start, end = s["token_offsets.npy"][j, 1]
    assert text[start:end] == "a"
    # Parquet side tables agree with the shards
    imgs = {r["sample_id"]: r for r in art.read("images").to_pylist()}
    assert set(imgs) == set(stored)
    for k, s in stored.items():
        np.testing.assert_array_equal(np.array(imgs[k]["image_embed"], np.float16), s["image_embed.npy"])
        assert (art.dir / imgs[k]["shard"]).is_file()
    capt = art.read("captions").to_pylist()
    assert len(capt) == 7 and sorted(r["caption_id"] for r in capt) == sorted(c for c in caps if caps[c]["sample_id"] in stored)
    assert all(r["n_tokens"] <= 48 for r in capt)


@pytest.mark.slow
def test_rerun_skips_and_deleted_shard_is_redone(clip_run):
    m, _, art, _ = clip_run
    state = art.dir / "_state"
    before = {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
    shards = sorted(art.files("shards"))
    digest = {p.name: p.read_bytes() for p in shards}
    shards[1].unlink()
    run_stage("extract-clip-tokens", RunContext(m))
    after = {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
    changed = [k for k in before if before[k] != after[k]]
    assert changed == ["00001.json"]
    assert shards[1].read_bytes() == digest[shards[1].name]  # byte-identical redo


def test_loader_batches_match_shards(direct):
    from pipeline.io.shards import ShardStream, loader
    from pipeline.loaders.clip_tokens import collate, read_shard, shard_reader

    _, art = direct
    stored = _stored(art)
    # zero-copy reader == tarfile reader
    for p in art.files("shards"):
        for s in read_shard(p, fields=None):
            ref = stored[s["sample_id"]]
            for k, v in ref.items():
                if k.endswith(".npy"):
                    np.testing.assert_array_equal(s[k[:-4]], v)
                    assert s[k[:-4]].dtype == v.dtype
    # lazy (pread) reader == tarfile reader
    for p in art.files("shards"):
        for s in read_shard(p, fields=None, lazy=True):
            ref = stored[s["sample_id"]]
            for k, v in ref.items():
                if k.endswith(".npy"):
                    got = np.asarray(s[k[:-4]])
                    np.testing.assert_array_equal(got, v)
                    assert got.dtype == v.dtype and got.shape == v.shape
    shards = art.files("shards")

    def stream(captions, batch_size=2, shuffle=False, seed=0):
        return ShardStream(shards, shard_reader(shards), lambda s, rng: collate(s, captions, rng), batch_size,
                           shuffle=shuffle, seed=seed, drop_last=False,
                           keep=lambda s: captions == "all" or s["caption_ids"].shape[0] > 0)

    threaded = list(loader(stream("first"), num_workers=2))  # batches read by two worker processes
    ids = [i for b in threaded for i in b["sample_id"].tolist()]
    assert sorted(ids) == sorted(stored)
    for b in threaded:
        for i, sid in enumerate(b["sample_id"].tolist()):
            np.testing.assert_array_equal(b["patch_tokens"][i].numpy(), stored[sid]["patch_tokens.npy"])
            assert b["caption_id"][i] == stored[sid]["caption_ids.npy"][0]
    batches = list(stream("all"))
    assert [b["sample_id"].shape[0] for b in batches] == [2, 2, 1]
    for b in batches:
        for i, sid in enumerate(b["sample_id"].tolist()):
            ref = stored[sid]
            np.testing.assert_array_equal(b["patch_tokens"][i].numpy(), ref["patch_tokens.npy"])
            rows = (b["caption_sample"] == i).nonzero().flatten().tolist()
            assert b["caption_id"][rows].tolist() == ref["caption_ids.npy"].tolist()
            for j, r in enumerate(rows):
                n = int(ref["text_mask.npy"][j].sum())
                assert b["text_mask"][r].sum() == n
                np.testing.assert_array_equal(b["text_tokens"][r, :n].numpy(), ref["text_tokens.npy"][j, :n])
                assert not b["text_tokens"][r, n:].any()
    one = list(stream("random", batch_size=4, shuffle=True, seed=3))
    ids = torch.cat([b["sample_id"] for b in one]).tolist()
    assert sorted(ids) == sorted(stored)
    for b in one:
        assert b["text_tokens"].shape[0] == b["sample_id"].shape[0]
        for i, (sid, cid) in enumerate(zip(b["sample_id"].tolist(), b["caption_id"].tolist())):
            assert cid in stored[sid]["caption_ids.npy"].tolist()
