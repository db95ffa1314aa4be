"""The evaluation harness: every job, every configured benchmark, one table.

``train eval <job> --checkpoint C --manifest M [--bench NAME ...]`` builds the job's model from the
checkpoint and, for every benchmark of the manifest's ``eval.benchmarks`` (and the job's own
evaluations, :meth:`train.loop.Job.job_metrics`):

1. reads the benchmark in its published format (:func:`train.eval.benchmarks.read_benchmark`, or
   the built-in ``split_retrieval`` format below);
2. matches each item's images to sample ids through the ``samples`` artifact
   (:class:`train.eval.images.ImageMatcher`: source id, file name, COCO ids across naming schemes,
   or an explicit ``image_map``); an item whose image is not in ``samples`` (``foreign_dataset: X``
   where its name says it is from a dataset X the run holds none of) or not in the job's artifacts
   (:meth:`Job.scorable_sample_ids`), or whose box lies outside its image, is skipped and counted
   (``skipped``, ``skip_reasons``), never silently dropped; a benchmark with zero scorable items is
   an error that says why (:class:`train.eval.interface.NoScorableItems`);
3. scores the remaining items' (image, text[, box]) pairs with :meth:`Job.score_pairs` (unique
   pairs only, in chunks of ``eval.pairs_chunk``), or, for retrieval benchmarks, asks
   :meth:`Job.retrieval_scores` for the [I, T] matrices and computes R@K both ways with their exact
   chance levels;
4. writes ``<run_dir>/eval/<step>/results.parquet`` (job, variant, checkpoint, step, benchmark,
   subset, metric, value, n, chance, ci_low, ci_high, skipped, skip_reasons, unit, note, baseline_for,
   and diff_vs, diff, diff_low, diff_high: each result row against its strongest baseline row,
   :mod:`train.eval.paired`), ``results.md`` and ``items.parquet`` (each row's per-item outcomes,
   :mod:`train.eval.items`); a row whose scorer gave no interval gets NaN and a note saying so.

``train compare RUN_DIR...`` (:func:`compare`) puts the latest results of several runs side by side.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.eval.interface import RESULT_COLUMNS, BenchData, Item, NoScorableItems, Pair, Row
from train.eval.items import write_items
from train.eval.intervals import interval, proportion

# ------------------------------------------------------------------------------------ chance


def retrieval_chance(n_correct: np.ndarray, n_candidates: int, k: int) -> float:
    """Exact probability (in %) that a uniformly random ranking of ``n_candidates`` puts at least one
    of a query's ``n_correct`` items in its top ``k``, averaged over queries:
    1 - C(G - c, k) / C(G, k)."""
    G = int(n_candidates)
    out = []
    for c in np.asarray(n_correct, dtype=np.int64):
        if k >= G or c <= 0:
            out.append(1.0 if c > 0 else 0.0)
            continue
        # C(G-c, k) / C(G, k) = prod_{i=0}^{k-1} (G - c - i) / (G - i)
        i = np.arange(k, dtype=np.float64)
        miss = float(np.prod(np.clip((G - c - i) / (G - i), 0.0, None)))
        out.append(1.0 - miss)
    return 100.0 * float(np.mean(out)) if out else float("nan")


def recall_first_hit(scores: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Rank (0-based) of each query's first correct item under a stable descending sort."""
    order = np.argsort(-scores, axis=1, kind="stable")
    hit = np.take_along_axis(gt, order, axis=1)
    return np.where(hit.any(1), hit.argmax(1), scores.shape[1])


