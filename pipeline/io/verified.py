"""Which files of an artifact folder still hold the bytes their writer recorded, at the cost of a
``stat`` for files already checked.

``_cache.json`` (in the folder; for an object-storage artifact, in its local mirror) maps a
file's relative path to ``[size, mtime_ns, sha256]`` as last seen hashed (or just written). A file
whose ``stat`` still gives that size and mtime holds those bytes unless something rewrote it
while keeping its mtime; any other file is hashed once and compared with the sha256 recorded for
it. The writer seeds the cache with the files it wrote (it hashed them anyway), so fresh files
are never read twice. What the stat cannot see: a rewrite that restores the mtime, one within the
filesystem's timestamp tick (milliseconds) of the writer's hash (the artifact's lock keeps other
writers out then), and silent media corruption; ``pipeline verify`` reads every byte whatever
the cache says.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.io.atomic import sha256_file, write_json_atomic

CACHE_FILE = "_cache.json"


def changed(size: int, entry: dict) -> str:
    """The problem text of a file whose bytes are not the ones ``entry`` records."""
    if size != entry["bytes"]:
        return f"{size} bytes, recorded {entry['bytes']}"
    return "sha256 differs from the one recorded (content changed or corrupt)"


class VerifiedFiles:
    """The ``_cache.json`` of one folder: :meth:`problem` checks a file, :meth:`save` keeps what it learnt."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._seen: dict | None = None
        self._dirty = False

    @property
    def seen(self) -> dict:
        if self._seen is None:
            try:
                self._seen = json.loads((self.folder / CACHE_FILE).read_text())
            except (OSError, ValueError):
                self._seen = {}
            if not isinstance(self._seen, dict):
                self._seen = {}
        return self._seen

    def remember(self, rel: str, size: int, mtime_ns: int, sha256: str) -> None:
        """``rel`` held the bytes of ``sha256`` when it had this size and mtime."""
        if self.seen.get(rel) != [size, mtime_ns, sha256]:
            self.seen[rel] = [size, mtime_ns, sha256]
            self._dirty = True

    def problem(self, entry: dict, full: bool = False) -> str | None:
        """``None`` when the file of ``entry`` (``path``, ``bytes``, ``sha256``, optionally the
        ``mtime_ns`` its writer saw) holds the recorded bytes, else what is wrong ("missing", a
        size, a sha256). ``full``: hash it whatever the cache says. An entry that records no size or
        sha256 (a hand-written manifest) can only be checked for presence."""
        rel = entry["path"]
        try:
            st = (self.folder / rel).stat()
        except OSError:
            return "missing"
        if "bytes" not in entry or "sha256" not in entry:
            return None
        if st.st_size != entry["bytes"]:
            return changed(st.st_size, entry)
        if not full and (entry.get("mtime_ns") == st.st_mtime_ns
                         or self.seen.get(rel) == [st.st_size, st.st_mtime_ns, entry["sha256"]]):
            return None
        if sha256_file(self.folder / rel) != entry["sha256"]:
            return changed(st.st_size, entry)
        self.remember(rel, st.st_size, st.st_mtime_ns, entry["sha256"])
        return None

    def keep_only(self, rels: set[str]) -> None:
        """Forget files that are no longer part of the artifact."""
        for rel in [r for r in self.seen if r not in rels]:
            del self.seen[rel]
            self._dirty = True

    def save(self) -> None:
        """Write what was learnt (a read-only artifact folder keeps its cache as it is: the next
        reader hashes again)."""
        if not self._dirty:
            return
        try:
            write_json_atomic(self.folder / CACHE_FILE, self.seen)
            self._dirty = False
        except OSError:
            pass
