"""Issue 27: does the text-groups grouping form? Runs `train run text-groups` on the testbed for each
configuration (each cause alone, then combined; see docs/jobs/text-groups.md) and prints one table of
phrase discovery (tIoU / P / R / F1 with 95% intervals, captions with >= 2 gold phrases and all)
beside the baselines, and held-out retrieval R@1.

    .venv/bin/python benchmarks/text_groups_causes.py --manifest manifests/testbed.yaml \
        [--configs base sum ...] [--seeds 0 1 2] [--parallel 2] [--summary-only]

Every run is the real command (`python -m train.cli run text-groups -m M --set ...`), in its own
run folder `<output>/train/text-groups/causes/<config>-s<seed>`; a finished run is not rerun.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the reduced encoder every configuration shares (CPU budget): width 64, 2 + 1 layers, the decoder's
# softmax over the corpus ids; 30 epochs of the testbed's training images (the paper's schedule)
REDUCED = dict(width=64, layers_pre=2, layers_post=1, vanilla_layers=3, recon_vocab="corpus")
CONFIGS = {
    "vanilla": dict(variant="vanilla"),
    "base": dict(reconstruction_reduction="mean"),                      # issue 14's setting (cause 3 only)
    "sum": dict(reconstruction_reduction="sum"),                        # cause 1: Eq. 10 summed over tokens
    "narrow": dict(reconstruction_reduction="mean", width=32),          # cause 2: group width 32
    "no-preassign": dict(reconstruction_reduction="mean", pre_assign_attn=False),  # cause 4: Eq. 4 literally
    "soft": dict(reconstruction_reduction="mean", hard_assignment=False),          # cause 4: soft assignment
    "tau05": dict(reconstruction_reduction="mean", gumbel_tau=0.5),               # cause 4: Gumbel temperature
    "combined": dict(reconstruction_reduction="sum", width=32, pre_assign_attn=False),
    # everything of cause 4 at once: the caption reaches the groups only through the soft assignment
    "forced": dict(reconstruction_reduction="sum", width=32, pre_assign_attn=False, isolate_groups=True,
                   hard_assignment=False),
    "forced-no-rec": dict(reconstruction_reduction="sum", width=32, pre_assign_attn=False, isolate_groups=True,
                          hard_assignment=False, variant="no-reconstruction"),
    "sum-no-rec": dict(reconstruction_reduction="sum", variant="no-reconstruction"),
    "combined-no-rec": dict(reconstruction_reduction="sum", width=32, pre_assign_attn=False, variant="no-reconstruction"),
    "sum-no-contrastive": dict(reconstruction_reduction="sum", variant="no-contrastive"),
}
METRICS = ("tIoU", "P", "R", "F1")
BASELINES = ("untrained", "random", "one-group", "chunks", "kmeans", "spectral", "meanshift")


def run_dir(output: Path, name: str, seed: int) -> Path:
    return output / "train" / "text-groups" / "causes" / f"{name}-s{seed}"


def run_one(manifest: str, output: Path, name: str, seed: int) -> tuple[str, int, int]:
    rd = run_dir(output, name, seed)
    if (rd / "eval" / "final" / "results.parquet").exists():
        return name, seed, 0
    opts = dict(REDUCED, **CONFIGS[name], seed=seed, run_dir=str(rd),
                vanilla_run=str(run_dir(output, "vanilla", seed).resolve()))
    cmd = [sys.executable, "-m", "train.cli", "run", "text-groups", "-m", manifest, "--no-progress"]
    for k, v in opts.items():
        cmd += ["--set", f"train.text_groups.{k}={v}"]
    rd.mkdir(parents=True, exist_ok=True)
    with open(rd.parent / f"{name}-s{seed}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    return name, seed, rc


def summary(output: Path, names: list[str], seeds: list[int], subset: str) -> None:
    import polars as pl

    print(f"\nphrase discovery, captions {subset}; value [95% interval]; held-out R@1 %")
    print(f"{'config':20s} {'seed':>4s} " + " ".join(f"{m:>18s}" for m in METRICS) + f" {'R@1':>16s} assign_stable (last)")
    for name in names:
        for seed in seeds:
            p = run_dir(output, name, seed) / "eval" / "final" / "results.parquet"
            if not p.exists():
                continue
            df = pl.read_parquet(p)
            pd = df.filter((pl.col("benchmark") == "phrase-discovery/samples") & (pl.col("subset") == subset))

            def cell(metric):
                r = pd.filter(pl.col("metric") == metric)
                if not r.height:
                    return f"{'-':>18s}"
                v, lo, hi = r["value"][0], r["ci_low"][0], r["ci_high"][0]
                return f"{v:6.3g} [{lo:.3g},{hi:.3g}]".rjust(18)

            ret = df.filter(pl.col("benchmark") == "retrieval/held-out")
            r1 = f"{ret['value'][0]:5.1f} (ch {ret['chance'][0]:.1f})" if ret.height else "-"
            import json

            last = [json.loads(x) for x in (p.parents[2] / "metrics.jsonl").read_text().splitlines() if '"train"' in x][-1]
            diag = f"stable {last['assign_stable']:.2f}" if "assign_stable" in last else ""
            if name != "vanilla":
                print(f"{name:20s} {seed:>4d} " + " ".join(cell(m) for m in METRICS) + f" {r1:>16s} {diag}")
            if name in ("vanilla",) or (name == names[0] and seed == seeds[0]):
                for b in BASELINES:
                    if pd.filter(pl.col("metric") == f"tIoU[{b}]").height:
                        print(f"{'  [' + b + ']':20s} {seed:>4d} " + " ".join(cell(f"{m}[{b}]") for m in METRICS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", default="manifests/testbed.yaml")
    ap.add_argument("--configs", nargs="*", default=["vanilla", "base", "sum", "narrow", "no-preassign", "combined",
                                                     "sum-no-rec"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--summary-only", action="store_true")
    a = ap.parse_args()
    from pipeline.config import load_manifest

    output = Path(load_manifest(a.manifest).output)
    if not a.summary_only:
        jobs = [(n, s) for n in a.configs for s in a.seeds]
        # the vanilla runs first: the grouped runs' k-means / spectral / mean-shift baselines use them
        van = [j for j in jobs if j[0] == "vanilla"]
        rest = [j for j in jobs if j[0] != "vanilla"]
        with ThreadPoolExecutor(a.parallel) as ex:
            for batch in (van, rest):
                for name, seed, rc in ex.map(lambda j: run_one(a.manifest, output, *j), batch):
                    print(f"{name} seed {seed}: exit {rc}", file=sys.stderr)
    for subset in ("ge2_phrases", "all"):
        summary(output, a.configs, a.seeds, subset)


if __name__ == "__main__":
    main()