def retrieval_rows(name: str, protocol: str, S: np.ndarray, img_of_caption: np.ndarray,
                   ks: Sequence[int] = (1, 5, 10)) -> list[Row]:
    """R@K image->text and text->image for one score matrix S [I, T] (percent), chance beside. R@K is
    a proportion of queries: i2t's queries are the images (Wilson); t2i's are the captions, several
    per image, so its interval is Wilson on the effective n of captions clustered by their image
    (:mod:`train.eval.intervals`).

    A protocol named ``<p>/i2t`` (``<p>/t2i``) is a matrix valid in one direction only, e.g. a
    two-stage rerank that ranks each query's own candidate set (ConceptOT G.4): it is read along
    rows (columns) only and reported under protocol ``<p>``."""
    I, T = S.shape
    directions = ("i2t", "t2i")
    if protocol.endswith(("/i2t", "/t2i")):
        protocol, d = protocol.rsplit("/", 1)
        directions = (d,)
    gt = np.zeros((I, T), dtype=bool)
    gt[img_of_caption, np.arange(T)] = True
    caps = np.bincount(img_of_caption, minlength=I)
    rows = []
    f_i2t = recall_first_hit(S, gt) if "i2t" in directions else None
    f_t2i = recall_first_hit(S.T, gt.T) if "t2i" in directions else None
    for k in ks:
        for d, first, n, chance, img in (("i2t", f_i2t, I, lambda: retrieval_chance(caps, T, k), None),
                                         ("t2i", f_t2i, T, lambda: retrieval_chance(np.ones(T, dtype=np.int64), I, k),
                                          img_of_caption)):
            if first is not None:
                est = proportion(first < k, img)
                rows.append(Row(name, protocol, f"{d}_R@{k}", 100.0 * float((first < k).mean()), n, chance(),
                                est=est).with_ci(interval(est, 100.0)))
    return rows


# ----------------------------------------------------------------------- split_retrieval format


def read_split_retrieval(spec, samples_dir: Path) -> BenchData:
    """Built-in format ``split_retrieval``: image-text retrieval over the samples of one split of
    the run's own ``samples`` artifact (``split``, default ``test``), every caption of each image.
    For datasets ingested with their official splits (Karpathy COCO / Flickr30k, the generated
    dataset) this is the standard retrieval protocol without a separate file."""
    import polars as pl

    from pipeline.io.artifacts import Artifact

    art = Artifact(samples_dir)
    split = spec.split or "test"
    smp = art.scan("samples").select("sample_id", "source_id", "split").filter(pl.col("split") == split).collect()
    if smp.height == 0:
        splits = sorted(set(art.scan("samples").select("split").collect()["split"].to_list()))
        raise NoScorableItems(f"{spec.name}: no samples of split {split!r} in {samples_dir} (splits: {splits}); "
                              f"set eval.benchmarks.{spec.name}.split")
    caps = art.scan("captions").select("caption_id", "sample_id", "text").filter(
        pl.col("sample_id").is_in(smp["sample_id"].implode())).sort("caption_id").collect()
    by_sid: dict[int, list[tuple[int, str]]] = {}
    for cid, sid, text in caps.iter_rows():
        by_sid.setdefault(int(sid), []).append((int(cid), text))
    items = []
    for sid, src in smp.select("sample_id", "source_id").sort("sample_id").iter_rows():
        cl = by_sid.get(int(sid))
        if not cl:
            continue
        items.append(Item([Pair(f"sample_id:{int(sid)}", t) for _, t in cl], subset=split, key=str(src),
                          meta={"caption_ids": [c for c, _ in cl]}))
    return BenchData(spec.name, items, score=lambda its, sc: [], kind="retrieval", source=str(samples_dir),
                     total=len(items))


BUILTIN = {"split_retrieval": read_split_retrieval}


# --------------------------------------------------------------------------------- the harness


class _Matcher:
    """sample_id:<n> keys (built-in readers) resolve directly; others through ImageMatcher."""

    def __init__(self, samples_dir: Path, image_map: str | None):
        self.samples_dir, self.image_map = samples_dir, image_map
        self._m = None

    def match(self, key: str) -> int | None:
        if key.startswith("sample_id:"):
            return int(key.split(":", 1)[1])
        if self._m is None:
            from train.eval.images import ImageMatcher

            self._m = ImageMatcher(self.samples_dir, image_map=self.image_map)
        return self._m.match(key)

    def skip_reason(self, key: str) -> str:
        """Why ``key`` matched no sample: ``foreign_dataset: <dataset>`` or not in samples."""
        return self._m.skip_reason(key) if self._m is not None else "skipped_no_image: not in samples"


def _subsample(items: list[Item], k: int | None, seed: int = 0) -> list[Item]:
    if k is None or len(items) <= k:
        return items
    keep = sorted(random.Random(seed).sample(range(len(items)), k))
    return [items[i] for i in keep]


def _fmt_skips(reasons: Counter) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(reasons.items()) if v}


