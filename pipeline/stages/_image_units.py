"""Shared plumbing of the frozen-image-encoder stages (clip tokens, image groups, regions).

* :func:`image_units` turns the ``samples`` artifact into units of at most ``shard_size`` samples
  (one output shard each; bounded shard size), each payload carrying image references and, when
  asked, the sample's captions (and ground-truth boxes for the ``annotations`` detector backend).
  A unit's fingerprint covers its records, so an edit of one input shard redoes only its units.
* :func:`prefetched_batches` decodes the next batch of images in a background thread while the
  model encodes the current one (PIL decoding and resizing release the GIL), and reports
  unreadable images as they are met so the unit writes them to ``errors/errors.parquet``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import polars as pl

from pipeline.io.atomic import fingerprint
from pipeline.stage import RunContext, StageError, describe_exception


def load_samples(ctx: RunContext, with_captions: bool, with_instances: bool = False) -> tuple[list[dict], dict]:
    """Records ``{sample_id, image, source_id, captions: [[caption_id, text], ...]}`` in sample_id
    order (first ``ctx.limit``), and the input fingerprints for provenance."""
    art = ctx.artifact("samples")
    samples = art.scan("samples").select("sample_id", "source_id", "image", "width", "height").sort("sample_id").collect()
    if ctx.limit is not None:
        samples = samples.head(ctx.limit)
    if samples.height == 0:
        raise StageError("samples artifact has no samples")
    if samples["image"].null_count() == samples.height:
        raise StageError(
            "the samples artifact is caption-only (ingested without dataset.images): this image stage cannot run; "
            "set dataset.images and run ingest again"
        )
    recs = samples.to_dicts()
    # samples.image is relative to the dataset's image root: resolved here for every image stage
    # (``image_path``; ``image`` stays as stored, so unit fingerprints survive a moved output)
    from pipeline.loaders.samples import image_resolver

    resolve = image_resolver(art.dir, ctx.manifest)
    for r in recs:
        r["image_path"] = resolve(r["image"])
    if with_captions:
        caps = (
            art.scan("captions")
            .filter(pl.col("sample_id").is_in(samples["sample_id"].implode()))
            .sort("caption_id")
            .group_by("sample_id", maintain_order=True)
            .agg(pl.col("caption_id"), pl.col("text"))
            .collect()
        )
        by_id = {r["sample_id"]: [[c, t] for c, t in zip(r["caption_id"], r["text"])] for r in caps.to_dicts()}
        for r in recs:
            r["captions"] = by_id.get(r["sample_id"], [])
    if with_instances:
        if "instances" not in art.tables():
            raise StageError("the samples artifact has no `instances` table (ground-truth boxes); use another detector backend")
        inst = (
            art.scan("instances")
            .filter(pl.col("sample_id").is_in(samples["sample_id"].implode()))
            .sort("sample_id", "instance_id")
            .group_by("sample_id", maintain_order=True)
            .agg(pl.col("instance_id"), pl.col("box"), pl.col("category"))
            .collect()
        )
        by_id = {
            r["sample_id"]: {"instance_ids": list(r["instance_id"]), "boxes": [list(b) for b in r["box"]], "categories": list(r["category"])}
            for r in inst.to_dicts()
        }
        for r in recs:
            r["instances"] = by_id.get(r["sample_id"], {"instance_ids": [], "boxes": [], "categories": []})
    return recs, {"samples": art.fingerprint}


def image_units(records: list[dict], shard_size: int) -> list[tuple[str, object, dict]]:
    units = []
    for u, start in enumerate(range(0, len(records), shard_size)):
        chunk = records[start : start + shard_size]
        stored = [{k: v for k, v in r.items() if k != "image_path"} for r in chunk]  # where the images are found now is not content
        units.append((f"{u:05d}", fingerprint(stored), {"records": chunk}))
    return units


def prefetched_batches(
    records: list[dict], batch_size: int, decode: Callable[[list[dict]], tuple[list[dict], object, list[tuple[dict, str]]]],
    failure=None,
) -> Iterator[tuple[list[dict], object, list[tuple[dict, str]], float]]:
    """Yield ``(kept records, decoded batch, failures, decode seconds)`` per batch, decoding batch
    i+1 in a thread while the caller works on batch i. ``decode(records)`` returns the records it
    could decode, their model input and ``(record, reason)`` for the rest."""

    def timed(chunk):
        t0 = time.perf_counter()
        out = isolated_decode(decode, chunk, failure)
        return (*out, time.perf_counter() - t0)

    chunks = [records[i : i + batch_size] for i in range(0, len(records), batch_size)]
    if not chunks:
        return
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(timed, chunks[0])
        for k in range(len(chunks)):
            result = fut.result()
            if k + 1 < len(chunks):
                fut = pool.submit(timed, chunks[k + 1])
            yield result


def isolated_decode(decode, records: list[dict], failure=None):
    """``decode(records)``; when it raises for the batch (a processor that cannot resize a 1x300
    image, say), decode each record alone to find the ones it fails on, report them as failures
    (``failure(record, exception)``, default ``(record, "Type: message")``) and decode the rest
    together: the shared error policy of :mod:`pipeline.stage`, applied to decoding."""
    failure = failure or (lambda r, e: (r, describe_exception(e)))
    try:
        return decode(records)
    except Exception as e:
        if len(records) == 1:
            return [], None, [failure(records[0], e)]
    kept, failed = [], []
    for r in records:
        try:
            decode([r])
            kept.append(r)
        except Exception as e:
            failed.append(failure(r, e))
    if not kept:
        return [], None, failed
    k2, batch, f2 = decode(kept)
    return k2, batch, failed + list(f2)


def decoded_batches(w, records: list[dict], batch_size: int, decode, times: dict) -> Iterator[tuple[list[dict], object]]:
    """:func:`prefetched_batches` for a unit writer ``w``: unreadable images become the unit's
    ``unreadable_image`` errors, empty batches are skipped, decode time accumulates in
    ``times["decode_s"]``. Yields ``(kept records, decoded batch)``."""
    for kept, batch, failed, dt in prefetched_batches(records, batch_size, decode):
        times["decode_s"] = times.get("decode_s", 0.0) + dt
        for r, reason in failed:
            w.error("unreadable_image", f"{r.get('image_path') or r['image']}: {reason}", sample_id=r["sample_id"], source_id=r["source_id"])
        if kept:
            yield kept, batch


def open_images(records: list[dict]):
    """Open each record's image; returns (kept records, PIL images, failures)."""
    from pipeline.readers.images import open_image

    kept, images, failed = [], [], []
    for r in records:
        try:
            images.append(open_image(r.get("image_path") or r["image"]))
            kept.append(r)
        except Exception as e:  # ImageError, or anything PIL raises on garbage
            failed.append((r, describe_exception(e)))
    return kept, images, failed
