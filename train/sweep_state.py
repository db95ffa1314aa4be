"""A sweep's Tune state, read only after it is checked: ``train sweep`` restores its Ray Tune
experiment (``<output>/train/<job>/sweeps/<name>``) with ``Tuner.restore``, which unpickles the
files there (``tuner.pkl``, the experiment state's trial records). A pickle runs code when loaded, so
nothing in that folder is read unless this project's sweep wrote it and it is unchanged:

- :func:`seal`, after Tune has written its state (the end of ``tuner.fit()``, finished or
  interrupted), records a sha256 of every file of the folder in ``vlpipe-state.sha256`` (written
  last, atomically);
- :func:`check`, before anything of the folder is read, recomputes them: a missing checksum file
  (a sweep killed before its end, a folder from elsewhere), a file that is not listed, missing or
  changed refuses the resume in one line with the fix: ``--fresh`` starts the Tune experiment over,
  which loses nothing (finished trials are reused from their run folders, the others resume from
  their own checkpoints).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pipeline.io.atomic import write_bytes_atomic

SUMS = "vlpipe-state.sha256"
FIX = "pass --fresh to start the Tune experiment over (finished trials are reused, the others resume from their checkpoints)"


class StateError(ValueError):
    """Tune state that is not read (one line with the fix)."""


def _files(exp: Path) -> list[Path]:
    return sorted(p for p in exp.rglob("*") if p.is_file() and p.name != SUMS and not p.name.startswith(f".{SUMS}"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def seal(exp: Path) -> None:
    """Record the sha256 of every file of the experiment folder ``exp`` (after Tune wrote them)."""
    exp = Path(exp)
    if not exp.is_dir():
        return
    lines = [f"{_sha256(p)}  {p.relative_to(exp).as_posix()}\n" for p in _files(exp)]
    write_bytes_atomic(exp / SUMS, "".join(lines).encode())


def check(exp: Path) -> None:
    """Raise :class:`StateError` unless every file of ``exp`` is one :func:`seal` recorded, unchanged.
    A missing or empty folder passes (nothing to resume)."""
    exp = Path(exp)
    files = _files(exp) if exp.is_dir() else []
    if not files:
        return
    where = f"sweep state {exp}"
    sums = exp / SUMS
    if not sums.is_file():
        raise StateError(f"{where}: no {SUMS} (the sweep that wrote it did not finish, or another program did): "
                         f"it is not read; {FIX}")
    listed: dict[str, str] = {}
    for i, line in enumerate(sums.read_bytes().decode("utf-8", "replace").splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64})  (.+)", line)
        if not m:
            raise StateError(f"{where}: {SUMS} line {i} is corrupt; {FIX}")
        listed[m[2]] = m[1]
    for p in files:
        rel = p.relative_to(exp).as_posix()
        if rel not in listed:
            raise StateError(f"{where}: {rel} was not written by this sweep (not in {SUMS}); {FIX}")
        if _sha256(p) != listed.pop(rel):
            raise StateError(f"{where}: {rel} changed since the sweep wrote it (sha256 differs); {FIX}")
    if listed:
        raise StateError(f"{where}: {sorted(listed)[0]} is missing ({len(listed)} file(s) of {SUMS}); {FIX}")
