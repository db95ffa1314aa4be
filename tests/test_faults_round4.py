"""Bad input and faults, round 4 (issue 40): every byte a trainer reads is checked. The concept
encodings' .npy arrays go through the manifest's sha256 like every other artifact file; checkpoints
carry a sha256 beside them (written after them), are refused in one line saying what the file is,
and `train run --resume previous` goes back to the checkpoint before; metrics.jsonl after a kill -9
and a rerun equals an uninterrupted run's."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import ArtifactWriter, CorruptArtifact
from pipeline.io.checkpoint import (
    CheckpointError,
    load_checkpoint,
    previous_path,
    recorded_sha256,
    save_checkpoint_file,
    sum_path,
)

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def flip(path: Path, at: int | None = None) -> None:
    """Invert one byte of ``path`` (the middle one by default), keeping its size and mtime: what a
    stat-based cache cannot see is the case the first use (and `pipeline verify`) must catch."""
    st = path.stat()
    b = bytearray(path.read_bytes())
    b[len(b) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(b))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- concept encodings: the .npy arrays are checked like every other artifact file -------------------


def _concept_tokens(tmp_path: Path) -> Path:
    from pipeline.stages.encode_concepts import ConceptTokenWorker, write_membership
    from tests.test_c3_concept_tokens import _vocab_artifact

    vocab_paths = _vocab_artifact(tmp_path, ["red circle", "a small blue square", "dog", "man riding a horse"])
    aw = ArtifactWriter(tmp_path, "concept_tokens", "encode-concepts", {"max_tokens": 16, "pooled_only": False})
    ConceptTokenWorker("tiny-random", "cpu", 1, 2, 16, False, False)(
        {"vocab_paths": vocab_paths, "range": [0, 3], "min_df": 3, "artifact_dir": str(aw.dir),
         "stage": "encode-concepts", "unit": "00000", "fingerprint": "x"})
    m = aw.unit_writer("membership", "fp")
    write_membership(m, [3, 3, 6], [7, 8, 8])
    m.commit()
    aw.finalize(["00000", "membership"], extra={"pooled_only": False})
    return tmp_path / "concept_tokens"


@pytest.mark.parametrize("rel", ["tokens/tokens-00000.npy", "pooled/pooled-00000.npy", "index/index-00000.parquet"])
def test_a_flipped_byte_in_the_concept_encodings_is_refused_naming_the_file(tmp_path, rel):
    from pipeline.loaders.concept_tokens import ConceptTokens

    ct = _concept_tokens(tmp_path)
    assert len(ConceptTokens(ct)) == 3  # intact: reads (and the cache now vouches for every file)
    flip(ct / rel)  # same size, same mtime: only the sha256 tells
    (ct / "_cache.json").unlink()  # a fresh reader: the cache must not hide it either way
    with pytest.raises(CorruptArtifact) as e:
        ConceptTokens(ct)
    msg = str(e.value)
    assert msg.startswith(str(ct / rel)) and "\n" not in msg
    assert "sha256 differs" in msg or "corrupt or unreadable Parquet file" in msg  # (a footer byte: unreadable)
    assert f"pipeline verify --fix {ct}" in msg


def test_a_resized_encoding_is_refused_even_with_the_cache_vouching_for_the_old_file(tmp_path):
    from pipeline.loaders.concept_tokens import ConceptTokens

    ct = _concept_tokens(tmp_path)
    ConceptTokens(ct)
    p = ct / "pooled" / "pooled-00000.npy"
    p.write_bytes(b"\xff" * p.stat().st_size)  # 0xFF over the array: once trained to loss=nan silently
    with pytest.raises(CorruptArtifact, match=r"pooled-00000\.npy: sha256 differs"):
        ConceptTokens(ct)


# --- checkpoints: a sha256 beside each, checked on every load ------------------------------------------


def _ck(tmp_path: Path, name: str = "last.pt", w: float = 0.0343) -> Path:
    path = tmp_path / "checkpoints" / name
    save_checkpoint_file(path, {"model": {"weight": torch.full((64, 64), w)}, "step": 3, "config": {"seed": 0}})
    return path


def test_checkpoint_sum_is_written_beside_it_after_it_in_sha256sum_format(tmp_path):
    import hashlib

    path = _ck(tmp_path)
    line = sum_path(path).read_text()
    assert line == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  last.pt\n"
    assert sum_path(path).stat().st_mtime_ns >= path.stat().st_mtime_ns  # after the file it covers
    r = subprocess.run(["sha256sum", "-c", sum_path(path).name], cwd=path.parent, capture_output=True, text=True)
    assert r.returncode == 0 and "last.pt: OK" in r.stdout
    assert load_checkpoint(path)["step"] == 3


def test_checkpoint_sum_is_never_stale_while_the_new_file_is_renamed(tmp_path, monkeypatch):
    """A kill between the checkpoint's rename and its checksum leaves no checksum (checked by its zip
    CRCs then), never the previous file's checksum beside the new bytes."""
    import pipeline.io.atomic as A

    path = _ck(tmp_path, w=1.0)
    seen = []
    real = A.os.replace

    def spy(src, dst):
        if Path(dst) == path:
            seen.append(sum_path(path).exists())
        return real(src, dst)

    monkeypatch.setattr(A.os, "replace", spy)
    save_checkpoint_file(path, {"model": {"weight": torch.zeros(3)}, "step": 4})
    assert seen == [False]
    assert load_checkpoint(path)["step"] == 4


