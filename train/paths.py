"""The paths a user gives, made absolute against the user's working directory before anything is
sent to a Ray Train worker or a Ray Tune trial (``train run --workers N``, ``train sweep``).

Those processes start in folders of Ray's (and may run on other nodes): a relative path there
would name another file. So the driver sends the manifest as an absolute path and appends ``--set``
options that restate every relative local path of the resolved manifest as an absolute one:
``output``, ``storage.cache_dir``, the dataset's files, ``eval.benchmarks`` (each benchmark's
``path``, ``images``, ``image_map``) and the job's own path options (``run_dir``, ``eval_output``,
``*_dir`` / ``*_dirs``). Paths relative to ``output`` (artifact names such as ``clip_tokens``, a
benchmark's ``{output}/...``) stay as they are: ``output`` itself is absolute now. URLs
(``s3://...``) pass through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_DATASET_KEYS = ("captions", "images", "path", "instances", "scene_graphs")
_BENCH_KEYS = ("path", "images", "image_map")


def _abs(value: Any, cwd: Path) -> Any:
    """An absolute local path for a relative one (``~`` expanded); anything else unchanged."""
    if not isinstance(value, str) or not value or "://" in value or "{" in value:
        return value  # a URL, or a template such as "{output}/source/..." (under output, absolute now)
    p = Path(value).expanduser()
    return value if p.is_absolute() and value == str(p) else str((cwd / p).resolve())


def _set(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"


def _job_path_keys(cfg) -> list[str]:
    return [k for k in type(cfg).model_fields
            if k in ("run_dir", "eval_output") or k.endswith("_dir") or k.endswith("_dirs")]


def absolute_inputs(manifest: Path | None, overrides: list[str], job: str | None = None,
                    cwd: Path | None = None) -> tuple[Path | None, list[str]]:
    """(the manifest's absolute path, ``overrides`` followed by ``--set`` options that make every
    relative path of the resolved manifest absolute against ``cwd`` (default: the working
    directory)). ``job``: also that job's path options. Raises pipeline.config.ManifestError as
    load_manifest does."""
    from pipeline.config import load_manifest

    cwd = Path(cwd or os.getcwd()).resolve()
    m = load_manifest(manifest, overrides)
    extra: list[str] = []

    def pin(key: str, value: Any) -> None:
        fixed = _abs(value, cwd)
        if fixed != value:
            extra.append(_set(key, fixed))

    pin("output", m.output)
    pin("storage.cache_dir", m.storage.cache_dir)
    for k in _DATASET_KEYS:
        pin(f"dataset.{k}", getattr(m.dataset, k))
    pin("dataset.synthetic.root", m.dataset.synthetic.root)
    benches = [b.model_dump(mode="json") for b in m.eval.benchmarks]
    fixed = [{**b, **{k: _abs(b.get(k), cwd) for k in _BENCH_KEYS}} for b in benches]
    if fixed != benches:
        extra.append(_set("eval.benchmarks", fixed))
    if job:
        key = job.replace("-", "_")
        cfg = getattr(m.train, key, None)
        for k in _job_path_keys(cfg) if cfg is not None else []:
            v = getattr(cfg, k)
            if isinstance(v, list):
                new = [_abs(x, cwd) for x in v]
                if new != v:
                    extra.append(_set(f"train.{key}.{k}", new))
            else:
                pin(f"train.{key}.{k}", v)
    where = None if manifest is None else Path(_abs(str(manifest), cwd))
    return where, list(overrides) + extra
