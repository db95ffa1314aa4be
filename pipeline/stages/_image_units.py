"""Shared plumbing of the frozen-image-encoder stages (clip tokens, image groups, regions, visual tokens).

* :func:`plan_image_units` plans units of at most ``shard_size`` samples (one output shard each)
  from cheap columnar metadata of the ``samples`` artifact: the int64 ``sample_id`` column of its
  ``samples`` files (one numpy array, 8 bytes a sample) and the Parquet footers of its other
  tables. The driver never builds a Python object per sample: a unit's payload is a small
  descriptor (the ``[lo, hi]`` sample-id range, the files of each table that hold ids in it, the
  image root), and the worker reads its own slice (:func:`unit_records`: Parquet predicate
  pushdown on those few files) and resolves image references itself
  (:func:`pipeline.loaders.samples.resolve_ref`). A unit's fingerprint is its range, its size and
  the sha256s (from ``samples/_manifest.json``) of the files it reads, so an edit of one input
  shard redoes only the units that read it; the samples artifact's whole fingerprint is kept in
  the output's ``_manifest.json`` as provenance, outside the unit fingerprints.
* :func:`image_units` makes the same kind of units from records already in memory (a worker
  called directly by a test or a benchmark); workers take either payload (:func:`unit_records`).
* :func:`prefetched_batches` decodes the next batch of images in a background thread while the
  model encodes the current one (PIL decoding and resizing release the GIL), and reports
  unreadable images as they are met so the unit writes them to ``errors/errors.parquet``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from pipeline.crashes import RECORDS, SampleSplit
from pipeline.io.artifacts import Artifact
from pipeline.io.atomic import fingerprint
from pipeline.stage import RunContext, StageError, describe_exception

SAMPLE_COLUMNS = ["sample_id", "source_id", "image", "width", "height"]
# what a unit attaches to its records, and the samples tables each needs
ATTACH_TABLES = {"captions": "captions", "boxes": "instances", "instances": "instances", "relations": "relations",
                 "scene": "instances"}  # scene: box, category and attributes of every instance (the scene-oracle's input)


@dataclass
class ImagePlan:
    """The units of an image stage, and what the stage records about its input."""

    units: list[tuple[str, object, dict]]
    inputs: dict  # provenance for _manifest.json (``input_fingerprints``), not part of unit fingerprints
    rows: int  # samples the stage reads (after ``--limit``)


def _file_id_range(path) -> tuple[int, int] | None:
    """``(min, max)`` of a Parquet file's ``sample_id`` from its footer statistics; ``None`` when
    the file has no rows; ``(-inf, inf)``-like bounds when statistics are absent."""
    md = pq.ParquetFile(path).metadata
    if md.num_rows == 0:
        return None
    col = md.schema.names.index("sample_id")
    lo, hi = None, None
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows == 0:
            continue
        st = rg.column(col).statistics
        if st is None or not st.has_min_max:
            return (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
        lo = st.min if lo is None else min(lo, st.min)
        hi = st.max if hi is None else max(hi, st.max)
    return None if lo is None else (int(lo), int(hi))


def _image_nulls(paths) -> int:
    """Null ``image`` references in these samples files (footer statistics; read when absent)."""
    n = 0
    for p in paths:
        md = pq.ParquetFile(p).metadata
        col = md.schema.names.index("image")
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(col).statistics
            if st is None or not st.has_null_count:
                return sum(pq.read_table(q, columns=["image"]).column("image").null_count for q in paths)
            n += st.null_count
    return n


def plan_image_units(ctx: RunContext, shard_size: int, attach: tuple[str, ...] = (), missing_hint: str = "") -> ImagePlan:
    """Units of at most ``shard_size`` samples in sample_id order (the first ``ctx.limit``).

    ``attach`` names what each record gets besides its sample columns: ``captions``
    (``[[caption_id, text], ...]``), ``boxes`` (the ``instances`` table as ``{instance_ids,
    boxes, categories}``, for the regions stage), ``instances`` (the ``instances`` rows with their
    masks, for visual tokens), ``relations`` (the scene-graph rows). ``missing_hint`` ends the
    error when a table these need is absent (what to configure instead)."""
    art = ctx.artifact("samples")
    for a in attach:
        if a not in ATTACH_TABLES:
            raise ValueError(f"unknown attachment {a!r}")
    needed = sorted({ATTACH_TABLES[a] for a in attach})
    entries = art.shard_entries("samples")
    files = art.files("samples")
    # one int64 column, 8 bytes a sample: the sample ids in file order (ingest writes them sorted)
    parts = [pq.read_table(f, columns=["sample_id"]).column("sample_id").to_numpy() for f in files]
    counts = np.asarray([len(a) for a in parts], np.int64)
    ids = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
    del parts
    which = None  # each id's file, only when the files are not in sample_id order
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        which = np.repeat(np.arange(len(files), dtype=np.int32), counts)
        order = np.argsort(ids, kind="stable")
        ids, which = ids[order], which[order]
        del order
        if bool((ids[1:] == ids[:-1]).any()):
            raise StageError("the samples artifact holds a sample_id twice; run ingest again")
    if ctx.limit is not None:
        ids = ids[: ctx.limit]
    if len(ids) == 0:
        raise StageError("samples artifact has no samples")
    ends = np.cumsum(counts)  # sorted case: position p lives in file searchsorted(ends, p, "right")

    def files_of(start: int, stop: int) -> list[int]:
        if which is not None:
            return np.unique(which[start:stop]).tolist()
        first, last = np.searchsorted(ends, [start, stop - 1], side="right").tolist()
        return [i for i in range(first, last + 1) if counts[i]]

    used = files_of(0, len(ids))
    if _image_nulls([files[i] for i in used]) == sum(int(pq.ParquetFile(files[i]).metadata.num_rows) for i in used):
        raise StageError(
            "the samples artifact is caption-only (ingested without dataset.images): this image stage cannot run; "
            "set dataset.images and run ingest again"
        )
    missing = [t for t in needed if t not in art.tables()]
    if missing:
        raise StageError(f"the samples artifact has no {' / '.join(missing)} table: the dataset has no annotations; {missing_hint}")
    # the other tables: each file's sample_id range from its footer
    others = {}
    for t in needed:
        kept = [(e, r) for e, f in zip(art.shard_entries(t), art.files(t)) if (r := _file_id_range(f)) is not None]
        bounds = np.asarray([r for _, r in kept], np.int64).reshape(-1, 2)
        others[t] = ([e for e, _ in kept], bounds[:, 0], bounds[:, 1])
    from pipeline.loaders.samples import find_image_root

    root = find_image_root(art.local, ctx.manifest)
    units = []
    for u, start in enumerate(range(0, len(ids), shard_size)):
        stop = min(len(ids), start + shard_size)
        lo, hi = int(ids[start]), int(ids[stop - 1])
        tables = {"samples": [entries[i] for i in files_of(start, stop)]}
        for t, (es, first, last) in others.items():
            tables[t] = [es[i] for i in np.flatnonzero((first <= hi) & (last >= lo))]
        desc = {
            "location": str(art.location),
            "image_root": None if root is None else str(root),
            "range": [lo, hi],
            "rows": stop - start,
            "files": {t: [e["path"] for e in es] for t, es in tables.items()},
            "attach": list(attach),
        }
        # what the unit's output depends on: its slice, named by the bytes of the files it reads
        unit_input = {"range": [lo, hi], "rows": stop - start, "attach": list(attach),
                      "files": {t: [e["sha256"] for e in es] for t, es in tables.items()}}
        units.append((f"{u:05d}", unit_input, {"slice": desc}))
    return ImagePlan(units, {"samples": art.fingerprint}, int(len(ids)))


def image_writer(ctx: RunContext, artifact: str, stage: str, params: dict, plan: ImagePlan, models: dict):
    """The stage's :class:`~pipeline.io.artifacts.ArtifactWriter`, its ``_manifest.json`` naming
    the samples artifact it read (``input_fingerprints``) while unit fingerprints name only the
    files each unit reads (a changed samples shard redoes the units that read it, not all)."""
    writer = ctx.writer(artifact, stage, params, models=models)
    writer.inputs = dict(plan.inputs)  # provenance only: the base fingerprint was made without it
    return writer


def read_slice(desc: dict) -> list[dict]:
    """The records of one planned unit (see :func:`plan_image_units`), read in the worker: the
    samples of ``desc["range"]`` from the unit's own files, with image references resolved against
    the image root and the asked-for annotations attached. Bounded by the unit, not the dataset.
    ``desc["only"]`` (set by :data:`IMAGE_UNITS`) keeps just those sample ids of the range."""
    from pipeline.loaders.samples import resolve_ref

    art = Artifact(desc["location"])
    lo, hi = desc["range"]
    in_range = pl.col("sample_id").is_between(lo, hi)
    if desc.get("only") is not None:
        in_range = in_range & pl.col("sample_id").is_in(desc["only"])

    def scan(table: str) -> pl.LazyFrame:
        return pl.scan_parquet([str(art.local_file(rel)) for rel in desc["files"][table]]).filter(in_range)

    samples = scan("samples").select(SAMPLE_COLUMNS).sort("sample_id").collect()
    if samples.height != desc["rows"]:
        raise StageError(f"samples {lo}..{hi}: {samples.height} rows read, {desc['rows']} planned (the samples artifact changed under the run)")
    recs = samples.to_dicts()
    root = desc.get("image_root")
    for r in recs:
        r["image_path"] = resolve_ref(r["image"], root)
    for a in desc.get("attach", []):
        files = desc["files"][ATTACH_TABLES[a]]
        if a == "captions":
            by_id = {}
            if files:
                caps = (scan("captions").sort("caption_id").group_by("sample_id", maintain_order=True)
                        .agg(pl.col("caption_id"), pl.col("text")).collect())  # fmt: skip
                by_id = {r["sample_id"]: [[c, t] for c, t in zip(r["caption_id"], r["text"])] for r in caps.to_dicts()}
            for r in recs:
                r["captions"] = by_id.get(r["sample_id"], [])
        elif a == "boxes":
            by_id = {}
            if files:
                inst = (scan("instances").sort("sample_id", "instance_id").group_by("sample_id", maintain_order=True)
                        .agg(pl.col("instance_id"), pl.col("box"), pl.col("category")).collect())  # fmt: skip
                by_id = {
                    r["sample_id"]: {"instance_ids": list(r["instance_id"]), "boxes": [list(b) for b in r["box"]], "categories": list(r["category"])}
                    for r in inst.to_dicts()
                }
            for r in recs:
                r["instances"] = by_id.get(r["sample_id"], {"instance_ids": [], "boxes": [], "categories": []})
        elif a == "instances":
            by = {}
            if files:
                inst = scan("instances").select("sample_id", "instance_id", "category", "box", "mask_rle").sort("sample_id", "instance_id").collect()
                for row in inst.to_dicts():
                    row["box"] = [float(x) for x in row["box"]]
                    by.setdefault(row.pop("sample_id"), []).append(row)
            for r in recs:
                r["instances"] = by.get(r["sample_id"], [])
        elif a == "scene":
            by = {}
            if files:
                inst = (scan("instances").select("sample_id", "instance_id", "category", "box", "attributes")
                        .sort("sample_id", "instance_id").collect())  # fmt: skip
                for row in inst.to_dicts():
                    row["box"] = [float(x) for x in row["box"]]
                    by.setdefault(row.pop("sample_id"), []).append(row)
            for r in recs:
                r["scene"] = by.get(r["sample_id"], [])
        elif a == "relations":
            by = {}
            if files:
                for row in scan("relations").collect().to_dicts():
                    by.setdefault(row.pop("sample_id"), []).append(row)
            for r in recs:
                r["relations"] = by.get(r["sample_id"], [])
    return recs


def unit_records(payload: dict) -> list[dict]:
    """A unit's records: read from its slice (:func:`plan_image_units`), or carried in the payload
    (:func:`image_units`). Call after :func:`pipeline.stage.unit_writer` (which configures object
    storage from the payload, for a remote samples artifact)."""
    if "slice" in payload:
        return read_slice(payload["slice"])
    return payload["records"]


def _unit_ids(payload: dict) -> list[dict]:
    if "slice" not in payload:
        return RECORDS.ids(payload)
    desc = payload["slice"]
    keep = pl.col("sample_id").is_between(*desc["range"])
    if desc.get("only") is not None:
        keep = keep & pl.col("sample_id").is_in(desc["only"])
    art = Artifact(desc["location"])
    files = [str(art.local_file(rel)) for rel in desc["files"]["samples"]]
    return pl.scan_parquet(files).filter(keep).select("sample_id", "source_id").sort("sample_id").collect().to_dicts()


def _keep_ids(payload: dict, sample_ids: list[int]) -> dict:
    if "slice" not in payload:
        return RECORDS.keep(payload, sample_ids)
    return dict(payload, slice=dict(payload["slice"], only=sorted(sample_ids), rows=len(sample_ids)))


# An image stage's units taken apart by sample (a sample that kills its worker, pipeline.crashes).
IMAGE_UNITS = SampleSplit(_unit_ids, _keep_ids)


def image_units(records: list[dict], shard_size: int) -> list[tuple[str, object, dict]]:
    """Units carrying ``records`` already in memory (tests and benchmarks calling a worker
    directly); a stage plans its units with :func:`plan_image_units` instead."""
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
