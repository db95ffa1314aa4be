"""Readers on small hand-written inputs in each real format, RLE helpers, image opening."""
from __future__ import annotations

import io
import json
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.masks import (
    counts_to_string,
    polygons_to_mask,
    rle_area,
    rle_counts,
    rle_decode,
    rle_encode,
    rle_to_bbox,
    string_to_counts,
)
from pipeline.readers import ImageError, ReaderError, open_image, read_dataset
from pipeline.readers.base import EMPTY_CAPTION, MISSING_IMAGE_FIELD, NO_CAPTIONS, NOT_UTF8
from pipeline.readers.cc3m import URL_NOT_FETCHED
from pipeline.readers.flickr import parse_sentence

BAD_UTF8 = b"caf\xe9 au lait"  # latin-1 bytes, invalid as UTF-8


def ds(kind, **kw):
    base = dict(kind=kind, captions=None, images=None, path=None, instances=None, scene_graphs=None, split=None)
    base.update({k: (str(v) if isinstance(v, Path) else v) for k, v in kw.items()})
    return types.SimpleNamespace(**base)


def read(d, tmp_path):
    return list(read_dataset(d, tmp_path / "out"))


def png_bytes(color=(255, 0, 0), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


# -- RLE -----------------------------------------------------------------------------------------

def test_rle_string_matches_pycocotools_encoding():
    # hand-computed with the rleToString rules: 40 needs two 5-bit chunks, the fourth count is a
    # delta to the second, and a negative delta sets the sign bit of its last chunk
    assert counts_to_string([3, 2, 40]) == "32X1"
    assert counts_to_string([1, 1, 1, 5]) == "1114"
    assert counts_to_string([1, 5, 1, 2]) == "151M"
    for counts in ([3, 2, 40], [1, 1, 1, 5], [1, 5, 1, 2], [0, 7, 1000, 3, 99999, 1]):
        assert string_to_counts(counts_to_string(counts)) == counts


@pytest.mark.parametrize("lo,hi,expected", [(0, 5, "05d00000000d?"), (5, 10, "R45d00000000b;"), (20, 25, "X`05d00000000")])
def test_rle_matches_pycocotools_reference_strings(lo, hi, expected):
    # strings produced by pycocotools.mask.encode for a 25x25 mask with [lo:hi, lo:hi] set, as
    # recorded in the test suites of pycocotools re-implementations
    m = np.zeros((25, 25), bool)
    m[lo:hi, lo:hi] = True
    assert rle_encode(m) == {"size": [25, 25], "counts": expected}
    assert np.array_equal(rle_decode({"size": [25, 25], "counts": expected.encode()}), m)


def test_rle_roundtrip_and_column_major_order():
    m = np.zeros((3, 4), bool)
    m[0, 0] = True  # first pixel set -> counts start with a zero-length background run
    m[1:3, 2] = True
    rle = rle_encode(m)
    assert rle["size"] == [3, 4]
    # Fortran order: column 0 = [1,0,0], column 1 = [0,0,0], column 2 = [0,1,1], column 3 = [0,0,0]
    assert rle_counts(rle) == [0, 1, 6, 2, 3]
    assert np.array_equal(rle_decode(rle), m)
    assert np.array_equal(rle_decode({"size": [3, 4], "counts": [0, 1, 6, 2, 3]}), m)
    assert rle_area(rle) == 3
    assert rle_to_bbox(rle) == (0.0, 0.0, 3.0, 3.0)
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (17, 5), (64, 48)]:
        r = rng.random(shape) < 0.3
        assert np.array_equal(rle_decode(rle_encode(r)), r)
    assert rle_decode(rle_encode(np.zeros((5, 5), bool))).sum() == 0
    with pytest.raises(ValueError):
        rle_decode({"size": [2, 2], "counts": [1, 1]})


