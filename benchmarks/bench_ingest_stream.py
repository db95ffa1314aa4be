"""Streaming ingest: driver peak RSS stays flat as the dataset grows.

Generates (once) a WebDataset folder of caption records with a tiny placeholder JPEG each
(img2dataset layout: ``<key>.jpg`` + ``<key>.txt``, 10,000 samples per tar), then for each size
runs ``pipeline run ingest --limit N`` on it in a fresh process and reports that driver process's
peak RSS (``ru_maxrss``: Ray's workers are other processes), its wall time and records/s. The
plain reference, measured in the same run, is what ingest did before streaming: the reader's
records collected into a list in one process (peak RSS and records/s of that).

    .venv/bin/python benchmarks/bench_ingest_stream.py                       # 100k and 1M
    .venv/bin/python benchmarks/bench_ingest_stream.py --sizes 100000 300000 --root /tmp/wds
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PER_TAR = 10_000
WORDS = "a red cube sits left of two small blue spheres near the large green cone on grey floor".split()


def placeholder_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 60, 30)).save(buf, "JPEG", quality=50)
    return buf.getvalue()


def generate(root: Path, n: int) -> None:
    """``root/{00000..}.tar`` with ``n`` samples in all (kept; regenerated only when smaller)."""
    done = root / "_generated.json"
    if done.is_file() and json.loads(done.read_text()).get("n", 0) >= n:
        return
    root.mkdir(parents=True, exist_ok=True)
    jpg = placeholder_jpeg()
    t0 = time.perf_counter()
    for t in range((n + PER_TAR - 1) // PER_TAR):
        with tarfile.open(root / f"{t:05d}.tar", "w") as tf:
            for i in range(t * PER_TAR, min(n, (t + 1) * PER_TAR)):
                key = f"{i:09d}"
                cap = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(6 + i % 7)).encode()
                for name, data in ((f"{key}.jpg", jpg), (f"{key}.txt", cap)):
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mtime = len(data), 0
                    tf.addfile(ti, io.BytesIO(data))
    done.write_text(json.dumps({"n": n}))
    print(f"generated {n:,} samples in {root} ({time.perf_counter() - t0:.0f}s)", flush=True)


# any `pipeline` command in a fresh process, reporting that process's peak RSS and wall time on
# stderr (also used by bench_image_plan.py)
CHILD_CLI = r"""
import json, resource, sys, time
from pipeline.cli import app
t0 = time.perf_counter()
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "seconds": time.perf_counter() - t0}), file=sys.stderr, flush=True)
"""

CHILD_LIST = r"""
import json, resource, sys, time
from pipeline.readers.wds import read_webdataset
t0 = time.perf_counter()
recs = []
for r in read_webdataset(sys.argv[1]):
    recs.append(r)
    if len(recs) >= int(sys.argv[2]):
        break
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t0, "records": len(recs)}), flush=True)
"""


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{") and "peak_rss_mb" in line:
            return json.loads(line)
    raise RuntimeError(f"no result line in:\n{text[-3000:]}")


def run_ingest(root: Path, out: Path, n: int, args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-c", CHILD_CLI, "run", "ingest", "--manifest", str(REPO / "manifests" / "tiny.yaml"),
           "--limit", str(n), "--force",
           "--set", f"output={out}", "--set", "dataset.kind=webdataset", "--set", f"dataset.path={root}",
           "--set", f"stages.ingest.shard_size={args.shard_size}", "--set", f"stages.ingest.verify_images={args.verify}",
           "--set", f"ray.num_cpus={args.cpus}", "--set", "ray.object_store_memory=268435456"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"ingest of {n} failed:\n{p.stderr[-3000:]}")
    res = last_json(p.stderr)
    man = json.loads((out / "samples" / "_manifest.json").read_text())
    res["rows"] = man["tables"]["samples"]["rows"]
    return res


def run_list(root: Path, n: int) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD_LIST, str(root), str(n)], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return last_json(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlpipe_bench_wds"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/vlpipe_bench_ingest"))
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--verify", default="header", choices=["decode", "header", "none"])
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--no-reference", action="store_true", help="skip the collect-everything reference")
    args = ap.parse_args()
    generate(args.root, max(args.sizes))
    rows = []
    for n in sorted(args.sizes):
        r = run_ingest(args.root, args.out / str(n), n, args)
        ref = None if args.no_reference else run_list(args.root, n)
        rows.append((n, r, ref))
        line = (f"ingest {n:>9,} records: driver peak RSS {r['peak_rss_mb']:7.0f} MB, {r['seconds']:6.0f} s, "
                f"{n / r['seconds']:8,.0f} records/s, {r['rows']:,} samples written")
        if ref:
            line += (f" | reference (records collected in the driver, reader only): peak RSS {ref['peak_rss_mb']:6.0f} MB, "
                     f"{n / ref['seconds']:8,.0f} records/s")
        print(line, flush=True)
    if len(rows) > 1:
        (n0, a, ra), (n1, b, rb) = rows[0], rows[-1]
        print(f"driver peak RSS ratio {n1:,} / {n0:,} records: {b['peak_rss_mb'] / a['peak_rss_mb']:.2f} "
              f"(records x{n1 / n0:.0f}; linear would be x{n1 / n0:.0f})"
              + (f"; reference ratio {rb['peak_rss_mb'] / ra['peak_rss_mb']:.2f}" if ra and rb else ""))


if __name__ == "__main__":
    main()
