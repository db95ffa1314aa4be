"""Artifact folders: shards written unit by unit, completion markers, errors, provenance.

Layout of ``<output>/<artifact>/``::

    _manifest.json            provenance + shard list, written when the stage finishes
    errors/errors.parquet     every rejected row of the stage (possibly empty); in its own folder
                              like every table, so a dataset reader on one folder reads one table
    _lock                     held (flock) by the run writing the artifact; released by the kernel
                              when that process dies, so a kill -9 never leaves a stale lock
                              (pipeline/io/lock.py)
    <table>/<table>-<unit>.parquet   Parquet tables, one file per unit of work
    shards/<unit>.tar         WebDataset shards
    _state/<unit>.json        completion marker of one unit: fingerprint, files, sha256s, stats
    _errors/<unit>.parquet    rejected rows of one unit

A unit of work is the stage's resumable piece (one input shard, one chunk of samples). A worker
writes the unit's files atomically, then its marker, last. On a rerun a unit is skipped when its
marker exists, its fingerprint matches and its files are present with the recorded sizes, so a
crash at any point loses at most the units in flight and a deleted shard is redone alone.
Markers and files of units that no longer exist (another shard size, say) are removed, and so are
the temporary files (``.<name>.<random>.tmp``) a killed run left behind.

An output (or artifact) may be an object-storage URL (``s3://bucket/run``): the artifact is then
written and read through a local mirror in the cache folder, units are uploaded file by file with
their marker last, ``_manifest.json`` last of all, resume reads markers from the store, readers
fetch and verify files on first use, and the lock is an object created with a conditional put.
:mod:`pipeline.io.storage` describes it.

This module writes artifacts; the read side (:class:`Artifact`) is :mod:`pipeline.io.artifact_reader`,
re-exported here.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io import storage
from pipeline.io.artifact_reader import (  # noqa: F401 (the read side, re-exported: one place to import artifacts from)
    ERROR_SCHEMA,
    ERRORS_PATH,
    Artifact,
    ArtifactMissing,
    CorruptArtifact,
    forget_units_of,
)
from pipeline.io.atomic import (
    fingerprint,
    remove_stale_tmp,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)
from pipeline.io.lock import FolderBusy, lock_folder, unlock_folder
from pipeline.io.verified import VerifiedFiles

log = logging.getLogger("pipeline")

SCHEMA_VERSION = 1

# Options that change where and how fast work runs, never what it produces: recorded in
# _manifest.json but left out of fingerprints, so moving a run onto a GPU cluster redoes nothing.
EXECUTION_ONLY = frozenset({"enabled", "num_gpus", "num_cpus", "max_error_rate"})

LEGACY_ERRORS_PATH = "errors.parquet"


# Another live run holds the artifact's lock; the message names the holder (pipeline/io/lock.py)
ArtifactBusy = FolderBusy


class OutputPathError(RuntimeError):
    """The output folder (or an artifact folder in it) cannot be used; the message names the path."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def ensure_dir(path: Path, what: str = "output") -> None:
    """Create ``path`` as a writable folder or raise :class:`OutputPathError` naming the problem."""
    for p in [path, *path.parents]:
        if p.exists() and not p.is_dir():
            raise OutputPathError(f"{what} path {p} is a file, not a folder")
        if p.exists():
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{what} folder {path}: cannot create ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} folder {path} is not writable")


def release_lock(artifact_dir: Path | None = None) -> None:
    """Release the lock on ``artifact_dir`` (or every lock this process holds)."""
    unlock_folder(artifact_dir)
    if artifact_dir is not None and (url := storage.url_of_local(str(Path(artifact_dir).resolve()))) is not None:
        storage.release_remote_lock(url)
    if artifact_dir is None:
        storage.release_remote_lock()


LAYOUT_NOTE = "README.txt"


def write_layout_note(artifact_dir: Path, artifact: str, stage: str, tables: list[str]) -> None:
    """``README.txt`` at the artifact's root: which folder holds which table. It is also what keeps
    a reader of the *root* folder from silently merging tables: ``pyarrow.dataset`` (and
    ``pq.read_table``, pandas) walk sub-folders and would stack ``errors/errors.parquet`` under a
    table; with this non-Parquet file there they fail with a line naming it instead. Written only
    when its text changes (a rerun with nothing to do touches nothing)."""
    names = [t for t in tables if t != "errors"]
    text = (f"{artifact}: the artifact written by the `{stage}` stage.\n"
            "Each table is in its own folder; read one folder, never this root folder (a dataset reader of\n"
            "the root would stack the tables, rejected rows included):\n"
            + "".join(f"  {t}/\n" for t in names)
            + "  errors/errors.parquet  the rows the stage rejected (sample_id, reason, detail)\n"
            "_manifest.json holds provenance, parameters, models and every file's size and sha256.\n")
    p = Path(artifact_dir) / LAYOUT_NOTE
    try:
        if p.read_text() == text:
            return
    except OSError:
        pass
    write_bytes_atomic(p, text.encode())