def test_polygon_mask():
    # pycocotools' rasteriser (COCO's own): the rectangle x 2..8, y 2..6 covers pixels x 2-7, y 2-5
    m = polygons_to_mask([[2, 2, 8, 2, 8, 6, 2, 6]], 10, 12)
    assert m.shape == (10, 12)
    assert m[4, 5] and not m[0, 0] and not m[9, 11]
    assert m[2:6, 2:8].all() and m.sum() == 6 * 4


# -- COCO -----------------------------------------------------------------------------------------

def write_coco(tmp_path: Path) -> tuple[Path, Path, Path]:
    caps = {
        "images": [
            {"id": 10, "file_name": "b.jpg", "width": 12, "height": 10},
            {"id": 2, "file_name": "a.jpg", "width": 12, "height": 10},
            {"id": 7, "file_name": "c.jpg"},  # no captions
            {"id": 8},  # no file_name
        ],
        "annotations": [
            {"id": 5, "image_id": 10, "caption": "second for ten"},
            {"id": 1, "image_id": 10, "caption": "first for ten"},
            {"id": 3, "image_id": 2, "caption": "   "},
            {"id": 4, "image_id": 2, "caption": "PLACEHOLDER"},
            {"id": 6, "image_id": 8, "caption": "orphan image entry"},
            {"id": 9, "image_id": 99, "caption": "unknown image id"},
        ],
    }
    # splice raw non-UTF-8 bytes into the JSON so only that caption is damaged
    raw = json.dumps(caps).encode().replace(b"PLACEHOLDER", BAD_UTF8)
    cap_file = tmp_path / "captions_val2017.json"
    cap_file.write_bytes(raw)
    inst = {
        "images": [],  # polygon rasterisation must take the image size from the captions file
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
        "annotations": [
            {"id": 21, "image_id": 2, "category_id": 2, "bbox": [2, 2, 6, 4], "iscrowd": 0,
             "segmentation": [[2, 2, 8, 2, 8, 6, 2, 6]], "attributes": {"color": "red"}},
            {"id": 20, "image_id": 2, "category_id": 1, "bbox": [0, 0, 1, 1], "iscrowd": 1,
             "segmentation": {"size": [10, 12], "counts": [0, 1, 119]}},
        ],
    }
    inst_file = tmp_path / "instances.json"
    inst_file.write_text(json.dumps(inst))
    sg = {"format": "vlpipe-scene-graph/1", "images": [{
        "image_id": 2,
        "relations": [{"subject": 21, "object": 20, "predicate": "right of"}],
        "phrases": [{"caption_id": 4, "start": 0, "end": 3, "text": "caf", "instance_ids": [21]}],
    }]}
    sg_file = tmp_path / "sg.json"
    sg_file.write_text(json.dumps(sg))
    return cap_file, inst_file, sg_file


def test_coco_reader_rows_and_problems(tmp_path):
    cap_file, _, _ = write_coco(tmp_path)
    recs = read(ds("coco", captions=cap_file, images=tmp_path / "imgs"), tmp_path)
    assert [r.source_id for r in recs] == ["2", "7", "8", "10", "99"]
    by = {r.source_id: r for r in recs}
    assert by["10"].captions == ["first for ten", "second for ten"]  # ordered by annotation id
    assert by["10"].problems == []
    assert by["10"].image == str((tmp_path / "imgs" / "b.jpg").resolve())
    assert by["10"].split == "val"  # from the file name
    assert by["2"].captions[0] == "" and by["2"].captions[1] == "caf\ufffd au lait"
    assert by["2"].problems == [(0, EMPTY_CAPTION), (1, NOT_UTF8)]
    assert by["7"].problems == [(None, NO_CAPTIONS)]
    assert by["8"].image is None and (None, MISSING_IMAGE_FIELD) in by["8"].problems
    assert by["99"].image is None and by["99"].captions == ["unknown image id"]


