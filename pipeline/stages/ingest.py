"""Read an image-caption dataset into the `samples` artifact (samples, captions, annotations).

Ids: ``sample_id`` is the record's position in the reader's deterministic order and
``caption_id`` the caption's position over all captions, rejected ones included, so ids do not
move when one bad record is fixed and the dataset is ingested again. Images are opened and fully
decoded in parallel (a truncated JPEG passes a header check but fails to decode); a sample whose
image is missing or unreadable is rejected with all its captions, a bad caption alone is dropped.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import Field

from pipeline.io.atomic import fingerprint
from pipeline.loaders.samples import dataset_image_root, recorded_root, relative_ref
from pipeline.masks import BadPolygon, deferred_to_rle
from pipeline.readers.base import MISSING_IMAGE_FIELD
from pipeline.readers.images import DEFAULT_MAX_IMAGE_BYTES, ImageTooLarge, NotAFile
from pipeline.stage import RunContext, StageConfig, StageError, describe_exception, unit_writer

log = logging.getLogger("pipeline")

# Dataset kinds whose images live under dataset.images: without it the dataset is caption-only.
CAPTION_ONLY_KINDS = ("coco", "karpathy")

NAME = "ingest"
READS: list[str] = []
WRITES = ["samples"]


class Config(StageConfig):
    shard_size: int = Field(5000, ge=1, description="samples per shard")
    verify_images: Literal["decode", "header", "none"] = Field(
        "decode", description="decode: open and decode every image; header: read size only; none: trust paths"
    )
    min_caption_chars: int = Field(1, ge=1, description="shorter captions (after stripping) are rejected")
    max_pixels: int = Field(
        50_000_000, ge=1,
        description="reject images with more decoded pixels than this (read from the header, before decoding); "
        "the encoders resize to <= 1333 px sides, so 50 MP is far above anything they use",
    )
    max_image_bytes: int = Field(
        DEFAULT_MAX_IMAGE_BYTES, ge=1,
        description="reject image files (and tar members) larger than this many bytes, from their size, before "
        "reading them; devices, FIFOs and folders named as images are rejected too (not_a_file)",
    )


SAMPLES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("source_id", pa.string()),
        ("image", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("split", pa.string()),
    ]
)
CAPTIONS_SCHEMA = pa.schema([("caption_id", pa.int64()), ("sample_id", pa.int64()), ("text", pa.string())])
INSTANCES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("instance_id", pa.int64()),
        ("category", pa.string()),
        ("box", pa.list_(pa.float32(), 4)),
        ("mask_rle", pa.string()),
        ("attributes", pa.string()),
    ]
)
RELATIONS_SCHEMA = pa.schema(
    [("sample_id", pa.int64()), ("subject", pa.int64()), ("object", pa.int64()), ("predicate", pa.string())]
)
PHRASES_SCHEMA = pa.schema(
    [
        ("caption_id", pa.int64()),
        ("sample_id", pa.int64()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("text", pa.string()),
        ("instance_ids", pa.list_(pa.int64())),
    ]
)


def _image_stat(ref: str | None) -> list:
    """What an image's bytes are taken to be, for the unit fingerprint (size and mtime)."""
    if not ref:
        return [None]
    path = ref.split("::", 1)[0]
    try:
        if "://" in path:  # an object (URL): its size and version (ETag)
            from pipeline.io.storage import url_info

            info = url_info(path)
            return [ref, info["size"], str(info["version"])]
        st = os.stat(path)
        return [ref, st.st_size, st.st_mtime_ns]
    except OSError:
        return [ref, None]


def _record_payload(rec, sample_id: int, first_caption_id: int) -> dict:
    return {
        "sample_id": sample_id,
        "first_caption_id": first_caption_id,
        "source_id": rec.source_id,
        "image": rec.image,
        "captions": list(rec.captions),
        "split": rec.split,
        "problems": [list(p) for p in rec.problems],
        "instances": [
            {
                "id": i.id,
                "box": list(i.box),
                "category": i.category,
                "mask_rle": i.mask_rle,
                "attributes": i.attributes,
            }
            for i in rec.instances
        ],
        "relations": [[r.subject, r.object, r.predicate] for r in rec.relations],
        "phrases": [[p.caption_index, p.start, p.end, p.text, list(p.instance_ids)] for p in rec.phrases],
    }


def _image_size(ref: str, mode: str, max_pixels: int | None = None, max_bytes: int | None = None) -> tuple[int, int]:
    from pipeline.readers.images import image_header_size, open_image

    path = ref.split("::", 1)[0]
    if "://" not in path and not os.path.exists(path):  # a URL's absence shows when it is read
        raise FileNotFoundError("file not found")
    if mode == "decode":
        return open_image(ref, max_pixels=max_pixels, max_bytes=max_bytes).size
    return image_header_size(ref, max_pixels=max_pixels, max_bytes=max_bytes)


