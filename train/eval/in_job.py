"""A job's own SugarCrepe-format evaluation during training, scored by the harness.

concept-ot and visual-tokens report pairwise accuracy on SugarCrepe-format folders at every
evaluation (the generated dataset's ``sugarcrepe/`` by default, held-out images only:
:func:`held_out_splits`). The folders are read by the
published-format reader (:mod:`train.eval.benchmarks.sugarcrepe`) and scored by
:func:`train.eval.harness.evaluate_benchmark` through the job's ``score_pairs``, exactly as
``train eval`` scores a configured ``sugarcrepe`` benchmark: images matched to the ``samples``
artifact, items whose image the job cannot score counted, a tie counts as wrong.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from train.eval.interface import BenchData, NoScorableItems, Row

NOT_IN_ARTIFACTS = "skipped_no_image: not in the job's artifacts"


def generated_sugarcrepe_dirs(manifest, configured: list[str] | None) -> list[Path]:
    """``configured`` when set; else the generated dataset's ``sugarcrepe/`` folder (a synthetic
    dataset only: other datasets have no default)."""
    if configured is not None:
        return [Path(d) for d in configured]
    if manifest.dataset.kind != "synthetic":
        return []
    from pipeline.io.storage import local_path
    from pipeline.readers import synthetic_root

    return [synthetic_root(manifest.dataset, local_path(manifest.output)) / "sugarcrepe"]


def read_folders(name: str, dirs, max_per_kind: int | None = None) -> tuple[BenchData | None, int]:
    """(the SugarCrepe items of every folder of ``dirs`` that holds a ``<kind>.json``, a kind found in several merged,
    at most the first ``max_per_kind`` of each kind in file order; the number of items read before
    that cap). (None, 0) when no folder has one."""
    from types import SimpleNamespace

    from train.eval.benchmarks import sugarcrepe

    items, skipped, read = [], Counter(), []
    for d in dirs:
        if Path(d).is_dir() and any(sugarcrepe.kind_of(f.stem) in sugarcrepe.KINDS for f in Path(d).glob("*.json")):
            data = sugarcrepe.read(SimpleNamespace(name=name, path=str(d), options={}))
            items += data.items
            skipped.update(data.skipped or {})
            read.append(str(d))
    if not read:
        return None, 0
    available = len(items)
    if max_per_kind:
        seen: Counter = Counter()
        kept = []
        for it in items:
            seen[it.subset] += 1
            if seen[it.subset] <= max_per_kind:
                kept.append(it)
        items = kept
    data = BenchData(name, items, kind="pairwise", score=lambda its, sc: sugarcrepe.score(name, its, sc),
                     skipped=dict(skipped), source=", ".join(read), total=len(items))
    return data, available


@dataclass
class FolderResult:
    """The harness's rows of one in-job benchmark, the items read (before ``max_per_kind``) and
    those whose image is in the samples artifact (``matched``)."""

    rows: list[Row] = field(default_factory=list)
    available: int = 0
    matched: int = 0
    kinds: list[str] = field(default_factory=list)


def held_out_splits(configured: list[str] | None, eval_splits: list[str]) -> list[str] | None:
    """The image splits an in-job SugarCrepe evaluation scores: the generated dataset's own folder
    (``configured`` None) has items for every image, training images included, so only those whose
    image is in ``eval_splits`` count (as the testbed's harness benchmarks, ``image_splits``);
    configured folders (published SugarCrepe) are scored whole."""
    return list(eval_splits) if configured is None else None


def score_folders(job, model, name: str, dirs, samples_dir, max_per_kind: int | None = None,
                  pairs_chunk: int = 2048, image_splits: list[str] | None = None,
                  baselines: bool = False) -> FolderResult | None:
    """The harness's rows for the SugarCrepe-format ``dirs`` scored by ``job.score_pairs`` (None
    when no folder holds a ``<kind>.json``); with ``image_splits`` only the items whose image is a
    sample of those splits (the others are skipped and counted); ``baselines``: the harness's
    no-learning rows (``[frozen]``, ``[text-only]``) kept beside the model's. Zero scorable items: no
    rows, ``matched`` 0."""
    from pipeline.config import BenchmarkSpec
    from train.eval.harness import evaluate_benchmark

    data, available = read_folders(name, dirs, max_per_kind)
    if data is None:
        return None
    kinds = sorted({it.subset for it in data.items})
    spec = BenchmarkSpec(name=name, format="sugarcrepe", path=data.source, image_splits=image_splits)
    scorable = {int(s) for s in job.scorable_sample_ids()}
    try:
        rows = evaluate_benchmark(job, model, spec, samples_dir, scorable, pairs_chunk, log=lambda m: None, data=data)
        if not baselines:  # in-job figures are the model's unless the caller reports the baselines beside them
            rows = [r for r in rows if not r.baseline_for]
    except NoScorableItems:
        return FolderResult([], available, 0, kinds)
    # matched = scored + those whose image is in samples but not in the job's artifacts (the "all"
    # row carries every skip reason; other reasons are images outside the samples)
    every = next((r for r in rows if r.subset == "all"), None)
    unscorable = (every.skip_reasons or {}).get(NOT_IN_ARTIFACTS, 0) if every is not None else 0
    return FolderResult(rows, available, sum(r.n for r in rows if r.subset in kinds and not r.baseline_for) + unscorable, kinds)
