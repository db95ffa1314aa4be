"""Job registry: every module of train/jobs/ with ``NAME`` and ``make_job``.

A job module exposes ``NAME`` (CLI name), ``Config`` (a :class:`train.config.TrainerConfig`,
importable without torch, discovered by the manifest loader; manifest section
``train.<NAME with underscores>``) and ``make_job(cfg, manifest, run_dir, device) ->
train.loop.Job``."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def registry() -> dict[str, ModuleType]:
    import train.jobs as pkg

    out: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"train.jobs.{info.name}")
        if getattr(mod, "NAME", None) and hasattr(mod, "make_job"):
            out[mod.NAME] = mod
    return out


def feature_jobs() -> dict[str, ModuleType]:
    """The jobs that train on the stages' artifacts (``train run all``): the registry without the
    frozen-encoder jobs (``ENCODER = True``: clip-encoder, mlm-encoder), whose exports are the stages' models."""
    return {k: m for k, m in registry().items() if not getattr(m, "ENCODER", False)}
