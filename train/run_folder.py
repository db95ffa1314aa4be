"""Whether a training run folder can be resumed, and the ways out when it cannot (train/loop.py).

A folder holds one training configuration: :func:`check_run_folder` refuses to resume a
checkpoint of another (:class:`RunMismatch`). A checkpoint whose bytes are not the ones written
(pipeline/io/checkpoint.py) is refused by the loader; :func:`restore_previous` (``train run
--resume previous``) goes back to ``checkpoints/previous.pt``, the checkpoint before ``last.pt``,
after checking it, and sets the refused ``last.pt`` aside as ``last.pt.rejected``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.io.checkpoint import CheckpointError, integrity_problem, load_checkpoint, previous_path, sum_path


class RunMismatch(RuntimeError):
    """A run folder whose checkpoint was trained with another configuration (one line: both configs
    and the way out)."""


def check_run_folder(run_dir: Path, cfg, job_name: str = "") -> None:
    """Refuse to resume ``run_dir`` when its checkpoint (else its config.json) holds another training
    configuration (train.config.config_differences: evaluation-only options may differ)."""
    from train.config import config_differences

    last = Path(run_dir) / "checkpoints" / "last.pt"
    stored, src = None, None
    if last.is_file():
        stored, src = (load_checkpoint(last).get("config") or None), last
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

    tmp = ckpt / f".last.pt.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.link(prev, tmp)
    os.replace(tmp, last)
    if sum_path(prev).is_file():  # (a previous.pt without one was checked by its zip CRCs)
        write_bytes_atomic(sum_path(last), sum_path(prev).read_bytes().replace(b"previous.pt", b"last.pt"))
    kept = f"; {last} set aside as last.pt.rejected{why}" if why else ""
    return f"resuming from {prev} (step {step}){kept}"
