"""Benchmark extract-image-groups: the stage worker in-process (what one Ray actor runs).

    .venv/bin/python benchmarks/bench_image_groups.py [--tiny-images 256] [--base-images 24]

JPEG files 256x256; ``tiny-random`` and ``base-random`` (nvidia/groupvit-gcc-yfcc shapes, random
weights = the real model's cost). Prints images/s, the share of decoding (open + processor),
encoding and writing, and the ratio to the plain baseline measured in the same run: the vision
forward alone on already-preprocessed tensors. torch uses 1 thread (shared machine); best of 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

torch.set_num_threads(1)

from bench_clip_tokens import make_images  # noqa: E402


def bench(spec: str, records: list[dict], out: Path, batch_size: int) -> dict:
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.models.groupvit import encode_groups
    from pipeline.readers.images import open_image
    from pipeline.stages import extract_image_groups as st
    from pipeline.stages._image_units import image_units

    worker = st.GroupWorker(spec, "cpu", 1, batch_size)
    best = None
    for rep in range(2):
        writer = ArtifactWriter(out / f"{spec}-{rep}", "image_groups", st.NAME, {})
        t0 = time.perf_counter()
        for name, _, payload in image_units(records, len(records)):
            stats = worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint="x"))["stats"]
        wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, stats)
    wall, stats = best
    pixels = worker.processor(images=[open_image(r["image"]) for r in records[:batch_size]], return_tensors="pt")["pixel_values"]
    base = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        encode_groups(worker.model, pixels)
        base = min(base, time.perf_counter() - t0)
    parts = {k: stats[k] for k in ("decode_s", "encode_s", "write_s")}
    total = sum(parts.values())
    shard = next((out / f"{spec}-0" / "image_groups" / "shards").glob("*.tar"))
    return dict(
        ips=len(records) / wall,
        base=len(pixels) / base,
        shares={k[:-2]: v / total for k, v in parts.items()},
        kb=shard.stat().st_size / len(records) / 1e3,
        n=len(records),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny-images", type=int, default=256)
    ap.add_argument("--base-images", type=int, default=24)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        recs = make_images(d / "imgs", max(a.tiny_images, a.base_images))
        for spec, n, bs in (("tiny-random", a.tiny_images, 32), ("base-random", a.base_images, 8)):
            r = bench(spec, recs[:n], d / "out", bs)
            sh = ", ".join(f"{k} {v:.0%}" for k, v in r["shares"].items())
            print(
                f"extract-image-groups {spec:12s}: {r['n']} images, {r['ips']:.1f} images/s "
                f"(forward alone {r['base']:.1f}/s, ratio {r['ips'] / r['base']:.2f}); shares: {sh}; {r['kb']:.1f} kB/sample"
            )


if __name__ == "__main__":
    main()
