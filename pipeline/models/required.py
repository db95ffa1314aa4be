"""The model folders a run needs that are not on disk: every one named at once, with the command that makes it.

A ``models.*`` spec is a Hugging Face id (``openai/clip-vit-base-patch16``), a preset (``tiny-random``,
``scene-oracle``), a prefixed spec (``clip-pool:<CLIP>``, ``vit_b:<checkpoint>``) or a local path. A spec
whose path part *looks local* (:func:`local_path`: it starts with ``/``, ``.`` or ``~``, it lies under the
manifest's output (``{output}/...``), or it has more ``/`` than a hub id's one) and does not exist is a
missing folder, never a hub id: the loaders would otherwise report ``Repo id must be in the form
'repo_name'...``. The folders the project itself makes are the encoder jobs' exports (``train run
clip-encoder`` -> ``<output>/encoders/clip``): a job of the manifest's ``train`` section whose Config has
``EXPORT`` (found through the manifest, so this package never imports ``train/``).

:func:`missing_models` lists what the stages about to run need and lack; :func:`missing_message` is the
one-line error ``pipeline run``, ``plan`` and ``status`` print before any calibration or Ray start.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ENCODERS_DIR = "encoders"

# The models.* slots each stage loads (a stage's option may name another: mine-concepts' text_encoder).
STAGE_SLOTS = {
    "extract-clip-tokens": ("clip",),
    "encode-concepts": ("clip",),
    "extract-image-groups": ("groupvit",),
    "extract-regions": ("detector",),
    "extract-visual-tokens": ("sam", "predicate_encoder"),
    "negative-captions": ("mlm", "word_encoder", "spacy"),
}
_PREFIX = re.compile(r"^([A-Za-z][\w.-]*):(?!//)(.+)$")  # clip-pool:<spec>, vit_b:<path> (not a URL, not C:\)


def encoder_export_dir(output, name: str, control: str = "none", override: str | None = None) -> Path:
    """Where an encoder job exports by default: ``override``, else ``<output>/encoders/<name>`` (a control
    run: ``<name>-<control>``). :func:`train.encoders.export_dir` is this."""
    from pipeline.io.storage import local_path as storage_local

    if override:
        return Path(override)
    return Path(storage_local(output)) / ENCODERS_DIR / (name if control == "none" else f"{name}-{control}")


def local_path(spec: str | None, output: str | None = None) -> str | None:
    """The local path a spec names, or None when it names a hub id, a preset or a URL (see the module
    docstring). A prefixed spec's path is the part after the prefix."""
    if not isinstance(spec, str) or not spec.strip():
        return None
    s = spec.strip()
    if s.startswith("open_clip:"):  # open_clip:<arch>[/<checkpoint file or tag>]: the part after the arch
        rest = s[len("open_clip:"):]
        s = rest.split("/", 1)[1].strip() if "/" in rest else ""
        if not s:
            return None
    else:  # clip-pool:<spec>, vit_b:<path>, torchvision:<arch>:<weights file>: each prefix stripped in turn
        while (m := _PREFIX.match(s)) and not os.path.exists(s):
            s = m.group(2).strip()
    if "://" in s:
        return None
    out = str(output).rstrip("/") + "/" if output and "://" not in str(output) else None
    if s.startswith(("/", ".", "~")) or "\\" in s or s.count("/") > 1 or (out and s.startswith(out)):
        return s
    return None


def missing_path(spec: str | None, output: str | None = None) -> str | None:
    """The path of a spec that looks local and does not exist; None otherwise."""
    p = local_path(spec, output)
    return p if p is not None and not Path(p).expanduser().exists() else None


@dataclass
class Missing:
    path: str                                        # the folder (or file) no slot can load
    slots: list[str] = field(default_factory=list)   # models.clip, stages.mine_concepts.text_encoder, ...
    job: str | None = None                           # the encoder job that exports it, if one does
    job_set: list[str] = field(default_factory=list)  # --set the job needs to export there (its control)


