"""Stages: discovery, dependency order, and the driver loop every stage shares.

A stage is a module in ``pipeline/stages`` that defines::

    NAME = "mine-concepts"           # CLI name; manifest key stages.mine_concepts
    READS = ["samples"]              # artifacts it needs
    WRITES = ["concepts"]            # artifacts it produces
    class Config(StageConfig): ...   # its manifest section, paper defaults
    def run(ctx: RunContext, cfg: Config) -> dict   # returns a short summary

The driver side of a stage lists its units of work and calls :func:`run_units`, which skips the
units already complete (matching fingerprint), runs the rest on Ray, shows progress and returns
every unit's marker. Workers receive a payload with ``artifact_dir``, ``stage``, ``unit`` and
``fingerprint`` plus the stage's own keys, and write through :func:`unit_writer`.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from pydantic import Field

from pipeline.config import Section
from pipeline.io.artifacts import (
    Artifact,
    ArtifactBusy,
    ArtifactMissing,
    ArtifactWriter,
    CorruptArtifact,
    OutputPathError,
    UnitWriter,
    release_lock,
)
from pipeline.crashes import REASON as WORKER_CRASHED
from pipeline.counts import unit_rows
from pipeline.progress import LOG_FILE_ONLY, format_seconds  # noqa: F401 (format_seconds: the stages' API)
from pipeline.crashes import SampleSplit
from pipeline.errors import RayStartError, StageError, describe_exception, model_key, shorten  # noqa: F401 (the stages' API)
from pipeline.runtime import ensure_ray, map_units  # noqa: F401 (ensure_ray: tests patch it here)

log = logging.getLogger("pipeline")


class StageConfig(Section):
    enabled: bool = Field(True, description="run this stage in `pipeline run all`")
    shard_size: int = Field(1000, ge=1, description="samples per output shard (unit of resume)")
    num_gpus: float = Field(
        0, ge=0, description="GPUs Ray reserves per model actor; set 1 (with device: cuda) on a GPU cluster"
    )
    max_error_rate: float = Field(
        0.5, ge=0, le=1,
        description="fail the stage (exit non-zero, no _manifest.json) when it rejects more than this fraction of its input samples",
    )


@dataclass(frozen=True)
class StageSpec:
    name: str
    module: ModuleType
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    @property
    def description(self) -> str:
        return (self.module.__doc__ or "").strip().splitlines()[0] if self.module.__doc__ else ""


@cache
def registry() -> dict[str, StageSpec]:
    import pipeline.stages as pkg

    specs = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"pipeline.stages.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "run"):
            specs[mod.NAME] = StageSpec(mod.NAME, mod, tuple(mod.READS), tuple(mod.WRITES))
    return specs


def dependency_order(names: list[str]) -> list[str]:
    """Order stages so that each runs after the stages writing what it reads."""
    reg = registry()
    producer = {a: s for s in names for a in reg[s].writes}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(s: str) -> None:
        if s in order:
            return
        if s in visiting:
            raise StageError(f"stage dependency cycle through {s}")
        visiting.add(s)
        for a in reg[s].reads:
            if a in producer and producer[a] != s:
                visit(producer[a])
        visiting.discard(s)
        order.append(s)

    for s in sorted(names, key=lambda n: list(reg).index(n)):
        visit(s)
    return order


@dataclass
class RunContext:
    manifest: object
    force: bool = False
    limit: int | None = None
    summaries: dict = field(default_factory=dict)
    stage_cfg: object = None  # the running stage's Config, for options run_units applies to every stage
    units_run: int = 0  # units the running stage computed (0: a no-op rerun; the report keeps the earlier times)
    hint_flags: str = ""  # the command's own flags a suggested `pipeline run` needs too (" --corpus")

    def __post_init__(self):
        from pipeline.io import storage

        storage.configure_from(self.manifest)  # the manifest's storage section (cache, endpoint)

    @property
    def location(self):
        """``output:`` as given: a local Path, or an object-storage URL (str)."""
        from pipeline.io import storage

        return storage.location(self.manifest.output)

    @property
    def output(self) -> Path:
        """The local output folder (for a URL output: its mirror in the storage cache)."""
        from pipeline.io import storage

        return storage.local_path(self.manifest.output)

    @property
    def ray_cfg(self):
        return self.manifest.ray

    def artifact(self, name: str) -> Artifact:
        """An input artifact of the running stage, every file checked against its manifest (a stat
        each once verified): a stage never consumes, and records the fingerprint of, bytes that
        are not the ones its input's manifest vouches for."""
        try:
            from pipeline.io import storage

            art = Artifact(storage.join(self.location, name))
            art.check()  # CorruptArtifact: run_stage makes it the stage's one-line error
            return art
        except ArtifactMissing:
            producers = [s.name for s in registry().values() if name in s.writes]
            hint = f"run `pipeline run {producers[0]}{self.hint_flags}` first" if producers else "it is not produced by any stage"
            raise StageError(f"input artifact '{name}' not found under {self.location}: {hint}") from None

    def writer(self, artifact: str, stage: str, params: dict, inputs=None, models=None) -> ArtifactWriter:
        w = ArtifactWriter(self.location, artifact, stage, params, inputs=inputs, models=models, force=self.force)
        # The error policy applies to every stage's artifact, whichever way its units are run;
        # run_units (or a stage) sets w.input_rows, else the rate is over rejected + kept rows.
        rate = getattr(self.stage_cfg, "max_error_rate", 0.5)
        w.error_check = lambda errors, out_rows, where: check_error_rate(
            w.artifact, w.stage, errors, w.input_rows, out_rows, rate, where
        )
        return w


