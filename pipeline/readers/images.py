"""Open an image reference produced by a reader: a file path or ``"<tar path>::<member>"``."""
from __future__ import annotations

import functools
import io
import os
import tarfile
from pathlib import Path

from PIL import Image

TAR_SEP = "::"


class ImageError(ValueError):
    """The image is missing or cannot be decoded; the message names it."""


def tar_ref(tar_path: str | Path, member: str) -> str:
    return f"{Path(tar_path).resolve()}{TAR_SEP}{member}"


@functools.lru_cache(maxsize=32)
def _tar_index(tar_path: str, mtime_ns: int, size: int) -> dict[str, tuple[int, int]]:
    """member name -> (data offset, size), built in one pass over the headers.

    ``tarfile.extractfile(name)`` would rescan the archive on every call, which makes reading all
    images of a shard quadratic; with the index each image is one seek + read. Keyed on mtime and
    size so a rewritten shard is re-indexed.
    """
    index: dict[str, tuple[int, int]] = {}
    with tarfile.open(tar_path, "r:") as tf:
        for m in tf:
            if m.isfile():
                index[m.name] = (m.offset_data, m.size)
    return index


def read_image_bytes(ref: str) -> bytes:
    """Raw bytes of an image reference (file path or ``<tar>::<member>``)."""
    if TAR_SEP in ref:
        tar_path, member = ref.split(TAR_SEP, 1)
        try:
            st = os.stat(tar_path)
            index = _tar_index(tar_path, st.st_mtime_ns, st.st_size)
            if member not in index:
                raise ImageError(f"image {ref}: no member {member!r} in {tar_path}")
            offset, size = index[member]
            with open(tar_path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
            if len(data) != size:
                raise ImageError(f"image {ref}: tar is truncated")
            return data
        except FileNotFoundError:
            raise ImageError(f"image {ref}: tar file not found") from None
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ImageError(f"image {ref}: cannot read tar ({e})") from None
    try:
        return Path(ref).read_bytes()
    except FileNotFoundError:
        raise ImageError(f"image {ref}: file not found") from None
    except OSError as e:
        raise ImageError(f"image {ref}: cannot read ({e.strerror or e})") from None


def open_image(ref: str) -> Image.Image:
    """Fully decoded RGB image; raises :class:`ImageError` on a missing, truncated or garbage file.

    The bytes are read and decoded eagerly (``load()``), because PIL otherwise defers decoding and a
    truncated JPEG would only fail later, far from the reference that caused it.
    """
    if not ref:
        raise ImageError("image reference is empty")
    data = read_image_bytes(ref)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # PIL raises several unrelated types for bad data
        raise ImageError(f"image {ref}: cannot decode ({type(e).__name__}: {e})") from None
    return img.convert("RGB") if img.mode != "RGB" else img