def code_version() -> str:
    """The package version, + the git revision (and ``.dirty``) when run from a checkout."""
    from pipeline import __version__

    def git(*args: str):
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=5)

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        if rev.returncode == 0:
            return f"{__version__}+g{rev.stdout.strip()}" + (".dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def unit_name(index: int) -> str:
    return f"{index:05d}"


def error_row(stage: str, unit: str, reason: str, detail: str = "", *, sample_id=None, caption_id=None, source_id=None) -> dict:
    return {
        "stage": stage,
        "unit": unit,
        "sample_id": None if sample_id is None else int(sample_id),
        "caption_id": None if caption_id is None else int(caption_id),
        "source_id": None if source_id is None else str(source_id),
        "reason": reason,
        "detail": _ADDRESS.sub("", str(detail))[:2000],  # no memory addresses: identical runs, identical bytes
    }


@dataclass
class UnitResult:
    """What a worker reports for one finished unit (also stored as its marker)."""

    unit: str
    fingerprint: str
    files: list[dict] = field(default_factory=list)  # {table, path (relative), rows, bytes, sha256}
    n_errors: int = 0
    stats: dict = field(default_factory=dict)
    skipped: bool = False


class UnitWriter:
    """Writes the files of one unit inside the artifact folder (usable inside Ray workers)."""

    def __init__(self, artifact_dir: str | Path, stage: str, unit: str, unit_fingerprint: str, url: str | None = None):
        self.dir = Path(artifact_dir)  # local (the mirror of ``url`` when the artifact is remote)
        self.url = url
        self.stage, self.unit, self.fp = stage, unit, unit_fingerprint
        self.files: list[dict] = []
        self.errors: list[dict] = []

    def _record(self, table: str, path: Path, rows: int) -> None:
        st = path.stat()
        self.files.append(
            {
                "table": table,
                "path": str(path.relative_to(self.dir)),
                "rows": int(rows),
                "bytes": st.st_size,
                "sha256": sha256_file(path),
                "mtime_ns": st.st_mtime_ns,  # these bytes were hashed: a rerun or a reader checks them with a stat
            }
        )

    def parquet_path(self, table: str) -> Path:
        return self.dir / table / f"{table}-{self.unit}.parquet"

    def write_table(self, table: str, data: pa.Table | pl.DataFrame) -> Path:
        if isinstance(data, pl.DataFrame):
            data = data.to_arrow()
        path = self.parquet_path(table)
        write_parquet_atomic(data, path)
        self._record(table, path, data.num_rows)
        return path

    def shard_path(self, table: str = "shards") -> Path:
        return self.dir / table / f"{self.unit}.tar"

    def record_shard(self, path: Path, rows: int, table: str = "shards") -> None:
        """Register a tar written with :class:`pipeline.io.wds.ShardWriter` at ``shard_path()``."""
        self._record(table, Path(path), rows)

    def error(self, reason: str, detail: str = "", **ids) -> None:
        self.errors.append(error_row(self.stage, self.unit, reason, detail, **ids))

    def commit(self, stats: dict | None = None) -> UnitResult:
        errors_rel, marker_rel = f"_errors/{self.unit}.parquet", f"_state/{self.unit}.json"
        if self.errors:
            write_parquet_atomic(pa.Table.from_pylist(self.errors, schema=ERROR_SCHEMA), self.dir / errors_rel)
        else:
            (self.dir / errors_rel).unlink(missing_ok=True)
        stats = dict(stats or {})
        table_rows: dict[str, int] = {}  # rows per table this unit wrote: the progress lines' count (pipeline/counts.py)
        for f in self.files:
            table_rows[f["table"]] = table_rows.get(f["table"], 0) + int(f["rows"])
        stats.setdefault("table_rows", table_rows)
        result = UnitResult(self.unit, self.fp, self.files, len(self.errors), stats)
        write_json_atomic(self.dir / marker_rel, result.__dict__)
        if self.url:  # write then put: the files, the errors, and the marker last
            remote = storage.Remote(self.url)
            remote.rm(marker_rel)  # an older marker must not vouch for files being replaced
            for f in self.files:
                remote.put(f["path"])
            if self.errors:
                remote.put(errors_rel)
            else:
                remote.rm(errors_rel)
            remote.put(marker_rel)
        return result


class ArtifactWriter:
    """Driver-side view of an artifact being produced by a stage."""

    def __init__(
        self,
        output: str | Path,
        artifact: str,
        stage: str,
        params: dict,
        inputs: dict[str, str] | None = None,
        models: dict[str, dict] | None = None,
        force: bool = False,
    ):
        self.location = storage.join(output, artifact)  # a path or a URL
        self.remote = storage.Remote(self.location) if storage.is_remote(self.location) else None
        self.dir = storage.local_path(self.location)  # where files are written (the mirror of a URL)
        self.artifact, self.stage = artifact, stage
        self.params, self.inputs, self.models = params, dict(inputs or {}), dict(models or {})
        self.force = force
        self.verified = VerifiedFiles(self.dir)
        self.input_rows: int | None = None  # the stage's input samples (set by run_units)
        self.error_check = None  # fn(errors, output rows, where) -> raise on too many rejections
        # Everything a unit's content depends on apart from its own input slice.
        semantic = {k: v for k, v in params.items() if k not in EXECUTION_ONLY}
        self.base_fingerprint = fingerprint(SCHEMA_VERSION, stage, semantic, self.inputs, self.models)
        ensure_dir(storage.local_path(output))
        ensure_dir(self.dir, "artifact")
        lock_folder(self.dir)
        if self.remote is not None:
            try:
                busy = storage.acquire_remote_lock(self.remote)
            except Exception:
                release_lock(self.dir)
                raise
            if busy:
                release_lock(self.dir)
                raise ArtifactBusy(f"{self.location} is being written by another run ({busy}); wait for it to finish or stop it")
        if n := remove_stale_tmp(self.dir):
            log.info("%s: removed %d temporary files left by an interrupted run", artifact, n)
        if force:
            for sub in ("_state", "_errors"):
                shutil.rmtree(self.dir / sub, ignore_errors=True)
            (self.dir / "_manifest.json").unlink(missing_ok=True)
            if self.remote is not None:
                for rel in list(self.remote.listing()):
                    if rel.startswith(("_state/", "_errors/")) or rel == "_manifest.json":
                        self.remote.rm(rel)
        if self.remote is not None:
            self._pull()

    # ---- object storage: the store is the truth, the mirror a working copy ----------------------
    _LOCAL_ONLY = ("_lock", "_cache.json")

    def _pull(self) -> None:
        """Replace the mirror's markers and unit errors by the store's, and fetch the artifact's
        other files (not the units' own files: resume checks those by size on the store)."""
        listing = self.remote.listing(refresh=True)
        for sub in ("_state", "_errors"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
        small = [r for r in listing if r.startswith(("_state/", "_errors/")) or r == "_manifest.json"]
        if small:
            self.remote.fs.get([self.remote._key(r) for r in small], [str(self.dir / r) for r in small])
        unit_files = set()
        for marker in (self.dir / "_state").glob("*.json"):
            try:
                unit_files.update(f["path"] for f in json.loads(marker.read_text()).get("files", []))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        for rel, size in listing.items():
            if rel in unit_files or rel in small or rel in self._LOCAL_ONLY or rel.startswith("errors/"):
                continue
            p = self.dir / rel
            if not p.is_file() or p.stat().st_size != size:
                self.remote.get(rel)

    def _push(self) -> None:
        """Upload what the mirror has and the store lacks (or holds with another size): the
        artifact's own files first, markers after them; ``_manifest.json`` is put by finalize."""
        listing = self.remote.listing(refresh=True)
        files, markers = [], []
        for p in sorted(self.dir.rglob("*")):
            rel = p.relative_to(self.dir).as_posix()
            if not p.is_file() or rel in self._LOCAL_ONLY or rel == "_manifest.json" or p.name.startswith("."):
                continue
            if listing.get(rel) != p.stat().st_size:
                (markers if rel.startswith("_state/") else files).append(rel)
        for rel in files + markers:
            self.remote.put(rel)

    def marker(self, unit: str) -> dict | None:
        """A unit's completion marker (fetched from the store when this machine did not write it)."""
        return self._marker(unit, fetch=True)

    def unit_fingerprint(self, unit: str, unit_input: object) -> str:
        return fingerprint(self.base_fingerprint, unit, unit_input)

    def unit_writer(self, unit: str, unit_fp: str) -> UnitWriter:
        return UnitWriter(self.dir, self.stage, unit, unit_fp, url=self.location if self.remote else None)

    def worker_keys(self) -> dict:
        """Payload keys a worker's :func:`pipeline.stage.unit_writer` needs (remote: the URL and
        the storage options, so a worker on another node finds its own mirror and the store)."""
        keys = {"artifact_dir": str(self.dir), "stage": self.stage, "storage": storage.config()}
        if self.remote is not None:
            keys["artifact_url"] = self.location
        return keys

    def _marker(self, unit: str, fetch: bool = False) -> dict | None:
        path = self.dir / "_state" / f"{unit}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        if fetch and self.remote is not None and self.remote.size(f"_state/{unit}.json") is not None:
            try:
                return json.loads(self.remote.get(f"_state/{unit}.json").read_text())
            except (OSError, ValueError):
                return None
        return None

    def is_done(self, unit: str, unit_fp: str) -> bool:
        """A unit is done when its marker has this fingerprint and its files are the recorded ones:
        on the store, by size; locally, by size and sha256 (a stat for files hashed before, see
        :mod:`pipeline.io.verified`), so a shard changed since it was written is redone."""
        m = self._marker(unit)
        if not m or m.get("fingerprint") != unit_fp:
            return False
        for f in m.get("files", []):
            if self.remote is not None:
                if self.remote.size(f["path"]) != f["bytes"]:
                    return False
                continue
            if (why := self.verified.problem(f)) is not None:
                if why != "missing":
                    why = f"changed since written ({'sha256' if why.startswith('sha256') else why})"
                log.info("%s: unit %s: %s %s: redoing", self.artifact, unit, f["path"], why)
                return False
        return True

    def local_file(self, rel: str) -> Path:
        """A file of this artifact as a local path (fetched from the store when missing here)."""
        p = self.dir / rel
        if self.remote is not None and not p.is_file():
            self.remote.get(rel)
        return p

    def prune(self, live_units: set[str]) -> None:
        """Delete markers, shards and error files of units that are not part of this run."""
        state = self.dir / "_state"
        if not state.is_dir():
            return
        for marker in state.glob("*.json"):
            unit = marker.stem
            if unit in live_units:
                continue
            m = self._marker(unit) or {}
            if self.remote is not None:  # the marker first: files without a marker are not a unit
                self.remote.rm(f"_state/{unit}.json")
                for f in m.get("files", []):
                    self.remote.rm(f["path"])
                self.remote.rm(f"_errors/{unit}.parquet")
            for f in m.get("files", []):
                (self.dir / f["path"]).unlink(missing_ok=True)
            (self.dir / "_errors" / f"{unit}.parquet").unlink(missing_ok=True)
            marker.unlink(missing_ok=True)

    def side_entry(self, rel: str) -> dict:
        """The ``files`` entry (path, bytes, sha256) of a file the stage wrote outside its units,
        hashed unless the cache holds its sha256 for its current size and mtime; remembered."""
        st = (self.dir / rel).stat()
        seen = self.verified.seen.get(rel)
        sha = seen[2] if seen and seen[:2] == [st.st_size, st.st_mtime_ns] else sha256_file(self.dir / rel)
        self.verified.remember(rel, st.st_size, st.st_mtime_ns, sha)
        return {"path": rel, "bytes": st.st_size, "sha256": sha}

    def finalize(self, units: list[str], extra: dict | None = None, schema: dict | None = None,
                 files: list[dict] | None = None) -> dict:
        """Merge per-unit errors and markers into ``errors.parquet`` and ``_manifest.json``.
        ``files``: the :meth:`side_entry` of every file the stage wrote outside its units (recorded as
        the manifest's ``files``, checked by readers, `pipeline status` and `pipeline verify`)."""
        markers = []
        for u in units:
            m = self._marker(u, fetch=True)
            if m is None:
                raise RuntimeError(f"{self.artifact}: unit {u} has no completion marker; the stage did not finish it")
            markers.append(m)
        if self.remote is not None:  # errors of units another node ran
            for u in units:
                rel = f"_errors/{u}.parquet"
                if not (self.dir / rel).is_file() and self.remote.size(rel) is not None:
                    self.remote.get(rel)
        error_files = [self.dir / "_errors" / f"{u}.parquet" for u in units]
        error_tables = [pq.read_table(p) for p in error_files if p.exists()]
        errors = pa.concat_tables(error_tables) if error_tables else ERROR_SCHEMA.empty_table()
        write_parquet_atomic(errors, self.dir / ERRORS_PATH, if_changed=True)
        (self.dir / LEGACY_ERRORS_PATH).unlink(missing_ok=True)  # written by older versions at the root
        tables: dict[str, dict] = {}
        shards = []
        for m in markers:
            for f in m["files"]:
                shards.append(f)
                t = tables.setdefault(f["table"], {"rows": 0, "files": 0})
                t["rows"] += f["rows"]
                t["files"] += 1
        stats: dict = {}
        for m in markers:
            for k, v in m.get("stats", {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    stats[k] = stats.get(k, 0) + v
        if self.error_check is not None:
            out_rows = sum(int(m.get("stats", {}).get("rows", 0)) for m in markers)
            if not any("rows" in m.get("stats", {}) for m in markers):
                out_rows = sum(t["rows"] for t in tables.values())
            self.error_check(errors, out_rows, self.dir / ERRORS_PATH)
        random_models = [k for k, v in self.models.items() if v.get("random_weights")]
        manifest = {
            "artifact": self.artifact,
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "parameters": self.params,
            "input_fingerprints": self.inputs,
            "models": self.models,
            "random_weights": random_models,
            "code_version": code_version(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint(self.base_fingerprint, [f["sha256"] for f in shards]),
            "tables": tables,
            "shards": [{k: f[k] for k in ("table", "path", "rows", "bytes", "sha256")} for f in shards],
            "units": len(units),
            "errors": {"path": ERRORS_PATH, "rows": errors.num_rows},
            "stats": stats,
            "schema": schema or {},
        }
        manifest.update(extra or {})
        self._remove_orphans(markers)
        write_layout_note(self.dir, self.artifact, self.stage, sorted(tables))
        # every other file the artifact holds, recorded and verified like the shards: the stage's own
        # (build-index's FAISS files), the merged errors table and the layout note
        files = list(files or []) + [self.side_entry(ERRORS_PATH), self.side_entry(LAYOUT_NOTE)]
        manifest["files"] = [{k: f[k] for k in ("path", "bytes", "sha256")} for f in files]
        self._seed_verified(markers, [f["path"] for f in files])
        write_json_atomic(self.dir / "_manifest.json", manifest)
        if self.remote is not None:  # everything else first, the manifest last
            self.remote.rm(LEGACY_ERRORS_PATH)
            self._push()
            self.remote.put("_manifest.json")
            storage.release_remote_lock(self.location)
        release_lock(self.dir)
        return manifest

    def _seed_verified(self, markers: list[dict], side: list[str]) -> None:
        """Readers check a file with a stat when ``_cache.json`` holds the size and mtime it had
        when hashed: the units' markers recorded both for the files they wrote (``side``: the files
        written outside units, remembered by :meth:`side_entry`)."""
        files = [f for m in markers for f in m.get("files", [])]
        for f in files:
            if "mtime_ns" in f:
                self.verified.remember(f["path"], f["bytes"], f["mtime_ns"], f["sha256"])
        self.verified.keep_only({f["path"] for f in files} | set(side))
        self.verified.save()

    def _remove_orphans(self, markers: list[dict]) -> None:
        """Delete unit files in the artifact's table folders that no live unit lists (a killed run
        with another shard size wrote them before its marker); the manifest lists only live ones."""
        live = {f["path"] for m in markers for f in m.get("files", [])}
        folders = {Path(p).parent for p in live if Path(p).parent != Path(".")}
        for folder in folders:
            if (self.dir / folder).is_dir():
                for f in (self.dir / folder).iterdir():
                    rel = str(f.relative_to(self.dir))
                    if f.is_file() and rel not in live and f.suffix in (".parquet", ".tar") and not f.name.startswith("."):
                        f.unlink()
        if self.remote is not None:
            names = {Path(folder).as_posix() for folder in folders}
            for rel in list(self.remote.listing(refresh=True)):
                p = Path(rel)
                if p.parent.as_posix() in names and rel not in live and p.suffix in (".parquet", ".tar") and not p.name.startswith("."):
                    self.remote.rm(rel)


def shard_inputs_fingerprint(entries: list[dict]) -> str:
    return fingerprint([e["sha256"] for e in entries])


def disk_usage(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum((Path(root) / f).stat().st_size for f in files)
    return total
