"""dataset.splits (pipeline/readers/splits.py): an image's held-out split is a function of its stable key
alone -- unchanged when other images are added, removed or reordered, fractions within binomial
tolerance, every caption and every record of one image in one split -- through the real readers
(folder, CC3M TSV, img2dataset webdataset, COCO), with readers' official splits kept without it."""

from __future__ import annotations

import hashlib
import random

import pytest
from scipy.stats import binomtest

from pipeline.config import DatasetConfig, ManifestError, SplitsConfig
from pipeline.readers import read_dataset
from pipeline.readers.base import SourceRecord
from pipeline.readers.splits import assign_splits, split_of
from pipeline.synthetic.own_formats import _images_and_captions, write_cc3m, write_folder, write_webdataset


def _assign(keys, cfg):
    return {r.source_id: r.split for r in assign_splits((SourceRecord(k, None, ["c"]) for k in keys), cfg)}


def test_split_of_is_the_documented_hash():
    """Independent reference: blake2b-64 of "seed\\0key" as a fraction of 2**64, test first, then val."""
    for key in ("000000001.jpg", "https://x.org/a b.jpg", "k\u00e9y", ""):
        for seed in (0, 7):
            u = int.from_bytes(hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest(), "little") / 2**64
            want = "test" if u < 0.2 else "val" if u < 0.5 else "train"
            assert split_of(key, val=0.3, test=0.2, seed=seed) == want


def test_split_survives_added_removed_and_shuffled_images():
    cfg = SplitsConfig(val=0.1, test=0.15, seed=3)
    rng = random.Random(0)
    keys = [f"images/{rng.getrandbits(40):x}.jpg" for _ in range(3000)]
    base = _assign(keys, cfg)
    for trial in range(5):
        kept = rng.sample(keys, 2000) + [f"new/{trial}/{i}.jpg" for i in range(1500)]
        rng.shuffle(kept)
        again = _assign(kept, cfg)
        assert all(again[k] == base[k] for k in kept if k in base)
    # another seed is another partition of the same images
    other = _assign(keys, SplitsConfig(val=0.1, test=0.15, seed=4))
    assert sum(other[k] != base[k] for k in keys) > 300


@pytest.mark.parametrize("val,test", [(0.05, 0.05), (0.1, 0.2), (0.0, 0.5), (0.0, 0.0)])
def test_fractions_within_binomial_tolerance(val, test):
    n = 20000
    got = _assign([f"{i:09d}" for i in range(n)], SplitsConfig(val=val, test=test))
    counts = {s: sum(v == s for v in got.values()) for s in ("train", "val", "test")}
    for split, p in (("val", val), ("test", test), ("train", 1 - val - test)):
        if p in (0.0, 1.0):
            assert counts[split] == n * p
        else:
            assert binomtest(counts[split], n, p).pvalue > 1e-4, (split, counts)


def test_fractions_over_one_is_a_one_line_manifest_error(tmp_path):
    from pipeline.config import load_manifest

    with pytest.raises(ManifestError) as e:
        load_manifest(None, [f"output={tmp_path}", "dataset.kind=folder", "dataset.images=x",
                             "dataset.splits={val: 0.6, test: 0.5}"])
    msg = str(e.value)
    assert "\n" not in msg and "dataset.splits.test" in msg and "val + test = 1.1 > 1" in msg, msg


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from pipeline.synthetic.generate import generate

    root = tmp_path_factory.mktemp("layouts")
    generate(root / "source", n_images=60, seed=1, image_size=64, captions_per_image=2)
    items = _images_and_captions(root / "source")
    return root, items


def _ds(**kw):
    return DatasetConfig(splits=SplitsConfig(val=0.2, test=0.2, seed=0), **kw)


def _splits(ds, out):
    return [(r.source_id, r.split_key, r.split) for r in read_dataset(ds, out)]