def _reason(problem: str, default: str) -> str:
    """errors.parquet reason code for a problem text reported by a reader."""
    from pipeline.readers import base

    codes = {
        base.EMPTY_CAPTION: "empty_caption",
        base.NOT_UTF8: "caption_not_utf8",
        base.NO_CAPTIONS: "no_captions",
        base.MISSING_IMAGE_FIELD: "missing_image",
    }
    if problem.startswith(base.PATH_OUTSIDE_ROOT):
        return "path_outside_root"
    if problem.startswith("member ") and "max_member_bytes" in problem:
        return "member_too_large"
    return codes.get(problem, default)


def ingest_unit(payload: dict) -> dict:
    """Worker: validate one shard of records and write its tables."""
    w = unit_writer(payload)
    mode, min_chars = payload["verify_images"], payload["min_caption_chars"]
    samples, captions, instances, relations, phrases = [], [], [], [], []
    for r in payload["records"]:
        sid, src = r["sample_id"], r["source_id"]
        whole = [reason for idx, reason in r["problems"] if idx is None]
        bad_caps = {idx: reason for idx, reason in r["problems"] if idx is not None}
        if whole:
            w.error(_reason(whole[0], "bad_record"), "; ".join(whole), sample_id=sid, source_id=src)
            continue
        width = height = None
        if r["image"] is None:
            if mode != "none":
                w.error("missing_image", "record has no image reference", sample_id=sid, source_id=src)
                continue
        elif mode != "none":
            try:
                width, height = _image_size(r["image"], mode, payload.get("max_pixels"), payload.get("max_image_bytes"))
            except FileNotFoundError as e:
                w.error("missing_image", f"{r['image']}: {e}", sample_id=sid, source_id=src)
                continue
            except ImageTooLarge as e:
                w.error("image_too_large", str(e), sample_id=sid, source_id=src)
                continue
            except NotAFile as e:
                w.error("not_a_file", str(e), sample_id=sid, source_id=src)
                continue
            except Exception as e:  # PIL raises many types for corrupt data
                w.error("unreadable_image", f"{r['image']}: {describe_exception(e)}", sample_id=sid, source_id=src)
                continue
        kept = []
        for k, text in enumerate(r["captions"]):
            cid = r["first_caption_id"] + k
            if k in bad_caps:
                w.error(_reason(bad_caps[k], "bad_caption"), bad_caps[k], sample_id=sid, caption_id=cid, source_id=src)
            elif text is None or len(text.strip()) < min_chars:
                w.error("empty_caption", f"caption {k} is empty", sample_id=sid, caption_id=cid, source_id=src)
            else:
                kept.append({"caption_id": cid, "sample_id": sid, "text": text.strip()})
        if not kept:
            w.error("no_captions", "no usable caption left", sample_id=sid, source_id=src)
            continue
        try:  # COCO polygons are rasterised here, in the worker (the reader defers them)
            masks = [deferred_to_rle(inst["mask_rle"]) for inst in r["instances"]]
        except BadPolygon as e:
            w.error("bad_polygon", f"instance mask: {e}", sample_id=sid, source_id=src)
            continue
        except Exception as e:
            w.error("bad_mask", f"instance mask: {describe_exception(e)}", sample_id=sid, source_id=src)
            continue
        # stored relative to the dataset's image root (pipeline.loaders.samples resolves it on read)
        image = relative_ref(r["image"], payload.get("image_root"))
        samples.append({"sample_id": sid, "source_id": src, "image": image, "width": width, "height": height, "split": r["split"]})
        captions.extend(kept)
        kept_ids = {c["caption_id"] for c in kept}
        for inst, mask in zip(r["instances"], masks):
            instances.append(
                {
                    "sample_id": sid,
                    "instance_id": inst["id"],
                    "category": inst["category"],
                    "box": [float(x) for x in inst["box"]],
                    "mask_rle": json.dumps(mask) if mask else None,
                    "attributes": json.dumps(inst["attributes"], sort_keys=True),
                }
            )
        for s, o, p in r["relations"]:
            relations.append({"sample_id": sid, "subject": s, "object": o, "predicate": p})
        for cidx, start, end, text, inst_ids in r["phrases"]:
            cid = r["first_caption_id"] + cidx
            if cid in kept_ids:
                phrases.append(
                    {"caption_id": cid, "sample_id": sid, "start": start, "end": end, "text": text, "instance_ids": inst_ids}
                )
    w.write_table("samples", pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA))
    w.write_table("captions", pa.Table.from_pylist(captions, schema=CAPTIONS_SCHEMA))
    if payload["has_annotations"]:
        w.write_table("instances", pa.Table.from_pylist(instances, schema=INSTANCES_SCHEMA))
        w.write_table("relations", pa.Table.from_pylist(relations, schema=RELATIONS_SCHEMA))
        w.write_table("phrases", pa.Table.from_pylist(phrases, schema=PHRASES_SCHEMA))
    res = w.commit({"rows": len(samples), "captions": len(captions), "rejected": len(w.errors)})
    return {"unit": res.unit, "stats": res.stats}