def unit_writer(payload: dict) -> UnitWriter:
    from pipeline.io import storage

    if "storage" in payload:  # the driver's storage options (a dataset or an output on object storage)
        storage.configure(**payload["storage"])
    url = payload.get("artifact_url")
    if url:  # an object-storage artifact: this node's mirror of it
        w = UnitWriter(storage.local_path(url), payload["stage"], payload["unit"], payload["fingerprint"], url=url)
    else:
        w = UnitWriter(payload["artifact_dir"], payload["stage"], payload["unit"], payload["fingerprint"])
    for s in payload.get("crashed_samples", []):  # the samples that killed this unit's worker (pipeline.crashes)
        w.error(WORKER_CRASHED, s["detail"], sample_id=s["sample_id"], source_id=s.get("source_id"))
    return w


# --- The error policy (one place for every stage) ----------------------------------------------
#
# 1. Isolate: a model call on a batch that raises is retried sample by sample to find the samples
#    that fail; each is recorded in the unit's errors (reason, sample id, one-line detail) and the
#    batch is run again without them (:func:`isolate_failures`).
# 2. Contain: an exception that still escapes a unit becomes a one-line stage error naming the unit
#    (see :mod:`pipeline.runtime`), never a worker traceback; completed units stay complete.
# 3. Fail loudly: when a stage rejects more than ``max_error_rate`` of its input samples (or all of
#    them), it writes errors/errors.parquet but no _manifest.json and exits non-zero with a one-line
#    summary of the top reasons (:func:`check_error_rate`).


def _take(inputs, idx: list[int]):
    if isinstance(inputs, (list, tuple)):
        return [inputs[i] for i in idx]
    if isinstance(inputs, dict):
        return {k: _take(v, idx) for k, v in inputs.items()}
    return inputs[idx]  # numpy array / torch tensor: fancy indexing keeps the batch dimension


def isolate_failures(w: UnitWriter, records: list[dict], inputs, fn, *, reason: str = "model_failed", take=_take):
    """``fn(records, inputs)`` on the whole batch; if it raises, find the records it fails on.

    Each record is run alone; the ones that raise are recorded in ``w`` as ``reason`` with their
    sample id and the exception's one-line description, then the batch is run again without them
    (so the survivors' outputs are those of a batch, as without the bad sample). Returns
    ``(kept records, fn's result for them)``; ``(records[:0], None)`` when none survives.
    ``inputs`` is sliced with ``take(inputs, indices)`` (lists, dicts of them, arrays, tensors).
    """
    try:
        return records, fn(records, inputs)
    except Exception as e:
        first = e  # `e` is unbound after the except block
        if len(records) == 1:
            _record_failure(w, records[0], reason, e)
            return records[:0], None
    good = []
    for i, r in enumerate(records):
        try:
            fn([r], take(inputs, [i]))
            good.append(i)
        except Exception as e:
            _record_failure(w, r, reason, e)
    if not good:
        return records[:0], None
    if len(good) < len(records):
        kept = [records[i] for i in good]
        try:
            return kept, fn(kept, take(inputs, good))
        except Exception as e:  # fails only together: reject the rest one by one
            log.warning("%s: batch fails without its failing samples too (%s); rejecting them", w.unit, describe_exception(e))
            for r in kept:
                _record_failure(w, r, reason, e)
            return records[:0], None
    # every sample passes alone but the batch fails together: reject the batch as a whole
    for r in records:
        _record_failure(w, r, reason, first)
    return records[:0], None


