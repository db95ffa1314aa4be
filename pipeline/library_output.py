"""Third-party output sent to a log file instead of the terminal, for a command whose output is a table
(``pipeline plan``): transformers' warnings and weight-loading bars, tqdm, Python warnings, the pipeline's
own log records, and whatever the child processes it starts write to their stderr."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path


def log_path(folder: Path, name: str) -> Path:
    """``<folder>/_logs/<name>.log``, or a file in the temporary folder where that cannot be made (an
    output on another machine's disk, a read-only folder)."""
    try:
        (Path(folder) / "_logs").mkdir(parents=True, exist_ok=True)
        path = Path(folder) / "_logs" / f"{name}.log"
        with open(path, "a"):
            pass
        return path
    except OSError:
        return Path(tempfile.gettempdir()) / f"vlpipe-{name}-{os.getpid()}.log"


@contextlib.contextmanager
def library_output_to(path: Path):
    """While the block runs, this process's stderr (file descriptor 2, inherited by child processes, and
    ``sys.stderr``) appends to ``path``. Yields ``say(line)``, which still reaches the terminal."""
    sys.stderr.flush()
    old = sys.stderr
    try:
        on_fd2 = old.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a captured stream (tests): say() writes to it
        on_fd2 = False
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1) if on_fd2 else old
    os.dup2(log.fileno(), 2)
    sys.stderr = log

    def say(line: str) -> None:
        terminal.write(line + "\n")
        terminal.flush()

    try:
        yield say
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sys.stderr = old
            log.close()
            if terminal is not old:
                terminal.close()