def expand_spec(spec, output: str | Path):
    """``{output}`` in a benchmark's path, images or image_map stands for the manifest's output
    folder (so a manifest's generated benchmark files follow ``--set output=...``)."""
    upd = {k: str(getattr(spec, k)).replace("{output}", str(output)) for k in ("path", "images", "image_map")
           if isinstance(getattr(spec, k, None), str) and "{output}" in getattr(spec, k)}
    if not upd:
        return spec
    if hasattr(spec, "model_copy"):
        return spec.model_copy(update=upd)
    import copy

    spec = copy.copy(spec)
    for k, v in upd.items():
        setattr(spec, k, v)
    return spec


# where each format's images come from (for the "0 scorable items" error)
IMAGE_SOURCES = {
    "sugarcrepe": "COCO val2017",
    "aro_vg_relation": "ARO's Visual Genome images (vgr_vga_images.zip)",
    "aro_vg_attribution": "ARO's Visual Genome images (vgr_vga_images.zip)",
    "aro_order": "the Karpathy test images (COCO val2014 / Flickr30k)",
    "retrieval": "the Karpathy test images (COCO val2014 / Flickr30k)",
    "split_retrieval": "images of that split",
    "winoground": "Winoground's images (data/images.zip)",
    "valse": "each VALSE piece's source images (Visual7W, COCO 2014, SWiG, VisDial, ...)",
    "vl_checklist": "VL-CheckList's images (VG, SWiG, HAKE per its DATASETS.md)",
    "svo_probes": "SVO-Probes' images (downloaded from the CSV's urls as <image_id>.jpg)",
    "foil": "COCO val2014",
}


class Tally:
    """What an evaluation scored, over its benchmarks: the one line the terminal gets (the line per
    benchmark goes to ``benchmarks.log`` beside the results, and to the terminal with ``-v``)."""

    def __init__(self):
        self.benchmarks = self.scored = self.total = 0
        self.skips: Counter = Counter()

    def add(self, scored: int, total: int, skips: Counter) -> None:
        self.benchmarks += 1
        self.scored, self.total = self.scored + scored, self.total + total
        self.skips += skips

    def line(self, configured: int, rows: int, out_dir: Path) -> str:
        """``benchmarks: 10 of 10 scored, 4,248 items (10,816 skipped: ...); 158 rows: <out>/results.md
        (each benchmark: benchmarks.log there)``."""
        skipped = sum(self.skips.values())
        why = ", ".join(f"{k} {v:,}" for k, v in _fmt_skips(self.skips).items())
        return (f"benchmarks: {self.benchmarks} of {configured} scored, {self.scored:,} items"
                + (f" ({skipped:,} skipped: {why})" if skipped else "")
                + f"; {rows} rows: {Path(out_dir) / 'results.md'} (each benchmark: {BENCH_LOG} there)")


BENCH_LOG = "benchmarks.log"  # an evaluation's line per benchmark (items scored, skipped and why), beside its results
VERBOSE = False  # `train run -v` / `train eval -v`: the line per benchmark on the terminal too (set_verbose)


def set_verbose(on: bool) -> None:
    global VERBOSE
    VERBOSE = bool(on)


