"""Whether a training run folder can be resumed, and the ways out when it cannot (train/loop.py).

A folder holds one training configuration: :func:`check_run_folder` refuses to resume a
checkpoint of another (:class:`RunMismatch`). A checkpoint whose bytes are not the ones written
(pipeline/io/checkpoint.py) is refused by the loader; :func:`restore_previous` (``train run
--resume previous``) goes back to ``checkpoints/previous.pt``, the checkpoint before ``last.pt``,
after checking it, and sets the refused ``last.pt`` aside as ``last.pt.rejected``.

A run folder is the project's only when it carries :data:`RUN_MARKER` (written by
:func:`claim_run_folder` when a run makes the folder, or finds it empty): nothing in a folder without
it is written or deleted (``train.<job>.run_dir`` naming a folder of other files is refused in one
line). A folder of a run trained before the marker existed (its ``config.json`` and ``checkpoints/``)
is marked and used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.io.checkpoint import CheckpointError, integrity_problem, load_checkpoint, previous_path, sum_path


RUN_MARKER = "_vlpipe_run"
_MARKER_TEXT = ("A training run folder made by vlpipe (`train run`). Its temporary files (.<name>.<random>.tmp) are "
                "removed by the next run; nothing is ever removed from a folder without this file.\n")


class NotARunFolder(RuntimeError):
    """A run folder option naming a folder of other files (one line: the folder and the way out)."""


def is_run_folder(run_dir: Path) -> bool:
    """``run_dir`` carries the project's run marker (a regular file)."""
    return (Path(run_dir) / RUN_MARKER).is_file()


def claim_run_folder(run_dir: Path, job_name: str = "") -> None:
    """Make ``run_dir`` a run folder of this project before anything is written in it: created (or
    found empty, or holding only a lock file and a train.log) -> marked; marked -> used; a run of
    this project from before the marker (its ``config.json`` and ``checkpoints/``) -> marked; any
    other folder (or a file) raises :class:`NotARunFolder`: nothing in it is written or deleted."""
    from pipeline.io.lock import LOCK_NAME

    run_dir = Path(run_dir)
    key = f"train.{job_name.replace('-', '_')}.run_dir" if job_name else "train.<job>.run_dir"
    if is_run_folder(run_dir):
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise NotARunFolder(f"run folder {run_dir} is a file, not a folder: set {key} to a new or empty folder")
    try:
        entries = sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_NAME, "train.log")) \
            if run_dir.is_dir() else []  # a lock and the log `--workers` opens first are taken as empty
    except OSError as e:
        raise NotARunFolder(f"run folder {run_dir}: cannot be listed ({e.strerror or type(e).__name__})") from None
    legacy = (run_dir / "config.json").is_file() and (run_dir / "checkpoints").is_dir()
    if entries and not legacy:
        shown = ", ".join(entries[:3]) + (f" (+{len(entries) - 3} more)" if len(entries) > 3 else "")
        raise NotARunFolder(
            f"run folder {run_dir} is not empty ({shown}) and was not made by `train run` (no {RUN_MARKER}): nothing is "
            f"written or deleted in it; set {key} to a new or empty folder")
    from pipeline.io.atomic import write_bytes_atomic

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(run_dir / RUN_MARKER, _MARKER_TEXT.encode())
    except OSError as e:
        raise NotARunFolder(read_only_line(run_dir, e, job_name)) from None


RUN_FILES = ("config.json", "metrics.jsonl", "train.log", "checkpoints/last.pt.sha256", "checkpoints/final.pt.sha256")


def check_run_files(run_dir: Path) -> None:
    """Refuse (:class:`pipeline.io.run_files.CorruptRunFile`, one line) a run file that exists but is not
    a regular file: a FIFO named config.json or last.pt.sha256 would block its read or write forever."""
    from pipeline.io.run_files import require_regular

    for rel in RUN_FILES:
        require_regular(Path(run_dir) / rel)


def read_only_line(folder: Path, e: OSError, job_name: str = "") -> str:
    """The one line of a run folder that cannot be written (the way out: another run_dir)."""
    from pipeline.io.run_files import unwritable_line

    key = f"train.{job_name.replace('-', '_')}.run_dir" if job_name else "train.<job>.run_dir"
    return unwritable_line(folder, e, f"make it writable, or set {key} to a writable folder")