def _annotated(ds) -> bool:
    """Whether the dataset kind carries boxes / relations / phrases (decided before reading it)."""
    return ds.kind in ("synthetic", "flickr30k_entities") or (ds.kind == "coco" and bool(ds.instances or ds.scene_graphs))


def run(ctx: RunContext, cfg: Config) -> dict:
    """Streams the reader: records are packed into units of ``shard_size`` as they are read and
    handed to the workers in bounded waves (:mod:`pipeline.streaming`); the driver never holds
    more than one wave, whatever the dataset's size. Image checks and mask conversion run in the
    workers; the driver only stats image files for the unit fingerprints."""
    from pipeline.readers import read_dataset
    from pipeline.crashes import RECORDS
    from pipeline.streaming import run_units_stream

    ds = ctx.manifest.dataset
    verify = cfg.verify_images
    caption_only = ds.kind in CAPTION_ONLY_KINDS and not ds.images
    if caption_only:
        # The design's caption-only datasets (C3 concept mining, negative captions): no image root,
        # so nothing to check; image stages refuse such a samples artifact with a clear line.
        log.info("ingest: dataset.images is not set: caption-only dataset, image checks off (image stages will not run)")
        verify = "none"
    has_ann = _annotated(ds)
    params = {"dataset": ds.model_dump(mode="json"), "limit": ctx.limit, **cfg.model_dump(mode="json")}
    params.pop("enabled", None)
    writer = ctx.writer("samples", NAME, params)
    image_root = None if caption_only else dataset_image_root(ds, ctx.output)
    counts = {"records": 0}

    def records():
        try:
            for rec in read_dataset(ds, ctx.output, defer_masks=True):
                if caption_only:
                    rec.image = None
                    rec.problems = [p for p in rec.problems if p[1] != MISSING_IMAGE_FIELD]
                counts["records"] += 1
                yield rec
                if ctx.limit is not None and counts["records"] >= ctx.limit:
                    return
        except (OSError, ValueError) as e:
            raise StageError(f"dataset ({ds.kind}): {e}") from None

    def units():
        next_caption, chunk, u = 0, [], 0
        stats: dict = {}  # tar shard -> (size, mtime): one stat per shard, not per member
        for rec in records():
            chunk.append(_record_payload(rec, counts["records"] - 1, next_caption))
            next_caption += len(rec.captions)
            if len(chunk) == cfg.shard_size:
                yield unit(u, chunk, stats)
                chunk, u, stats = [], u + 1, {}
        if chunk:
            yield unit(u, chunk, stats)

    def unit(u: int, chunk: list[dict], stats: dict):
        def stat(ref):
            path = ref.split("::", 1)[0] if ref else None
            if path not in stats:
                stats[path] = _image_stat(path)[1:]
            return stats[path]

        # image references as stored (relative to the root): an output moved with its dataset redoes nothing
        rel = [dict(r, image=relative_ref(r["image"], image_root)) for r in chunk]
        unit_input = fingerprint(rel, [[relative_ref(r["image"], image_root), *stat(r["image"])] for r in chunk])
        payload = {
            "records": chunk,
            "verify_images": verify,
            "max_pixels": cfg.max_pixels,
            "max_image_bytes": cfg.max_image_bytes,
            "min_caption_chars": cfg.min_caption_chars,
            "has_annotations": has_ann or any(r["instances"] or r["relations"] or r["phrases"] for r in chunk),
            "image_root": str(image_root) if image_root else None,
        }
        return f"{u:05d}", unit_input, payload

    names = run_units_stream(ctx, writer, units(), ingest_unit, input_rows=lambda: counts["records"], split=RECORDS)
    if not counts["records"]:
        raise StageError(f"dataset ({ds.kind}) has no records")
    has_ann = has_ann or any('"instances"' in json.dumps(writer.marker(n) or {}) for n in names)
    schema = {
        "samples": str(SAMPLES_SCHEMA),
        "captions": str(CAPTIONS_SCHEMA),
    }
    if has_ann:
        schema.update(instances=str(INSTANCES_SCHEMA), relations=str(RELATIONS_SCHEMA), phrases=str(PHRASES_SCHEMA))
    m = writer.finalize(names, extra={"dataset_kind": ds.kind, "caption_only": caption_only,
                                      "image_root": recorded_root(ctx.output, image_root)}, schema=schema)
    return {
        "samples": m["tables"]["samples"]["rows"],
        "captions": m["tables"]["captions"]["rows"],
        "errors": m["errors"]["rows"],
        "path": str(writer.location),
    }
