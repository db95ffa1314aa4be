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


def test_leave_false_leaves_nothing_once_done():
    """The harness's benchmarks loop prints its own summary line: its progress leaves no last line."""
    out = io.StringIO()
    assert list(progress(range(5), "benchmarks", unit="bench", stream=out, leave=False)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""
    out = io.StringIO()
    list(progress(range(3), "benchmarks", unit="bench", stream=out, leave=False, every=0.0))  # a long loop: its lines
    assert [ln.split(",")[0] for ln in out.getvalue().splitlines()] == ["benchmarks: 1/3 bench", "benchmarks: 2/3 bench"]


def test_a_terminal_gets_a_tqdm_bar():
    out = _Tty()
    assert list(progress([1, 2, 3], "benchmarks", unit="bench", stream=out)) == [1, 2, 3]
    text = out.getvalue()
    assert "\r" in text and "benchmarks" in text and "3/3" in text


def test_stage_progress_counts_each_kind_of_row_apart(caplog):
    """build-index's two units search the captions (2,994 rows) and the images (599): its progress
    line said "2/2 shards, 3,593 images"; each kind is counted by what it is."""
    import logging

    from pipeline.counts import unit_rows
    from pipeline.stage import _Progress

    units = [{"stats": {"missing_slots": 0, "rows": 2994, "table_rows": {"caption_negatives": 2994}}},
             {"stats": {"missing_slots": 0, "rows": 599, "table_rows": {"image_negatives": 599}}}]
    assert [unit_rows("build-index", u) for u in units] == [(2994, "captions"), (599, "images")]
    p = _Progress("index", 2, 3593)
    with caplog.at_level(logging.INFO, logger="pipeline"):
        for u in units:
            p.update(*unit_rows("build-index", u))
    last = [r.getMessage() for r in caplog.records][-1]
    assert last.startswith("index: 2/2 shards, 2,994 captions + 599 images, ") and " rows/s, ETA 0.0s" in last, last
    one = _Progress("clip_tokens", 2, 300)  # one kind of row: counted and rated by its name
    with caplog.at_level(logging.INFO, logger="pipeline"):
        one.update(150, "images")
        one.update(150, "images")
    last = [r.getMessage() for r in caplog.records][-1]
    assert last.startswith("clip_tokens: 2/2 shards, 300 images, ") and " images/s, ETA 0.0s" in last, last
