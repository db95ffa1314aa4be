"""Driver memory of an image stage's unit planning (issue 17): flat in the dataset size.

Writes (once per size) a ``samples`` artifact of N records the way ingest writes it (files of
``--ingest-shard`` samples: 5 captions and 3 boxes a sample; no image files, planning opens
none), then in a fresh process per size plans the units of extract-regions with the
annotations backend (ground-truth boxes attached, the heaviest slice of the four image stages
besides visual tokens' masks) and prints that process's peak RSS growth over its RSS before
planning (``VmRSS`` sampled every 2 ms), the planning time and the bytes of all unit payloads (what the driver
ships to the workers). ``--stage`` also runs the whole stage (``pipeline run extract-regions``)
on each size and prints its driver's peak RSS.

With an older checkout first on ``PYTHONPATH`` (before issue 17: ``load_samples`` +
``image_units``, the driver reading every sample into Python dicts) the same command measures
the old planning, for comparison:

    .venv/bin/python benchmarks/bench_image_plan.py --sizes 100000 1000000
    .venv/bin/python benchmarks/bench_image_plan.py --sizes 2000 20000 --stage   # + the whole stage's driver
    PYTHONPATH=/path/to/old/checkout .venv/bin/python benchmarks/bench_image_plan.py --sizes 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_ingest_stream import CHILD_CLI, last_json  # benchmarks/ is on sys.path when a script here runs

REPO = Path(__file__).resolve().parents[1]
CATS = ["cube", "sphere", "cone", "cylinder", "torus"]


def generate(out: Path, n: int, per_file: int) -> None:
    """``out/samples``: an ingest-shaped samples artifact of ``n`` samples (kept when present)."""
    import numpy as np
    import pyarrow as pa

    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages.ingest import CAPTIONS_SCHEMA, INSTANCES_SCHEMA, SAMPLES_SCHEMA

    if (out / "samples" / "_manifest.json").is_file():
        return
    t0 = time.perf_counter()
    w = ArtifactWriter(out, "samples", "ingest", {"generated": n})
    names = []
    for u, a in enumerate(range(0, n, per_file)):
        b = min(n, a + per_file)
        sid = np.arange(a, b, dtype=np.int64)
        uw = w.unit_writer(f"{u:05d}", f"gen-{u}")
        uw.write_table("samples", pa.table({
            "sample_id": sid, "source_id": [f"{i:09d}" for i in sid], "image": [f"images/{i:09d}.jpg" for i in sid],
            "width": np.full(len(sid), 640, np.int32), "height": np.full(len(sid), 480, np.int32),
            "split": ["train"] * len(sid)}, schema=SAMPLES_SCHEMA))
        cs = np.repeat(sid, 5)
        uw.write_table("captions", pa.table({
            "caption_id": np.arange(5 * a, 5 * b, dtype=np.int64), "sample_id": cs,
            "text": [f"a {CATS[i % 5]} left of a {CATS[(i + 2) % 5]} on a grey floor number {i}" for i in range(len(cs))]},
            schema=CAPTIONS_SCHEMA))
        isid = np.repeat(sid, 3)
        boxes = np.tile(np.asarray([[10, 20, 110, 220]], np.float32), (len(isid), 1)).reshape(-1)
        uw.write_table("instances", pa.table({
            "sample_id": isid, "instance_id": np.tile(np.arange(3, dtype=np.int64), len(sid)),
            "category": [CATS[i % 5] for i in range(len(isid))],
            "box": pa.FixedSizeListArray.from_arrays(pa.array(boxes), 4),
            "mask_rle": pa.nulls(len(isid), pa.string()), "attributes": pa.nulls(len(isid), pa.string())},
            schema=INSTANCES_SCHEMA))
        uw.commit({"rows": len(sid)})
        names.append(f"{u:05d}")
    w.finalize(names, extra={"image_root": "."})  # image refs "images/<id>.jpg", relative to the output folder
    print(f"generated {n:,} samples in {out} ({time.perf_counter() - t0:.0f}s)", flush=True)


CHILD = r"""
import json, sys, time
from pathlib import Path
from pipeline.config import load_manifest
from pipeline.stage import RunContext
out, shard = sys.argv[1], int(sys.argv[2])
m = load_manifest(Path(sys.argv[3]), [f"output={out}", "stages.extract_regions.backend=annotations"])
ctx = RunContext(m)
import pipeline.stages._image_units as iu
import threading
def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
peak, stop = [0], threading.Event()
def sample():  # RSS sampled every 2 ms: the peak of this step, not of the imports before it
    while not stop.is_set():
        peak[0] = max(peak[0], rss_kb())
        time.sleep(0.002)
