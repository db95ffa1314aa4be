"""docs/report.png from a real demo run: the top of its report (the summary) above one training run's
evaluation table, in headless Chromium, with docs/report.png.json beside it naming what produced it.

    .venv/bin/python docs/make_report_png.py runs/demo/report/index.html --job concept-ot \
        --command "<the command that made the run>"

The sidecar records the report, the manifest and command of the run, the commit, the counts the page
shows and the PNG's sha256; tests/test_docs.py checks that the figure is the one the sidecar
describes and that it came from manifests/demo.yaml.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="a demo run's report/index.html")
    ap.add_argument("--job", default="concept-ot", help="the training run whose evaluation table is shown")
    ap.add_argument("--manifest", default="manifests/demo.yaml", help="the manifest the run was made with")
    ap.add_argument("--command", required=True, help="the command that made the run (recorded)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "report.png")
    a = ap.parse_args()
    shown = shoot(a.report, a.job, a.out)
    output = a.report.resolve().parent.parent
    samples = json.loads((output / "samples" / "_manifest.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=output, capture_output=True, text=True).stdout.strip()
    side = {
        "figure": a.out.name, "sha256": hashlib.sha256(a.out.read_bytes()).hexdigest(),
        "report": str(a.report), "manifest": a.manifest, "command": a.command, "commit": commit or None,
        "job_table": a.job, "images": samples["tables"]["samples"]["rows"],
        "runs": sorted(p.parent.parent.parent.name for p in (output / "train").glob("*/*/checkpoints/final.pt")),
        "page": shown, "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not re.search(r"\bmanifests/demo\.yaml\b", a.command):
        raise SystemExit("the figure must come from a demo run (manifests/demo.yaml)")
    Path(str(a.out) + ".json").write_text(json.dumps(side, indent=1) + "\n")
    print(json.dumps(side, indent=1))


if __name__ == "__main__":
    main()