def evaluate_benchmark(job, model, spec, samples_dir: Path, scorable: set[int], pairs_chunk: int = 2048,
                       log: Callable[[str], None] = print, data: BenchData | None = None,
                       tally: Tally | None = None) -> list[Row]:
    """Rows of one benchmark (raises NoScorableItems when nothing can be scored). ``data``: the
    benchmark already read (a job's own evaluation reads its folders itself, train/eval/in_job.py).
    ``log`` gets the benchmark's line (items scored, skipped and why, seconds); ``tally`` adds them up."""
    if data is None and spec.format in BUILTIN:
        data = BUILTIN[spec.format](spec, samples_dir)
    elif data is None:
        from train.eval.benchmarks import read_benchmark

        data = read_benchmark(spec)
    items = list(data.items)
    if spec.format in BUILTIN:  # the published-format readers apply subsets and max_items themselves
        if spec.subsets:
            items = [it for it in items if it.subset in set(spec.subsets)]
        items = _subsample(items, spec.max_items)
    reader_skips = Counter(dict(data.skipped or {}))
    matcher = _Matcher(samples_dir, spec.image_map)
    sid_of: dict[str, int | None] = {}
    for it in items:
        for p in it.pairs:
            if p.image not in sid_of:
                sid_of[p.image] = matcher.match(p.image)
    keep: list[Item] = []
    skips: Counter = Counter()
    skips_by_subset: dict[str, Counter] = {}
    from train.eval.images import boxes_outside

    box_outside = boxes_outside(items, sid_of, samples_dir)
    not_held: set[int] = set()
    if getattr(spec, "image_splits", None):  # held-out only: items with an image of another split are skipped
        from pipeline.io.artifacts import Artifact, ArtifactMissing
        from train.job import Splits

        known = [s for s in set(sid_of.values()) if s is not None]
        try:
            splits = Splits(Artifact(samples_dir))
        except ArtifactMissing:
            splits = Splits(None)  # the hash rule (train/job.py)
        held = splits.mask(known, spec.image_splits)
        not_held = {s for s, ok in zip(known, held) if not ok}
    for k, it in enumerate(items):
        why = "box outside its image" if k in box_outside else None
        for p in it.pairs:
            s = sid_of[p.image]
            if s is None:
                why = matcher.skip_reason(p.image)
                break
            if s in not_held:
                why = f"image outside image_splits {list(spec.image_splits)}"
                break
            if s not in scorable:
                why = "skipped_no_image: not in the job's artifacts"
                break
        if why is None:
            keep.append(it)
        else:
            skips[why] += 1
            skips_by_subset.setdefault(it.subset, Counter())[why] += 1
    total = len(items)
    if not keep:
        n_imgs = len(sid_of)
        n_in = sum(1 for s in sid_of.values() if s is not None)
        n_art = sum(1 for s in sid_of.values() if s is not None and s in scorable)
        if total == 0:
            raise NoScorableItems(f"{spec.name}: no items read from {spec.path}"
                                  + (f" ({dict(reader_skips)})" if reader_skips else ""))
        where = IMAGE_SOURCES.get(str(spec.format).lower(), "the benchmark's images")
        if getattr(spec, "images", None):
            where += f" ({spec.images})"
        if n_in and not n_art:  # the images are in the samples, not in the artifacts this job reads
            fix = (f"run the stage(s) that make this job's artifacts on them (the {n_in:,} matched samples have "
                   "no features)")
        else:
            fix = f"ingest {where} into this run or give eval.benchmarks[{spec.name}].image_map"
        raise NoScorableItems(
            f"{spec.name}: 0 of {total:,} items are scorable: {n_in:,} of {n_imgs:,} benchmark images are in "
            f"{samples_dir} and {n_art:,} in the job's artifacts (skipped: "
            f"{', '.join(f'{k} {v:,}' for k, v in _fmt_skips(skips).items())}); {fix}")
    t0 = time.perf_counter()
    if data.kind == "retrieval":
        rows = _score_retrieval(job, model, spec, data, keep, sid_of)
    else:
        rows = _score_pairwise(job, model, data, keep, sid_of, pairs_chunk, fmt=str(spec.format or ""))
    all_skips = skips + reader_skips
    n_skipped = sum(all_skips.values())
    for r in rows:
        if r.subset in ("all", "overall") or data.kind == "retrieval":
            r.skipped, r.skip_reasons = n_skipped, _fmt_skips(all_skips)
        else:  # a subset row counts the skips of its items' subsets (an aggregate such as VALSE's
            # `actions` or VL-CheckList's `Attribute/color` covers `actions/...`, `Attribute/color/...`)
            sub: Counter = Counter()
            for k, c in skips_by_subset.items():
                if k == r.subset or k.startswith(r.subset + "/"):
                    sub += c
            r.skipped, r.skip_reasons = sum(sub.values()), _fmt_skips(sub)
        if getattr(job, "crop_note", "") and any(p.box is not None for it in keep[:50] for p in it.pairs):
            r.note = (r.note + "; " if r.note else "") + job.crop_note
    log(f"  {spec.name}: {len(keep):,} of {total:,} items scored, {n_skipped:,} skipped "
        f"({', '.join(f'{k} {v:,}' for k, v in _fmt_skips(all_skips).items()) or 'none'}) in {time.perf_counter() - t0:.1f}s")
    if tally is not None:
        tally.add(len(keep), total, all_skips)
    return rows


