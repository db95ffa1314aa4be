"""Benchmark data-parallel training and sweeps on Ray (train/distributed.py, train/sweep.py).

    .venv/bin/python benchmarks/bench_ray_train.py [--images 512] [--steps 40] [--trials 4]
    .venv/bin/python benchmarks/bench_ray_train.py --compute-bound runs/demo --steps 16

Data: the small oracle testbed of the tests (tests/testbed_reduced.py, ``small_oracle_testbed``: the
testbed manifest at ``--images`` generated images, its ingest and extract-clip-tokens stages run
in-process with the scene-oracle encoder, shards of 64; not timed). Job:
concept-ot (dense-uot, d_c 16, batch 32, 1 torch thread per process).

1. Workers: the same run (``--steps`` steps, effective batch 32) in one process (``train run``) and
   on 2 Ray Train workers (``train run --workers 2``, embedded Ray). Reported: the steady training
   rate (samples/s from metrics.jsonl, the first log interval dropped) and the wall time of the
   command (Ray start, worker group, evaluation included).
2. Sweep: ``--trials`` short runs (lr x seeds, 4 steps each) as ``train sweep`` (Ray Tune, 2
   concurrent) and the same runs one after another with ``train run`` in one process; the
   difference over the trial count is the overhead of a trial.
3. ``--compute-bound OUTPUT`` (instead of 1 and 2): a job whose step is compute-bound, visual-tokens
   at the paper's width (8 layers x 512, feed-forward 2048, embedding 512, text head 2 layers),
   batch 64, ``--steps`` steps, on an output that holds its artifacts (``pipeline run all
   --manifest manifests/demo.yaml`` writes one): one process with 1 torch thread, one process with
   2 threads, 2 Ray Train workers with 1 thread each. Reported: steady samples/s, the wall time of
   the command, and the machine's load average before each (the CPUs may be shared).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent


def _sets(out: Path, steps: int) -> list[str]:
    s = [f"output={out}", f"train.concept_ot.max_steps={steps}", "train.concept_ot.batch_size=32",
         "train.concept_ot.variant=dense-uot", "train.concept_ot.d_c=16", "train.concept_ot.log_every=5",
         "train.concept_ot.eval_splits=[test]", "train.concept_ot.eval_max_images=32",
         "train.concept_ot.sugarcrepe_dirs=[]", "train.concept_ot.heatmaps=0", "train.concept_ot.threads=1",
         "train.concept_ot.benchmarks_at_end=false", "ray.num_cpus=2"]
    return sum((["--set", x] for x in s), [])


def _train(args: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([str(BIN / "train"), *args], capture_output=True, text=True, cwd=REPO)
    if p.returncode not in (0, 1):
        raise SystemExit(f"train {' '.join(args[:3])} failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def _rate(run: Path) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if r["kind"] == "train"][1:]
    return sum(rates) / len(rates)


def compute_bound(output: Path, steps: int) -> None:
    """Section 3 of the module docstring: visual-tokens at the paper's width on 1 and 2 workers."""
    vt = "train.visual_tokens"
    sets = [f"output={output.resolve()}", f"{vt}.width=512", f"{vt}.layers=8", f"{vt}.heads=8", f"{vt}.ff_dim=2048",
            f"{vt}.embed_dim=512", f"{vt}.image_mlp_hidden=512", f"{vt}.text_layers=2", f"{vt}.batch_size=64",
            f"{vt}.log_every={max(1, steps // 4)}", f"{vt}.benchmarks_at_end=false", f"{vt}.eval_max_images=16",
            f"{vt}.swap_dirs=[]", "ray.num_cpus=2"]
    print(f"| processes x threads | samples/s (steady) | wall s ({steps} steps, batch 64) | load before |\n|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench_vt_") as tmp:
        for workers, threads in ((1, 1), (1, 2), (2, 1)):
            run = Path(tmp) / f"w{workers}t{threads}"
            load = Path("/proc/loadavg").read_text().split()[0]
            t = _train(["run", "visual-tokens", "--manifest", str(REPO / "manifests" / "demo.yaml"), "--no-progress",
                        "--fresh", "--max-steps", str(steps), "--workers", str(workers),
                        *sum((["--set", x] for x in [*sets, f"{vt}.threads={threads}", f"{vt}.run_dir={run}"]), [])])
            what = f"{workers} worker{'s' * (workers > 1)} (Ray Train)" if workers > 1 else "1 process"
            print(f"| {what} x {threads} thread{'s' * (threads > 1)} | {_rate(run):.1f} | {t:.1f} | {load} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--compute-bound", type=Path, default=None, metavar="OUTPUT",
                    help="section 3 only: visual-tokens at the paper's width on OUTPUT's artifacts")
    a = ap.parse_args()
    if a.compute_bound is not None:
        return compute_bound(a.compute_bound, a.steps)
    import ray

    from tests.testbed_reduced import small_oracle_testbed

    root = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    try:
        small_oracle_testbed(root, ["ingest", "extract-clip-tokens"], n_images=a.images, shard_size=64)
        ray.shutdown()  # the stages' embedded Ray: the timed commands start their own
        tmp = root / "testbed"
        man = tmp / "m.yaml"
        man.write_text("name: bench\n")
        common = ["--manifest", str(man), "--no-progress", "--fresh"]
        one, two = tmp / "w1", tmp / "w2"
        t1 = _train(["run", "concept-ot", *common, *_sets(tmp, a.steps), "--set", f"train.concept_ot.run_dir={one}"])
        t2 = _train(["run", "concept-ot", *common, "--workers", "2", *_sets(tmp, a.steps),
                     "--set", f"train.concept_ot.run_dir={two}"])
        r1, r2 = _rate(one), _rate(two)
        print(f"| workers | samples/s (steady) | wall s ({a.steps} steps, batch 32) |\n|---:|---:|---:|")
        print(f"| 1 | {r1:.1f} | {t1:.1f} |\n| 2 | {r2:.1f} | {t2:.1f} |")
        print(f"ratio 2/1 workers: {r2 / r1:.2f}x samples/s")

        seeds = max(1, a.trials // 2)
        grid = tmp / "grid.yaml"
        grid.write_text("train.concept_ot.lr: [0.0001, 0.0002]\n")
        sweep_sets = _sets(tmp, 4)
        ts = _train(["sweep", "concept-ot", "--manifest", str(man), "--grid", str(grid), "--seeds", str(seeds),
                     "--max-concurrent", "2", *sweep_sets])
        tq = 0.0
        for lr in ("0.0001", "0.0002"):
            for s in range(seeds):
                tq += _train(["run", "concept-ot", *common, *_sets(tmp, 4), "--set", f"train.concept_ot.lr={lr}",
                              "--set", f"train.concept_ot.seed={s}",
                              "--set", f"train.concept_ot.run_dir={tmp / 'seq' / f'{lr}-{s}'}"])
        n = 2 * seeds
        print(f"\n| {n} trials (4 steps each) | wall s |\n|---|---:|\n| train sweep (Ray Tune, 2 concurrent) | {ts:.1f} |")
        print(f"| train run, one after another | {tq:.1f} |")
        print(f"overhead per trial: {(ts - tq) / n:+.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