base = rss_kb()
th = threading.Thread(target=sample, daemon=True)
th.start()
t0 = time.perf_counter()
if hasattr(iu, "plan_image_units"):
    impl = "slices (plan_image_units)"
    plan = iu.plan_image_units(ctx, shard, ("boxes",))
    units, rows = plan.units, plan.rows
else:
    impl = "records in the driver (load_samples + image_units)"
    records, _ = iu.load_samples(ctx, with_captions=False, with_instances=True)
    units, rows = iu.image_units(records, shard), len(records)
dt = time.perf_counter() - t0
stop.set()
th.join()
peak = max(peak[0], rss_kb())
payload = sum(len(json.dumps(p, default=str)) for _, _, p in units)
print(json.dumps({"impl": impl, "rows": rows, "units": len(units), "seconds": dt, "rss_before_mb": base / 1024,
                  "peak_growth_mb": (peak - base) / 1024, "payload_mb": payload / 2**20}), flush=True)
"""


def run_stage(out: Path, n: int, env: dict) -> dict:
    """``pipeline run extract-regions`` (annotations backend, tiny-random detector at its smallest
    input size) on the generated artifact, every sample's image a symlink to one 64x64 JPEG;
    the driver process's peak RSS (``ru_maxrss``: Ray's workers are other processes)."""
    import os as _os

    from PIL import Image

    img = out / "images"
    if not (img / f"{n - 1:09d}.jpg").is_file():
        img.mkdir(exist_ok=True)
        Image.new("RGB", (64, 64), (90, 120, 30)).save(img / "_one.jpg", quality=80)
        for i in range(n):
            p = img / f"{i:09d}.jpg"
            if not p.exists():
                _os.symlink("_one.jpg", p)  # (hard links: ext4 allows 65,000 a file)
    cmd = [sys.executable, "-c", CHILD_CLI, "run", "extract-regions", "--force", "--manifest", str(REPO / "manifests" / "tiny.yaml"),
           "--set", f"output={out}", "--set", "stages.extract_regions.backend=annotations",
           "--set", "stages.extract_regions.min_size=32", "--set", "ray.num_cpus=2"]
    (out / "regions" / "_manifest.json").unlink(missing_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out)
    man = out / "regions" / "_manifest.json"
    if p.returncode != 0 or not man.is_file() or json.loads(man.read_text())["errors"]["rows"]:
        raise RuntimeError(f"extract-regions did not finish cleanly:\n{p.stderr[-3000:]}")
    return last_json(p.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--root", type=Path, default=Path("/tmp/vlpipe_bench_image_plan"))
    ap.add_argument("--ingest-shard", type=int, default=5000, help="samples per generated samples file")
    ap.add_argument("--shard-size", type=int, default=500, help="samples per unit (extract-regions' default)")
    ap.add_argument("--stage", action="store_true", help="also run extract-regions itself on each size (driver peak RSS)")
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    res = []
    for n in sorted(args.sizes):
        out = args.root / str(n)
        generate(out, n, args.ingest_shard)
        p = subprocess.run([sys.executable, "-c", CHILD, str(out), str(args.shard_size), str(REPO / "manifests" / "tiny.yaml")],
                           capture_output=True, text=True, env=env, cwd=args.root)  # not the checkout: PYTHONPATH decides
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-3000:])
        r = json.loads(p.stdout.strip().splitlines()[-1])
        res.append(r)
        print(f"{r['impl']}: {r['rows']:>9,} samples, {r['units']:,} units: planning peak RSS growth {r['peak_growth_mb']:8.1f} MB "
              f"(RSS before {r['rss_before_mb']:.0f} MB), {r['seconds']:6.2f} s, unit payloads {r['payload_mb']:8.2f} MB", flush=True)
        if args.stage:
            st = run_stage(out, n, env)
            print(f"  pipeline run extract-regions on {n:,} samples: driver peak RSS {st['peak_rss_mb']:.0f} MB, {st['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
