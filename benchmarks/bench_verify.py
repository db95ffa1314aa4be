"""Benchmark the check of an artifact's files against their recorded sha256 (pipeline/io/verified.py).

    .venv/bin/python benchmarks/bench_verify.py [--mb 300] [--shards 30]

Writes an artifact of ``--shards`` tar-sized files of random bytes (``--mb`` in all) with the
stage writer (which hashes each file once and records it), then times ``Artifact.files`` (the path
every loader and stage takes to its shards) three ways: fresh (the cache the writer seeded: one
stat per file), cold (``_cache.json`` removed, as for an artifact written before the cache: every
byte hashed) and cached again (stat only); also the producer's rerun check (``is_done`` of every
unit) and, as the yardstick, plain ``hashlib.sha256`` over the same files in this run and the
``sha256sum`` binary when there is one. Files are in the page cache (just written): the hash
rates are CPU-bound; a cold disk adds its read time to the cold read only. Best of 3.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best(fn) -> float:
    return min(timeit.repeat(fn, number=1, repeat=3))


def write_artifact(out: Path, shards: int, shard_bytes: int) -> Path:
    from pipeline.io.artifacts import ArtifactWriter, release_lock, unit_name

    w = ArtifactWriter(out, "blobs", "bench-verify", {"shards": shards, "bytes": shard_bytes})
    rng = os.urandom
    names = []
    for i in range(shards):
        name = unit_name(i)
        u = w.unit_writer(name, w.unit_fingerprint(name, i))
        path = u.shard_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng(shard_bytes))
        u.record_shard(path, 1)
        u.commit({"rows": 1})
        names.append(name)
    w.finalize(names)
    release_lock()
    return w.dir


def plain_hashlib(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        out.append(h.hexdigest())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--shards", type=int, default=30)
    args = ap.parse_args()

    from pipeline.io.artifacts import Artifact, ArtifactWriter, release_lock

    with tempfile.TemporaryDirectory(prefix="bench_verify_") as d:
        tmp = Path(d)
        shard_bytes = args.mb * 2**20 // args.shards
        t0 = time.perf_counter()
        folder = write_artifact(tmp, args.shards, shard_bytes)
        t_write = time.perf_counter() - t0
        total_mb = args.shards * shard_bytes / 2**20
        paths = Artifact(folder).files("shards")

        t_fresh = best(lambda: Artifact(folder).files("shards"))

        def cold():
            (folder / "_cache.json").unlink(missing_ok=True)
            return Artifact(folder).files("shards")

        t_cold = best(cold)
        t_cached = best(lambda: Artifact(folder).files("shards"))

        def rerun_check():
            w = ArtifactWriter(tmp, "blobs", "bench-verify", {"shards": args.shards, "bytes": shard_bytes})
            done = sum(w.is_done(f"{i:05d}", w.unit_fingerprint(f"{i:05d}", i)) for i in range(args.shards))
            release_lock()
            return done

        assert rerun_check() == args.shards
        t_rerun = best(rerun_check)
        t_plain = best(lambda: plain_hashlib(paths))
        t_bin = None
        if shutil.which("sha256sum"):
            t_bin = best(lambda: subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True))

        print(f"artifact: {args.shards} shards, {total_mb:.0f} MB; written (incl. the writer's one hash) in {t_write:.2f}s")
        print(f"Artifact.files, fresh (writer-seeded cache, stat only): {t_fresh * 1e3:8.2f} ms  "
              f"({t_fresh / args.shards * 1e6:.1f} us/file)")
        print(f"Artifact.files, cold (no cache, hash every byte):      {t_cold * 1e3:8.1f} ms  ({total_mb / t_cold:.0f} MB/s)")
        print(f"Artifact.files, cached again (stat only):              {t_cached * 1e3:8.2f} ms  "
              f"({t_cached / args.shards * 1e6:.1f} us/file)")
        print(f"rerun check, is_done of every unit (stat only):         {t_rerun * 1e3:8.2f} ms")
        print(f"plain hashlib.sha256 over the same files:               {t_plain * 1e3:8.1f} ms  ({total_mb / t_plain:.0f} MB/s)")
        if t_bin is not None:
            print(f"sha256sum binary over the same files:                   {t_bin * 1e3:8.1f} ms  ({total_mb / t_bin:.0f} MB/s)")
        print(f"cold / plain hashlib: {t_cold / t_plain:.2f}x;  cold / cached: {t_cold / t_cached:.0f}x")


if __name__ == "__main__":
    main()
