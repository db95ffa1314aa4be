"""pipeline.progress: a tqdm bar on a terminal, a plain line every few seconds elsewhere."""

from __future__ import annotations

import io

from pipeline.progress import progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_not_a_terminal_gives_plain_lines_at_most_every_few_seconds():
    out = io.StringIO()
    assert list(progress(range(5), "benchmarks", unit="bench", stream=out)) == [0, 1, 2, 3, 4]
    lines = out.getvalue().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("benchmarks: 5/5 bench") and "ETA 0.0s" in lines[-1]
    assert "\r" not in out.getvalue()
    out = io.StringIO()
    list(progress(iter(range(3)), "search", every=0.0, stream=out))  # no length: no total, a line per item
    assert [ln.split(",")[0] for ln in out.getvalue().splitlines()] == ["search: 1 it", "search: 2 it", "search: 3 it"]


def test_a_terminal_gets_a_tqdm_bar():
    out = _Tty()
    assert list(progress([1, 2, 3], "benchmarks", unit="bench", stream=out)) == [1, 2, 3]
    text = out.getvalue()
    assert "\r" in text and "benchmarks" in text and "3/3" in text
