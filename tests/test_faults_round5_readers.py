"""Round 5 (a), issue 49 items 2 and 7: file names taken from data resolve inside the dataset's
declared root (``path_outside_root`` rows, never read), and only regular files of bounded size are
read (``not_a_file`` / ``image_too_large`` rows, no endless read, no hang)."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from pipeline.io.artifacts import Artifact
from pipeline.readers import read_dataset
from pipeline.readers.base import PATH_OUTSIDE_ROOT, inside_root
from pipeline.readers.images import NotAFile, read_image_bytes
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest
from tests.test_rerun_cheap import _in_process

SECRET = b"TOP-SECRET-BYTES-" * 8


def _png(color=(200, 30, 30), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def _secret(tmp_path: Path) -> Path:
    """A readable image outside every dataset root, its bytes marked so a copy can be found."""
    p = tmp_path / "outside_secret.png"
    p.write_bytes(_png((1, 2, 3)) + SECRET)  # PIL ignores trailing bytes: it would decode
    return p


def _ingest(tmp_path: Path, monkeypatch, *keys: str) -> Artifact:
    _in_process(monkeypatch, [])
    m = make_manifest(tmp_path, ["stages.ingest.shard_size=50", "stages.ingest.max_error_rate=1", *keys])
    run_stage("ingest", RunContext(m))
    return Artifact(Path(m.output) / "samples")


def _rows(art: Artifact) -> dict[str, tuple[str, str]]:
    return {r["source_id"]: (r["reason"], r["detail"]) for r in art.errors().to_pylist()}


def _no_secret_in(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            assert SECRET[:17] not in f.read_bytes(), f


def test_inside_root_refuses_dot_dot_absolute_and_symlink_out(tmp_path):
    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    secret = _secret(tmp_path)
    (root / "link.png").symlink_to(secret)
    (root / "sub" / "ok.png").write_bytes(_png())
    r = str(root.resolve())
    assert inside_root(root, "sub/ok.png") == (f"{r}/sub/ok.png", None)
    assert inside_root(root, f"{r}/sub/ok.png") == (f"{r}/sub/ok.png", None)
    assert inside_root(root, "sub/../sub/ok.png") == (f"{r}/sub/ok.png", None)
    s = str(secret.resolve())
    for name in ("../outside_secret.png", s, "link.png", "s3://bucket/x.png"):
        target = name if name.startswith("s3://") else s
        assert inside_root(root, name) == (None, f"{PATH_OUTSIDE_ROOT}: {name!r} resolves to {target}, outside {root} (not read)")
    # a remote root: the same rule on the normalised URL
    assert inside_root("s3://b/data/imgs", "a/1.png") == ("s3://b/data/imgs/a/1.png", None)
    assert inside_root("s3://b/data/imgs", "../other/1.png")[1] == (
        f"{PATH_OUTSIDE_ROOT}: '../other/1.png' resolves to s3://b/data/other/1.png, outside s3://b/data/imgs (not read)")
    assert inside_root("s3://b/data/imgs", "s3://b/data/imgs2/1.png")[0] is None  # a sibling prefix is not inside


def test_folder_captions_naming_files_outside_are_error_rows_never_read(tmp_path, monkeypatch):
    secret = _secret(tmp_path)
    root = tmp_path / "data" / "imgs"
    root.mkdir(parents=True)
    (root / "good.png").write_bytes(_png())
    (root / "link.png").symlink_to(secret)
    (root / "captions.tsv").write_text(
        "good.png\ta red square\n"
        "../../outside_secret.png\tdot dot\n"
        f"{secret}\tabsolute\n"
        "link.png\tsymlink out\n"
    )
    art = _ingest(tmp_path / "out", monkeypatch, "dataset.kind=folder", f"dataset.images={root}", "dataset.captions=null")
    assert [r["source_id"] for r in art.read("samples").to_pylist()] == ["good.png"]
    s = secret.resolve()
    assert _rows(art) == {
        "../../outside_secret.png": ("path_outside_root", f"{PATH_OUTSIDE_ROOT}: '../../outside_secret.png' resolves to {s}, outside {root.resolve()} (not read)"),
        str(secret): ("path_outside_root", f"{PATH_OUTSIDE_ROOT}: '{secret}' resolves to {s}, outside {root.resolve()} (not read)"),
        "link.png": ("path_outside_root", f"{PATH_OUTSIDE_ROOT}: 'link.png' resolves to {s}, outside {root.resolve()} (not read)"),
    }
    _no_secret_in(tmp_path / "out")


def _ds(**kw):
    from pipeline.config import DatasetConfig

    return DatasetConfig(**kw)


def test_every_reader_that_joins_a_name_from_data_checks_it(tmp_path):
    """COCO file_name, Karpathy filepath/filename, a CC3M TSV path or file:// URL, and a Flickr30k
    Entities image that is a symlink out: each record keeps its captions and a path_outside_root problem."""
    secret = _secret(tmp_path)
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "ok.png").write_bytes(_png())
    r = root.resolve()

    def outside(name):
        return [(None, f"{PATH_OUTSIDE_ROOT}: {name!r} resolves to {secret.resolve()}, outside {r} (not read)")]

    coco = tmp_path / "coco.json"
    coco.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "ok.png"}, {"id": 2, "file_name": "../outside_secret.png"}],
        "annotations": [{"id": 1, "image_id": 1, "caption": "fine"}, {"id": 2, "image_id": 2, "caption": "escape"}]}))
    recs = list(read_dataset(_ds(kind="coco", captions=str(coco), images=str(root)), tmp_path))
    assert [(x.image, x.problems) for x in recs] == [(f"{r}/ok.png", []), (None, outside("../outside_secret.png"))]

    karpathy = tmp_path / "k.json"
    karpathy.write_text(json.dumps({"images": [
        {"imgid": 0, "filename": "ok.png", "sentences": [{"raw": "fine"}]},
        {"imgid": 1, "filepath": "..", "filename": "outside_secret.png", "sentences": [{"raw": "escape"}]}]}))
    recs = list(read_dataset(_ds(kind="karpathy", captions=str(karpathy), images=str(root)), tmp_path))
    assert [(x.image, x.problems) for x in recs] == [(f"{r}/ok.png", []), (None, outside("../outside_secret.png"))]

    tsv = tmp_path / "cc.tsv"
    tsv.write_text(f"fine\tok.png\nabsolute\t{secret}\nurl\tfile://{secret}\n")
    recs = list(read_dataset(_ds(kind="cc3m_tsv", captions=str(tsv), images=str(root)), tmp_path))
    assert [(x.image, x.problems) for x in recs] == [
        (f"{r}/ok.png", []), (None, outside(str(secret))), (None, outside(str(secret)))]
    assert [x.captions for x in recs] == [["fine"], ["absolute"], ["url"]]

    f30k = tmp_path / "f30k"
    (f30k / "Sentences").mkdir(parents=True)
    (f30k / "images").mkdir()
    (f30k / "Sentences" / "1.txt").write_text("[/EN#1/people A man] waves\n")
    (f30k / "Sentences" / "2.txt").write_text("[/EN#1/people A woman] waves\n")
    (f30k / "images" / "1.jpg").write_bytes(_png())
    (f30k / "images" / "2.jpg").symlink_to(secret)
    recs = list(read_dataset(_ds(kind="flickr30k_entities", path=str(f30k)), tmp_path))
    img = (f30k / "images").resolve()
    assert recs[0].image == f"{img}/1.jpg" and recs[0].problems == []
    assert recs[1].image is None and recs[1].problems == [
        (None, f"{PATH_OUTSIDE_ROOT}: '2.jpg' resolves to {secret.resolve()}, outside {img} (not read)")]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_a_fifo_and_an_oversized_file_are_error_rows_not_reads(tmp_path, monkeypatch):
    """A CC3M TSV whose root is /dev naming ``zero`` (inside the root: the containment check passes),
    a FIFO inside the root (opening it would hang) and a file over stages.ingest.max_image_bytes:
    three error rows, the good row kept, and the run ends."""
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "ok.png").write_bytes(_png())
    (root / "big.png").write_bytes(_png(size=(64, 64)) + b"\0" * 4000)
    os.mkfifo(root / "pipe.png")
    tsv = tmp_path / "cc.tsv"
    tsv.write_text(f"fine\t{root}/ok.png\nendless\t/dev/zero\npipe\t{root}/pipe.png\nhuge\t{root}/big.png\n")
    # the root is / (so that /dev/zero is inside it): only the file's kind and size stop the reads
    art = _ingest(tmp_path / "out", monkeypatch, "dataset.kind=cc3m_tsv", f"dataset.captions={tsv}", "dataset.images=/",
                  "stages.ingest.max_image_bytes=2000")
    assert [r["source_id"] for r in art.read("samples").to_pylist()] == ["0"]
    big = (root / "big.png").stat().st_size
    assert _rows(art) == {
        "1": ("not_a_file", "image /dev/zero: /dev/zero is a character device, not a regular file (not read)"),
        "2": ("not_a_file", f"image {root.resolve()}/pipe.png: {root.resolve()}/pipe.png is a FIFO, not a regular file (not read)"),
        "3": ("image_too_large", f"image {root.resolve()}/big.png: {big:,} bytes > max_image_bytes 2,000 (not read)"),
    }


def test_read_image_bytes_refuses_before_opening(tmp_path):
    os.mkfifo(tmp_path / "p")
    with pytest.raises(NotAFile, match="is a FIFO, not a regular file"):
        read_image_bytes(str(tmp_path / "p"))  # would block forever if opened
    with pytest.raises(NotAFile, match="is a folder, not a regular file"):
        read_image_bytes(str(tmp_path))


def test_a_captions_file_that_is_a_fifo_is_refused_naming_it(tmp_path):
    from pipeline.readers.base import ReaderError

    os.mkfifo(tmp_path / "cc.tsv")
    with pytest.raises(ReaderError) as e:
        list(read_dataset(_ds(kind="cc3m_tsv", captions=str(tmp_path / "cc.tsv")), tmp_path))
    assert str(e.value) == (f"CC3M TSV {(tmp_path / 'cc.tsv').resolve()}: not a regular file (a device, FIFO or folder); "
                            "name the file itself")
