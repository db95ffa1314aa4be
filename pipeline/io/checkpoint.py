"""Checkpoints that load without running code: tensors plus plain data, read with ``weights_only``.

``torch.load(..., weights_only=False)`` unpickles arbitrary objects, so a checkpoint someone shares
could run code when loaded. Everything this project saves (training checkpoints, the relation
head) is written through :func:`plain` — tensors, numbers, strings, bools, None, and lists /
tuples / dicts of them; numpy arrays become tensors, numpy scalars Python numbers — and read with
:func:`load_checkpoint`, which uses ``weights_only=True`` (torch's default) and turns a refusal into
a one-line :class:`CheckpointError` naming the file.

Integrity: :func:`save_checkpoint_file` writes ``<name>.sha256`` beside each checkpoint (the
``sha256sum`` format: ``sha256sum -c last.pt.sha256`` checks it), after the checkpoint is complete
and renamed into place; until then the checkpoint has no checksum file (the previous one is
removed first), never a stale one. :func:`load_checkpoint` hashes the file and refuses one whose
bytes differ from the recorded sha256; a checkpoint without a checksum file (written before
checksums, copied without it, or killed between the rename and the checksum) is checked by the
CRC32 of every member of its zip container instead. A file that fails either check, or does not
load, is described: empty, a Git LFS pointer, not a torch file, a truncated torch file, a torch
file whose bytes changed, one holding pickled Python objects. ``keep_previous`` keeps the
checkpoint being replaced as ``previous<suffix>`` (a hard link: no copy) with its checksum, what
``train run --resume previous`` goes back to.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from pipeline.errors import shorten

SUM_SUFFIX = ".sha256"
LFS_POINTER = b"version https://git-lfs.github.com/spec"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded safely (or at all); the message names the file."""


def plain(obj: Any) -> Any:
    """``obj`` with numpy values turned into tensors / Python numbers (what weights_only accepts)."""
    import numpy as np
    import torch

    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [plain(v) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, np.ndarray):
        a = obj.astype(np.int64) if obj.dtype in (np.uint32, np.uint16) else obj
        return torch.from_numpy(np.ascontiguousarray(a))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


class _Writes:
    """A file object for ``torch.save`` that keeps the error of a failed write: torch turns it
    into a RuntimeError of its zip writer ("enforce fail at inline_container.cc ... unexpected
    pos") that never says why, e.g. 'No space left on device'."""

    def __init__(self, f):
        self.f, self.error = f, None
        self.sha = hashlib.sha256()  # of the bytes written, so the checksum costs no second read

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(memoryview(data)[:n] if n is not None else data)
        return n

    def flush(self) -> None:
        self.f.flush()


def sum_path(path: str | Path) -> Path:
    """The checksum file of a checkpoint: ``<name>.sha256`` beside it."""
    path = Path(path)
    return path.with_name(path.name + SUM_SUFFIX)


def previous_path(path: str | Path) -> Path:
    """Where ``keep_previous`` keeps the checkpoint ``path`` replaces: ``previous.pt`` beside it."""
    path = Path(path)
    return path.with_name("previous" + path.suffix)


def save_checkpoint_file(path: str | Path, payload: dict, keep_previous: bool = False) -> None:
    """``torch.save`` of :func:`plain` ``(payload)`` to a temporary name, then renamed
    (:func:`pipeline.io.atomic.atomic_path`: a failed write leaves the previous file and no
    temporary one), then its ``.sha256`` beside it (see the module docstring). A write the disk
    refuses raises that OSError (errno, strerror) with ``path`` as its filename, e.g.
    ``[Errno 28] No space left on device: '.../last.pt'``. ``keep_previous``: the file being
    replaced becomes ``previous<suffix>`` (with its checksum file)."""
    import torch

    from pipeline.io.atomic import atomic_path, write_bytes_atomic

    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                out = _Writes(f)
                try:
                    torch.save(plain(payload), out)
                except RuntimeError:
                    if out.error is None:
                        raise
                    raise out.error from None
            if keep_previous and path.is_file():
                _keep_as_previous(path)
            sum_path(path).unlink(missing_ok=True)  # never a checksum of other bytes beside the new file
        write_bytes_atomic(sum_path(path), f"{out.sha.hexdigest()}  {path.name}\n".encode())
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _keep_as_previous(path: Path) -> None:
    """``path`` (and its checksum file) as ``previous<suffix>``: a hard link renamed into place, so
    a crash leaves the old previous or the new one, never none."""
    from pipeline.io.atomic import atomic_path, write_bytes_atomic

    prev = previous_path(path)
    with atomic_path(prev) as tmp:
        try:
            os.link(path, tmp)
        except OSError:  # a filesystem without hard links
            import shutil

            shutil.copyfile(path, tmp)
        sum_path(prev).unlink(missing_ok=True)
    recorded = recorded_sha256(path)
    if recorded is not None:
        write_bytes_atomic(sum_path(prev), f"{recorded}  {prev.name}\n".encode())