# pairwise formats whose negatives can be told from the positive by the text alone (a negative that is
# less fluent or less plausible: Hsieh et al. 2023 on SugarCrepe's predecessors, VL-CheckList's
# Attribute/size at 60% with images zeroed): scored again by Job.score_pairs_text_only where a job has it
TEXT_SHORTCUT_FORMATS = ("sugarcrepe", "vl_checklist", "valse")


def _score_pairwise(job, model, data: BenchData, keep: list[Item], sid_of: dict, pairs_chunk: int,
                    fmt: str = "") -> list[Row]:
    uniq: dict[tuple, int] = {}
    index: list[list[int]] = []
    for it in keep:
        idx = []
        for p in it.pairs:
            key = (sid_of[p.image], p.text, p.box)
            if key not in uniq:
                uniq[key] = len(uniq)
            idx.append(uniq[key])
        index.append(idx)
    keys = list(uniq)
    sids = np.array([k[0] for k in keys], dtype=np.int64)
    texts = [k[1] for k in keys]
    has_box = any(k[2] is not None for k in keys)
    boxes = np.array([k[2] if k[2] is not None else (np.nan,) * 4 for k in keys], dtype=np.float64) if has_box else None

    def scores(fn, what: str) -> np.ndarray:
        out = np.empty(len(keys), dtype=np.float64)
        for s in range(0, len(keys), pairs_chunk):
            e = min(len(keys), s + pairs_chunk)
            sc = fn(model, sids[s:e], texts[s:e], None if boxes is None else boxes[s:e])
            sc = np.asarray(sc.detach().cpu() if hasattr(sc, "detach") else sc, dtype=np.float64).reshape(-1)
            if sc.shape[0] != e - s:
                raise RuntimeError(f"{type(job).__name__}.{what} returned {sc.shape[0]} scores for {e - s} pairs")
            out[s:e] = sc
        return out

    out = scores(job.score_pairs, "score_pairs")
    rows = data.score(keep, [out[np.asarray(ix)] for ix in index])

    def baseline(fn, what: str, tag: str, note: str) -> None:
        # the same items scored again by a no-learning scorer (same order, same images: the rows'
        # estimates pair item for item with the result rows'), each row the baseline of its result row
        sc = scores(fn, what)
        for r in data.score(keep, [sc[np.asarray(ix)] for ix in index]):
            r.baseline_for, r.metric = f"{r.subset}/{r.metric}", f"{r.metric}[{tag}]"
            r.note = "; ".join(x for x in (note, r.note) if x)
            rows.append(r)

    frozen = getattr(job, "score_pairs_frozen", None)
    if callable(frozen) and getattr(job, "has_frozen_baseline", lambda: False)():
        # the job's score without anything it learnt (concept-ot's frozen global cosine g, the frozen
        # CLIP cosine visual-tokens reads)
        baseline(frozen, "score_pairs_frozen", "frozen", getattr(job, "frozen_note", "")
                 or "the job's frozen score alone (no learnt term)")
    text_only = getattr(job, "score_pairs_text_only", None)
    if callable(text_only) and str(fmt).lower() in TEXT_SHORTCUT_FORMATS:
        # the text shortcut's bar: the job's own scorer with every image replaced by one constant image
        baseline(text_only, "score_pairs_text_only", "text-only", getattr(job, "text_only_note", "")
                 or "text-only bar: the job's scorer with the image side replaced by a constant")
    return rows


