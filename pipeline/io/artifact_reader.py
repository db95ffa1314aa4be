"""Read side of an artifact folder (layout: :mod:`pipeline.io.artifacts`): its manifest, tables,
shards and errors. Every file handed out is checked against the size and sha256 ``_manifest.json``
records (a ``stat`` once it has been verified: :mod:`pipeline.io.verified`), so a consumer never
reads changed bytes without saying so; a URL's files are fetched through the cache first.
:meth:`Artifact.verify` hashes every file, :func:`forget_units_of` makes the next run redo the
units whose files fail it.

Below the writer (:mod:`pipeline.io.artifacts`), which re-exports these names.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io import storage
from pipeline.io.atomic import write_bytes_atomic
from pipeline.io.verified import VerifiedFiles, changed

ERROR_SCHEMA = pa.schema(
    [
        ("stage", pa.string()),
        ("unit", pa.string()),
        ("sample_id", pa.int64()),
        ("caption_id", pa.int64()),
        ("source_id", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)


ERRORS_PATH = "errors/errors.parquet"


# the keys every reader of an artifact's _manifest.json relies on (pipeline/io/artifacts.py writes them)
MANIFEST_KEYS = ("tables", "shards")


def _checked_manifest(obj, where) -> dict:
    """A parsed _manifest.json with the keys readers index; ValueError (one line) otherwise, so that a
    manifest rewritten as ``{}`` or ``[]`` is reported as corrupt, not as a KeyError deep in a reader."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}/_manifest.json holds a {type(obj).__name__}, not an object")
    missing = [k for k in MANIFEST_KEYS if k not in obj]
    if missing:
        raise ValueError(f"{where}/_manifest.json lacks {', '.join(missing)}")
    if not isinstance(obj["shards"], list) or not isinstance(obj["tables"], (dict, list)):
        raise ValueError(f"{where}/_manifest.json: shards is not a list or tables not a mapping")
    return obj


class CorruptArtifact(ValueError):
    """A file of a finished artifact cannot be read, is missing or is not the bytes _manifest.json
    records; the message names it, the artifact, its stage and how to redo it."""


_PARQUET_PREFIX = re.compile(r"^Could not open Parquet input source '[^']*': ")


class ArtifactMissing(FileNotFoundError):
    pass


