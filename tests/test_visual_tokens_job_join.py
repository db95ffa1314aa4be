"""train.data.ShardJoin / ShardIndex: two shard artifacts joined by sample_id (different shard
sizes and orders, samples missing on either side), exact against an in-memory join, resumable
at a batch index, identical through DataLoader workers, lazy (pread) and mapped readers alike;
and the visual_tokens loader's batches through the same resumable stream."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.io.shards import ShardStream, loader
from pipeline.loaders.clip_tokens import read_shard
from train.data import ShardIndex, ShardJoin


def _write(dirpath, ids, shard_size, make, order_seed):
    dirpath.mkdir(parents=True, exist_ok=True)
    ids = list(np.random.default_rng(order_seed).permutation(ids))
    paths = []
    for k in range(0, len(ids), shard_size):
        p = dirpath / f"shard-{k // shard_size:04d}.tar"
        with ShardWriter(p) as w:
            for sid in ids[k:k + shard_size]:
                w.write(sample_key(int(sid)), make(int(sid)))
        paths.append(str(p))
    return paths


def _a(sid):  # "visual tokens": a variable-length array (large enough to be read lazily) + a small one
    g = np.random.default_rng(sid)
    return {"tangible.npy": g.normal(size=(1 + sid % 5, 2100)).astype(np.float16), "ranks.npy": np.full((3, 3), sid % 8, np.uint8)}


def _b(sid):  # "clip tokens": captions
    g = np.random.default_rng(10_000 + sid)
    return {"text_embed.npy": g.normal(size=(sid % 3, 6)).astype(np.float16), "caption_ids.npy": np.arange(sid % 3) + 100 * sid}


@pytest.fixture(scope="module")
def two_artifacts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("join")
    ids_a = [i for i in range(200) if i % 17 != 3]  # some only in b
    ids_b = [i for i in range(200) if i % 13 != 5]  # some only in a
    return _write(tmp / "a", ids_a, 23, _a, 1), _write(tmp / "b", ids_b, 64, _b, 2), set(ids_a), set(ids_b)


def _collate(samples, rng):
    return {"sample_id": torch.tensor([s["sample_id"] for s in samples]),
            "t_sum": torch.tensor([float(np.asarray(s["tangible"], np.float64).sum()) for s in samples], dtype=torch.float64),
            "cap": [np.asarray(s["caption_ids"]).tolist() for s in samples],
            "emb": [np.asarray(s["text_embed"]).tolist() for s in samples], "r": torch.tensor([rng.random()])}


def _stream(pa, pb, lazy):
    join = ShardJoin(pb, ("text_embed", "caption_ids"), lazy=lazy)
    read = functools.partial(read_shard, fields=("tangible", "ranks"), lazy=lazy)
    return ShardStream(pa, read, _collate, 16, shuffle_buffer=40, seed=3, keep=join.keep, joins=[join]), join


@pytest.mark.parametrize("lazy", [True, False])
def test_join_exact_resumable_and_counted(two_artifacts, lazy):
    pa, pb, ids_a, ids_b = two_artifacts
    both = ids_a & ids_b
    st, join = _stream(pa, pb, lazy)
    assert st.count_batches() == len(both) // 16
    assert join.missing == ids_a - ids_b  # counted by keep
    full = list(st.set_position(2, 0))
    seen = [int(s) for b in full for s in b["sample_id"]]
    assert len(seen) == len(set(seen)) == 16 * (len(both) // 16) and set(seen) <= both
    for b in full:  # every joined field is the other artifact's value for that very sample
        for sid, ts, cap, emb in zip(b["sample_id"].tolist(), b["t_sum"].tolist(), b["cap"], b["emb"]):
            assert ts == float(_a(sid)["tangible.npy"].astype(np.float64).sum())
            assert cap == _b(sid)["caption_ids.npy"].tolist()
            assert emb == _b(sid)["text_embed.npy"].tolist()
    st2, _ = _stream(pa, pb, lazy)
    tail = list(st2.set_position(2, 4))  # resume at batch 4 of epoch 2
    assert [b["sample_id"].tolist() for b in tail] == [b["sample_id"].tolist() for b in full[4:]]
    assert [float(b["r"]) for b in tail] == [float(b["r"]) for b in full[4:]]
    st3, _ = _stream(pa, pb, lazy)
    par = list(loader(st3.set_position(2, 1), num_workers=2))
    assert [b["sample_id"].tolist() for b in par] == [b["sample_id"].tolist() for b in full[1:]]
    assert [b["cap"] for b in par] == [b["cap"] for b in full[1:]]


def test_shard_index_random_access_and_errors(two_artifacts, tmp_path):
    pa, pb, ids_a, _ = two_artifacts
    idx = ShardIndex(pa, lazy=True)
    assert len(idx) == len(ids_a) and 4 in idx and 3 not in idx
    np.testing.assert_array_equal(np.asarray(idx.read(4, ("tangible",))["tangible"]), _a(4)["tangible.npy"])
    with pytest.raises(KeyError, match="sample 3 is not in"):
        idx.read(3)
    join = ShardJoin(pb, ("caption_ids",), lazy=True)
    with pytest.raises(KeyError, match="sample 5 is not in"):
        join({"sample_id": 5})
    dup = _write(tmp_path / "dup", [1, 2], 1, _b, 0) + _write(tmp_path / "dup2", [2], 1, _b, 0)
    with pytest.raises(ValueError, match="sample_id 2 is in two shards"):
        ShardIndex(dup)


def test_mapped_join_shares_no_state_between_samples(two_artifacts):
    """Kept maps: the join merges one prepared dict per sample (views, shared across epochs);
    what a caller does to a joined sample never reaches the next join of the same id, and the
    prefix and field selection match the lazy join's."""
    pa, pb, ids_a, ids_b = two_artifacts
    sid = min(ids_a & ids_b)
    mapped = ShardJoin(pb, ("caption_ids",), prefix="ct_", lazy=False)
    lazy = ShardJoin(pb, ("caption_ids",), prefix="ct_", lazy=True)
    first = mapped({"sample_id": sid, "x": 1})
    assert set(first) == {"sample_id", "x", "ct_caption_ids"}
    first["ct_caption_ids"] = "overwritten"
    first["scribble"] = 1
    again = mapped({"sample_id": sid})
    assert set(again) == {"sample_id", "ct_caption_ids"}
    np.testing.assert_array_equal(again["ct_caption_ids"], _b(sid)["caption_ids.npy"])
    np.testing.assert_array_equal(np.asarray(lazy({"sample_id": sid})["ct_caption_ids"]), again["ct_caption_ids"])
    with pytest.raises(KeyError, match=f"sample {min(ids_a - ids_b)} is not in"):
        mapped({"sample_id": min(ids_a - ids_b)})
