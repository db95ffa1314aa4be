"""Kept shard maps: same batches as the pread path, and a rewritten shard is never served stale
(:mod:`pipeline.io.shards` under the clip_tokens loader)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.io.shards import ShardStream, close_mappings, fits_in_memory
from pipeline.loaders.clip_tokens import collate, read_shard, shard_reader


def _write(root, seed: int, n: int = 10):
    rng = np.random.default_rng(seed)
    shard = root / "shards" / "00000.tar"
    shard.parent.mkdir(parents=True, exist_ok=True)
    with ShardWriter(shard) as w:
        for sid in range(n):
            c, m = 2, 5
            mask = np.zeros((c, m), bool)
            mask[0, :3] = mask[1, :5] = True
            w.write(sample_key(sid), {
                "patch_tokens.npy": rng.standard_normal((4, 8)).astype(np.float16),
                "image_embed.npy": rng.standard_normal(6).astype(np.float16),
                "text_tokens.npy": (rng.standard_normal((c, m, 7)) * mask[..., None]).astype(np.float16),
                "text_mask.npy": mask,
                "text_embed.npy": rng.standard_normal((c, 6)).astype(np.float16),
                "caption_ids.npy": np.arange(2 * sid, 2 * sid + c, dtype=np.int64),
            })
    (root / "_manifest.json").write_text(json.dumps({
        "artifact": "clip_tokens", "tables": {"shards": {}},
        "shards": [{"table": "shards", "path": "shards/00000.tar"}],
    }))
    return shard


def _batches(root, mapped):
    shards = [root / "shards" / "00000.tar"]
    return list(ShardStream(shards, shard_reader(shards, mapped), lambda s, rng: collate(s, "all", rng), 4,
                            shuffle=False, seed=3, drop_last=False))


def test_mapped_and_pread_batches_are_identical(tmp_path):
    _write(tmp_path, 0)
    close_mappings()
    a, b = _batches(tmp_path, True), _batches(tmp_path, False)
    again = _batches(tmp_path, True)  # second epoch through the kept maps
    assert len(a) == len(b) == 3
    for x, y, z in zip(a, b, again):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) and torch.equal(x[k], z[k]), k


def test_rewritten_shard_is_remapped(tmp_path):
    shard = _write(tmp_path, 0)
    first = [s["patch_tokens"].copy() for s in read_shard(shard)]
    st = os.stat(shard)
    _write(tmp_path, 1)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = [s["patch_tokens"].copy() for s in read_shard(shard)]
    assert not np.array_equal(first[0], second[0])
    fresh = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float16)
    np.testing.assert_array_equal(second[0], fresh)


def test_fields_filter_and_fresh_dicts(tmp_path):
    shard = _write(tmp_path, 0)
    s = next(read_shard(shard, fields=("caption_ids",)))
    assert set(s) == {"__key__", "sample_id", "caption_ids"}
    s["scribble"] = 1
    assert "scribble" not in next(read_shard(shard, fields=None))
    # the same field selection again (cached per mapping): a fresh dict, not the one changed above
    assert set(next(read_shard(shard, fields=("caption_ids",)))) == {"__key__", "sample_id", "caption_ids"}
    assert set(next(read_shard(shard, fields=("caption_ids", "text_mask")))) == {"__key__", "sample_id", "caption_ids",
                                                                                 "text_mask"}


def test_fits_in_memory_by_size(tmp_path):
    shard = _write(tmp_path, 0)
    assert fits_in_memory([shard])
    assert not fits_in_memory([shard], fraction=0.0)
