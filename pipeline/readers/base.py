"""Records produced by every dataset reader (the contract with the ``ingest`` stage).

Readers yield :class:`SourceRecord` objects in a stable, deterministic order. They do not decode
images (ingest validates them in parallel) but report the caption-level problems they can see in
``problems`` and keep the record, so that one bad caption never hides the good ones. A file that
cannot be parsed at all raises :class:`ReaderError` naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Reasons put in SourceRecord.problems; ingest copies them into errors.parquet.
EMPTY_CAPTION = "empty caption"
NOT_UTF8 = "caption is not valid UTF-8"
NO_CAPTIONS = "record has no captions"
MISSING_IMAGE_FIELD = "missing image field"
# Problem text of a file name (from the data) that resolves outside the dataset's declared root:
# ingest files it as `path_outside_root` and never reads the file (see :func:`inside_root`).
PATH_OUTSIDE_ROOT = "path outside the dataset root"


class ReaderError(ValueError):
    """A whole input file is unreadable; the message names the file."""


@dataclass
class Instance:
    id: int
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels
    category: str
    mask_rle: dict | None = None  # compressed COCO RLE {"size": [h, w], "counts": str}
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass
class Relation:
    subject: int  # Instance.id
    object: int  # Instance.id
    predicate: str


@dataclass
class Phrase:
    caption_index: int  # index into SourceRecord.captions
    start: int  # character span [start, end) in that caption
    end: int
    text: str
    instance_ids: list[int]


@dataclass
class SourceRecord:
    source_id: str
    image: str | None  # absolute path, or "<abs tar path>::<member name>"
    captions: list[str]
    split: str = "train"
    instances: list[Instance] = field(default_factory=list)
    relations: list[Relation] = field(default_factory=list)
    phrases: list[Phrase] = field(default_factory=list)
    # (caption index, or None for the whole record; reason)
    problems: list[tuple[int | None, str]] = field(default_factory=list)
    # the image's stable identity for dataset.splits (pipeline/readers/splits.py); None: source_id
    split_key: str | None = None


def decode_caption(raw: bytes | str) -> tuple[str, str | None]:
    """Decode one caption; return (text, problem or None).

    Invalid UTF-8 is replaced by U+FFFD so the text stays writable to Parquet, and flagged.
    A ``str`` may still carry lone surrogates (from ``surrogateescape`` decoding of a whole file,
    or a JSON ``\\udcXX`` escape); those are treated the same way.
    """
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace"), NOT_UTF8
    else:
        text = raw
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            fixed = text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
            try:
                fixed.encode("utf-8")
            except UnicodeEncodeError:  # surrogates that are not escaped bytes
                fixed = text.encode("utf-8", errors="replace").decode("utf-8")
            return fixed, NOT_UTF8
    return text, None


def add_caption(rec: SourceRecord, raw: bytes | str | None) -> None:
    """Append a caption (surrounding whitespace stripped) to ``rec`` and record its problems
    (empty or whitespace-only, not UTF-8)."""
    idx = len(rec.captions)
    if raw is None:
        rec.captions.append("")
        rec.problems.append((idx, EMPTY_CAPTION))
        return
    if not isinstance(raw, (str, bytes, bytearray)):
        rec.captions.append(str(raw))
        rec.problems.append((idx, f"caption is not text (got {type(raw).__name__})"))
        return
    text, problem = decode_caption(raw)
    # Stored stripped, so that phrase spans computed by a reader index exactly the text that ingest
    # keeps (a later strip would shift every span of a caption with leading blanks).
    text = text.strip()
    rec.captions.append(text)
    if problem:
        rec.problems.append((idx, problem))
    elif not text:
        rec.problems.append((idx, EMPTY_CAPTION))


def finish(rec: SourceRecord) -> SourceRecord:
    """Record-level checks shared by all readers."""
    if not rec.captions:
        rec.problems.append((None, NO_CAPTIONS))
    return rec


def abspath(p: str | Path) -> Path:
    """An absolute local path, or for a URL (``s3://``, ``gs://``: read through fsspec) a
    :class:`pipeline.io.storage.UrlPath`, which supports what the readers do with paths."""
    from pipeline.io import storage

    if isinstance(p, storage.UrlPath) or storage.is_remote(p):
        return storage.as_path(p)
    return Path(p).expanduser().resolve()


def inside_root(root: str | Path, name: str | Path) -> tuple[str | None, str | None]:
    """Resolve a file name taken from the data (a captions line, a JSON ``file_name``) inside the
    dataset's declared ``root``: ``(path, None)``, or ``(None, problem)`` when it escapes (``../``, an
    absolute path or URL elsewhere, a symlink pointing out). The one containment check of every
    reader: a problem keeps the record (ingest files it as ``path_outside_root``), the file is never read."""
    import posixpath

    from pipeline.io import storage

    name = str(name)
    if isinstance(root, storage.UrlPath) or storage.is_remote(root):
        base = storage.normalize(root).rstrip("/")
        if storage.is_remote(name):
            target = name
        elif Path(name).is_absolute():  # a local file named from a remote dataset
            target = name
        else:
            target = f"{base}/{name}"
        if storage.is_remote(target):
            scheme, _, rest = target.partition("://")
            target = f"{scheme}://{posixpath.normpath(rest)}"
        ok = storage.is_remote(target) and target.startswith(base + "/")
    elif storage.is_remote(name):
        target, ok = name, False
    else:
        base_path = Path(root).expanduser().resolve()
        p = Path(name).expanduser()
        target = str((p if p.is_absolute() else base_path / p).resolve())  # follows symlinks
        ok = Path(target).is_relative_to(base_path)
    if ok:
        return target, None
    return None, f"{PATH_OUTSIDE_ROOT}: {name!r} resolves to {target}, outside {root} (not read)"


def read_bytes(path: str | Path, what: str) -> bytes:
    """A dataset file's bytes; a device, FIFO or folder is refused from its stat, never opened."""
    import stat

    p = abspath(path)
    try:
        if isinstance(p, Path) and not stat.S_ISREG(p.stat().st_mode):
            raise ReaderError(f"{what} {p}: not a regular file (a device, FIFO or folder); name the file itself")
        return p.read_bytes()
    except FileNotFoundError:
        raise ReaderError(f"{what} {p}: file not found") from None
    except OSError as e:
        raise ReaderError(f"{what} {p}: cannot read ({e.strerror or e})") from None


def load_json(path: str | Path, what: str):
    """Parse a JSON file; undecodable bytes survive as lone surrogates so that the one caption
    holding them is flagged (see :func:`decode_caption`) instead of the whole file failing."""
    import json

    data = read_bytes(path, what)
    try:
        return json.loads(data.decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as e:
        raise ReaderError(f"{what} {abspath(path)}: not valid JSON ({e})") from None


def natural_key(s: str):
    """Numeric ids sort as numbers (2 < 10), others as text after them."""
    return (0, int(s), "") if s.isdigit() else (1, 0, s)
