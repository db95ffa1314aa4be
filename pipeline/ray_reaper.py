"""Ends an embedded Ray's processes when the driver that started them dies, kill -9 included.

Ray ties its head processes (GCS, raylet, ...) to the driver, but the raylet's agents (the
dashboard agent, the runtime-env agent) notice the raylet's death and then hang instead of
exiting: a `kill -9` of `pipeline run` left them running for good. :func:`start` launches this
module as a small process holding the read end of a pipe whose write end only the driver has.
While the driver lives it notes the processes `ray.init` started and their descendants (pid and
start time) every second; when the pipe reaches end-of-file (the driver is gone, however it
ended) it terminates, then kills, those it noted that still run (same pid *and* start time:
never a recycled pid), and exits.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

_POLL_S = 1.0
_GRACE_S = 2.0


_REAPERS: list[subprocess.Popen] = []  # referenced for our lifetime: closing the pipe would end Ray


def children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children()}


def start(before: set[int]) -> None:
    """Start the reaper of the processes this process started since ``before`` (the
    :func:`children` taken just before ``ray.init``)."""
    roots = sorted(children() - before)
    if not roots:
        return
    _REAPERS.append(subprocess.Popen([sys.executable, "-m", "pipeline.ray_reaper", *map(str, roots)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True))


def _tree(roots: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for root in roots:
        try:
            r = psutil.Process(root)
            procs = [r, *r.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                out[p.pid] = p.create_time()
            except psutil.Error:
                pass
    return out


def _end(noted: dict[int, float]) -> None:
    import psutil

    live = []
    for pid, created in noted.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.terminate()
                live.append(p)
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(live, timeout=_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def main(roots: list[int]) -> None:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the driver's terminal: outlive it, then clean
    noted: dict[int, float] = {}
    while True:
        noted.update(_tree(roots))
        for pid in [p for p in noted if not psutil.pid_exists(p)]:
            noted.pop(pid)  # ended on its own (idle workers come and go)
        ready, _, _ = select.select([sys.stdin], [], [], _POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # end-of-file: the driver is gone
    _end(noted)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
