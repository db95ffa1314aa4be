"""Open an image reference produced by a reader: a file path or ``"<tar path>::<member>"``."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

from PIL import Image

TAR_SEP = "::"


class ImageError(ValueError):
    """The image is missing or cannot be decoded; the message names it."""


def tar_ref(tar_path: str | Path, member: str) -> str:
    return f"{Path(tar_path).resolve()}{TAR_SEP}{member}"


def read_image_bytes(ref: str) -> bytes:
    if TAR_SEP in ref:
        tar_path, member = ref.split(TAR_SEP, 1)
        try:
            with tarfile.open(tar_path, "r:*") as tf:
                try:
                    f = tf.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise ImageError(f"image {ref}: no member {member!r} in {tar_path}")
                return f.read()
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
