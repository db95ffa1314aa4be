"""The slow suite's cost, test by test, and what of it `.ci/run` runs.

A slow test is marked ``slow``; one that takes minutes on its own (the demo's every command, the
encoders and models trained from pixels, the killed-node cluster, the paper grid, ...) is also
marked ``heavy``. `.ci/run` runs ``-m "slow and not heavy"`` after README command 2, so that CI
stays inside its 90-minute limit (55 min from a fresh clone of 365967a; the target is 45); ``pytest -m heavy`` is run before a release, and the dated
figures in docs/performance.md say when it last passed.

    pytest -v -m slow --durations=0 | tee slow.log
    python benchmarks/slow_durations.py slow.log --write   # -> benchmarks/results/slow_durations.json
    python benchmarks/slow_durations.py                      # the recorded totals, split heavy / CI

tests/test_ci_budget.py checks that every slow test collected today has a recorded duration (a new
slow test is measured before it lands) and that the CI part of the record fits the budget below.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks" / "results" / "slow_durations.json"
CI_SLOW_BUDGET_S = 1800  # `.ci/run`'s slow part; with install (~5 min) and README command 2 (~15 min): ~50 min at most
LINE = re.compile(r"^(?:\d+ )?\s*([\d.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
RESULT = re.compile(r"^(?:\d+ )?(tests/\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED)\b")
COLLECT = """
import json, sys, pytest
class Markers:
    def pytest_collection_modifyitems(self, items):
        self.items = [[i.nodeid, sorted({m.name for m in i.iter_markers()} & {"slow", "heavy"})] for i in items]
plugin = Markers()
code = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "-m", "slow or heavy"], plugins=[plugin])
print("MARKERS " + json.dumps(getattr(plugin, "items", [])))
sys.exit(0 if code in (0, 5) else 1)
"""


def parse(log: str) -> dict[str, float]:
    """{test id: setup + call + teardown seconds} from a ``pytest -v --durations=0`` report (lines may
    carry a leading epoch-seconds stamp); a test whose phases were all under pytest's 0.005 s display
    floor is recorded at 0 from its ``-v`` result line."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(3)] = round(out.get(m.group(3), 0.0) + float(m.group(1)), 2)
        elif (r := RESULT.match(line)) and r.group(1) not in out:
            out[r.group(1)] = 0.0
    if not out:
        raise SystemExit("slow_durations: no `--durations=0` lines in the log (run pytest -v with --durations=0)")
    return out


def collected() -> dict[str, set[str]]:
    """{test id: its markers among slow / heavy} of every test marked slow or heavy, from one collection."""
    r = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("MARKERS ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"slow_durations: collecting the slow tests failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return {k: set(v) for k, v in json.loads(line[len("MARKERS "):])}


def split(record: dict, marks: dict[str, set[str]]) -> dict:
    """The record restricted to the slow tests collected today (``marks``: :func:`collected`), split into
    the heavy part (``pytest -m heavy``) and CI's part (``-m "slow and not heavy"``): seconds and test
    counts of each, and the slow tests the record lacks."""
    slow = {k for k, m in marks.items() if "slow" in m}
    heavy = {k for k, m in marks.items() if "heavy" in m}
    secs = {k: v for k, v in record["seconds"].items() if k in slow}
    return {"all": round(sum(secs.values()), 1), "n": len(secs),
            "heavy": round(sum(v for k, v in secs.items() if k in heavy), 1), "n_heavy": len(heavy & set(secs)),
            "ci": round(sum(v for k, v in secs.items() if k not in heavy), 1), "n_ci": len(set(secs) - heavy),
            "unmeasured": sorted(slow - set(secs)), "heavy_not_slow": sorted(heavy - slow),
            "top": sorted(secs.items(), key=lambda kv: -kv[1])[:12], "heavy_ids": heavy}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", nargs="?", help="a `pytest -v -m slow --durations=0` log to record")
    ap.add_argument("--write", action="store_true", help=f"write the record ({RECORD.relative_to(REPO)})")
    ap.add_argument("--note", default="", help="where and when the log was made (commit, date, load)")
    a = ap.parse_args(argv)
    if a.log:
        record = {"note": a.note, "seconds": parse(Path(a.log).read_text())}
        if a.write:
            RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    else:
        record = json.loads(RECORD.read_text())
    t = split(record, collected())
    print(f"slow suite {t['all']:.0f} s recorded ({t['n']} tests collected today; {record['note']})")
    print(f"  heavy (pytest -m heavy, not in CI): {t['heavy']:.0f} s, {t['n_heavy']} tests")
    print(f"  CI (.ci/run: -m 'slow and not heavy'): {t['ci']:.0f} s, {t['n_ci']} tests (budget {CI_SLOW_BUDGET_S} s)")
    for k, v in t["top"]:
        print(f"  {v:7.1f} s  {'heavy' if k in t['heavy_ids'] else 'CI   '}  {k}")
    if t["unmeasured"]:
        print(f"  not measured: {', '.join(t['unmeasured'])}")


if __name__ == "__main__":
    main()
