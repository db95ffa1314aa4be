"""A progress bar for long loops in the driver (benchmarks of ``train eval``, ...).

On a terminal: a tqdm bar on stderr. Elsewhere (a log file, CI, a pipe): no bar, one plain line
every ``every`` seconds and a last one at the end (done/total, rate, ETA), so a log is not flooded
with carriage returns. Stage units have their own rows-and-shards line (``pipeline.stage._Progress``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

# ``log.info(msg, extra=LOG_FILE_ONLY)``: a line for the run's log file, not the terminal (``-v`` shows it
# there too; pipeline.cli.setup_logging filters it): what the terminal already shows in another form
LOG_FILE_ONLY = {"file_only": True}


def terminal_filter(verbose: bool):
    """The filter of a terminal log handler: drops :data:`LOG_FILE_ONLY` records unless ``verbose``."""
    return lambda record: verbose or not getattr(record, "file_only", False)


def progress(items: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it", every: float = 5.0,
             stream=None, leave: bool = True) -> Iterator[T]:
    """Yield ``items``, showing how many are done (``total``: defaults to ``len(items)``).
    ``leave=False``: nothing stays once done (the bar is cleared; no last line), for a loop whose
    caller prints its own summary."""
    stream = stream or sys.stderr
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=unit, file=stream, dynamic_ncols=True, leave=leave)
        return
    t0 = last = time.perf_counter()
    done = 0
    for x in items:
        yield x
        done += 1
        now = time.perf_counter()
        if (now - last < every and done != total) or (done == total and not leave):
            continue
        last = now
        rate = done / max(now - t0, 1e-9)
        of = f"/{total}" if total is not None else ""
        eta = f", ETA {format_seconds((total - done) / rate)}" if total is not None and rate > 0 else ""
        stream.write(f"{desc}: {done}{of} {unit}, {rate:,.2f} {unit}/s{eta}\n")
        stream.flush()


def format_seconds(s: float) -> str:
    """Seconds for people: 0.4s, 12s, 3m 05s, 2h 10m (never negative)."""
    s = max(0.0, float(s))
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