def _record_failure(w: UnitWriter, r: dict, reason: str, e: BaseException) -> None:
    ids = {k: r[k] for k in ("sample_id", "caption_id", "source_id") if r.get(k) is not None}
    w.error(reason, describe_exception(e), **ids)


def check_error_rate(artifact: str, stage: str, errors, input_rows: int | None, output_rows: int, max_rate: float, where: str) -> None:
    """Raise :class:`StageError` with a one-line summary when the stage rejected too much.

    The rate is the number of distinct rejected samples (error rows naming a sample and no caption)
    over the stage's input samples; a stage that produced no rows but recorded errors fails too.
    """
    if errors.num_rows == 0:
        return
    import pyarrow.compute as pc

    sample_level = errors.filter(pc.and_(pc.is_valid(errors["sample_id"]), pc.is_null(errors["caption_id"])))
    rejected = len(pc.unique(sample_level["sample_id"])) if sample_level.num_rows else 0
    total = input_rows if input_rows else rejected + output_rows
    rate = rejected / total if total else 0.0
    if rate <= max_rate and output_rows > 0:
        return
    counts: dict[str, list] = {}
    for row in errors.select(["reason", "sample_id", "detail"]).to_pylist():
        c = counts.setdefault(row["reason"], [0, row])
        c[0] += 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0]))[:3]
    reasons = "; ".join(
        f"{reason} x{n} (e.g. sample {ex['sample_id']}: {shorten(ex['detail'], 80)})" for reason, (n, ex) in top
    )
    if rejected == 0:
        head = f"{stage}: produced no rows; {errors.num_rows} errors"
    else:
        head = f"{stage}: rejected {rejected} of {total} samples ({100 * rate:.1f}% > max_error_rate {100 * max_rate:g}%)"
    raise StageError(f"{head}: {reasons}; see {where}")


class _Progress:
    """Units and rows done, rate and ETA, on stderr; a plain line per update when not a terminal.
    Rows are counted by what they are (pipeline/counts.py): a stage whose units write different
    things says each (``599 images + 2,994 captions``), never their sum under one name."""

    def __init__(self, desc: str, total_units: int, total_rows: int | None):
        self.desc, self.total_units, self.total_rows = desc, total_units, total_rows
        self.units = self.rows = 0
        self.by_unit: dict[str, int] = {}  # rows by what they are (images, concept rows, captions, ...)
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    @property
    def unit(self) -> str:
        """What the rows are: their one unit, or ``rows`` when the units wrote several kinds."""
        return next(iter(self.by_unit)) if len(self.by_unit) == 1 else "rows"

    def counts(self) -> str:
        """``150 images``, or ``599 images + 2,994 captions``."""
        return " + ".join(f"{n:,} {u}" for u, n in self.by_unit.items()) or "0 rows"

    def update(self, rows: int, unit: str = "rows") -> None:
        self.units += 1
        self.rows += rows
        self.by_unit[unit] = self.by_unit.get(unit, 0) + rows
        now = time.perf_counter()
        if not self.tty and now - self._last < 2.0 and self.units < self.total_units:
            return
        self._last = now
        dt = max(now - self.t0, 1e-9)
        rate = self.rows / dt
        by_units = dt / self.units * (self.total_units - self.units)
        if self.total_rows and self.unit == "rows" and rate > 0 and self.rows < self.total_rows:
            eta = (self.total_rows - self.rows) / rate
        else:  # no row estimate, or the estimate was exceeded: the shards left say how long
            eta = by_units
        eta = 0.0 if self.units >= self.total_units else max(0.0, eta)
        msg = (
            f"{self.desc}: {self.units}/{self.total_units} shards, {self.counts()}, "
            f"{rate:,.1f} {self.unit}/s, ETA {format_seconds(eta)}"
        )
        if self.tty:
            end = "\n" if self.units == self.total_units else ""
            sys.stderr.write("\r" + msg.ljust(100) + end)
            sys.stderr.flush()
        else:
            log.info(msg)


