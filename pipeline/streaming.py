"""Streaming units: work flows from a generator to Ray workers in bounded waves.

:func:`pipeline.stage.run_units` takes a list of units (fine when a unit's payload is a file
path or a small range). Ingest's payloads are the records themselves, so a list would hold the
whole dataset in the driver. :func:`run_units_stream` consumes an iterator of units instead:
complete units are skipped as they are met, pending ones are collected into waves of at most
``max_in_flight`` (default four per worker slot) and each wave runs through the same
:func:`pipeline.runtime.map_units` as every stage (Ray Data task pool, retries); Ray starts only
when the first pending unit appears. Driver memory is then bounded by one wave of payloads
(``max_in_flight x shard_size`` records), independent of the dataset's size.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator

from pipeline.counts import unit_rows
from pipeline.io.artifacts import ArtifactWriter
from pipeline.stage import StageError, check_error_rate, format_seconds, raise_failed_units

log = logging.getLogger("pipeline")


def _window(ray_cfg, num_cpus: float) -> int:
    """Units submitted per wave: four per worker slot (CPUs of the running cluster, else of the
    manifest's ray.num_cpus / this machine)."""
    cpus = None
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.cluster_resources().get("CPU")
    except Exception:
        cpus = None
    cpus = cpus or ray_cfg.num_cpus or os.cpu_count() or 1
    return max(2, 4 * int(max(1, cpus // max(num_cpus, 1e-9))))


def run_units_stream(ctx, writer: ArtifactWriter, units: Iterable[tuple[str, object, dict]], fn: Callable, *,
                     num_cpus: float = 1.0, max_in_flight: int | None = None,
                     input_rows: Callable[[], int] | None = None, split=None) -> list[str]:
    """:func:`pipeline.stage.run_units` over an iterator of ``(unit name, unit input, payload)``.

    Units are checked against their completion markers as they come; the pending ones run in
    waves. Returns every unit's name in order (the markers of units no longer produced are
    pruned afterwards). ``input_rows()`` is called once the iterator is exhausted (the stage's
    input count for the error-rate check). ``split``: as in :func:`pipeline.stage.run_units`.
    """
    cfg = ctx.stage_cfg
    names: list[str] = []
    seen: set[str] = set()
    counts = {"done": 0, "pending": 0}

    def pending_units() -> Iterator[dict]:
        for name, unit_input, payload in units:
            if name in seen:
                raise StageError("duplicate unit names")
            seen.add(name)
            names.append(name)
            fp = writer.unit_fingerprint(name, unit_input)
            if writer.is_done(name, fp):
                counts["done"] += 1
                continue
            counts["pending"] += 1
            ctx.units_run += 1
            yield dict(payload, **writer.worker_keys(), unit=name, fingerprint=fp)

    failed: list[tuple[str, str]] = []
    t0 = last = time.perf_counter()
    finished = rows = 0
    unit = "rows"
    def waves() -> Iterator[dict]:
        """pipeline.stage.map_units over consecutive waves of pending units: one wave in the
        driver at a time (Ray starts with the first pending unit; none when all are complete)."""
        import pipeline.stage as S

        wave: list[dict] = []
        size = max_in_flight
        for u in pending_units():
            wave.append(u)
            size = size or _window(ctx.ray_cfg, num_cpus)
            if len(wave) >= size:
                yield from S.map_units(wave, fn, ray_cfg=ctx.ray_cfg, actor=False, num_cpus=num_cpus, split=split)
                wave = []
        if wave:
            yield from S.map_units(wave, fn, ray_cfg=ctx.ray_cfg, actor=False, num_cpus=num_cpus, split=split)

    for result in waves():
        finished += 1
        if result.get("failed"):
            failed.append((result.get("unit", "?"), result["failed"]))
        n, unit = unit_rows(writer.stage, result)  # the count `pipeline status` shows (images for ingest)
        rows += n
        now = time.perf_counter()
        if now - last >= 2.0:
            last = now
            log.info("%s: %d shards done (%d read so far, %d already complete), %s %s, %.1f %s/s, %s",
                     writer.artifact, finished, counts["pending"], counts["done"], f"{rows:,}", unit,
                     rows / max(now - t0, 1e-9), unit, format_seconds(now - t0))
    log.info("%s: %d shards done, %d already complete", writer.artifact, counts["pending"], counts["done"])
    writer.prune(set(names))
    if input_rows is not None and writer.input_rows is None:
        writer.input_rows = input_rows()
    writer.error_check = lambda errors, out_rows, where: check_error_rate(
        writer.artifact, writer.stage, errors, writer.input_rows, out_rows, getattr(cfg, "max_error_rate", 0.5), where
    )
    raise_failed_units(writer, failed)
    return names
