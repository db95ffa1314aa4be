"""Open an image reference produced by a reader: a file path or ``"<tar path>::<member>"``."""
from __future__ import annotations

import functools
import io
import os
import re
import stat
import tarfile
import warnings
from pathlib import Path

from PIL import Image

TAR_SEP = "::"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class ImageError(ValueError):
    """The image is missing or cannot be decoded; the message names it."""


class ImageMissing(ImageError, FileNotFoundError):
    """The image (or the tar holding it) does not exist: a local file or an object (URL)."""


# Byte ceiling of one image file (or tar member) read when the caller gives none (ingest passes its
# manifest option stages.ingest.max_image_bytes): a file larger than this is refused from its size,
# never read, so that a captions line naming a huge or endless file cannot fill the memory.
DEFAULT_MAX_IMAGE_BYTES = 256 * 2**20


class NotAFile(ImageError):
    """The reference names a device, FIFO, socket or folder: never opened (it could block or not end)."""


def _kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a character device"
            if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def _check_local(ref: str, path: str, max_bytes: int | None, what: str = "image") -> int:
    """Size of the local regular file ``path`` (stat only, nothing opened); refuses a device, FIFO,
    socket or folder, and a file over ``max_bytes``."""
    st = os.stat(path)  # FileNotFoundError goes to the caller
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(f"{what} {ref}: {path} is {_kind(st.st_mode)}, not a regular file (not read)")
    limit = DEFAULT_MAX_IMAGE_BYTES if max_bytes is None else max_bytes
    if st.st_size > limit:
        raise ImageTooLarge(f"{what} {ref}: {st.st_size:,} bytes > max_image_bytes {limit:,} (not read)")
    return st.st_size


def tar_ref(tar_path: str | Path, member: str) -> str:
    from pipeline.io import storage

    if isinstance(tar_path, storage.UrlPath) or storage.is_remote(tar_path):
        return f"{storage.normalize(tar_path)}{TAR_SEP}{member}"
    return f"{Path(tar_path).resolve()}{TAR_SEP}{member}"


