"""The scoring contract between training jobs and the evaluation harness (``train eval``).

Every job is scored by the same harness (:mod:`train.eval.harness`). The harness reads each
benchmark in its published format (:mod:`train.eval.benchmarks`), matches the benchmark's images
to the ``samples`` artifact (:class:`train.eval.images.ImageMatcher`), asks the job for scores,
and writes one ``results.parquet`` row per (benchmark, subset, metric) with its chance level, the
number of items scored and the number skipped (and why).

A job takes part by implementing, on its :class:`train.loop.Job` subclass:

``scorable_sample_ids() -> set[int] | numpy array``
    The sample ids whose image the job's artifacts hold (e.g. the ids of its ``clip_tokens``
    shards). A benchmark item whose image maps to a sample outside this set is counted as
    ``skipped_no_image``, never silently dropped.

``score_pairs(model, sample_ids, texts, boxes=None) -> numpy float64 [P]``
    Image-text compatibility s(I, x) for P pairs (``sample_ids[p]``, ``texts[p]``), higher =
    more compatible. Texts are arbitrary strings: a job encodes them with the frozen text side of
    its models when they are not in an artifact (concept-ot: ``models.clip``'s text tower).
    ``boxes`` is ``None`` or a float array [P, 4] (x0, y0, x1, y1 in the image's pixels, NaN
    where an item has no box): benchmarks such as ARO's VG-Relation score a crop of the image. A
    job that can restrict its image features to a box does so; one that cannot returns scores of
    the whole image and sets ``self.crop_note`` (a short string) that the harness records.
    Called with the model in eval mode under ``torch.no_grad()``; the harness chunks P.

``retrieval_scores(model, sample_ids, caption_ids, texts) -> dict[str, numpy [I, T]]``  (optional)
    Score matrices for image-text retrieval over I images and T captions (the captions of those
    images, ``caption_ids`` from the ``captions`` table, ``texts`` their strings): one matrix per
    protocol the job reports (concept-ot: ``global`` and ``rerank``, ConceptOT G.4). The default
    (:meth:`train.loop.Job.retrieval_scores`) scores the full cross product through
    ``score_pairs`` under the name ``score``, which is fine for the 1K Flickr30k test split and
    slow for 5K COCO; jobs with a cheap first stage override it.

``score_pairs_frozen(model, sample_ids, texts, boxes=None)`` with ``has_frozen_baseline() -> bool``  (optional)
    The same pairs scored by the frozen model the job reads, without anything it learnt
    (concept-ot: its global cosine g; visual-tokens: the frozen CLIP's image-text cosine). The
    harness scores every pairwise benchmark's items again with it and adds each row as
    ``<metric>[frozen]`` with ``baseline_for`` naming the result row (``frozen_note``: its note).

``score_pairs_text_only(model, sample_ids, texts, boxes=None)``  (optional)
    The job's own scorer with every image replaced by one constant image (the job documents which:
    visual-tokens and concept-ot use the mean image feature of the evaluation split): the bar of a
    benchmark whose negatives a text prior can tell apart. Scored on the formats of
    :data:`train.eval.harness.TEXT_SHORTCUT_FORMATS` (SugarCrepe, VL-CheckList, VALSE), each row
    ``<metric>[text-only]`` with ``baseline_for`` its result row (``text_only_note``: its note).

``baseline_protocols: dict[str, str]``  (optional)
    Retrieval protocols of ``retrieval_scores`` that learn nothing, each mapped to the protocol
    it is the baseline of (concept-ot ``{"global": "rerank"}``, visual-tokens ``{"frozen": "score"}``).

Every baseline row carries its ``est`` over the same items, in the same order and with the same
image clusters as its result row's, so a paired bootstrap can resample the same images for both.

``job_metrics(model, out_dir) -> list[Row]``  (optional)
    The job's own evaluations that are not image-text scoring (grounding accuracy, phrase
    discovery, MCP AUC, relation recall); they go into the same table.

Units: every accuracy, recall and rate is a percentage (0-100) and its chance level is in the
same unit; AUCs and IoUs are fractions (0-1) with their chance beside them. ``Row.unit`` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# results.parquet columns, in order (DESIGN.md, Evaluation)
RESULT_COLUMNS = ("job", "variant", "checkpoint", "step", "benchmark", "subset", "metric", "value", "n", "chance",
                  "ci_low", "ci_high", "skipped", "skip_reasons", "unit", "note", "baseline_for",
                  "diff_vs", "diff", "diff_low", "diff_high")
# the paired columns (older results.parquet files lack them: readers take them as absent, no verdict)
PAIRED_COLUMNS = ("diff_vs", "diff", "diff_low", "diff_high")


@dataclass
class Row:
    """One result: a metric of a benchmark subset (``subset='all'`` for the benchmark's overall
    figure), the number of items it was computed on, its chance level (None only where no chance
    level is defined, e.g. a loss), the number of items skipped and why, and the 95% interval of
    ``value`` in its unit (:mod:`train.eval.intervals` chooses it by the metric's kind: Wilson for a
    proportion, on the effective n where items share an image; a bootstrap that resamples images otherwise). A row that has no interval says why in its note (:meth:`no_interval`)."""

    benchmark: str
    subset: str
    metric: str
    value: float
    n: int
    chance: float | None
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    unit: str = "%"  # "%" | "fraction" | "" (a count or a loss)
    note: str = ""
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    # set on a no-learning baseline's row (a frozen score, a prior, one group, a random assignment, the
    # untrained model): "<subset>/<metric>" of the result row in the same benchmark it is the baseline of.
    # Verdicts (pipeline.report.significance) call a result "above" only when the interval of its paired
    # difference from its strongest baseline lies above 0 and its own interval above chance; the
    # baseline row itself is labelled a baseline, no verdict. The harness pairs them (train.eval.paired).
    baseline_for: str = ""
    # the paired difference against the strongest baseline naming this row (``diff_vs``: its metric label):
    # result - baseline and its 95% interval over the same resampled images (intervals.paired_difference),
    # in the row's unit; NaN and a "no paired interval: <why>" note where it cannot be computed
    diff_vs: str = ""
    diff: float = float("nan")
    diff_low: float = float("nan")
    diff_high: float = float("nan")
    # the per-item estimate behind ``value`` (not a column): a macro average over rows combines them
    est: Any = field(default=None, repr=False, compare=False)
    # (items tied, items) where the scorer counts ties (not a column: the note says it when any tied; a macro
    # average over rows adds them up): a strict protocol scores a tie wrong, so a blind scorer lands below chance
    tied: Any = field(default=None, repr=False, compare=False)

    def with_ci(self, interval: tuple[float, float]) -> Row:
        self.ci_low, self.ci_high = float(interval[0]), float(interval[1])
        return self

    def no_interval(self, reason: str) -> Row:
        """NaN interval, with ``reason`` in the note (never silently)."""
        self.ci_low = self.ci_high = float("nan")
        self.note = "; ".join(x for x in (self.note, f"no interval: {reason}") if x)
        return self

    def as_dict(self) -> dict[str, Any]:
        import json

        return {"benchmark": self.benchmark, "subset": self.subset, "metric": self.metric, "value": float(self.value),
                "n": int(self.n), "chance": None if self.chance is None else float(self.chance),
                "ci_low": float(self.ci_low), "ci_high": float(self.ci_high),
                "skipped": int(self.skipped), "skip_reasons": json.dumps(self.skip_reasons, sort_keys=True),
                "unit": self.unit, "note": self.note, "baseline_for": self.baseline_for,
                "diff_vs": self.diff_vs, "diff": float(self.diff), "diff_low": float(self.diff_low),
                "diff_high": float(self.diff_high)}


@dataclass
class Pair:
    """One (image, text) pair a benchmark item needs scored. ``image`` is the benchmark's own
    image key (a file name, a relative path or a source id, as the benchmark publishes it);
    ``box`` an optional crop (x0, y0, x1, y1) in the image's pixels."""

    image: str
    text: str
    box: tuple[float, float, float, float] | None = None


@dataclass
class Item:
    """One benchmark item: the pairs it needs scored and what it belongs to. The benchmark's
    scorer receives the item with ``scores`` aligned to ``pairs`` (e.g. SugarCrepe: pairs
    [(img, caption), (img, negative)], correct when scores[0] > scores[1]; Winoground: the four
    (image_i, caption_j) pairs)."""

    pairs: list[Pair]
    subset: str = "all"
    key: str = ""  # the item's id in the benchmark file (for errors and per-item output)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchData:
    """A benchmark as read from disk: its items, the scoring function over scored items, and the
    rows a reader had to skip as malformed (counted in the results, with reasons)."""

    name: str
    items: list[Item]
    score: Callable[[Sequence[Item], Sequence[np.ndarray]], list[Row]]
    kind: str = "pairwise"  # "pairwise": score() over items' pair scores; "retrieval": items are images with
    # their captions (pairs [(image, caption), ...]), scored by the harness through retrieval_scores
    skipped: dict[str, int] = field(default_factory=dict)
    source: str = ""  # the files read (shown in the report)
    total: int | None = None  # items in the files (for "0 of N images are in the artifacts")


class NoScorableItems(RuntimeError):
    """A benchmark none of whose items could be scored: an error that says why, never a blank row."""
