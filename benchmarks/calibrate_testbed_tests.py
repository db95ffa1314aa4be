"""Calibrate the slow learning tests (tests/test_testbed_*.py): the same reduced testbed they build
(tests/testbed_run.py, 1000 images through the real commands), each job trained on several seeds and
its shuffled control on the same seeds, every main results row printed per seed with its interval,
n, the bar it is judged against and the verdict. The tests' docstrings quote these tables; their
bounds are set from the smallest margin over the seeds.

    .venv/bin/python benchmarks/calibrate_testbed_tests.py --jobs c3 text-groups --seeds 0 1 2 [--root DIR]

Stages per job are those its slow test runs. Wall time: about the slow test's per seed and arm.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the stages each job's slow test asks for (tests/test_testbed_<job>.py)
STAGES = {
    "concept-ot": ("ingest", "extract-clip-tokens"),
    "c3": ("ingest", "extract-clip-tokens", "mine-concepts", "encode-concepts"),
    "infoground": ("ingest", "negative-captions", "extract-regions"),
    "visual-tokens": ("ingest", "extract-visual-tokens"),
    "relation-head": ("ingest", "extract-visual-tokens"),
    "text-groups": ("ingest", "extract-image-groups"),
}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", nargs="+", default=list(STAGES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--root", default=None, help="keep the reduced testbed here (default: a temporary folder)")
    ap.add_argument("--no-control", action="store_true")
    args = ap.parse_args(argv)
    from tests.testbed_run import Testbed
    from train.summary import _main, result_rows

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="calibrate-"))
    root.mkdir(parents=True, exist_ok=True)
    tb = Testbed(root)
    print(f"reduced testbed: {tb.root}", flush=True)
    for job in args.jobs:
        t0 = time.perf_counter()
        tb.stages(*STAGES[job])
        print(f"\n## {job} (stages {time.perf_counter() - t0:.0f} s)\n", flush=True)
        print("| arm | seed | row | value | 95% interval | bar | n | verdict | wall s |\n|---|---:|---|---:|---|---|---:|---|---:|")
        key = job.replace("-", "_")
        for arm in ("trained",) + (() if args.no_control else ("control",)):
            for seed in args.seeds:
                sets = [f"train.{key}.seed={seed}"] + ([f"train.{key}.control=shuffled"] if arm == "control" else [])
                t0 = time.perf_counter()
                res, results = tb.train(job, *sets)
                wall = time.perf_counter() - t0
                for r in _main(result_rows(results.parent.parent.parent)):
                    bar = r.get("bar")
                    bar_s = f"{bar[0]} {bar[1]:.4g}" if bar else f"chance {_fmt(r.get('chance'))}"
                    print(f"| {arm} | {seed} | {r['benchmark']}/{r.get('subset') or ''}/{r['metric']} | {_fmt(r['value'])} | "
                          f"[{_fmt(r.get('ci_low'))}, {_fmt(r.get('ci_high'))}] | {bar_s} | {r.get('n')} | "
                          f"{r['verdict']} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