def slots_of(manifest, stages) -> dict[str, str]:
    """{slot key: spec} of what ``stages`` load, in stage order."""
    m = manifest.models
    out: dict[str, str] = {}
    for name in stages:
        cfg = getattr(manifest.stages, name.replace("-", "_"), None)
        for slot in STAGE_SLOTS.get(name, ()):
            if (name, slot) == ("extract-visual-tokens", "sam") and (getattr(cfg, "embedding", None), getattr(cfg, "segmenter", None)) \
                    == ("clip_pool", "annotations"):
                continue  # the masks are given and the CLIP pools them: no SAM is loaded
            out.setdefault(f"models.{slot}", getattr(m, slot))
        if name == "extract-regions" and getattr(cfg, "backend", None) == "sam":  # boxes from models.sam's masks
            out.setdefault("models.sam", m.sam)
        if name == "extract-visual-tokens" and getattr(cfg, "relations", None) == "learned" and m.relation_head:
            out.setdefault("models.relation_head", m.relation_head)
        if name == "extract-visual-tokens" and getattr(cfg, "embedding", None) == "clip_pool":
            out.setdefault("models.clip", m.clip)
        if name == "mine-concepts" and getattr(cfg, "hard_negatives", False):
            key = "stages.mine_concepts.text_encoder" if cfg.text_encoder else "models.text_encoder"
            out.setdefault(key, cfg.text_encoder or m.text_encoder)
    return out


def exporters(manifest) -> dict[str, tuple[str, list[str]]]:
    """{absolute export folder: (job, its --set)} of the encoder jobs in the manifest's ``train`` section:
    each job's folder as configured, then its default folder for each of its ``control`` values."""
    import typing

    out: dict[str, tuple[str, list[str]]] = {}
    train = getattr(manifest, "train", None)
    for key in type(train).model_fields if train is not None else ():
        cfg = getattr(train, key)
        name = getattr(type(cfg), "EXPORT", None)
        if not name:
            continue
        job = key.replace("_", "-")
        field_ = type(cfg).model_fields.get("control")
        controls = [getattr(cfg, "control", "none")] + list(typing.get_args(field_.annotation) if field_ else ())
        for i, ctl in enumerate(controls):
            folder = encoder_export_dir(manifest.output, name, ctl, getattr(cfg, "export_dir", None) if i == 0 else None)
            out.setdefault(os.path.abspath(folder), (job, [f"train.{key}.control={ctl}"] if ctl != "none" else []))
    return out


def missing_models(manifest, stages) -> list[Missing]:
    """The folders the ``stages`` of ``manifest`` need that do not exist, one entry per folder."""
    makers = exporters(manifest)
    found: dict[str, Missing] = {}
    for slot, spec in slots_of(manifest, stages).items():
        path = missing_path(spec, manifest.output)
        if path is None:
            continue
        miss = found.setdefault(path, Missing(path))
        miss.slots.append(slot)
        job = makers.get(os.path.abspath(Path(path).expanduser()))
        if job:
            miss.job, miss.job_set = job
    return list(found.values())


def command_args(manifest_path, sets: list[str] | None = None) -> str:
    """`` -m <manifest> --set ...``: what a suggested command needs to act on the same run."""
    parts = ["-m", str(manifest_path)] + [a for s in (sets or []) for a in ("--set", s)]
    return " " + shlex.join(parts)


def missing_message(missing: list[Missing], manifest, manifest_path, sets: list[str] | None = None) -> str:
    """One line: every missing folder, the slots that name it and the command that makes it."""
    args = command_args(manifest_path, sets)
    parts, trained = [], False
    for miss in missing:
        what = f"{miss.path} ({', '.join(miss.slots)})"
        if miss.job:
            extra = "".join(f" --set {shlex.quote(s)}" for s in miss.job_set if s not in (sets or []))
            parts.append(f"{what}: make it with `train run {miss.job}{args}{extra}`")
            trained = True
        else:
            parts.append(f"{what}: no such file or folder; point {miss.slots[0]} at an existing one, a Hugging Face "
                         "id or a preset (tiny-random)")
    n = len(missing)
    line = f"{n} model folder{'s' if n > 1 else ''} the manifest names {'do' if n > 1 else 'does'} not exist: " + "; ".join(parts)
    if trained and not _has_samples(manifest):
        line += f"; the encoder jobs train on the samples artifact: run `pipeline run ingest{args}` first"
    return line


def _has_samples(manifest) -> bool:
    from pipeline.io.storage import local_path as storage_local

    return (Path(storage_local(manifest.output)) / "samples" / "_manifest.json").is_file()


def require_local(key: str, spec: str | None, output: str | None = None) -> None:
    """Raise FileNotFoundError (one line) when ``spec`` names a local path that does not exist: the
    loaders call it before a hub lookup could report the path as a malformed repo id."""
    path = missing_path(spec, output)
    if path is not None:
        raise FileNotFoundError(f"{key}: {path} does not exist (a local path, not a Hugging Face id)")
