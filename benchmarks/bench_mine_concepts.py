"""Benchmark of C3 concept mining (issue 3).

    .venv/bin/python benchmarks/bench_mine_concepts.py                 # 200k (+ reference), 1M, 5M
    .venv/bin/python benchmarks/bench_mine_concepts.py --sizes 200000  # quick
    .venv/bin/python benchmarks/bench_mine_concepts.py --sizes "" --stage 1000000  # the stage on Ray

Captions come from ``pipeline.concepts.coco_like`` (COCO-like: ~10.5 words, Zipfian vocabulary,
5 captions per sample).  Every size runs in a fresh subprocess so that its peak RSS
(``ru_maxrss``, includes the generated captions) is its own.  At the reference size the plain
Python dictionary-based implementation (``pipeline.concepts.reference``) runs on the same captions
in the same process and both outputs are checked to be identical.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(n: int, with_reference: bool, seed: int) -> dict:
    import numpy as np  # noqa: F401

    from pipeline.concepts import mining as M
    from pipeline.concepts.coco_like import coco_like_captions

    t = time.perf_counter()
    df = coco_like_captions(n, seed=seed)
    gen_s = time.perf_counter() - t
    params = M.MiningParams()
    t = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    concepts, vocab = M.mine(df["sample_id"].to_numpy(), df["text"], params)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    mine_s = time.perf_counter() - t
    cpu_s = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    out = {
        "captions": n, "samples": int(df["sample_id"].n_unique()),
        "words_per_caption": float(df["text"].str.split(" ").list.len().mean()),
        "gen_s": gen_s, "mine_s": mine_s, "cpu_s": cpu_s, "captions_per_s": n / mine_s,
        "concept_rows": concepts.num_rows, "vocab": vocab.num_rows,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "cpus": os.cpu_count(), "load1": os.getloadavg()[0],
    }
    if with_reference:
        from pipeline.concepts.reference import mine_reference

        samples = [(int(s), list(g["text"])) for (s,), g in df.group_by("sample_id", maintain_order=True)]
        t = time.perf_counter()
        rows, ref_vocab = mine_reference(samples, params)
        out["reference_s"] = time.perf_counter() - t
        out["speedup_vs_reference"] = out["reference_s"] / mine_s
        fast_rows = list(zip(concepts["sample_id"].to_pylist(), concepts["concept_id"].to_pylist(),
                             concepts["partners"].to_pylist()))
        out["identical_to_reference"] = fast_rows == [(s, c, list(p)) for s, c, p in rows] and \
            {r["concept_id"]: (r["text"], r["n"], r["df"]) for r in vocab.to_pylist()} == ref_vocab
    return out


def stage_child(n: int, seed: int, workdir: str) -> dict:
    """The `mine-concepts` stage on Ray (2 workers) over a `samples` artifact holding n captions
    (hard negatives off: this measures mining).  Peak memory is the largest sum of RSS over the
    driver and all its descendants (Ray workers), sampled every 0.2 s; it counts the memory-mapped
    index once per worker, so it is an upper bound."""
    import threading

    import psutil
    import pyarrow as pa

    from pipeline.concepts.coco_like import coco_like_captions
    from pipeline.config import load_manifest
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stage import RunContext, run_stage

    df = coco_like_captions(n, seed=seed)
    out = os.path.join(workdir, "run")
    w = ArtifactWriter(out, "samples", "ingest", {"bench": n, "seed": seed})
    names = []
    step = 1_000_000
    for i, a in enumerate(range(0, n, step)):
        part = df.slice(a, step)
        u = w.unit_writer(f"{i:05d}", f"bench-{n}-{seed}-{i}")
        u.write_table("captions", part.select("caption_id", "sample_id", "text").to_arrow())
        u.write_table("samples", pa.table({"sample_id": part["sample_id"].unique(maintain_order=True).to_arrow()}))
        u.commit({"rows": part.height})
        names.append(f"{i:05d}")
    w.finalize(names)
    del df
    m = load_manifest(None, [f"output={out}", "ray.num_cpus=2", "stages.mine_concepts.hard_negatives=false",
                             "stages.mine_concepts.shard_size=100000"])
    proc = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                tot = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
                peak[0] = max(peak[0], tot)
            except psutil.Error:
                pass
            stop.wait(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    summary = run_stage("mine-concepts", RunContext(m))
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    return {"captions": n, "stage_s": dt, "captions_per_s": n / dt, "concept_rows": summary["concept_rows"],
            "peak_tree_rss_gib": peak[0] / 2**30, "load1": os.getloadavg()[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="200000,1000000,5000000")
    ap.add_argument("--reference-size", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage", type=int, default=0, help="also run the mine-concepts stage (Ray, 2 workers) on this many captions")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stage-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--with-reference", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.with_reference, a.seed)))
        return
    if a.stage_child:
        print(json.dumps(stage_child(a.stage_child, a.seed, a.workdir)))
        return
    results = []
    for n in [int(x) for x in a.sizes.split(",") if x]:
        cmd = [sys.executable, __file__, "--child", str(n), "--seed", str(a.seed)]
        if n == a.reference_size:
            cmd.append("--with-reference")
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        results.append(r)
        line = (f"{r['captions']:>9,d} captions ({r['samples']:,d} samples, {r['words_per_caption']:.1f} words/caption): "
                f"mine {r['mine_s']:7.1f} s = {r['captions_per_s']:>9,.0f} captions/s, "
                f"{1e6 * r['mine_s'] / r['captions']:.1f} us/caption (CPU {r['cpu_s']:.1f} s), peak RSS {r['peak_rss_gib']:.2f} GiB, "
                f"{r['concept_rows']:,d} concept rows, load {r['load1']:.1f}")
        if "reference_s" in r:
            line += (f"\n          plain-Python reference {r['reference_s']:.1f} s -> speed-up x{r['speedup_vs_reference']:.1f}, "
                     f"identical output: {r['identical_to_reference']}")
        print(line, flush=True)
    if a.stage:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="bench_mc_") as wd:
            cmd = [sys.executable, __file__, "--stage-child", str(a.stage), "--seed", str(a.seed), "--workdir", wd]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"stage mine-concepts on Ray (2 workers, hard negatives off): {r['captions']:,d} captions in {r['stage_s']:.1f} s "
              f"= {r['captions_per_s']:,.0f} captions/s, peak RSS of driver+workers {r['peak_tree_rss_gib']:.2f} GiB "
              f"(upper bound), {r['concept_rows']:,d} concept rows, load {r['load1']:.1f}", flush=True)
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(f"scaling {base['captions']:,d} -> {r['captions']:,d}: time x{r['mine_s'] / base['mine_s']:.2f} "
                  f"for x{r['captions'] / base['captions']:.1f} captions "
                  f"(per-caption wall x{(r['mine_s'] / r['captions']) / (base['mine_s'] / base['captions']):.2f}, "
                  f"per-caption CPU x{(r['cpu_s'] / r['captions']) / (base['cpu_s'] / base['captions']):.2f})")


if __name__ == "__main__":
    main()
