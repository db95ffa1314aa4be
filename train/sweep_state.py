"""A sweep's Tune state, read only after it is checked: ``train sweep`` restores its Ray Tune
experiment (``<output>/train/<job>/sweeps/<name>``) with ``Tuner.restore``, which unpickles the
files there (``tuner.pkl``, the experiment state's trial records). A pickle runs code when loaded, so
nothing in that folder is read unless this project's sweep wrote it and it is unchanged:

- :func:`seal`, after Tune has written its state (the end of ``tuner.fit()``, finished or
  interrupted), records a sha256 of every file of the folder in ``vlpipe-state.sha256`` (written
  last, atomically), signed: its last line is an HMAC-SHA256 of the lines above it under a key kept
  outside the output, per user (``~/.config/vlpipe/state.key``, or ``$XDG_CONFIG_HOME/vlpipe/``;
  the environment variable ``VLPIPE_STATE_KEY`` names another file), made (32 random bytes, mode
  0600) on first use. A checksum beside a file stops accidents; the signature stops someone who can
  write the output folder but not read the user's key from forging a pickle and its sha256 line;
- :func:`check`, before anything of the folder is read, checks the signature, then recomputes the
  sums: a missing or unsigned checksum file (a sweep killed before its end, a folder from elsewhere,
  a sum line rewritten), a file that is not listed, missing or changed refuses the resume in one
  line with the fix: ``--fresh`` starts the Tune experiment over, which loses nothing (finished
  trials are reused from their run folders, the others resume from their own checkpoints).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from pathlib import Path

from pipeline.io.atomic import write_bytes_atomic

SUMS = "vlpipe-state.sha256"
FIX = "pass --fresh to start the Tune experiment over (finished trials are reused, the others resume from their checkpoints)"


KEY_ENV = "VLPIPE_STATE_KEY"
_SIGNED = re.compile(r"# hmac-sha256 ([0-9a-f]{64})")


class StateError(ValueError):
    """Tune state that is not read (one line with the fix)."""


def key_path() -> Path:
    """The signing key's file: ``$VLPIPE_STATE_KEY``, else ``<$XDG_CONFIG_HOME or ~/.config>/vlpipe/state.key``."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "vlpipe" / "state.key"


def _key() -> bytes:
    """This user's signing key, made (mode 0600, in a 0700 folder) on first use; a key that others may
    read or write, or that is not a regular file, is refused (it could not tell this user's state
    from a forged one)."""
    path = key_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise StateError(f"sweep state key {path}: cannot be made ({e.strerror or type(e).__name__}); set {KEY_ENV} "
                         "to a file in a folder of yours") from None
    else:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"sweep state key {path}: not a regular file; remove it (a new key is made)")
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise StateError(f"sweep state key {path}: readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}) "
                             f"or not yours: `chmod 600 {path}`, or remove it (a new key is made)")
        key = path.read_bytes().strip()
    except OSError as e:
        raise StateError(f"sweep state key {path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(key) < 32:
        raise StateError(f"sweep state key {path}: holds {len(key)} bytes, fewer than 32; remove it (a new key is made)")
    return key


def _signature(body: bytes) -> str:
    return hmac.new(_key(), body, hashlib.sha256).hexdigest()


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
    body = "".join(f"{_sha256(p)}  {p.relative_to(exp).as_posix()}\n" for p in _files(exp)).encode()
    write_bytes_atomic(exp / SUMS, body + f"# hmac-sha256 {_signature(body)}\n".encode())


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
    from pipeline.io.run_files import not_regular

    if (what := not_regular(sums)) is not None:
        raise StateError(f"{where}: {SUMS} is {what}, not a regular file: it is not read; {FIX}")
    try:
        raw = sums.read_bytes()
    except OSError as e:  # a permission, an I/O error: one line, as every other refusal here
        raise StateError(f"{where}: {SUMS} cannot be read ({e.strerror or type(e).__name__}): it is not read; {FIX}") from None
    body, _, last = raw.rstrip(b"\n").rpartition(b"\n")
    body = body + b"\n" if body else b""
    m = _SIGNED.fullmatch(last.decode("utf-8", "replace"))
    if not m or not hmac.compare_digest(m[1], _signature(body)):
        raise StateError(f"{where}: {SUMS} is not signed with this user's key ({key_path()}): another user or program "
                         f"wrote or changed it, so nothing there is unpickled; {FIX}")
    listed: dict[str, str] = {}
    for i, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
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