class Artifact:
    """Read side of a finished artifact folder (a local path, or a URL read through the cache).

    For a URL, ``_manifest.json`` is downloaded at construction; :meth:`files`, :meth:`local_file`
    and :meth:`errors` fetch what they return into the local mirror. Either way what they return
    is checked against the sizes and sha256s the manifest records (:class:`CorruptArtifact`
    when a local file is not those bytes); ``dir`` fetches the whole artifact first (for code that
    reads the folder directly), ``local`` is the mirror without fetching anything."""

    def __init__(self, path: str | Path):
        loc = storage.normalize(path)
        self.location = storage.location(loc)
        self.remote = storage.Remote(loc) if storage.is_remote(loc) else None
        self._local = storage.local_path(loc)
        self._synced = False
        self._verified = VerifiedFiles(self._local)
        if self.remote is not None:
            raw = self.remote.cat("_manifest.json")
            if raw is None:
                raise ArtifactMissing(
                    f"{loc} is not a finished artifact (no _manifest.json): run the stage that writes it first"
                )
            self.__dict__["manifest"] = _checked_manifest(json.loads(raw), loc)
            dst = self._local / "_manifest.json"
            if not dst.is_file() or dst.read_bytes() != raw:
                write_bytes_atomic(dst, raw)
        elif not (self._local / "_manifest.json").is_file():
            raise ArtifactMissing(
                f"{self._local} is not a finished artifact (no _manifest.json): run the stage that writes it first"
            )

    @property
    def local(self) -> Path:
        """The local folder (for a URL: its mirror, holding what has been fetched so far)."""
        return self._local

    @property
    def dir(self) -> Path:
        """The local folder with every file of the artifact in it (a URL's are fetched once)."""
        if self.remote is not None and not self._synced:
            self.fetch_all()
        return self._local

    @cached_property
    def manifest(self) -> dict:
        return _checked_manifest(json.loads((self._local / "_manifest.json").read_text()), self._local)

    @property
    def name(self) -> str:
        return self.manifest["artifact"]

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def tables(self) -> list[str]:
        return list(self.manifest["tables"])

    def files(self, table: str) -> list[Path]:
        if table not in self.manifest["tables"]:
            raise KeyError(f"artifact {self.name} has no table {table!r}; it has {self.tables()}")
        entries = [s for s in self.manifest["shards"] if s["table"] == table]
        out = [self._fetch(s) for s in entries]
        self._verified.save()
        return out

    def shard_entries(self, table: str) -> list[dict]:
        return [s for s in self.manifest["shards"] if s["table"] == table]

    @property
    def recorded(self) -> list[dict]:
        """Every file ``_manifest.json`` records: the units' shards, then the files the stage wrote
        outside its units (``files``: build-index's FAISS indexes and matrices)."""
        return list(self.manifest["shards"]) + list(self.manifest.get("files") or [])

    def side_file(self, rel: str) -> bool:
        """``rel`` is one of the files the stage wrote outside its units (a rerun of the stage mends it)."""
        return any(f["path"] == rel for f in self.manifest.get("files") or [])

    # ---- checking files against _manifest.json (pipeline/io/verified.py) -------------------
    def _fetch(self, entry: dict) -> Path:
        """The local copy of a manifest entry, checked against the recorded size and sha256 (a
        stat when the cache vouches for it). A URL's copy is downloaded when absent or not the
        recorded bytes; a local file that is not raises :class:`CorruptArtifact` (a Parquet file
        that cannot even be opened says so, as :meth:`read_file` would)."""
        p = self._local / entry["path"]
        why = self._verified.problem(entry)
        if why is None:
            return p
        if self.remote is None:
            if why != "missing" and p.suffix == ".parquet":
                self._parquet(p, pq.read_metadata)
            stage = self.manifest.get("stage", "?")
            raise CorruptArtifact(
                f"{p}: {why} since `{stage}` wrote it; artifact {self.name} is not read until it is redone: "
                f"run `pipeline verify --fix {self.location}`, then `pipeline run {stage}`")
        self.remote.get(entry["path"])
        why = self._verified.problem(entry, full=True)
        if why is not None:
            p.unlink(missing_ok=True)
            raise OSError(f"{self.location}/{entry['path']}: the stored object is not the one _manifest.json records "
                          f"({why}); the artifact changed while being read, or is corrupt: `pipeline verify` it")
        return p

    def check(self) -> None:
        """Raise :class:`CorruptArtifact` for the first recorded file that is missing or not the
        recorded bytes (a stat per file the cache vouches for): what a stage does to its inputs.
        A URL's files are checked when fetched (a worker fetches its unit's files, on its node)."""
        if self.remote is not None:
            return
        for s in self.recorded:
            self._fetch(s)
        self._verified.save()

    def local_file(self, rel: str) -> Path:
        """One file of the artifact as a local path (a URL's fetched, and verified when the
        manifest records it)."""
        entry = next((s for s in self.recorded if s["path"] == rel), None)
        if entry is not None:
            p = self._fetch(entry)
            self._verified.save()
            return p
        if self.remote is None:
            return self._local / rel
        p = self._local / rel
        size = self.remote.size(rel)
        if size is not None and (not p.is_file() or p.stat().st_size != size):
            self.remote.get(rel)
        return p

    def fetch_all(self) -> None:
        """Fetch every file of a remote artifact (its shards, errors and other files) into the mirror."""
        if self.remote is None:
            return
        shards = {s["path"] for s in self.recorded}
        for s in self.recorded:
            self._fetch(s)
        self._verified.save()
        for rel, size in self.remote.listing(refresh=True).items():
            if rel in shards or rel in ("_lock", "_manifest.json") or rel.startswith(("_state/", "_errors/")):
                continue
            p = self._local / rel
            if not p.is_file() or p.stat().st_size != size:
                self.remote.get(rel)
        self._synced = True

    def read(self, table: str, columns: list[str] | None = None) -> pa.Table:
        parts = [self.read_file(f, columns) for f in self.files(table)]
        return pa.concat_tables(parts) if parts else pa.table({})

    def scan(self, table: str) -> pl.LazyFrame:
        files = self.files(table)
        for f in files:  # the footers now (cheap), so a corrupt file is named, not a polars ComputeError later
            self._parquet(f, pq.read_metadata)
        return pl.scan_parquet([str(f) for f in files])

    def errors(self) -> pa.Table:
        rel = self.manifest.get("errors", {}).get("path", ERRORS_PATH)
        path = self.local_file(rel)
        return self.read_file(path) if path.exists() else ERROR_SCHEMA.empty_table()

    def read_file(self, path: str | Path, columns: list[str] | None = None) -> pa.Table:
        """One Parquet file of the artifact (a path from :meth:`files`, or relative to the folder);
        an unreadable one raises :class:`CorruptArtifact` naming it and how to redo it."""
        path = Path(path)
        if not (path.is_absolute() or path.is_relative_to(self._local)):  # files() gives paths under the folder
            path = self.local_file(str(path))  # (relative ones when the output is): else relative to the folder
        return self._parquet(path, lambda p: pq.read_table(p, columns=columns))

    def _parquet(self, path: Path, read):
        try:
            return read(path)
        except (pa.ArrowException, OSError) as e:
            try:
                rel = str(Path(path).relative_to(self._local))
            except ValueError:
                rel = str(path)
            stage = self.manifest.get("stage", "<stage>")
            if rel == self.manifest.get("errors", {}).get("path", ERRORS_PATH):
                fix = f"`pipeline run {stage}` writes it again"
            else:
                fix = f"`pipeline verify --fix {self.location}` forgets its unit, then `pipeline run {stage}` redoes it"
            why = _PARQUET_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise CorruptArtifact(f"{storage.join(self.location, rel)}: corrupt or unreadable Parquet file ({why}); {fix}") from None

    def problems(self, hashes: bool = True) -> list[tuple[str, str]]:
        """``(relative path, problem)`` for every recorded file that is missing, of another size
        or another sha256 (a remote artifact: sizes on the store, sha256 of the fetched copies).
        ``hashes=False``: presence and size only, a ``stat`` per file (`pipeline status`); a file the
        stage wrote outside its units (``files``) is hashed too once its stat is not the one it was
        last hashed with (few files, and a same-size rewrite of an index is otherwise unseen)."""
        out = []
        listing = self.remote.listing(refresh=True) if self.remote is not None else None
        side = {f["path"] for f in self.manifest.get("files") or []}
        for s in self.recorded:
            rel = s["path"]
            if not hashes and listing is None and rel in side:
                if (why := self._verified.problem(s)) is not None:
                    out.append((rel, why))
                continue
            if not hashes and listing is None:
                try:
                    size = (self._local / rel).stat().st_size
                except OSError:
                    out.append((rel, "missing"))
                    continue
                if "bytes" in s and size != s["bytes"]:
                    out.append((rel, changed(size, s)))
                continue
            if listing is not None:
                if rel not in listing:
                    out.append((rel, "missing"))
                elif listing[rel] != s["bytes"]:
                    out.append((rel, changed(listing[rel], s)))
                elif hashes:
                    try:
                        self._fetch(s)
                    except OSError:
                        out.append((rel, changed(s["bytes"], s)))
                continue
            if (why := self._verified.problem(s, full=True)) is not None:  # every byte: media errors keep the mtime
                out.append((rel, why))
        self._verified.save()
        return out

    def verify(self) -> list[str]:
        """Check every recorded file against its size and sha256; one problem line per bad file."""
        fix = f": rerun `pipeline run {self.manifest.get('stage', '<stage>')}` (it writes the file again)"
        return [f"{storage.join(self.location, rel)}: {why}{fix if self.side_file(rel) else ''}"
                for rel, why in self.problems()]


def forget_units_of(art: Artifact) -> int:
    """Remove the completion markers of the units whose files fail :meth:`Artifact.verify`, and the
    artifact's _manifest.json, so the next run of its stage redoes exactly those units."""
    bad = {rel for rel, _why in art.problems()}
    n = 0
    if art.remote is not None:
        for rel in art.remote.listing(refresh=True):
            if not (rel.startswith("_state/") and rel.endswith(".json")):
                continue
            try:
                files = json.loads(art.remote.cat(rel) or b"{}").get("files", [])
            except ValueError:
                continue
            if any(f["path"] in bad for f in files):
                art.remote.rm(rel)
                (art.local / rel).unlink(missing_ok=True)
                n += 1
        art.remote.rm("_manifest.json")
        (art.local / "_manifest.json").unlink(missing_ok=True)
        return n
    for marker in (art.local / "_state").glob("*.json"):
        try:
            files = json.loads(marker.read_text()).get("files", [])
        except (OSError, ValueError):
            continue
        if any(f["path"] in bad for f in files):
            marker.unlink()
            n += 1
    (art.local / "_manifest.json").unlink(missing_ok=True)
    return n
