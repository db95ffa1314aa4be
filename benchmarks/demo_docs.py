"""docs/performance.md's demo table and docs/report.png, both from one demo run (README command 1's output).

    .venv/bin/python benchmarks/demo_docs.py --table [--png] [--output runs/demo] [--check]

``--table``: the closing table of ``train run all`` (:func:`train.summary.runs_table`) over the run
folders ``train run <job>`` uses with the manifest, without its ``wall`` column (wall times depend on
the machine; the numbers are seeded), written between the ``demo-table`` markers of
docs/performance.md. ``--png``: docs/report.png, the top of the run's report above one job's
evaluation table, in headless Chromium, and docs/report.png.json beside it: the commit, the
manifest and the command of the run, the figure's sha256 and the table the run gives (the same
rows as the docs table: tests/test_docs.py checks the two agree). ``--check``: write nothing, exit
1 naming the lines of the docs table that differ from the run's (the slow test
``tests/test_docs.py::test_demo_docs_match_a_demo_run`` runs it on a demo run). The numbers are seeded, so
on the machine that made the table they agree to the digit; another CPU's floating-point arithmetic moves
some in the third digit (relation-head's recall@1 37.1 -> 35.6 on a 2-core AMD EPYC, 2026-11-29), so
where they differ ``--check`` accepts each number within ``--tolerance`` (0.25) of its row's 95% interval
width, with the same jobs, labels, item counts and verdicts; ``--tolerance 0`` asks for every digit.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERFORMANCE = REPO / "docs" / "performance.md"
TABLE_BLOCK = re.compile(r"(<!-- demo-table[^\n]*-->\n```text\n)(.*?)(```\n<!-- /demo-table -->)", re.S)
COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/pipeline run all --manifest "
           "manifests/demo.yaml && .venv/bin/train run all --manifest manifests/demo.yaml")


class NotADemoRun(RuntimeError):
    """The output holds no finished run of a job (README command 1 has not run, or not to its end)."""


def demo_runs(manifest: Path, output: Path | None = None) -> list[tuple[str, Path, dict]]:
    """(job, run folder, its eval/final/metrics.json) of every job ``train run all`` trains, in its order:
    the folders ``train run <job>`` uses with ``manifest`` (``output``: the manifest's output instead)."""
    from pipeline.config import load_manifest
    from train.cli import run_folder
    from train.registry import feature_jobs

    m = load_manifest(manifest, [f"output={output}"] if output else [])
    runs = []
    for job in feature_jobs():
        run = Path(run_folder(job, m, getattr(m.train, job.replace("-", "_"))))
        final = run / "eval" / "final" / "metrics.json"
        if not final.is_file():
            raise NotADemoRun(f"{final}: missing; run README command 1 (`train run all --manifest {manifest}`) first")
        runs.append((job, run, json.loads(final.read_text())))
    return runs


def closing_table(runs: list[tuple[str, Path, dict]]) -> str:
    """``train run all``'s closing table of ``runs`` without the run folders and the ``wall`` column."""
    from train.summary import runs_table

    table = runs_table(runs, []).split("\nrun folders:", 1)[0]
    return "\n".join(re.sub(r"\s+\S+$", "", line) for line in table.splitlines()) + "\n"


def docs_table(text: str | None = None) -> str:
    """The table docs/performance.md shows between its ``demo-table`` markers."""
    m = TABLE_BLOCK.search(PERFORMANCE.read_text() if text is None else text)
    if m is None:
        raise SystemExit(f"{PERFORMANCE}: no <!-- demo-table --> block")
    return m[2]


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"


def write_table(table: str, commit: str | None = None) -> None:
    text = PERFORMANCE.read_text()
    docs_table(text)
    new = TABLE_BLOCK.sub(lambda m: f"<!-- demo-table: benchmarks/demo_docs.py --table, run at {commit or _commit()} -->\n"
                          f"```text\n{table}{m[3]}", text, count=1)
    PERFORMANCE.write_text(new)


def check_table(table: str) -> list[str]:
    """The lines where the docs table and ``table`` differ (empty: they agree)."""
    shown = docs_table().splitlines()
    made = table.splitlines()
    out = [f"line {i + 1}: docs {a!r} != run {b!r}" for i, (a, b) in enumerate(zip(shown, made)) if a != b]
    if len(shown) != len(made):
        out.append(f"docs {len(shown)} lines, run {len(made)}")
    return out


NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
N_COL, VERDICT_COL, DIFF_COL = 5, 6, 7  # the closing table's columns: job headline value interval bar n verdict diff


def _numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in NUMBER.findall(cell)]


