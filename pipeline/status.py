"""Which artifacts of an output are complete, stale, incomplete, corrupt or missing.

Every artifact's ``_manifest.json`` records the fingerprints of the artifacts it was made from
(``input_fingerprints``); an artifact's own fingerprint covers its parameters, models and the sha256
of every shard. So an artifact is **stale** when an input's fingerprint is no longer the one it
recorded (the input was redone: re-ingested with other options, a shard redone after
``pipeline verify --fix``), when an input is gone, or when an input is itself stale (the chain
``samples -> clip_tokens -> index``). ``pipeline status`` prints the table; ``train run`` refuses
stale inputs with one line (:func:`require_fresh`); a stage rerun redoes what its inputs changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.io import storage
from pipeline.io.artifacts import Artifact, ArtifactMissing

STATES = ("complete", "stale", "incomplete", "corrupt", "missing")


class StaleArtifact(RuntimeError):
    """An input artifact is stale or missing (the message is the one-line error)."""


@dataclass
class ArtifactState:
    name: str
    stage: str
    state: str  # one of STATES
    detail: str = ""
    rows: int | None = None  # pipeline/counts.py: the artifact's one count, of ``unit``
    created: str = ""
    unit: str = "rows"


def writers() -> dict[str, str]:
    """artifact -> the stage that writes it."""
    from pipeline.stage import registry

    return {a: s.name for s in registry().values() for a in s.writes}


def _units_done(loc) -> int:
    if storage.is_remote(loc):
        try:
            return sum(1 for rel in storage.Remote(storage.normalize(loc)).listing(refresh=True)
                       if rel.startswith("_state/") and rel.endswith(".json"))
        except OSError:
            return 0
    return len(list((Path(loc) / "_state").glob("*.json"))) if Path(loc, "_state").is_dir() else 0


def artifact_state(location, name: str, verify: bool = False, _seen: dict | None = None, args: str = "") -> ArtifactState:
    """The state of ``<location>/<name>`` (see the module docstring): every recorded file must be
    present with its recorded size (a ``stat`` each); ``verify``: its sha256 too (reads every byte).
    ``args`` (`` -m <manifest> --set ...``, :func:`pipeline.models.required.command_args`) complete the
    suggested commands."""
    seen = {} if _seen is None else _seen
    if name in seen:
        return seen[name]
    stage = writers().get(name, "?")
    loc = storage.join(location, name)
    try:
        art = Artifact(loc)
        man = art.manifest
    except (ArtifactMissing, OSError, ValueError) as e:
        n = _units_done(loc)
        st = (ArtifactState(name, stage, "incomplete", f"{n} units done, not finished: rerun `pipeline run {stage}{args}`")
              if n else ArtifactState(name, stage, "missing", f"run `pipeline run {stage}{args}`"))
        if isinstance(e, ValueError):
            from pipeline.io.run_files import LFS_POINTER

            try:
                lfs = (Path(storage.local_path(loc)) / "_manifest.json").open("rb").read(len(LFS_POINTER)) == LFS_POINTER
            except OSError:
                lfs = False
            what = ("is a Git LFS pointer, not the file: fetch it with `git lfs pull`, or" if lfs else
                    f"is not valid JSON ({e}):" if isinstance(e, json.JSONDecodeError) else f"is malformed ({e}):")
            st = ArtifactState(name, stage, "corrupt", f"_manifest.json {what} rerun `pipeline run {stage}{args}`")
        seen[name] = st
        return st
    from pipeline.counts import artifact_count

    rows, unit = artifact_count(man)  # the number the run summary, progress lines and report show
    created = str(man.get("created", ""))
    reasons, corrupt_inputs = [], []
    for inp, fp in sorted((man.get("input_fingerprints") or {}).items()):
        up = artifact_state(location, inp, False, seen, args)
        if up.state == "missing":
            reasons.append(f"its input {inp} is missing")
            continue
        try:
            now = Artifact(storage.join(location, inp)).fingerprint
        except (ArtifactMissing, OSError, ValueError, KeyError):
            now = None
        if now != fp:
            reasons.append(f"{inp} changed since it was written ({created or 'at an earlier run'})")
        elif up.state == "corrupt":  # the input's own file and fix, not a rerun of this stage from it
            corrupt_inputs.append(f"its input {inp} is corrupt: {up.detail}")
        elif up.state == "stale":
            reasons.append(f"its input {inp} is {up.state}")
    if reasons or corrupt_inputs:
        detail = "; ".join(corrupt_inputs + ([f"{'; '.join(reasons)}: rerun `pipeline run {stage}{args}`"] if reasons else []))
        st = ArtifactState(name, stage, "stale", detail, rows, created, unit)
    else:
        st = ArtifactState(name, stage, "complete", "", rows, created, unit)
        bad = art.problems(hashes=verify)  # every file present at its recorded size (a stat each); --verify: sha256s
        if bad:
            rel, why = bad[0]
            more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
            fix = (f"rerun `pipeline run {stage}{args}` (it writes the file again)" if all(art.side_file(r) for r, _ in bad)
                   else f"`pipeline verify --fix {loc}`, then rerun `pipeline run {stage}{args}`")
            st = ArtifactState(name, stage, "corrupt", f"{rel}: {why}{more}: {fix}", rows, created, unit)
    seen[name] = st
    return st


def output_states(manifest, verify: bool = False, args: str = "") -> list[ArtifactState]:
    """One state per artifact that the manifest's enabled stages write or that is on disk, in
    dependency order (``args``: see :func:`artifact_state`)."""
    from pipeline.stage import dependency_order, registry

    reg = registry()
    enabled = [s for s in reg if getattr(getattr(manifest.stages, reg[s].key, None), "enabled", True)]
    names: list[str] = []
    for s in dependency_order(enabled):
        names += [a for a in reg[s].writes if a not in names]
    root = storage.local_path(manifest.output)
    if not storage.is_remote(manifest.output) and root.is_dir():
        for d in sorted(root.iterdir()):
            if (d / "_manifest.json").is_file() and d.name not in names:
                try:
                    if json.loads((d / "_manifest.json").read_text()).get("artifact") == d.name:
                        names.append(d.name)
                except (OSError, ValueError):
                    continue
    seen: dict = {}
    location = storage.location(manifest.output)
    return [artifact_state(location, n, verify, seen, args) for n in names]


def require_fresh(manifest, names, who: str, args: str = "") -> None:
    """Raise :class:`StaleArtifact` naming the first of ``names`` (artifacts under the manifest's
    output) that is stale; missing ones are left to the caller (some are optional). ``args``: see
    :func:`artifact_state`."""
    seen: dict = {}
    location = storage.location(manifest.output)
    for n in names:
        # an artifact of the pretraining corpus (`corpus/visual_tokens`): its inputs are the corpus's, under corpus/
        parent, _, leaf = n.rpartition("/")
        from pipeline.config import CORPUS_DIR

        more = " --corpus" if parent == CORPUS_DIR else ""
        st = artifact_state(storage.join(location, parent) if parent else location, leaf, False,
                            seen.setdefault(parent, {}), args + more)
        if st.state in ("stale", "corrupt", "incomplete"):
            raise StaleArtifact(f"{who}: input artifact {n} is {st.state}: {st.detail}")


def format_states(states: list[ArtifactState]) -> str:
    width = max([len(s.name) for s in states] + [8])
    counts = [f"{s.rows:,} {s.unit}" if s.rows is not None else "-" for s in states]
    cw = max([len(c) for c in counts] + [5])
    lines = [f"{'artifact':{width}}  {'state':10}  {'count':>{cw}}  {'stage':22}  detail"]
    for s, count in zip(states, counts):
        lines.append(f"{s.name:{width}}  {s.state:10}  {count:>{cw}}  {s.stage:22}  {s.detail}".rstrip())
    return "\n".join(lines)
