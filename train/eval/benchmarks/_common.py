"""Shared pieces of the benchmark readers: file loading with one-line errors (a Git LFS pointer in
place of a file says so), malformed-row bookkeeping, and the accuracy rows every pairwise benchmark
reports."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from train.eval.interface import Item, Row
from train.eval.intervals import interval, macro, proportion


class BenchmarkError(ValueError):
    """A benchmark file that cannot be used at all; the message names the file (and the row)."""


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def not_lfs_pointer(path: Path, what: str, head: bytes | None = None) -> None:
    """Raise when ``path`` (whose first bytes are ``head``, read here when None) is a Git LFS pointer,
    what a clone without ``git lfs pull`` holds in place of the file."""
    if head is None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(256)
        except OSError:
            return  # the reader reports it
    if head.startswith(LFS_POINTER):
        m = re.search(rb"\nsize (\d+)", head)
        size = f" ({int(m.group(1)):,} bytes)" if m else ""
        raise BenchmarkError(f"{what} {path}: a Git LFS pointer, not the file{size}: fetch it (`git lfs pull` in its "
                             "repository, or download the file itself)")


def load_json(path: Path, what: str) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BenchmarkError(f"{what} {path}: file not found") from None
    except OSError as e:
        raise BenchmarkError(f"{what} {path}: cannot read ({e.strerror or e})") from None
    not_lfs_pointer(path, what, raw[:256])
    try:
        return json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise BenchmarkError(f"{what} {path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


class Rows:
    """Collects a file's items and malformed rows. ``bad(row, problem)`` counts a row as skipped
    (reason ``malformed: <problem>``); ``done()`` raises when a file had rows but none usable,
    naming the file and its first bad row."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        self.items: list[Item] = []
        self.skipped: Counter = Counter()
        self.first_bad: tuple[str, str] | None = None
        self.filtered: Counter = Counter()  # rows left out on purpose (e.g. VALSE's non-validated foils)

    def bad(self, row: Any, problem: str) -> None:
        self.skipped[f"malformed: {problem}"] += 1
        if self.first_bad is None:
            self.first_bad = (str(row), problem)

    def done(self) -> None:
        if not self.items and self.first_bad is not None:
            row, problem = self.first_bad
            raise BenchmarkError(f"{self.what} {self.path}: row {row}: {problem} (no usable row in the file)")


def text_field(rec: Any, name: str) -> str | None:
    """A non-empty string field of a dict row, else None."""
    if not isinstance(rec, dict):
        return None
    v = rec.get(name)
    if isinstance(v, str) and v.strip():
        return v.strip()
    return None


def missing(rec: Any, names: Iterable[str]) -> str | None:
    """'missing or empty field(s) a, b' for the text fields absent in rec, None if all present."""
    if not isinstance(rec, dict):
        return f"not an object (got {type(rec).__name__})"
    gone = [n for n in names if text_field(rec, n) is None]
    return f"missing or empty field{'s' if len(gone) > 1 else ''} {', '.join(repr(g) for g in gone)}" if gone else None


def files_in(path: Path, patterns: Sequence[str], what: str) -> list[Path]:
    """The files a spec path names: the file itself, a glob, or the matching files of a folder."""
    s = str(path)
    if any(c in s for c in "*?["):
        import glob

        found = sorted(Path(p) for p in glob.glob(s, recursive=True))
    elif path.is_dir():
        found = sorted({f for pat in patterns for f in path.rglob(pat)})
    elif path.exists():
        found = [path]
    else:
        raise BenchmarkError(f"{what} {path}: not found")
    found = [f for f in found if f.is_file()]
    if not found:
        raise BenchmarkError(f"{what} {path}: no {' / '.join(patterns)} files there")
    return found


# -- scoring --------------------------------------------------------------------------------------


def beats(scores: np.ndarray) -> bool:
    """Strict: the first pair's score is higher than every other pair's (ties count as wrong)."""
    s = np.asarray(scores, dtype=np.float64)
    return bool(s.shape[0] > 1 and np.all(s[0] > s[1:]))


def tied_at_top(scores: Sequence[np.ndarray]) -> np.ndarray:
    """Per item: the first pair's score equals the best other pair's exactly (scored wrong, :func:`beats`)."""
    return np.fromiter((len(s) > 1 and float(np.max(np.asarray(s, np.float64)[1:])) == float(s[0]) for s in scores),
                       dtype=bool, count=len(scores))


def tie_text(tied: int, n: int, where: str = "at the top") -> str:
    """``K of N items tied at the top (scored wrong, as the original)``: the one wording of a row's ties
    (pipeline.report.significance.below_reason reads it back beside a "below" verdict)."""
    return f"{tied:,} of {n:,} items tied {where} (scored wrong, as the original)"


def tie_note(scores: Sequence[np.ndarray]) -> str:
    """"; K of N items tied at the top (scored wrong, as the original)" when the first pair's score equals
    the best other pair's exactly: a model blind to what the negatives change (word order) ties on every
    item, and a strict protocol then lands far below chance; the note says why."""
    tied = int(tied_at_top(scores).sum())
    return f"; {tie_text(tied, len(scores))}" if tied else ""