def _score_retrieval(job, model, spec, data: BenchData, keep: list[Item], sid_of: dict) -> list[Row]:
    sids = np.array([sid_of[it.pairs[0].image] for it in keep], dtype=np.int64)
    texts: list[str] = []
    cap_ids: list[int] = []
    img_of: list[int] = []
    for i, it in enumerate(keep):
        cids = it.meta.get("caption_ids") or [-1] * len(it.pairs)
        for p, c in zip(it.pairs, cids):
            texts.append(p.text)
            cap_ids.append(int(c))
            img_of.append(i)
    mats = job.retrieval_scores(model, sids, np.array(cap_ids, dtype=np.int64), texts)
    rows: list[Row] = []
    for proto, S in mats.items():
        S = np.asarray(S.detach().cpu() if hasattr(S, "detach") else S, dtype=np.float64)
        if S.shape != (len(keep), len(texts)):
            raise RuntimeError(f"{type(job).__name__}.retrieval_scores[{proto!r}] has shape {S.shape}, "
                               f"expected {(len(keep), len(texts))}")
        rows += retrieval_rows(data.name, proto, S, np.array(img_of))
    # a protocol that learns nothing (concept-ot's frozen ``global`` g beside its ``rerank``): its rows
    # are that protocol's no-learning baseline (Job.baseline_protocols: {baseline: result protocol})
    protos = {r.subset for r in rows}
    for base, target in getattr(job, "baseline_protocols", {}).items():
        if target in protos:
            for r in rows:
                if r.subset == base:
                    r.baseline_for = f"{target}/{r.metric}"
    return rows


def _job_label(job) -> tuple[str, str]:
    """(job name, variant): the variant is named as the run folder names it (the Config's NAMED
    options, e.g. infoground's ``negatives``: ``contextual`` / ``random`` / ``none``), so runs of
    one job are told apart in ``train compare``; ``default`` for a job without one."""
    cfg = job.cfg
    named = [k for k in getattr(cfg, "NAMED", ("variant",)) if k in getattr(type(cfg), "model_fields", {})]
    if named:
        return getattr(job, "NAME", type(job).__name__), "-".join(str(getattr(cfg, k)) for k in named)
    return getattr(job, "NAME", type(job).__name__), str(getattr(cfg, "variant", "default"))


def run_harness(job, model, manifest, out_dir: Path, *, checkpoint: str = "", step: int | None = None,
                only: Sequence[str] | None = None, job_metrics: bool = True,
                log: Callable[[str], None] | None = None) -> tuple[list[dict], list[str]]:
    """Evaluate ``model`` on every configured benchmark (``only``: these names) plus the job's own
    metrics; write results.parquet and results.md into ``out_dir``. Returns (rows, errors): a
    benchmark that fails (zero scorable items, unreadable files) gives one error line and no row.
    ``log`` (default: stderr) gets one line for all the benchmarks (:class:`Tally`); the line per
    benchmark goes to ``out_dir/benchmarks.log``, and to ``log`` too when :data:`VERBOSE`."""
    import torch

    log = log or (lambda m: print(m, file=sys.stderr))
    details: list[str] = []

    def detail(line: str) -> None:
        details.append(line)
        if VERBOSE:
            log(line)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = list(manifest.eval.benchmarks)
    names = [s.name for s in specs]
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise ValueError(f"eval.benchmarks: duplicate name(s) {dup}")
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"--bench {', '.join(unknown)}: not in the manifest's eval.benchmarks "
                             f"({', '.join(names) or 'none configured'})")
        specs = [s for s in specs if s.name in set(only)]
    from pipeline.io.storage import resolve_under
    from pipeline.progress import progress

    samples_dir = resolve_under(manifest.output, manifest.eval.samples_artifact)
    rows: list[Row] = []
    errors: list[str] = []
    tally = Tally()
    model.eval()
    with torch.no_grad():
        if job_metrics:
            try:
                rows += list(job.job_metrics(model, out_dir))
            except NoScorableItems as e:
                errors.append(str(e))
        if specs:
            try:
                scorable = {int(s) for s in job.scorable_sample_ids()}
            except NotImplementedError as e:
                errors.append(f"{e}: benchmarks {', '.join(s.name for s in specs)} not scored")
                specs = []
        for spec in progress(specs, "benchmarks", unit="benchmark", every=30.0, leave=False):
            try:
                rows += evaluate_benchmark(job, model, expand_spec(spec, manifest.output), samples_dir, scorable,
                                           manifest.eval.pairs_chunk, detail, tally=tally)
            except (NoScorableItems, FileNotFoundError, ValueError) as e:
                errors.append(str(e).splitlines()[0] if str(e) else f"{spec.name}: {type(e).__name__}")
                detail(f"  {errors[-1]}")
    from train.eval.paired import pair_rows

    pair_rows(rows)  # each result row against its strongest baseline, on the same resampled images
    jname, variant = _job_label(job)
    table = []
    for r in rows:
        if math.isfinite(r.value) and math.isnan(r.ci_low) and "no interval" not in r.note:
            r.no_interval("its scorer gave no per-item outcomes")
        d = r.as_dict()
        table.append({"job": jname, "variant": variant, "checkpoint": str(checkpoint),
                      "step": -1 if step is None else int(step), **d})
    write_results(table, out_dir, errors)
    write_items(rows, out_dir)  # each row's per-item outcomes beside it (train/eval/items.py)
    (out_dir / BENCH_LOG).write_text("".join(f"{line}\n" for line in details))
    log(tally.line(len(specs), len(table), out_dir) if specs else f"results: {len(table)} rows: {out_dir / 'results.md'}")
    return table, errors