@functools.lru_cache(maxsize=32)
def _tar_index(tar_path: str, mtime_ns, size: int) -> dict[str, tuple[int, int]]:
    """member name -> (data offset, size), built in one pass over the headers.

    ``tarfile.extractfile(name)`` would rescan the archive on every call, which makes reading all
    images of a shard quadratic; with the index each image is one seek + read. Keyed on mtime and
    size so a rewritten shard is re-indexed.
    """
    index: dict[str, tuple[int, int]] = {}
    from pipeline.io import storage

    with storage.open_file(tar_path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
        for m in tf:
            if m.isfile():
                index[m.name] = (m.offset_data, m.size)
    return index


def _stat(path: str) -> tuple[int, object]:
    """(mtime or version, size) of a local file or an object (URL)."""
    from pipeline.io import storage

    if storage.is_remote(path):
        info = storage.url_info(path)
        return str(info["version"]), int(info["size"] or 0)
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def read_image_bytes(ref: str, max_bytes: int | None = None) -> bytes:
    """Raw bytes of an image reference (file path or ``<tar>::<member>``; either may be a URL,
    read through fsspec: :mod:`pipeline.io.storage`). Only regular files are opened, and none over
    ``max_bytes`` (default :data:`DEFAULT_MAX_IMAGE_BYTES`) is read: :class:`NotAFile`,
    :class:`ImageTooLarge`."""
    from pipeline.io import storage

    limit = DEFAULT_MAX_IMAGE_BYTES if max_bytes is None else max_bytes
    if TAR_SEP in ref:
        tar_path, member = ref.split(TAR_SEP, 1)
        try:
            if not storage.is_remote(tar_path):
                _check_local(ref, tar_path, float("inf"), "image")  # the tar itself: a regular file of any size
            version, size = _stat(tar_path)
            index = _tar_index(tar_path, version, size)
            if member not in index:
                raise ImageError(f"image {ref}: no member {member!r} in {tar_path}")
            offset, size = index[member]
            if size > limit:
                raise ImageTooLarge(f"image {ref}: member is {size:,} bytes > max_image_bytes {limit:,} (not read)")
            with storage.open_file(tar_path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
            if len(data) != size:
                raise ImageError(f"image {ref}: tar is truncated")
            return data
        except FileNotFoundError:
            raise ImageMissing(f"image {ref}: tar file not found") from None
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ImageError(f"image {ref}: cannot read tar ({e})") from None
    try:
        if storage.is_remote(ref):
            size = int(storage.url_info(ref)["size"] or 0)
            if size > limit:
                raise ImageTooLarge(f"image {ref}: {size:,} bytes > max_image_bytes {limit:,} (not read)")
        else:
            _check_local(ref, ref, limit)
        return storage.read_bytes(ref)
    except FileNotFoundError:
        raise ImageMissing(f"image {ref}: file not found") from None
    except OSError as e:
        raise ImageError(f"image {ref}: cannot read ({e.strerror or e})") from None


# Decoded-pixel ceiling of open_image when the caller gives none (ingest passes its manifest option
# stages.ingest.max_pixels, 50 MP by default; extract-visual-tokens has its own max_pixels).
DEFAULT_MAX_PIXELS = 100_000_000


class ImageTooLarge(ImageError):
    """The image has more pixels than allowed; found from the header, before decoding."""


def _open_header(ref: str, data: bytes, max_pixels: int | None) -> Image.Image:
    limit = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we check the size ourselves
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(f"image {ref}: too large to decode ({_ADDRESS.sub('', str(e))})") from None
    except Exception as e:
        raise ImageError(f"image {ref}: cannot decode ({type(e).__name__}: {_ADDRESS.sub('', str(e))})") from None
    w, h = img.size
    if w * h > limit:
        raise ImageTooLarge(f"image {ref}: {w}x{h} = {w * h:,} pixels > max_pixels {limit:,}")
    return img


def image_header_size(ref: str, max_pixels: int | None = None, max_bytes: int | None = None) -> tuple[int, int]:
    """(width, height) from the header only; raises :class:`ImageTooLarge` past ``max_pixels``."""
    with _open_header(ref, read_image_bytes(ref, max_bytes), max_pixels) as im:
        return im.size


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB with 8 bits per channel. 16-bit (and 32-bit integer) greyscale is scaled to 0-255
    (``convert("RGB")`` would clip every value above 255 to white); float images are refused."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I"):  # "I;16", "I;16B", "I;16L", "I" (how PIL opens 16-bit PNG / TIFF)
        import numpy as np

        a = np.asarray(img).astype(np.float64)
        peak = 65535.0 if img.mode.startswith("I;16") or (a.size and a.max() <= 65535) else float(a.max())
        a8 = np.clip(np.rint(a * (255.0 / peak)), 0, 255).astype(np.uint8)
        return Image.fromarray(a8, "L").convert("RGB")
    if img.mode == "F":
        raise ImageError("floating-point image (mode F) is not supported; convert it to 8 or 16-bit integers")
    return img.convert("RGB")


def open_image(ref: str, max_pixels: int | None = None, max_bytes: int | None = None) -> Image.Image:
    """Fully decoded RGB image; raises :class:`ImageError` on a missing, truncated or garbage file,
    :class:`ImageTooLarge` when it has more than ``max_pixels`` (default :data:`DEFAULT_MAX_PIXELS`)
    pixels: checked from the header, so an oversized image is never decoded.

    The bytes are read and decoded eagerly (``load()``), because PIL otherwise defers decoding and a
    truncated JPEG would only fail later, far from the reference that caused it. 16-bit images are
    scaled to 8 bits (:func:`to_rgb`).
    """
    if not ref:
        raise ImageError("image reference is empty")
    data = read_image_bytes(ref, max_bytes)
    img = _open_header(ref, data, max_pixels)
    try:
        img.load()
    except Exception as e:  # PIL raises several unrelated types for bad data
        raise ImageError(f"image {ref}: cannot decode ({type(e).__name__}: {_ADDRESS.sub('', str(e))})") from None
    try:
        return to_rgb(img)
    except ImageError as e:
        raise ImageError(f"image {ref}: {e}") from None