def recorded_sha256(path: str | Path) -> str | None:
    """The sha256 the checksum file beside ``path`` records (``None``: no readable one); a checksum
    file that is not a regular file (a FIFO would block the read forever) raises :class:`CheckpointError`."""
    from pipeline.io.run_files import not_regular

    if (what := not_regular(sum_path(path))) is not None:
        raise CheckpointError(f"checkpoint {path}: its checksum file {sum_path(path)} is {what}, not a regular file: it "
                              f"is not read; remove it (the checkpoint is then checked by its zip CRCs)")
    try:
        first = sum_path(path).read_text(errors="replace").split()
    except OSError:
        return None
    return first[0].lower() if first and _HEX64.match(first[0].lower()) else None


def describe(path: str | Path) -> str:
    """What the file at ``path`` is, in a phrase, for an error message: empty, a Git LFS pointer, not
    a torch file, a truncated torch file, a torch file whose bytes changed (a member's CRC32), a
    complete torch file (zip CRCs hold)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    if size == 0:
        return "an empty file (0 bytes)"
    if head.startswith(LFS_POINTER):
        return f"a Git LFS pointer ({size} bytes), not the checkpoint: fetch it with `git lfs pull`"
    if head.startswith(b"\x80"):
        return f"a bare pickle ({size} bytes), not a torch zip checkpoint"
    if not head.startswith(b"PK\x03\x04"):
        return f"not a torch file ({size} bytes starting {head[:16]!r})"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return f"a truncated torch file ({size} bytes: its zip directory is missing or cut)"
    if bad is not None:
        return f"a torch file whose bytes changed after it was written (the CRC32 of its member {bad} fails)"
    return f"a complete torch file ({size} bytes, zip CRCs hold)"


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load with ``weights_only=True`` after checking the bytes (module docstring): a checkpoint
    whose sha256 differs from its ``.sha256`` file, or (without one) whose zip CRCs fail, is
    refused, and so is one carrying pickled objects; each is one :class:`CheckpointError` line
    naming the file and saying what it is."""
    import pickle

    import torch

    from pipeline.io.run_files import not_regular

    path = Path(path)
    if (what := not_regular(path)) is not None:
        raise CheckpointError(f"checkpoint {path}: is {what}, not a regular file: it is not read")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: file not found")
    problem = integrity_problem(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    try:
        ck = torch.load(str(path), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in why if "Unsupported global" in ln or "GLOBAL" in ln), why[0] if why else "")
        raise CheckpointError(
            f"checkpoint {path}: refused: it holds pickled Python objects, not only tensors and plain data "
            f"({shorten(detail, 160)}); re-save it as tensors + plain metadata"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        first = shorten(str(e).strip().splitlines()[0].split(". ")[0], 160) if str(e).strip() else ""  # torch adds advice after
        raise CheckpointError(f"checkpoint {path}: not a readable torch checkpoint: {describe(path)} "
                              f"({type(e).__name__}: {first})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint {path}: expected a dict of tensors and metadata, got {type(ck).__name__}")
    return ck


def integrity_problem(path: str | Path) -> str | None:
    """``None`` when ``path`` holds the bytes its ``.sha256`` records (without one: a zip whose
    members' CRC32s hold), else what is wrong and what the file is, in one phrase."""
    from pipeline.io.atomic import sha256_file

    path = Path(path)
    recorded = recorded_sha256(path)
    if recorded is not None:
        actual = sha256_file(path)
        if actual == recorded:
            return None
        return (f"its sha256 {actual[:12]}... is not the {recorded[:12]}... recorded in {sum_path(path).name} when it "
                f"was written: {describe(path)}")
    what = describe(path)
    if what.startswith("a complete torch file"):
        return None
    beside = "is unreadable" if sum_path(path).exists() else "is missing"
    return f"{what} (its {sum_path(path).name} {beside}, so its zip CRCs were checked)"