class RunMismatch(RuntimeError):
    """A run folder whose checkpoint was trained with another configuration (one line: both configs
    and the way out)."""


def check_run_folder(run_dir: Path, cfg, job_name: str = "", inputs: dict | None = None) -> None:
    """Refuse to resume ``run_dir`` when its checkpoint (else its config.json) holds another training
    configuration (train.config.config_differences: evaluation-only options may differ), or when its checkpoint
    was trained on artifacts of other fingerprints than ``inputs`` ({option: fingerprint}, :meth:`train.job.Job.
    input_fingerprints`; checkpoints from before it was recorded are not checked)."""
    from train.config import config_differences

    last = Path(run_dir) / "checkpoints" / "last.pt"
    stored, src = None, None
    if last.is_file():
        ck = load_checkpoint(last)
        stored, src = (ck.get("config") or None), last
        was = ck.get("inputs") or {}
        moved = sorted(k for k in (inputs or {}) if k in was and was[k] != inputs[k])
        if moved:
            shown = ", ".join(f"{k} {getattr(cfg, k, '?')!r} fingerprint {was[k][:12]} -> {inputs[k][:12]}" for k in moved)
            raise RunMismatch(f"{run_dir} was trained on artifacts that have been rewritten since ({shown}): "
                              f"{fresh_hint(job_name)}")
    elif (Path(run_dir) / "config.json").is_file() and (Path(run_dir) / "checkpoints").is_dir():
        try:
            stored, src = json.loads((Path(run_dir) / "config.json").read_text()), Path(run_dir) / "config.json"
        except ValueError:
            stored = None
    if not stored:
        return
    diff = config_differences(stored, cfg)
    if diff:
        shown = list(diff.items())[:4]
        more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
        raise RunMismatch(
            f"{run_dir} holds a run of another configuration ({src.name}: "
            f"{', '.join(f'{k}={a}' for k, (a, _) in shown)}; now: {', '.join(f'{k}={b}' for k, (_, b) in shown)}{more}): "
            f"{fresh_hint(job_name)}")


def fresh_hint(job_name: str = "", run_dir: Path | None = None) -> str:
    """The ways out of a run folder that cannot be resumed (``--resume previous`` where the folder
    has a previous checkpoint)."""
    key = f"train.{job_name.replace('-', '_')}" if job_name else "train.<job>"
    prev = Path(run_dir) / "checkpoints" / "previous.pt" if run_dir is not None else None
    back = f"pass --resume previous to resume from {prev} (the checkpoint before), " \
        if prev is not None and prev.is_file() else "pass "
    return f"{back}--fresh to start over in it, or set {key}.run_dir to another folder"


def restore_previous(run_dir: Path) -> str:
    """Make ``checkpoints/previous.pt`` the checkpoint a resume starts from: it is checked
    (sha256; :class:`CheckpointError` when it fails too), ``last.pt`` is kept as
    ``last.pt.rejected`` (with its checksum file) and ``previous.pt`` linked as ``last.pt``.
    Returns the line to print."""
    ckpt = Path(run_dir) / "checkpoints"
    last = ckpt / "last.pt"
    prev = previous_path(last)
    if not prev.is_file():
        raise CheckpointError(f"checkpoint {prev}: file not found (--resume previous needs the checkpoint before "
                              f"last.pt; a run keeps one from its second checkpoint on)")
    step = load_checkpoint(prev).get("step")  # refuses a previous.pt that is not the bytes written
    why = ""
    if last.is_file():
        problem = integrity_problem(last)
        why = f" ({problem})" if problem else " (its bytes check out; going back anyway, as asked)"
        os.replace(last, ckpt / "last.pt.rejected")
        if sum_path(last).is_file():
            os.replace(sum_path(last), sum_path(ckpt / "last.pt.rejected"))
    from pipeline.io.atomic import write_bytes_atomic

    from pipeline.io.atomic import tmp_name

    tmp = tmp_name(last)
    os.link(prev, tmp)
    os.replace(tmp, last)
    if sum_path(prev).is_file():  # (a previous.pt without one was checked by its zip CRCs)
        write_bytes_atomic(sum_path(last), sum_path(prev).read_bytes().replace(b"previous.pt", b"last.pt"))
    kept = f"; {last} set aside as last.pt.rejected{why}" if why else ""
    return f"resuming from {prev} (step {step}){kept}"