def test_coco_instances_and_scene_graph(tmp_path):
    cap_file, inst_file, sg_file = write_coco(tmp_path)
    recs = read(ds("coco", captions=cap_file, images=tmp_path, instances=inst_file, scene_graphs=sg_file), tmp_path)
    r = next(x for x in recs if x.source_id == "2")
    assert [i.id for i in r.instances] == [20, 21]
    crowd, dog = r.instances
    assert dog.category == "dog" and dog.box == (2.0, 2.0, 8.0, 6.0) and dog.attributes == {"color": "red"}
    assert isinstance(dog.mask_rle["counts"], str)  # polygons converted to compressed RLE
    m = rle_decode(dog.mask_rle)
    assert m.shape == (10, 12) and m[3, 4] and m.sum() == 24  # pycocotools: pixels x 2-7, y 2-5
    assert isinstance(crowd.mask_rle["counts"], str) and rle_decode(crowd.mask_rle).sum() == 1
    assert [(x.subject, x.object, x.predicate) for x in r.relations] == [(21, 20, "right of")]
    (p,) = r.phrases
    assert (p.caption_index, p.text, p.instance_ids) == (1, "caf", [21])
    assert all(not x.instances for x in recs if x.source_id != "2")


def test_coco_unreadable_file_names_it(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"images": [')
    with pytest.raises(ReaderError, match="broken.json"):
        read(ds("coco", captions=bad), tmp_path)
    with pytest.raises(ReaderError, match="nope.json"):
        read(ds("coco", captions=tmp_path / "nope.json"), tmp_path)
    with pytest.raises(ReaderError, match="dataset.captions"):
        read(ds("coco"), tmp_path)


# -- Karpathy -------------------------------------------------------------------------------------

def test_karpathy_reader_split_filter(tmp_path):
    data = {"images": [
        {"filepath": "val2014", "filename": "x.jpg", "split": "test", "cocoid": 42,
         "sentences": [{"raw": "a test image."}, {"raw": ""}]},
        {"filepath": "train2014", "filename": "y.jpg", "split": "restval", "cocoid": 7, "sentences": [{"raw": "rest"}]},
        {"filename": "z.jpg", "split": "train", "imgid": 3, "sentences": [{"raw": "plain train"}]},
        {"split": "train", "cocoid": 9, "sentences": []},
    ]}
    f = tmp_path / "dataset_coco.json"
    f.write_text(json.dumps(data))
    allr = read(ds("karpathy", captions=f, images=tmp_path), tmp_path)
    assert [r.source_id for r in allr] == ["42", "7", "3", "9"]  # file order
    assert allr[0].image == str(tmp_path.resolve() / "val2014" / "x.jpg")
    assert allr[2].image == str(tmp_path.resolve() / "z.jpg")
    assert allr[0].problems == [(1, EMPTY_CAPTION)] and allr[0].split == "test"
    assert set(allr[3].problems) == {(None, MISSING_IMAGE_FIELD), (None, NO_CAPTIONS)}
    train = read(ds("karpathy", captions=f, images=tmp_path, split="train"), tmp_path)
    assert [r.source_id for r in train] == ["7", "3", "9"]  # restval counts as train
    assert [r.source_id for r in read(ds("karpathy", captions=f, split="test"), tmp_path)] == ["42"]


# -- Flickr30k Entities ---------------------------------------------------------------------------

FLICKR_SENT = (
    "[/EN#18/people A man] with [/EN#19/clothing pierced ears] is wearing [/EN#20/clothing glasses] "
    "and [/EN#21/clothing an orange hat] .\n"
    "[/EN#18/people/other A man] in [/EN#22/other the dark] stands near [/EN#23/notvisual it] .\n"
    "\n"
)
FLICKR_XML = """<annotation><filename>{id}.jpg</filename><size><width>500</width><height>375</height><depth>3</depth></size>
<object><name>18</name><bndbox><xmin>10</xmin><ymin>20</ymin><xmax>200</xmax><ymax>370</ymax></bndbox></object>
<object><name>20</name><name>19</name><bndbox><xmin>50</xmin><ymin>30</ymin><xmax>90</xmax><ymax>60</ymax></bndbox></object>
<object><name>20</name><bndbox><xmin>60</xmin><ymin>35</ymin><xmax>95</xmax><ymax>55</ymax></bndbox></object>
<object><name>22</name><scene>1</scene></object>
</annotation>"""


def test_parse_sentence_spans():
    clean, spans = parse_sentence(FLICKR_SENT.splitlines()[0])
    assert clean == "A man with pierced ears is wearing glasses and an orange hat ."
    for start, end, text, _, _ in spans:
        assert clean[start:end] == text
    assert [(s[2], s[3], s[4]) for s in spans] == [
        ("A man", 18, "people"), ("pierced ears", 19, "clothing"), ("glasses", 20, "clothing"),
        ("an orange hat", 21, "clothing")]


def test_flickr_reader(tmp_path):
    root = tmp_path / "f30k"
    (root / "Sentences").mkdir(parents=True)
    (root / "Annotations").mkdir()
    for sid in ("1000", "99"):
        (root / "Sentences" / f"{sid}.txt").write_text(FLICKR_SENT)
        (root / "Annotations" / f"{sid}.xml").write_text(FLICKR_XML.format(id=sid))
    # leading blanks are stripped before the spans are computed, so spans index the stored caption
    (root / "Sentences" / "5.txt").write_bytes(b"  [/EN#1/people A " + BAD_UTF8 + b"] sits .\n")
    (root / "test.txt").write_text("99\n")
    (root / "train.txt").write_text("1000\n5\n")
    recs = read(ds("flickr30k_entities", path=root), tmp_path)
    assert [r.source_id for r in recs] == ["5", "99", "1000"]  # numeric order
    r = recs[2]
    assert r.image == str(root.resolve() / "images" / "1000.jpg") and r.split == "train"
    assert recs[1].split == "test"
    # a blank line before the final newline is an empty caption, the final newline is not
    assert len(r.captions) == 3 and r.problems == [(2, EMPTY_CAPTION)]
    assert r.captions[1] == "A man in the dark stands near it ."
    for p in r.phrases:
        assert r.captions[p.caption_index][p.start:p.end] == p.text
    links = {(p.caption_index, p.text): p.instance_ids for p in r.phrases}
    assert links[(0, "A man")] == [0] and links[(1, "A man")] == [0]
    assert links[(0, "pierced ears")] == [1]
    assert links[(0, "glasses")] == [1, 2]  # entity with two boxes
    assert links[(1, "the dark")] == [] and links[(1, "it")] == []  # scene / not visual: no box
    assert [(i.id, i.box, i.category) for i in r.instances] == [
        (0, (10.0, 20.0, 200.0, 370.0), "people"), (1, (50.0, 30.0, 90.0, 60.0), "clothing"),
        (2, (60.0, 35.0, 95.0, 55.0), "clothing")]
    bad = recs[0]
    assert bad.problems == [(0, NOT_UTF8)] and bad.instances == []
    assert bad.captions == ["A caf\ufffd au lait sits ."]
    assert (bad.phrases[0].start, bad.phrases[0].text) == (0, "A caf\ufffd au lait")
    test_only = read(ds("flickr30k_entities", path=root, split="test"), tmp_path)
    assert [x.source_id for x in test_only] == ["99"]
    (root / "Annotations" / "99.xml").write_text("<annotation><object>")
    with pytest.raises(ReaderError, match="99.xml"):
        read(ds("flickr30k_entities", path=root), tmp_path)


# -- CC3M TSV -------------------------------------------------------------------------------------

def test_cc3m_tsv_without_header(tmp_path):
    f = tmp_path / "train.tsv"
    root = str(tmp_path.resolve() / "root").encode()  # absolute paths and file:// URLs inside the root are kept
    f.write_bytes(
        b"a dog on a beach\timgs/0.jpg\r\n"
        b"\n"
        b"a cat\t" + root + b"/abs/cat.jpg\n"
        + BAD_UTF8 + b"\thttp://example.com/x.jpg\n"
        b"   \tfile://" + root + b"/data/a%20b.png\n"
        b"no tab here\n"
    )
    recs = read(ds("cc3m_tsv", captions=f, images=tmp_path / "root"), tmp_path)
    assert [r.source_id for r in recs] == ["0", "1", "2", "3", "4"]
    assert recs[0].captions == ["a dog on a beach"] and recs[0].problems == []
    assert recs[0].image == str((tmp_path / "root" / "imgs" / "0.jpg").resolve())
    assert recs[1].image == f"{root.decode()}/abs/cat.jpg"
    assert recs[2].image is None and recs[2].problems == [(0, NOT_UTF8), (None, URL_NOT_FETCHED)]
    assert recs[3].image == f"{root.decode()}/data/a b.png" and recs[3].problems == [(0, EMPTY_CAPTION)]
    assert recs[4].captions == ["no tab here"] and recs[4].problems[0][0] is None
    assert "malformed row" in recs[4].problems[0][1]


def test_cc3m_tsv_with_header_in_other_order(tmp_path):
    f = tmp_path / "cc.tsv"
    f.write_text("url\tcaption\nx/1.jpg\tfirst\nx/2.jpg\tsecond\n")
    recs = read(ds("cc3m_tsv", captions=f), tmp_path)
    assert [(r.source_id, r.captions) for r in recs] == [("0", ["first"]), ("1", ["second"])]
    assert recs[1].image == str(tmp_path.resolve() / "x" / "2.jpg")  # relative to the TSV's folder


# -- WebDataset -----------------------------------------------------------------------------------

def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def test_webdataset_reader_and_tar_images(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "00001.tar", "w") as tf:
        _add(tf, "000010000.jpg", png_bytes((0, 255, 0)))  # PNG bytes under .jpg: PIL sniffs content
        _add(tf, "000010000.txt", b"  green square \n")
        _add(tf, "000010000.json", b'{"key": "000010000"}')
    with tarfile.open(shards / "00000.tar", "w") as tf:
        _add(tf, "000000000.png", png_bytes())
        _add(tf, "000000000.txt", b"a red picture")
        _add(tf, "000000001.jpg", b"not an image at all")
        _add(tf, "000000001.txt", BAD_UTF8)
        _add(tf, "000000002.txt", b"caption without image")
        _add(tf, "000000003.jpg", png_bytes())
        _add(tf, "000000003.json", json.dumps({"caption": "from json"}).encode())
        _add(tf, "000000004.png", png_bytes())
    recs = read(ds("webdataset", path=shards), tmp_path)
    assert [r.source_id for r in recs] == ["000000000", "000000001", "000000002", "000000003", "000000004", "000010000"]
    by = {r.source_id: r for r in recs}
    assert by["000000000"].captions == ["a red picture"] and by["000000000"].problems == []
    assert by["000000000"].image == f"{(shards / '00000.tar').resolve()}::000000000.png"
    assert by["000000001"].problems == [(0, NOT_UTF8)]
    assert by["000000002"].image is None and by["000000002"].problems == [(None, MISSING_IMAGE_FIELD)]
    assert by["000000003"].captions == ["from json"]
    assert by["000000004"].problems == [(None, NO_CAPTIONS)]
    assert by["000010000"].captions == ["green square"]

    im = open_image(by["000000000"].image)
    assert im.size == (8, 6) and im.getpixel((0, 0)) == (255, 0, 0)
    assert open_image(by["000010000"].image).getpixel((3, 3)) == (0, 255, 0)
    with pytest.raises(ImageError, match="000000001.jpg"):
        open_image(by["000000001"].image)
    with pytest.raises(ImageError, match="no member"):
        open_image(f"{shards / '00000.tar'}::missing.jpg")

    # a rewritten shard is re-indexed, not served from the stale offset cache
    with tarfile.open(shards / "00001.tar", "w") as tf:
        _add(tf, "extra.txt", b"shifts the offsets" * 50)
        _add(tf, "000010000.jpg", png_bytes((0, 0, 255), size=(9, 9)))
    assert open_image(by["000010000"].image).getpixel((3, 3)) == (0, 0, 255)

    # a single shard by file name and by glob
    assert len(read(ds("webdataset", path=shards / "00001.tar"), tmp_path)) == 2
    assert len(read(ds("webdataset", path=str(shards) + "/0000[01].tar"), tmp_path)) == 7
    (shards / "00002.tar").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ReaderError, match="00002.tar"):
        read(ds("webdataset", path=shards), tmp_path)


def test_webdataset_duplicate_keys_flagged(tmp_path):
    for n in ("a.tar", "b.tar"):
        with tarfile.open(tmp_path / n, "w") as tf:
            _add(tf, "k1.png", png_bytes())
            _add(tf, "k1.txt", b"x")
    recs = read(ds("webdataset", path=str(tmp_path / "*.tar")), tmp_path)
    assert recs[0].problems == [] and "duplicate key" in recs[1].problems[0][1]


# -- folder ---------------------------------------------------------------------------------------

def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "folder"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(png_bytes())
    (root / "sub" / "b.jpg").write_bytes(png_bytes())
    (root / "c.png").write_bytes(png_bytes())  # no caption line
    (root / "notes.txt").write_text("not an image")
    return root


def test_folder_tsv(tmp_path):
    root = _folder(tmp_path)
    caps = tmp_path / "caps.tsv"
    caps.write_bytes(b"file\tcaption\na.png\tfirst a\nsub/b.jpg\tonly b\na.png\tsecond a\ngone.png\tno file\n"
                     b"sub/b.jpg\t\nbroken line\n")
    recs = read(ds("folder", images=root, captions=caps), tmp_path)
    assert [r.source_id for r in recs] == ["a.png", "c.png", "gone.png", "sub/b.jpg", "caps.tsv:7"]
    by = {r.source_id: r for r in recs}
    assert by["a.png"].captions == ["first a", "second a"] and by["a.png"].problems == []
    assert by["a.png"].image == str(root.resolve() / "a.png")
    assert by["c.png"].problems == [(None, NO_CAPTIONS)]
    assert by["sub/b.jpg"].problems == [(1, EMPTY_CAPTION)]
    assert by["gone.png"].captions == ["no file"]  # kept; ingest reports the missing image
    assert by["caps.tsv:7"].image is None and "line 7" in by["caps.tsv:7"].problems[0][1]


def test_folder_jsonl_default_name(tmp_path):
    root = _folder(tmp_path)
    lines = [json.dumps({"file": "a.png", "caption": "json a"}), json.dumps({"file": "c.png", "captions": ["c1", "c2"]}),
             json.dumps({"file": "sub/b.jpg", "caption": "x"}).replace("x", "\\udce9")]
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    recs = read(ds("folder", images=root), tmp_path)
    by = {r.source_id: r for r in recs}
    assert by["a.png"].captions == ["json a"]
    assert by["c.png"].captions == ["c1", "c2"]
    assert by["sub/b.jpg"].problems == [(0, NOT_UTF8)]
    with pytest.raises(ReaderError, match="no captions file"):
        read(ds("folder", images=_folder(tmp_path / "other")), tmp_path)


def test_open_image_errors(tmp_path):
    good = tmp_path / "g.png"
    good.write_bytes(png_bytes((1, 2, 3)))
    assert open_image(str(good)).getpixel((1, 1)) == (1, 2, 3)
    trunc = tmp_path / "t.png"
    trunc.write_bytes(png_bytes()[:40])
    with pytest.raises(ImageError, match="t.png"):
        open_image(str(trunc))
    with pytest.raises(ImageError, match="not found"):
        open_image(str(tmp_path / "missing.jpg"))
