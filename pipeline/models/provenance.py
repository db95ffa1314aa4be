"""What a stage records about each model it ran: which one, from where, and whether it was random.

Every adapter returns one of these records; stages put them in ``_manifest.json`` (``models`` and
the top-level ``random_weights`` list) and the run log says RANDOM WEIGHTS in plain words, so an
artifact computed from a ``tiny-random`` model can never pass for a real one.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pipeline.io.atomic import sha256_file

log = logging.getLogger("pipeline")

TINY_RANDOM = "tiny-random"

_hash_cache: dict[tuple[str, int, float], str] = {}


def is_tiny_random(spec: str | None) -> bool:
    return spec is not None and spec.strip().lower() == TINY_RANDOM


def weights_hash(files: list[str | Path]) -> str | None:
    """sha256 over the weight files (cached by path, size and mtime; large checkpoints hash once)."""
    files = sorted(Path(f) for f in files if Path(f).is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime)
        if key not in _hash_cache:
            _hash_cache[key] = sha256_file(f)
        h.update(f.name.encode())
        h.update(_hash_cache[key].encode())
    return h.hexdigest()


def state_dict_hash(module) -> str:
    """Hash of in-memory weights: how a seeded random model is identified in provenance."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_record(role: str, spec: str, *, random_weights: bool, weights_sha256: str | None = None, **extra) -> dict:
    rec = {"role": role, "spec": spec, "random_weights": bool(random_weights), "weights_sha256": weights_sha256}
    rec.update(extra)
    if random_weights:
        log.warning("RANDOM WEIGHTS: model %r (%s) is randomly initialised; its outputs carry no learned meaning", role, spec)
    return rec
