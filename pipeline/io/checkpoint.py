"""Checkpoints that load without running code: tensors plus plain data, read with ``weights_only``.

``torch.load(..., weights_only=False)`` unpickles arbitrary objects, so a checkpoint someone shares
could run code when loaded. Everything this project saves (training checkpoints, the relation
head) is written through :func:`plain` — tensors, numbers, strings, bools, None, and lists /
tuples / dicts of them; numpy arrays become tensors, numpy scalars Python numbers — and read with
:func:`load_checkpoint`, which uses ``weights_only=True`` (torch's default) and turns a refusal into
a one-line :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint_file(path: str | Path, payload: dict) -> None:
    """``torch.save`` of :func:`plain` ``(payload)`` to a temporary name, then renamed
    (:func:`pipeline.io.atomic.atomic_path`: a failed write leaves the previous file and no
    temporary one). A write the disk refuses raises that OSError (errno, strerror) with ``path``
    as its filename, e.g. ``[Errno 28] No space left on device: '.../last.pt'``."""
    import torch

    from pipeline.io.atomic import atomic_path

    path = Path(path)
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            out = _Writes(f)
            try:
                torch.save(plain(payload), out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load with ``weights_only=True``; a checkpoint carrying pickled objects is refused."""
    import pickle

    import torch

    try:
        ck = torch.load(str(path), map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: file not found") from None
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in why if "Unsupported global" in ln or "GLOBAL" in ln), why[0] if why else "")
        raise CheckpointError(
            f"checkpoint {path}: refused: it holds pickled Python objects, not only tensors and plain data "
            f"({detail[:160]}); re-save it as tensors + plain metadata"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0].split(". ")[0][:160] if str(e).strip() else ""  # torch adds advice after
        raise CheckpointError(f"checkpoint {path}: not a readable torch checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"checkpoint {path}: expected a dict of tensors and metadata, got {type(ck).__name__}")
    return ck