def test_a_flipped_byte_in_a_checkpoint_is_refused_in_one_line(tmp_path):
    path = _ck(tmp_path)
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    raw = path.read_bytes()
    n, m = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])  # the local header's lengths
    at = info.header_offset + 30 + n + m + 8
    before = load_checkpoint(path)["model"]["weight"].clone()
    # a byte of a weight (the stored bytes of member data/0): torch reads the changed weight back silently
    flip(path, at)
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["weight"], before)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {path}: its sha256 ")
    assert "recorded in last.pt.sha256" in msg and "CRC32 of its member" in msg and "data/0" in msg
    sum_path(path).unlink()  # without its checksum file: the zip CRCs still catch it
    with pytest.raises(CheckpointError, match=r"CRC32 of its member .*data/0 fails.*last\.pt\.sha256 is missing"):
        load_checkpoint(path)


@pytest.mark.parametrize("content, what", [
    (lambda b: b[:300], "a truncated torch file (300 bytes"),
    (lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"a" * 64 + b"\nsize 123\n",
     "a Git LFS pointer"),
    (lambda b: bytes(range(256)) * 4, "not a torch file (1024 bytes"),
    (lambda b: b"", "an empty file (0 bytes)"),
])
def test_a_checkpoint_that_is_not_one_says_what_it_is(tmp_path, content, what):
    path = _ck(tmp_path)
    path.write_bytes(content(path.read_bytes()))
    for keep_sum in (True, False):
        if not keep_sum:
            sum_path(path).unlink()
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint {path}: ") and what in msg, msg
        assert "pickled" not in msg


def test_pickled_code_with_a_valid_sum_is_still_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    import hashlib

    sum_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  evil.pt\n")
    with pytest.raises(CheckpointError, match="refused: it holds pickled Python objects"):
        load_checkpoint(path)
    assert pickle  # (the module the refusal comes from)


def test_keep_previous_keeps_the_replaced_checkpoint_with_its_sum(tmp_path):
    path = _ck(tmp_path, w=1.0)
    first = recorded_sha256(path)
    save_checkpoint_file(path, {"model": {"weight": torch.zeros(2)}, "step": 9}, keep_previous=True)
    prev = previous_path(path)
    assert prev.name == "previous.pt" and recorded_sha256(prev) == first
    assert load_checkpoint(prev)["step"] == 3 and load_checkpoint(path)["step"] == 9
