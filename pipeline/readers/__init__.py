"""Dataset readers: every supported source format -> a stream of :class:`SourceRecord`.

``read_dataset(ds, output_root)`` dispatches on ``ds.kind``; each reader module documents its
format. Relative paths in ``ds`` are taken relative to the current directory (the manifest loader
is expected to have resolved them already).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pipeline.readers.base import Instance, Phrase, ReaderError, Relation, SourceRecord
from pipeline.readers.images import ImageError, open_image

if TYPE_CHECKING:  # the lead's config module; readers only use its attribute names
    from pipeline.config import DatasetConfig

__all__ = [
    "Instance", "Phrase", "Relation", "SourceRecord", "ReaderError", "ImageError",
    "open_image", "read_dataset", "synthetic_root",
]


def _need(ds, attr: str) -> str:
    value = getattr(ds, attr, None)
    if not value:
        raise ReaderError(f"dataset.kind={ds.kind} needs dataset.{attr}")
    return value


def synthetic_root(ds, output_root: Path) -> Path:
    root = getattr(ds.synthetic, "root", None)
    return Path(root) if root else Path(output_root) / "source" / "synthetic"


def read_dataset(ds: "DatasetConfig", output_root: Path, defer_masks: bool = False) -> Iterator[SourceRecord]:
    """``defer_masks``: COCO segmentations stay as read, rasterised later (by the ingest workers).
    With ``ds.splits`` every record's split is assigned from its key's hash (pipeline/readers/splits.py),
    replacing the reader's own (read with ``split: None``), and ``ds.split`` keeps one assigned split."""
    if getattr(ds, "splits", None) is None:
        return _read_records(ds, output_root, defer_masks)
    from pipeline.readers.splits import assign_splits

    return assign_splits(_read_records(ds.model_copy(update={"split": None}), output_root, defer_masks),
                         ds.splits, keep=ds.split)


def _read_records(ds: "DatasetConfig", output_root: Path, defer_masks: bool) -> Iterator[SourceRecord]:
    kind = ds.kind
    if kind == "coco":
        from pipeline.readers.coco import read_coco

        return read_coco(_need(ds, "captions"), ds.images, ds.instances, ds.scene_graphs, ds.split, defer_masks=defer_masks)
    if kind == "karpathy":
        from pipeline.readers.karpathy import read_karpathy

        return read_karpathy(_need(ds, "captions"), ds.images, ds.split)
    if kind == "flickr30k_entities":
        from pipeline.readers.flickr import read_flickr30k_entities

        return read_flickr30k_entities(_need(ds, "path"), ds.images, ds.split)
    if kind == "cc3m_tsv":
        from pipeline.readers.cc3m import read_cc3m_tsv

        return read_cc3m_tsv(_need(ds, "captions"), ds.images, ds.split)
    if kind == "webdataset":
        from pipeline.readers.wds import read_webdataset

        from pipeline.readers.wds import DEFAULT_MAX_MEMBER_BYTES

        return read_webdataset(_need(ds, "path"), ds.split, max_member_bytes=getattr(ds, "max_member_bytes", DEFAULT_MAX_MEMBER_BYTES))
    if kind == "folder":
        from pipeline.readers.folder import read_folder

        return read_folder(_need(ds, "images"), ds.captions, ds.split)
    if kind == "synthetic":
        from pipeline.readers.coco import read_coco
        from pipeline.synthetic.generate import generate

        s = ds.synthetic
        paths = generate(
            synthetic_root(ds, output_root), n_images=s.n_images, seed=s.seed, image_size=s.image_size,
            captions_per_image=s.captions_per_image, min_objects=s.min_objects, max_objects=s.max_objects,
            corrupt_images=s.corrupt_images, empty_captions=s.empty_captions, heldout=s.heldout, vocabulary=s.vocabulary,
            first_id=s.first_id, twins=s.twins,
        )
        # Read back through the real COCO reader so that path is exercised by the demo too.
        # The generated COCO JSON carries each image's split, so ds.split filters here.
        records = read_coco(paths["captions"], paths["images"], paths["instances"], paths["scene_graphs"], defer_masks=defer_masks)
        return (r for r in records if not ds.split or r.split == ds.split)
    raise ReaderError(f"unknown dataset.kind {kind!r}")