def _same_words(a: str, b: str) -> bool:
    """Two cells' text with the numbers left out, equal, or equal up to where a label was cut (``…``): a column's
    width follows its widest cell, so a number printed one digit longer cuts a label beside it one letter shorter."""
    a, b = NUMBER.sub("#", a), NUMBER.sub("#", b)
    if a == b:
        return True
    if "…" not in a + b:
        return False
    pa, pb = a.split("…", 1)[0], b.split("…", 1)[0]
    return pa.startswith(pb) or pb.startswith(pa)


def close_lines(table: str, tolerance: float, shown: str | None = None) -> list[str]:
    """The rows of the docs table and ``table`` that differ by more than another CPU's arithmetic moves them: the
    same jobs, headlines, labels, item counts (n) and verdicts, and every other number within ``tolerance`` times
    the width of its row's 95% interval (the value's for the value, the interval and the bar; the difference's for
    the difference). Empty: they agree within it. ``shown``: the table to compare with (default the docs')."""
    shown, made = (docs_table() if shown is None else shown).splitlines(), table.splitlines()
    if len(shown) != len(made):
        return [f"docs {len(shown)} lines, run {len(made)}"]
    out = []
    for i, (a, b) in enumerate(zip(shown, made)):
        ca, cb = re.split(r"\s{2,}", a.strip()), re.split(r"\s{2,}", b.strip())
        bad = len(ca) != len(cb) or (i > 0 and (ca[N_COL] != cb[N_COL] or ca[VERDICT_COL] != cb[VERDICT_COL]))
        for j, (x, y) in enumerate(zip(ca, cb)):
            if bad:
                break
            nx, ny = _numbers(x), _numbers(y)
            if not _same_words(x, y) or len(nx) != len(ny):
                bad = True
            elif nx and i > 0:
                ci = _numbers(ca[DIFF_COL] if j == DIFF_COL else ca[3])[-2:]
                width = abs(ci[1] - ci[0]) if len(ci) == 2 else 0.0
                bad = any(abs(u - v) > tolerance * width + 1e-12 for u, v in zip(nx, ny))
        if bad:
            out.append(f"line {i + 1}: docs {a!r} != run {b!r}")
    return out


# ---------------------------------------------------------------------------------------- the figure


