"""The image-stage actor base (issue 28): a stage that says only its model call gets the unit's
decoding, error policy, batching, shard and tables from :class:`ImageActor` (no model needed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import Artifact, ArtifactWriter
from pipeline.io.wds import iter_shard
from pipeline.stages._image_actor import ImageActor, f16_list, images_table
from pipeline.stages._image_units import image_units
from tests.test_clip_tokens import folder_records, make_image_folder


class MeanColour(ImageActor):
    """A toy stage: each image's mean colour; fails on images narrower than 40 pixels."""

    encode_stat = "colour_s"

    def load(self, spec, device):
        self.loaded = getattr(self, "loaded", 0) + 1
        self.batches = []

    def prepare(self, images):
        return [np.asarray(im, np.float32) for im in images]

    def encode(self, records, arrays):
        self.batches.append([r["sample_id"] for r in records])
        if any(a.shape[1] < 40 for a in arrays):
            raise ValueError("too narrow")
        return [{"image_embed.npy": a.mean(axis=(0, 1)).astype(np.float16)} for a in arrays]

    def complete(self, done, stats):
        stats["pixels"] = 1
        return done

    def tables(self, done, shard):
        return {"images": images_table(done, shard, 3)}


def test_base_runs_a_stage_that_only_says_its_model_call(tmp_path):
    folder = make_image_folder(tmp_path / "imgs")  # a 120x90, 64x64, 50x140, 200x100, 33x47 image and a corrupt file
    records = folder_records(folder)
    actor = MeanColour("none", "cpu", 1, batch_size=3)
    assert actor.loaded == 1 and actor.batch_size == 3
    writer = ArtifactWriter(tmp_path / "out", "colours", "toy", {})
    names = []
    for name, unit_input, payload in image_units(records, 6):
        fp = writer.unit_fingerprint(name, unit_input)
        res = actor(dict(payload, artifact_dir=str(writer.dir), stage="toy", unit=name, fingerprint=fp))
        names.append(name)
    writer.finalize(names)
    art = Artifact(writer.dir)
    by_src = {r["source_id"]: r["sample_id"] for r in records}
    stored = {int(s["__key__"]): s for p in art.files("shards") for s in iter_shard(p)}
    kept = [by_src[f] for f in ("a.jpg", "b.png", "c.png", "d.jpg")]
    assert sorted(stored) == kept
    errors = {(e["sample_id"], e["reason"]) for e in art.errors().to_pylist()}
    assert errors == {(by_src["e.jpg"], "model_failed"), (by_src["f.jpg"], "unreadable_image")}
    # batches of 3 records (f.jpg dropped by decoding); the failing batch is retried sample by
    # sample, then without e.jpg
    a, b, c, d, e = (by_src[f] for f in ("a.jpg", "b.png", "c.png", "d.jpg", "e.jpg"))
    assert actor.batches == [[a, b, c], [d, e], [d], [e], [d]]
    from pipeline.readers.images import open_image

    want = np.asarray(open_image(str(folder / "d.jpg")), np.float32).mean(axis=(0, 1)).astype(np.float16)
    assert np.array_equal(stored[by_src["d.jpg"]]["image_embed.npy"], want)
    table = art.read("images")
    assert table.column("sample_id").to_pylist() == kept and table.column("shard").to_pylist() == ["shards/00000.tar"] * 4
    stats = res["stats"]
    assert stats["rows"] == 4 and stats["rejected"] == 2 and stats["pixels"] == 1
    assert {"decode_s", "colour_s", "write_s"} <= set(stats)


def test_images_table_of_an_empty_unit_keeps_its_width():
    t = images_table([], "shards/00000.tar", 7)
    assert t.num_rows == 0 and t.schema.field("image_embed").type == pa.list_(pa.float16(), 7)
    assert f16_list(np.ones((2, 3))).to_pylist() == [[1.0] * 3] * 2