def run_units(
    ctx: RunContext,
    writer: ArtifactWriter,
    units: list[tuple[str, object, dict]],
    fn,
    *,
    actor: bool = False,
    num_cpus: float = 1.0,
    pool_size: int | None = None,
    constructor_kwargs: dict | None = None,
    total_rows: int | None = None,
    num_gpus: float | None = None,
    live: set[str] | None = None,
    split: SampleSplit | None = None,
) -> list[dict]:
    """Run the pending units of ``writer``'s artifact and return all units' markers, in order.

    ``units`` holds ``(unit name, what the unit's output depends on, payload)``; the second item
    is fingerprinted together with the stage's parameters, inputs and models. ``live`` names
    further units of the same artifact that must survive pruning (a stage with several phases).
    ``split`` takes a payload apart by sample, so that a sample whose worker dies on every try is
    recorded as ``worker_crashed`` and the rest of its unit written (:mod:`pipeline.crashes`).
    """
    names = [u[0] for u in units]
    if len(set(names)) != len(names):
        raise StageError("duplicate unit names")
    cfg = ctx.stage_cfg
    if writer.input_rows is None and total_rows is not None:
        writer.input_rows = total_rows  # the stage's input (first phase of a multi-phase stage)
    writer.error_check = lambda errors, out_rows, where: check_error_rate(
        writer.artifact, writer.stage, errors, writer.input_rows, out_rows, getattr(cfg, "max_error_rate", 0.5), where
    )
    writer.prune(set(names) | set(live or ()))
    pending, done = [], 0
    for name, unit_input, payload in units:
        fp = writer.unit_fingerprint(name, unit_input)
        if writer.is_done(name, fp):
            done += 1
            continue
        pending.append(
            dict(payload, **writer.worker_keys(), unit=name, fingerprint=fp)
        )
    log.info("%s: %d shards to do, %d already complete", writer.artifact, len(pending), done)
    failed: list[tuple[str, str]] = []
    ctx.units_run += len(pending)
    if pending:
        progress = _Progress(writer.artifact, len(pending), total_rows)
        for result in map_units(
            pending,
            fn,
            ray_cfg=ctx.ray_cfg,
            actor=actor,
            num_cpus=num_cpus,
            pool_size=pool_size,
            constructor_kwargs=constructor_kwargs,
            num_gpus=(getattr(ctx.stage_cfg, "num_gpus", 0) if actor else 0) if num_gpus is None else num_gpus,
            split=split,
        ):
            if result.get("failed"):
                failed.append((result.get("unit", "?"), result["failed"]))
            progress.update(*unit_rows(writer.stage, result))  # the count `pipeline status` shows
    raise_failed_units(writer, failed)
    return names


def raise_failed_units(writer: ArtifactWriter, failed: list[tuple[str, str]]) -> None:
    """One :class:`StageError` line naming the first failed unit (and how many more failed)."""
    if failed:
        unit, why = sorted(failed)[0]
        more = f" (and {len(failed) - 1} more units)" if len(failed) > 1 else ""
        raise StageError(
            f"{writer.stage}: unit {unit} of {writer.artifact} failed: {why}{more}; "
            "completed units are kept, a rerun resumes from them"
        )


def run_stage(name: str, ctx: RunContext) -> dict:
    reg = registry()
    if name not in reg:
        raise StageError(f"unknown stage {name!r}; stages: {', '.join(reg)}")
    spec = reg[name]
    cfg = getattr(ctx.manifest.stages, spec.key)
    # Ray starts on the first unit that has work (map_units): a rerun with nothing to do starts none.
    ctx.stage_cfg = cfg
    ctx.units_run = 0
    t0 = time.perf_counter()
    log.info("stage %s: start (output %s)", name, ctx.location)
    try:
        summary = spec.module.run(ctx, cfg) or {}
    except (ArtifactBusy, CorruptArtifact, OutputPathError, RayStartError) as e:
        raise StageError(str(e)) from None
    finally:
        release_lock()  # a failed stage leaves no lock behind in this process either
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["units_run"] = ctx.units_run
    ctx.summaries[name] = summary
    # the log file's line; the terminal gets the summary once, from the command (`<stage>: {...}`)
    log.info("stage %s: done in %.1fs %s", name, summary["seconds"], {k: v for k, v in summary.items() if k != "seconds"},
             extra=LOG_FILE_ONLY)
    return summary
