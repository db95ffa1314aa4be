"""Units whose worker process dies: bounded retries, then the samples of the unit one by one.

An exception in a unit is contained by the worker (:mod:`pipeline.runtime`); a crash is not: a
segfault in native code (pycocotools, a decoder, a model kernel) or an out-of-memory kill takes
the worker process down, and Ray retries the unit on a fresh worker. Ray's own retries are
bounded (:data:`pipeline.runtime.RETRIES`), and Ray Data is told to go on past a unit whose
retries ran out, so one bad sample can neither stop the stage nor restart workers forever.
:func:`isolate_crashes` then takes those lost units in hand:

1. Each is run again on its own (an actor that died also lost the units queued behind it).
2. A unit that still kills its worker, when the stage can take its payload apart
   (:class:`SampleSplit`), has each of its samples run alone as a probe whose output goes to a
   scratch folder. A sample whose probe kills the worker too is the killer.
3. The unit is run once more without its killers; they are recorded in its errors as
   ``worker_crashed`` (sample named), the other samples are written as usual, and the run goes on.

A unit that cannot be split, or whose samples each pass alone, fails with one line naming it
(the stage error of :func:`pipeline.stage.run_units`); completed units stay complete.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pipeline")

REASON = "worker_crashed"
_WHY = "a crash in native code such as a segfault, or killed for memory"
CRASHED = f"its worker process died on every try ({_WHY}); see the Ray worker logs"
DETAIL = f"the worker process died running this sample alone ({_WHY})"


@dataclass(frozen=True)
class SampleSplit:
    """How a stage's unit payload is taken apart sample by sample.

    ``ids(payload)`` lists the unit's samples as ``{"sample_id", "source_id"}`` dicts;
    ``keep(payload, sample_ids)`` is the payload of just those samples (same unit otherwise).
    """

    ids: Callable[[dict], list[dict]]
    keep: Callable[[dict, list[int]], dict]


def _record_ids(payload: dict) -> list[dict]:
    return [{"sample_id": r["sample_id"], "source_id": r.get("source_id")} for r in payload["records"]]


def _keep_records(payload: dict, sample_ids: list[int]) -> dict:
    keep = set(sample_ids)
    return dict(payload, records=[r for r in payload["records"] if r["sample_id"] in keep])


# Payloads that carry their records (``{"records": [{"sample_id", ...}, ...]}``): ingest's units.
RECORDS = SampleSplit(_record_ids, _keep_records)

# run(units, alone) -> (index in units, result) for each unit that came back; alone: each unit in a
# task of its own, an actor stage's worker built in it (a dying task takes no other unit with it,
# a dying actor may; the price: one worker construction, e.g. a model load, per unit).
Runner = Callable[[list[dict], bool], Iterator[tuple[int, dict]]]


def _lost(units: list[dict], run: Runner, alone: bool, out: list[dict]) -> list[dict]:
    """Run ``units``; append the results to ``out``; return the units that never came back."""
    back = set()
    for i, res in run(units, alone):
        back.add(i)
        out.append(res)
    return [u for i, u in enumerate(units) if i not in back]


def isolate_crashes(units: list[dict], run: Runner, *, actor: bool, split: SampleSplit | None) -> Iterator[dict]:
    """Every unit's result dict, in completion order, crashes handled as the module says."""
    done = set()
    for i, res in run(units, False):  # results as they come (progress), not after the last unit
        done.add(i)
        yield res
    lost = [u for i, u in enumerate(units) if i not in done]
    if lost and actor:  # a dead actor also lost the units queued on it: each alone, once more
        log.warning("%d units lost with a dead worker; running them again one per worker", len(lost))
        results: list[dict] = []
        lost = _lost(lost, run, True, results)
        yield from results
    if not lost:
        return
    if split is None:
        for u in lost:
            yield {"unit": u.get("unit"), "failed": CRASHED}
        return
    yield from _split_and_rerun(lost, run, split)


def _probe_dir(unit: dict) -> Path:
    # a ".<name>.tmp" folder: remove_stale_tmp clears it should this run be killed before it does
    return Path(unit["artifact_dir"]) / f".probe-{unit.get('unit')}.tmp"


def _split_and_rerun(lost: list[dict], run: Runner, split: SampleSplit) -> Iterator[dict]:
    probes, owners = [], []
    for k, u in enumerate(lost):
        for j, sample in enumerate(split.ids(u)):
            p = split.keep(u, [sample["sample_id"]])
            p.pop("artifact_url", None)  # a probe's output is thrown away: never uploaded
            probes.append(dict(p, artifact_dir=str(_probe_dir(u) / str(j))))
            owners.append((k, sample))
    log.warning("%d units kill their worker on every try: running their %d samples one by one", len(lost), len(probes))
    try:
        dead = _lost(probes, run, True, [])
    finally:
        for u in lost:
            shutil.rmtree(_probe_dir(u), ignore_errors=True)
    dead_ids = {id(p) for p in dead}
    killers: dict[int, list[dict]] = {}
    for p, (k, sample) in zip(probes, owners):
        if id(p) in dead_ids:
            killers.setdefault(k, []).append(sample)
    reruns = []
    for k, u in enumerate(lost):
        if k not in killers:
            yield {"unit": u.get("unit"), "failed": f"{CRASHED}, though each of its samples alone passes"}
            continue
        bad = {s["sample_id"] for s in killers[k]}
        log.warning("unit %s: samples %s kill the worker; recorded as %s", u.get("unit"), sorted(bad), REASON)
        rerun = split.keep(u, [s["sample_id"] for s in split.ids(u) if s["sample_id"] not in bad])
        rerun["crashed_samples"] = [dict(s, detail=DETAIL) for s in killers[k]]
        reruns.append(rerun)
    results: list[dict] = []
    for u in _lost(reruns, run, True, results):
        results.append({"unit": u.get("unit"), "failed": f"{CRASHED}, even without the samples that crash it alone"})
    yield from results
