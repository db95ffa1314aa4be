"""Image references of the ``samples`` artifact: stored relative, resolved in this one place.

``samples.image`` holds each image's path relative to the dataset's image root (``a/b.jpg``, or
``shards/000001.tar::key.jpg`` for a WebDataset member), and ``samples/_manifest.json`` records
that root as ``image_root``: relative to the output folder when the dataset lives inside it (the
generated demo: ``source/synthetic``), else absolute. An output therefore moves between machines
and folders: every reader of images (the image stages, the report, the trainers) calls
:func:`image_resolver` and gets absolute references back, looking for the root

1. where ``_manifest.json`` says it is (relative roots follow the moved output folder),
2. where the manifest in use says the dataset is (``dataset.images`` / ``dataset.path`` / the
   synthetic root: point it at the dataset's new home on another machine),

the first that exists winning. Absolute paths and URLs (outputs written before relative paths,
images outside the root, datasets on object storage: ``s3://...`` references are stored as full
URLs and ``image_root`` is the dataset's URL) pass through unchanged.
"""

from __future__ import annotations

import glob as _glob
import os
from collections.abc import Callable
from pathlib import Path

TAR_SEP = "::"


def is_url(ref: str) -> bool:
    return "://" in ref.split(TAR_SEP, 1)[0]


def dataset_image_root(ds, output: str | Path) -> Path | None:
    """The folder a dataset's image references are relative to (``None``: caption-only)."""
    kind = getattr(ds, "kind", None)
    if kind == "synthetic":
        from pipeline.readers import synthetic_root

        return Path(os.path.abspath(synthetic_root(ds, Path(output))))
    if kind == "webdataset" and ds.path and is_url(ds.path):  # s3://b/shards/, s3://b/shards/*.tar, .../x.tar
        p = ds.path.rstrip("/")
        if _glob.has_magic(p):
            p = p[: next(i for i, ch in enumerate(p) if ch in "*?[")].rsplit("/", 1)[0]
        elif p.endswith(".tar"):
            p = p.rsplit("/", 1)[0]
        return p
    if getattr(ds, "images", None) and is_url(ds.images):
        return ds.images.rstrip("/")
    if kind == "webdataset" and ds.path:
        p = ds.path
        if _glob.has_magic(p):  # the folder before the first wildcard
            parts = Path(p).parts
            k = next(i for i, part in enumerate(parts) if _glob.has_magic(part))
            p = str(Path(*parts[:k])) if k else "."
        p = Path(os.path.abspath(p))
        return p.parent if p.is_file() else p
    if getattr(ds, "images", None):
        return Path(os.path.abspath(ds.images))
    return None


def relative_ref(ref: str | None, root: str | Path | None) -> str | None:
    """``ref`` relative to ``root`` (POSIX separators) when it lies under it; else unchanged."""
    if not ref or root is None or is_url(ref) or is_url(str(root)):
        return ref
    path, sep, member = ref.partition(TAR_SEP)
    if not os.path.isabs(path):
        return ref
    try:
        rel = Path(os.path.abspath(path)).relative_to(Path(root))
    except ValueError:
        return ref
    return rel.as_posix() + sep + member


def recorded_root(output: str | Path, root: str | Path | None) -> str | None:
    """How ``root`` is written into ``_manifest.json``: relative to ``output`` when inside it."""
    if root is None:
        return None
    if is_url(str(root)):
        return str(root)
    try:
        return Path(os.path.abspath(root)).relative_to(Path(os.path.abspath(output))).as_posix() or "."
    except ValueError:
        return str(Path(os.path.abspath(root)))


def resolve_ref(ref: str | None, root: str | Path | None) -> str | None:
    """An absolute reference (``None`` stays ``None``; absolute paths and URLs are unchanged)."""
    if not ref or is_url(ref):
        return ref
    path, sep, member = ref.partition(TAR_SEP)
    if os.path.isabs(path) or root is None:
        return ref
    if is_url(str(root)):
        return f"{str(root).rstrip('/')}/{path}{sep}{member}"
    return str(Path(root) / path) + sep + member


def find_image_root(samples_dir: str | Path, manifest=None, recorded: str | None = None) -> Path | None:
    """The image root of a samples artifact as it is found now (see the module docstring)."""
    samples_dir = Path(samples_dir)
    if recorded is None:
        import json

        try:
            recorded = json.loads((samples_dir / "_manifest.json").read_text()).get("image_root")
        except (OSError, ValueError):
            recorded = None
    candidates = []
    if recorded and is_url(recorded):  # a dataset on object storage: URLs resolve as they are
        return recorded
    if recorded:
        r = Path(recorded)
        candidates.append(r if r.is_absolute() else samples_dir.parent / r)
    if manifest is not None:
        from pipeline.io.storage import local_path

        own = dataset_image_root(manifest.dataset, local_path(manifest.output))  # an object-store output: its mirror
        if own is not None:
            candidates.append(own)
    for c in candidates:
        if c.is_dir():
            return Path(os.path.abspath(c))
    return Path(os.path.abspath(candidates[0])) if candidates else None


def image_resolver(samples_dir: str | Path, manifest=None) -> Callable[[str | None], str | None]:
    """``ref -> absolute ref`` for the images of the samples artifact at ``samples_dir``."""
    root = find_image_root(samples_dir, manifest)
    return lambda ref: resolve_ref(ref, root)