def test_folder_split_by_relative_path_and_all_captions_share_it(layouts, tmp_path):
    root, items = layouts
    write_folder(items, tmp_path / "a")
    recs = list(read_dataset(_ds(kind="folder", images=str(tmp_path / "a" / "images"), captions=str(tmp_path / "a" / "captions.tsv")), tmp_path))
    assert len(recs) == 60 and all(len(r.captions) == 2 for r in recs)  # one record per image: its captions go together
    assert all(r.split == split_of(r.source_id, 0.2, 0.2) for r in recs)
    # the folder grows (its captions file lists every image of the bigger folder): no image moves
    write_folder(items + [(f"extra_{i}.jpg", items[0][1], ["more"], 64, 64) for i in range(30)], tmp_path / "b")
    bigger = {r.source_id: r.split for r in read_dataset(_ds(kind="folder", images=str(tmp_path / "b" / "images"), captions=str(tmp_path / "b" / "captions.tsv")), tmp_path)}
    assert all(bigger[r.source_id] == r.split for r in recs)


def test_cc3m_split_by_image_reference_not_row_number(layouts, tmp_path):
    root, items = layouts
    write_cc3m(items, tmp_path)
    tsv = tmp_path / "captions.tsv"
    rows = tsv.read_text().splitlines()
    by_path = {key: s for _, key, s in _splits(_ds(kind="cc3m_tsv", captions=str(tsv)), tmp_path)}
    assert len(by_path) == 60 and all(s == split_of(k, 0.2, 0.2) for k, s in by_path.items())
    # rows reversed, a second caption for every image appended: source_id (row number) changes, splits do not;
    # both rows naming an image share its split
    extra = [f"another caption\t{r.split(chr(9))[1]}" for r in rows]
    tsv.write_text("\n".join(list(reversed(rows)) + extra) + "\n")
    again = _splits(_ds(kind="cc3m_tsv", captions=str(tsv)), tmp_path)
    assert len(again) == 120 and {k for _, k, _ in again} == set(by_path)
    assert all(s == by_path[k] for _, k, s in again)
    assert {s for _, _, s in again} == {"train", "val", "test"}


def test_webdataset_split_by_url_survives_a_reshard(layouts, tmp_path):
    root, items = layouts
    write_webdataset(items, tmp_path / "a", shard_size=25)
    a = _splits(_ds(kind="webdataset", path=str(tmp_path / "a")), tmp_path)
    assert all(k.startswith("https://images.example.org/") for _, k, _ in a)
    # a re-download in another order and shard size: other keys, same urls, same splits
    write_webdataset(list(reversed(items)), tmp_path / "b", shard_size=40)
    b = _splits(_ds(kind="webdataset", path=str(tmp_path / "b")), tmp_path)
    assert {sid for sid, _, _ in a} != {sid for sid, _, _ in b}
    assert {k: s for _, k, s in a} == {k: s for _, k, s in b}
    # a sample without a .json (not img2dataset's layout): its key is the split key
    import io
    import tarfile

    with tarfile.open(tmp_path / "c.tar", "w") as tf:
        for name, data in (("k1.jpg", items[0][1]), ("k1.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    [(sid, key, split)] = _splits(_ds(kind="webdataset", path=str(tmp_path / "c.tar")), tmp_path)
    assert sid == "k1" and key is None and split == split_of("k1", 0.2, 0.2)


def test_official_splits_kept_without_the_option_replaced_with_it(tmp_path):
    from pipeline.config import load_manifest

    m = load_manifest(None, [f"output={tmp_path}", "dataset.synthetic.n_images=40"])
    official = {r.source_id: r.split for r in read_dataset(m.dataset, tmp_path)}
    assert set(official.values()) == {"train", "val", "test"}  # the generated COCO file's own splits
    ds = m.dataset.model_copy(update={"splits": SplitsConfig(val=0.3, test=0.3, seed=5)})
    hashed = {r.source_id: r.split for r in read_dataset(ds, tmp_path)}
    assert hashed == {k: split_of(k, 0.3, 0.3, 5) for k in official} != official
    # dataset.split keeps one of the assigned splits
    only = [r.source_id for r in read_dataset(ds.model_copy(update={"split": "test"}), tmp_path)]
    assert only == [k for k, s in hashed.items() if s == "test"] and only


def test_readers_without_official_splits_label_train_without_the_option(layouts, tmp_path):
    root, items = layouts
    write_folder(items, tmp_path)
    assert {r.split for r in read_dataset(DatasetConfig(kind="folder", images=str(tmp_path / "images"),
                                                              captions=str(tmp_path / "captions.tsv")), tmp_path)} == {"train"}
