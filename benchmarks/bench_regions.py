"""Benchmark extract-regions: the stage worker in-process (what one Ray actor runs).

    .venv/bin/python benchmarks/bench_regions.py [--tiny-images 64] [--base-images 3]

JPEG files 256x256. ``tiny-random`` (mobilenet-v3 FPN Faster R-CNN at 128 px) and
``torchvision:fasterrcnn_resnet50_fpn_v2:random`` (the real COCO detector's architecture and
input size, 800 px shorter side, random weights = its cost). Prints images/s, the share of
decoding, detection + ROI pooling, writing, and the ratio to the plain baseline in the same run:
torchvision's own ``model(images)`` inference (no re-pooling, no writing). 1 torch thread; best of 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

torch.set_num_threads(1)

from bench_clip_tokens import make_images  # noqa: E402


def bench(spec: str, records: list[dict], out: Path) -> dict:
    import torchvision.transforms.functional as TF

    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.readers.images import open_image
    from pipeline.stages import extract_regions as st
    from pipeline.stages._image_units import image_units

    worker = st.RegionWorker(spec, "cpu", 1, 1, "detector", 30, None, None)
    best = None
    for rep in range(2):
        writer = ArtifactWriter(out / f"{rep}-{spec.replace(':', '_')}", "regions", st.NAME, {})
        t0 = time.perf_counter()
        for name, _, payload in image_units(records, len(records)):
            stats = worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint="x"))["stats"]
        wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, stats)
    wall, stats = best
    tensors = [TF.to_tensor(open_image(r["image"])) for r in records]
    base = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            for t in tensors:
                worker.det.model([t])
        base = min(base, time.perf_counter() - t0)
    parts = {k: stats[k] for k in ("decode_s", "encode_s", "write_s")}
    total = sum(parts.values())
    return dict(ips=len(records) / wall, base=len(records) / base, shares={k[:-2]: v / total for k, v in parts.items()}, n=len(records), dim=worker.det.dim)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny-images", type=int, default=64)
    ap.add_argument("--base-images", type=int, default=3)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        recs = make_images(d / "imgs", max(a.tiny_images, a.base_images))
        for spec, n in (("tiny-random", a.tiny_images), ("torchvision:fasterrcnn_resnet50_fpn_v2:random", a.base_images)):
            r = bench(spec, recs[:n], d / "out")
            sh = ", ".join(f"{k} {v:.0%}" for k, v in r["shares"].items())
            print(
                f"extract-regions {spec}: {r['n']} images, {r['ips']:.2f} images/s (torchvision inference alone "
                f"{r['base']:.2f}/s, ratio {r['ips'] / r['base']:.2f}); shares: {sh}; features {r['dim']}-d"
            )


if __name__ == "__main__":
    main()
