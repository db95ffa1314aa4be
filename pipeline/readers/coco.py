"""COCO captions JSON (+ optional COCO instances JSON and scene-graph JSON).

* captions: ``{"images": [{"id", "file_name", ...}], "annotations": [{"id", "image_id", "caption"}]}``.
  One record per image id, ascending; captions ordered by annotation id. An optional non-standard
  ``"split"`` on an image entry (written by the generated dataset) sets the record's split;
  otherwise ``ds.split`` if given, else guessed from the file name (``val``/``test``/``train``).
  Annotations for an image id missing from ``images`` still give a record, with image None and a
  ``missing image field`` problem.
* instances: standard COCO instances; every ``segmentation`` (polygons, uncompressed or compressed
  RLE) is converted to compressed RLE. ``Instance.id`` is the annotation id; a non-standard
  ``"attributes"`` dict on an annotation is kept (values as text).
* scene graphs (format ``vlpipe-scene-graph/1``, see :mod:`pipeline.readers.scene_graph`).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterator

from pipeline.masks import segmentation_to_rle
from pipeline.readers.base import (
    MISSING_IMAGE_FIELD,
    Instance,
    ReaderError,
    SourceRecord,
    abspath,
    add_caption,
    finish,
    inside_root,
    load_json,
)
from pipeline.readers.scene_graph import attach_scene_graphs, load_scene_graphs


def guess_split(path: str | Path) -> str:
    name = Path(str(path)).name.lower()  # a UrlPath (s3://...) too
    for s in ("val", "test"):
        if s in name:
            return s
    return "train"


def _int_id(value, what: str, path: Path) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ReaderError(f"{what} {path}: id {value!r} is not an integer") from None


def load_instances(path: str | Path, sizes: dict[int, tuple[int, int]] | None = None,
                   defer_masks: bool = False) -> dict[int, list[Instance]]:
    """image id -> instances; ``sizes`` (image id -> (h, w)) fills in images the file lacks,
    which polygon masks need. ``defer_masks``: leave each segmentation as read
    (``{"segmentation", "height", "width"}``, see :func:`pipeline.masks.deferred_to_rle`) for the
    ingest workers to rasterise, instead of converting it here in the driver."""
    p = abspath(path)
    data = load_json(p, "COCO instances")
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise ReaderError(f"COCO instances {p}: expected an object with an 'annotations' list")
    cats = {c["id"]: c.get("name", str(c["id"])) for c in data.get("categories", [])}
    sizes = dict(sizes or {})
    sizes.update({
        int(im["id"]): (int(im.get("height", 0)), int(im.get("width", 0)))
        for im in data.get("images", [])
        if "id" in im and im.get("height") and im.get("width")
    })
    out: dict[int, list[Instance]] = defaultdict(list)
    for ann in data["annotations"]:
        try:
            image_id = int(ann["image_id"])
            x, y, w, h = (float(v) for v in ann["bbox"])
            seg = ann.get("segmentation")
            rle = None
            if seg:
                hh, ww = sizes.get(image_id, (0, 0))
                if isinstance(seg, list) and not (hh and ww):
                    raise ReaderError(
                        f"COCO instances {p}: annotation {ann.get('id')} has polygons but image "
                        f"{image_id} has no height/width"
                    )
                rle = {"segmentation": seg, "height": hh, "width": ww} if defer_masks else segmentation_to_rle(seg, hh, ww)
            attrs = ann.get("attributes") or {}
            out[image_id].append(
                Instance(
                    id=int(ann["id"]),
                    box=(x, y, x + w, y + h),
                    category=str(cats.get(ann.get("category_id"), ann.get("category_id"))),
                    mask_rle=rle,
                    attributes={str(k): str(v) for k, v in attrs.items()},
                )
            )
        except ReaderError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ReaderError(f"COCO instances {p}: bad annotation {ann.get('id')!r} ({e!r})") from None
    for lst in out.values():
        lst.sort(key=lambda i: i.id)
    return out


def read_coco(
    captions: str | Path,
    images: str | Path | None = None,
    instances: str | Path | None = None,
    scene_graphs: str | Path | None = None,
    split: str | None = None,
    defer_masks: bool = False,
) -> Iterator[SourceRecord]:
    cap_path = abspath(captions)
    data = load_json(cap_path, "COCO captions")
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise ReaderError(f"COCO captions {cap_path}: expected an object with an 'annotations' list")
    img_root = abspath(images) if images else None
    default_split = split or guess_split(cap_path)

    image_entries: dict[int, dict] = {}
    for im in data.get("images", []):
        if not isinstance(im, dict) or "id" not in im:
            raise ReaderError(f"COCO captions {cap_path}: an 'images' entry has no id")
        image_entries[_int_id(im["id"], "COCO captions", cap_path)] = im
    caps: dict[int, list[dict]] = defaultdict(list)
    for ann in data["annotations"]:
        if not isinstance(ann, dict) or "image_id" not in ann:
            raise ReaderError(f"COCO captions {cap_path}: an annotation has no image_id")
        caps[_int_id(ann["image_id"], "COCO captions", cap_path)].append(ann)

    sizes = {i: (int(im["height"]), int(im["width"])) for i, im in image_entries.items()
             if im.get("height") and im.get("width")}
    inst = load_instances(instances, sizes, defer_masks) if instances else {}
    graphs = load_scene_graphs(scene_graphs) if scene_graphs else {}

    for image_id in sorted(set(image_entries) | set(caps)):
        im = image_entries.get(image_id)
        rec = SourceRecord(source_id=str(image_id), image=None, captions=[], split=default_split)
        file_name = im.get("file_name") if im else None
        if not file_name:
            rec.problems.append((None, MISSING_IMAGE_FIELD))
        elif img_root is not None:
            rec.image, outside = inside_root(img_root, file_name)
            if outside:
                rec.problems.append((None, outside))
        if im and not split and im.get("split"):
            rec.split = str(im["split"])
        anns = sorted(caps.get(image_id, []), key=lambda a: (a.get("id") is None, a.get("id") or 0))
        for ann in anns:
            add_caption(rec, ann.get("caption"))
        rec.instances = list(inst.get(image_id, []))
        if image_id in graphs:
            caption_index = {int(a["id"]): i for i, a in enumerate(anns) if a.get("id") is not None}
            attach_scene_graphs(rec, graphs[image_id], caption_index)
        yield finish(rec)