def with_ties(row: Row, tied: np.ndarray | tuple[int, int] | None, where: str = "at the top") -> Row:
    """``row`` with its items' ties (a bool per item, or (tied, items)) recorded: ``row.tied``, and in its
    note when any tied."""
    if tied is None:
        return row
    k, n = (int(tied[0]), int(tied[1])) if isinstance(tied, tuple) else (int(np.sum(tied)), int(np.size(tied)))
    row.tied = (k, n)
    if k:
        row.note = "; ".join(x for x in (row.note, tie_text(k, n, where)) if x)
    return row


def correct_vector(items: Sequence[Item], scores: Sequence[np.ndarray], fn: Callable = beats) -> np.ndarray:
    if len(items) != len(scores):
        raise ValueError(f"score: {len(items)} items but {len(scores)} score arrays")
    for it, s in zip(items, scores):
        if len(s) != len(it.pairs):
            raise ValueError(f"score: item {it.key!r} has {len(it.pairs)} pairs but {len(s)} scores")
    return np.fromiter((fn(s) for s in scores), dtype=bool, count=len(scores))


def item_images(items: Sequence[Item]) -> list[str]:
    """Each item's image (its first pair's): the unit its interval resamples (items of one image are
    not independent)."""
    return [it.pairs[0].image if it.pairs else it.key for it in items]


def group_rows(name: str, groups: Sequence[str], correct: np.ndarray, chance: np.ndarray | float,
               metric: str = "accuracy", order: Sequence[str] | None = None, note: str = "",
               images: Sequence | None = None, ties: np.ndarray | None = None) -> list[Row]:
    """One accuracy row per group (pooled over its items), in ``order`` (default sorted), each with
    its interval (:mod:`train.eval.intervals`: Wilson, on the effective n where ``images`` repeat)
    and its per-item estimate (for macro averages over groups); ``ties`` (a bool per item): each
    row's ties (:func:`with_ties`)."""
    by: dict[str, list[int]] = defaultdict(list)
    for k, g in enumerate(groups):
        by[g].append(k)
    ch = np.broadcast_to(np.asarray(chance, dtype=np.float64), correct.shape)
    img = np.asarray(images if images is not None else np.arange(len(correct)), dtype=object)
    out = []
    for g in (order if order is not None else sorted(by)):
        idx = by.get(g)
        if not idx:
            continue
        est = proportion(correct[idx], img[idx])
        row = Row(name, g, metric, 100.0 * float(correct[idx].mean()), len(idx), 100.0 * float(ch[idx].mean()),
                  note=note, est=est).with_ci(interval(est, 100.0))
        out.append(with_ties(row, None if ties is None else np.asarray(ties)[idx]))
    return out


def pooled_row(name: str, subset: str, correct: np.ndarray, chance: np.ndarray | float, metric: str = "accuracy",
               note: str = "", images: Sequence | None = None, ties: np.ndarray | None = None) -> Row:
    ch = np.broadcast_to(np.asarray(chance, dtype=np.float64), correct.shape)
    est = proportion(correct, None if images is None else np.asarray(images, dtype=object))
    return with_ties(Row(name, subset, metric, 100.0 * float(correct.mean()), int(correct.size), 100.0 * float(ch.mean()),
                         note=note, est=est).with_ci(interval(est, 100.0)), ties)


def macro_row(name: str, subset: str, rows: Sequence[Row], metric: str = "macro_accuracy", note: str = "") -> Row | None:
    """Unweighted mean of ``rows``' values (and chances); n = the items under them. Its interval
    resamples images across all the rows at once and recomputes the macro
    (:func:`train.eval.intervals.macro`); it keeps the estimate for a macro over macros."""
    if not rows:
        return None
    chances = [r.chance for r in rows]
    chance = None if any(c is None for c in chances) else float(np.mean(chances))
    row = Row(name, subset, metric, float(np.mean([r.value for r in rows])), int(sum(r.n for r in rows)), chance, note=note)
    if all(r.tied is not None for r in rows):  # the ties of the items under it
        with_ties(row, (sum(r.tied[0] for r in rows), sum(r.tied[1] for r in rows)))
    if any(r.est is None for r in rows):
        return row.no_interval("a row it averages has no per-item estimate")
    row.est = macro([r.est for r in rows])
    return row.with_ci(interval(row.est, 100.0))


def karpathy_split_images(data: dict, split: str, rows: "Rows"):
    """``(index, image dict, key)`` for every image of ``split`` in a Karpathy split JSON
    (``{"images": [...]}``): the key is ``filename``, else ``cocoid``, else ``imgid`` (None, recorded
    as malformed, where the image has none); entries that are not objects are recorded and skipped."""
    from pipeline.readers.karpathy import split_matches

    for n, im in enumerate(data["images"]):
        if not isinstance(im, dict):
            rows.bad(f"images[{n}]", "not an object")
            continue
        if not split_matches(str(im.get("split") or "train"), split):
            continue
        key = im.get("filename") or im.get("cocoid") or im.get("imgid")
        key = None if key is None or str(key).strip() == "" else str(key).strip()
        if key is None:
            rows.bad(f"images[{n}]", "no 'filename'")
        yield n, im, key