def write_results(table: list[dict], out_dir: Path, errors: Sequence[str] = ()) -> None:
    import pyarrow as pa

    from pipeline.io.atomic import write_parquet_atomic

    text = ("baseline_for", "diff_vs")
    cols = {c: [r.get(c, "" if c in text else None) for r in table] for c in RESULT_COLUMNS}
    types = {"job": pa.string(), "variant": pa.string(), "checkpoint": pa.string(), "step": pa.int64(),
             "benchmark": pa.string(), "subset": pa.string(), "metric": pa.string(), "value": pa.float64(),
             "n": pa.int64(), "chance": pa.float64(), "ci_low": pa.float64(), "ci_high": pa.float64(), "skipped": pa.int64(), "skip_reasons": pa.string(),
             "unit": pa.string(), "note": pa.string(), "baseline_for": pa.string(), "diff_vs": pa.string(),
             "diff": pa.float64(), "diff_low": pa.float64(), "diff_high": pa.float64()}
    t = pa.table({c: pa.array(cols[c], type=types[c]) for c in RESULT_COLUMNS})
    write_parquet_atomic(t, out_dir / "results.parquet")
    md = markdown_table(table)
    if errors:
        md += "\n\nErrors (benchmarks not scored):\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    (out_dir / "results.md").write_text(md + "\n")
    # the benchmarks that could not be scored, for the run report (a stale list from an earlier run goes)
    err_path = out_dir / "errors.json"
    if errors:
        err_path.write_text(json.dumps(list(errors), indent=1) + "\n")
    else:
        err_path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------- presentation


def fmt_num(v: Any, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    v = float(v)
    if unit == "fraction":
        return f"{v:.3f}"
    if unit == "%":
        return f"{v:.1f}"
    if v == int(v) and abs(v) < 1e12:
        return f"{int(v):,}"
    return f"{v:.4g}"


def fmt_value(r: dict, unit: str) -> str:
    """``value [ci_low, ci_high]`` in the row's unit (the interval left out where it is NaN)."""
    lo, hi = r.get("ci_low"), r.get("ci_high")
    ci = "" if fmt_num(lo, unit) == "-" else f" [{fmt_num(lo, unit)}, {fmt_num(hi, unit)}]"
    return f"{fmt_num(r['value'], unit)}{ci}"


def diff_fmt(unit: str):
    """A signed number in the row's unit (a paired difference)."""
    return lambda v: ("+" if v > 0 else "") + fmt_num(v, unit)


def markdown_table(table: list[dict]) -> str:
    """The results as Markdown, each row with its verdict and, where a no-learning baseline is reported
    beside it, the paired difference from the strongest one and its 95% interval
    (:mod:`pipeline.report.significance`)."""
    from pipeline.report.significance import diff_text, verdicts, with_reason

    head = ("| benchmark | subset | metric | value [95% CI] | chance | n | skipped | verdict | diff vs baseline [95% CI] |\n"
            "|---|---|---|---:|---:|---:|---:|---|---|")
    lines = [head]
    for r, v in zip(table, verdicts(table)):
        unit = r.get("unit") or ""
        suffix = " %" if unit == "%" else ""
        chance = fmt_num(r["chance"], unit)
        lines.append(f"| {r['benchmark']} | {r['subset']} | {r['metric']} | {fmt_value(r, unit)}{suffix} | "
                     f"{chance}{suffix if chance != '-' else ''} | {int(r['n']):,} | {int(r['skipped']):,} | {with_reason(v, r) or '-'} | "
                     f"{diff_text(r, diff_fmt(unit)) or '-'} |")
    return "\n".join(lines)
