"""The testbed's headline tables in README.md, BENCHMARKS.md and docs/testbed.md, from one confirmation run.

    .venv/bin/python benchmarks/confirm_tables.py [RESULT] [--check]

RESULT (default: the newest ``benchmarks/results/testbed-confirm-*.md``) is the table that
``benchmarks/testbed.py --confirm`` printed and wrote to ``<output>-confirm-<seed>/testbed.md``, copied
into the repository unchanged (issue 47 item 5: the headline tables come from a generator seed no
tuning used, against expectations committed before the run; the table's first line names the
expectations file's git blob). Between the ``confirm-table`` markers of BENCHMARKS.md and docs/testbed.md
goes the whole table; between README.md's ``confirm-headline`` markers, each job's first row in a
short form. ``--check``: write nothing; exit 1 naming the first page whose block differs (the test
``tests/test_confirm_tables.py`` runs it), so the pages cannot drift from the run they cite.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL_PAGES = ("BENCHMARKS.md", "docs/testbed.md")
HEADLINE_PAGE = "README.md"
BLOCK = r"(<!-- {name}[^\n]*-->\n)(.*?)(<!-- /{name} -->)"


def newest_result() -> Path:
    found = sorted((REPO / "benchmarks" / "results").glob("testbed-confirm-*.md"))
    if not found:
        raise SystemExit("no benchmarks/results/testbed-confirm-*.md: copy a `benchmarks/testbed.py --confirm` "
                         "run's testbed.md there first")
    return found[-1]


def table_rows(text: str) -> list[list[str]]:
    """The result table's rows (header included), each a list of cells."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]
    if not rows or rows[0][:2] != ["job", "metric"]:
        raise SystemExit("not a table of benchmarks/testbed.py (its header starts `| job | metric |`)")
    return rows


def full_block(result: Path, text: str) -> str:
    first = text.splitlines()[0]
    lines = [f"From `{result.relative_to(REPO)}` ({first.split(';')[0]}; the expectations file as committed: "
             f"`{first.split('git blob ')[-1].split()[0]}`). Printed by `benchmarks/testbed.py --confirm`; "
             "placed here by `benchmarks/confirm_tables.py`.", ""]
    lines += [ln for ln in text.splitlines() if ln.startswith("|")]
    tail = [ln for ln in text.splitlines() if ln.startswith("stages:") or ln.startswith("whole run:")]
    return "\n".join(lines + [""] + [f"{ln}  " for ln in tail]) + "\n"


def _short(verdict: str) -> str:
    return re.split(r"[(,]", verdict, maxsplit=1)[0].strip()


def headline_block(result: Path, text: str) -> str:
    rows = table_rows(text)
    head, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(head)}
    seen, out = set(), []
    for r in body:
        if r[0] in seen:
            continue
        seen.add(r[0])
        base = f"{r[col['diff 95%']]} vs {r[col['diff vs base']]}" if r[col["diff vs base"]] != "-" else "no frozen base on the oracle testbed"
        out.append(f"| {r[0]} | {r[1]} | {r[col['value']]} {r[col['95% interval']]} | {r[col['chance']]} | {base} | "
                   f"{r[col['control']]} | {_short(r[col['verdict']])} |")
    return "\n".join([f"Each job's first row of the confirmation run (`{result.relative_to(REPO)}`; every row: BENCHMARKS.md, "
                      "Testbed):", "",
                      "| job | metric (held-out) | value [95%] | chance | paired difference vs the frozen base | control | verdict |",
                      "|---|---|---|---:|---|---:|---|", *out]) + "\n"


def place(page: Path, name: str, block: str, check: bool) -> bool:
    text = page.read_text()
    pat = re.compile(BLOCK.format(name=name), re.S)
    m = pat.search(text)
    if m is None:
        raise SystemExit(f"{page.relative_to(REPO)}: no <!-- {name} --> ... <!-- /{name} --> markers")
    if m.group(2) == block:
        return True
    if check:
        return False
    page.write_text(text[:m.start(2)] + block + text[m.end(2):])
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="?", default=None)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page's block differs")
    args = ap.parse_args(argv)
    result = Path(args.result).resolve() if args.result else newest_result()
    text = result.read_text()
    ok = True
    for page in FULL_PAGES:
        if not place(REPO / page, "confirm-table", full_block(result, text), args.check):
            print(f"{page}: the confirm-table block differs from {result.relative_to(REPO)}; run benchmarks/confirm_tables.py")
            ok = False
    if not place(REPO / HEADLINE_PAGE, "confirm-headline", headline_block(result, text), args.check):
        print(f"{HEADLINE_PAGE}: the confirm-headline block differs from {result.relative_to(REPO)}; run benchmarks/confirm_tables.py")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
