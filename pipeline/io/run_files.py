"""Reading the files of a training run folder (``config.json``, ``eval/<tag>/results.parquet``,
``eval/<tag>/metrics.json``) for tables across runs: `train compare` (plain, ``--over-seeds``,
``--paper``) and the report's training section. A file that cannot be read raises
:class:`CorruptRunFile`, one line naming it; those readers skip that run folder, name it, and go on
with the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CorruptRunFile(ValueError):
    """A file of a run folder that is not readable (the message names it and the problem)."""


def _why(e: BaseException) -> str:
    from pipeline.errors import describe_exception

    return describe_exception(e, 160)


def read_json_file(path: str | Path) -> Any:
    """The JSON value in ``path`` (UTF-8)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptRunFile(f"{path}: corrupt or unreadable JSON ({_why(e)})") from None


def read_parquet_file(path: str | Path, columns: list[str] | None = None):
    """The table in ``path`` (a pyarrow Table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise CorruptRunFile(f"{path}: corrupt or unreadable Parquet file ({_why(e)})") from None


def skipped_line(errors: list[str]) -> str:
    """The note a table across runs ends with: the run folders it skipped and why."""
    return f"skipped {len(errors)} run folder(s) with a corrupt file: " + "; ".join(errors) if errors else ""
