"""A run folder's ``metrics.jsonl`` on resume (train/loop.py): the lines a resumed run continues.

Each line is one JSON object ``{"kind": "train"|"eval"|"best", "step", "epoch", ...}``, appended by
the rank that writes the run folder. A run killed after its checkpoint at step S wrote lines past S
that the resumed run writes again; a second process that wrote into the file left lines whose step
goes back or repeats; a kill mid-write leaves an unreadable last line. :func:`truncate_metrics`
keeps exactly the lines a resume from S continues, so the file after any kill and rerun holds each
(kind, step) once, as an uninterrupted run's does.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.io.atomic import write_bytes_atomic


def truncate_metrics(path: Path, step: int, redo: frozenset = frozenset()) -> str:
    """Keep the lines of ``metrics.jsonl`` that a resume from ``step`` continues: readable, at or
    before ``step``, in step order and each (kind, step) once; ``redo``: the kinds of line at
    ``step`` itself that the resumed run writes again (the final evaluation of a run resumed at its
    last step). A line whose step goes back, or repeats, is a remnant of another run that wrote
    into the same file. Returns what was dropped (one phrase; '' when nothing was)."""
    if not path.exists():
        return ""
    keep, past, back, bad = [], [], [], 0
    seen: set[tuple] = set()
    last = None
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        s = row.get("step") if isinstance(row, dict) else None
        if not isinstance(s, (int, float)) or isinstance(s, bool):
            bad += 1
        elif s > step or (s == step and row.get("kind") in redo):
            past.append(s)
        elif (last is not None and s < last) or (row.get("kind"), s) in seen:
            back.append(s)
        else:
            keep.append(line)
            seen.add((row.get("kind"), s))
            last = s
    if not (past or back or bad):
        return ""
    write_bytes_atomic(path, "".join(k + "\n" for k in keep).encode())

    def steps(xs: list) -> str:
        shown = ", ".join(str(x) for x in xs[:6])
        return f"step {shown}" if len(xs) == 1 else f"steps {shown}{', ...' if len(xs) > 6 else ''}"

    what = f"at or past the checkpoint's step {step}" if redo else f"past the checkpoint's step {step}"
    parts = ([f"{len(past)} {what} ({steps(past)})"] if past else []) + \
            ([f"{len(back)} out of step order or repeated ({steps(back)}; another run wrote into this file)"]
             if back else []) + ([f"{bad} unreadable"] if bad else [])
    return f"dropped {len(past) + len(back) + bad} line(s): " + "; ".join(parts)


def lines_in(path: Path) -> int:
    """How many non-empty lines ``path`` holds (0 when it does not exist)."""
    try:
        return sum(1 for ln in path.read_text(errors="replace").splitlines() if ln.strip())
    except OSError:
        return 0
