"""Benchmark of C3 concept mining (issue 3).

    .venv/bin/python benchmarks/bench_mine_concepts.py                 # 200k (+ reference), 1M, 5M
    .venv/bin/python benchmarks/bench_mine_concepts.py --sizes 200000  # quick

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
    concepts, vocab = M.mine(df["sample_id"].to_numpy(), df["text"], params)
    mine_s = time.perf_counter() - t
    out = {
        "captions": n, "samples": int(df["sample_id"].n_unique()),
        "words_per_caption": float(df["text"].str.split(" ").list.len().mean()),
        "gen_s": gen_s, "mine_s": mine_s, "captions_per_s": n / mine_s,
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="200000,1000000,5000000")
    ap.add_argument("--reference-size", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--with-reference", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.with_reference, a.seed)))
        return
    results = []
    for n in [int(x) for x in a.sizes.split(",")]:
        cmd = [sys.executable, __file__, "--child", str(n), "--seed", str(a.seed)]
        if n == a.reference_size:
            cmd.append("--with-reference")
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        results.append(r)
        line = (f"{r['captions']:>9,d} captions ({r['samples']:,d} samples, {r['words_per_caption']:.1f} words/caption): "
                f"mine {r['mine_s']:7.1f} s = {r['captions_per_s']:>9,.0f} captions/s, "
                f"{1e6 * r['mine_s'] / r['captions']:.1f} us/caption, peak RSS {r['peak_rss_gib']:.2f} GiB, "
                f"{r['concept_rows']:,d} concept rows, load {r['load1']:.1f}")
        if "reference_s" in r:
            line += (f"\n          plain-Python reference {r['reference_s']:.1f} s -> speed-up x{r['speedup_vs_reference']:.1f}, "
                     f"identical output: {r['identical_to_reference']}")
        print(line, flush=True)
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(f"scaling {base['captions']:,d} -> {r['captions']:,d}: time x{r['mine_s'] / base['mine_s']:.2f} "
                  f"for x{r['captions'] / base['captions']:.1f} captions "
                  f"(per-caption cost x{(r['mine_s'] / r['captions']) / (base['mine_s'] / base['captions']):.2f})")


if __name__ == "__main__":
    main()