def _driver(width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    o.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--window-size={width},{height}", "--allow-file-access-from-files", "--hide-scrollbars"):
        o.add_argument(a)
    return webdriver.Chrome(options=o, service=Service(shutil.which("chromedriver")))


def shoot(report: Path, job: str, out: Path, width: int = 1400, top: int = 1250, table: int = 640) -> dict:
    """Screenshot the report's top ``top`` pixels and ``job``'s first evaluation table (at most
    ``table`` pixels of it), stacked, to ``out``; returns what the page showed."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    d = _driver(width, top)
    try:
        d.get(report.resolve().as_uri())
        time.sleep(1.0)
        head = Image.open(io.BytesIO(d.get_screenshot_as_png())).convert("RGB")
        fold = d.find_element(By.CSS_SELECTOR, f"[id^=\"train-{job}-\"], #train-{job}").find_element(By.XPATH, "..")
        d.execute_script("document.querySelectorAll('nav, header').forEach(n => n.style.position = 'static');"
                         "arguments[0].open = true; arguments[0].scrollIntoView();", fold)
        time.sleep(0.5)
        tab = fold.find_element(By.CSS_SELECTOR, "table")
        d.execute_script("arguments[0].scrollIntoView();", tab)
        body = Image.open(io.BytesIO(tab.screenshot_as_png)).convert("RGB")
        title = d.title
        summary = d.find_element(By.CSS_SELECTOR, "#overview h2").text
    finally:
        d.quit()
    body = body.crop((0, 0, min(body.width, head.width), min(body.height, table)))
    canvas = Image.new("RGB", (head.width, head.height + 12 + body.height), "white")
    canvas.paste(head, (0, 0))
    canvas.paste(body, (0, head.height + 12))
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out, optimize=True)
    return {"title": title, "summary": summary, "size": list(canvas.size)}


def write_png(output: Path, manifest: str, table: str, runs: list, out: Path, job: str = "concept-ot",
              command: str = COMMAND, commit: str | None = None) -> dict:
    """docs/report.png of ``output``'s report and its sidecar (``out``.json): what made it, and the
    closing table of the same run."""
    shown = shoot(output / "report" / "index.html", job, out)
    samples = json.loads((output / "samples" / "_manifest.json").read_text())
    side = {
        "figure": out.name, "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        "report": str(output / "report" / "index.html"), "manifest": manifest, "command": command,
        "commit": commit or _commit(), "job_table": job, "images": samples["tables"]["samples"]["rows"],
        "runs": {j: str(Path(r).relative_to(output)) for j, r, _ in runs}, "table": table.splitlines(),
        "page": shown, "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(str(out) + ".json").write_text(json.dumps(side, indent=1) + "\n")
    return side


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=None, help="the demo run's output (default: the manifest's, runs/demo)")
    ap.add_argument("--manifest", default="manifests/demo.yaml", help="the manifest the run was made with")
    ap.add_argument("--table", action="store_true", help="docs/performance.md's demo table")
    ap.add_argument("--png", action="store_true", help="docs/report.png and docs/report.png.json")
    ap.add_argument("--png-out", type=Path, default=REPO / "docs" / "report.png")
    ap.add_argument("--check", action="store_true", help="compare the docs table with the run's; write nothing")
    ap.add_argument("--tolerance", type=float, default=0.25, help="--check: where the tables differ, accept numbers "
                    "within this fraction of their row's 95%% interval width (another CPU's arithmetic; labels, n and "
                    "verdicts exact); 0: to the digit")
    a = ap.parse_args(argv)
    if not re.search(r"(^|/)manifests/demo\.yaml$", a.manifest):
        raise SystemExit("the docs' table and figure come from a demo run (manifests/demo.yaml)")
    try:
        runs = demo_runs(Path(a.manifest), a.output)
    except NotADemoRun as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = runs[0][1].parents[2]
    table = closing_table(runs)
    if a.check:
        diff = check_table(table)
        if not diff:
            print(f"docs/performance.md's demo table is {output}'s, to the digit")
            return 0
        far = close_lines(table, a.tolerance) if a.tolerance > 0 else diff
        print("\n".join(far) if far else "\n".join(diff) + f"\ndocs/performance.md's demo table is {output}'s within "
              f"{a.tolerance} of each row's 95% interval width (not to the digit: a CPU other than the one that made "
              "it?); the same jobs, labels, n and verdicts")
        return 1 if far else 0
    commit = _commit()  # before this writes anything
    if a.table:
        write_table(table, commit)
        print(f"{PERFORMANCE}: the demo table of {output}:\n{table}")
    if a.png:
        side = write_png(output, a.manifest, table, runs, a.png_out, commit=commit)
        print(f"{a.png_out}: {side['page']['size'][0]}x{side['page']['size'][1]}, sidecar {a.png_out}.json")
    if not (a.table or a.png):
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
