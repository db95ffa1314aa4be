"""InfoGround training throughput (train/jobs/infoground): the vectorised loss against a per-word
loop reference of the same math, and the data path against in-memory batches.

    .venv/bin/python benchmarks/bench_infoground.py [--images 300] [--regions 12] [--steps 6] [--rounds 2] [--threads 1]

Writes generated `samples` / `regions` / `negatives` artifacts (benchmarks/infoground_artifacts.py) at the paper's widths (2048-d regions,
768-d words, 25 negatives per noun, batches of 50 captions) into a temporary folder, then measures
training samples/s (forward + backward + Adam step):

* ``job``: the job's loss (two GEMMs per batch for every word x every image, packed MLPs);
* ``reference``: :func:`train.jobs.infoground.losses.reference_loss` in float32 — the public code's
  math one word and one image at a time (attention, attended value, phi, InfoNCE terms in Python
  loops), the MLPs on the same packed rows; target: job >= 5x reference;
* ``data path``: the job's training through ``job.batches()`` (shard reading, regions join,
  collate) against the same steps over batches already in memory; target >= 80%.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--regions", type=int, default=12, help="boxes per image (2 objects + distractors, <= 16)")
    ap.add_argument("--steps", type=int, default=6, help="timed job steps per measurement")
    ap.add_argument("--ref-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="alternating loader / in-memory measurements")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from infoground_artifacts import write_grounding_artifacts
    from pipeline.config import load_manifest
    from train.jobs.infoground import make_job
    from train.jobs.infoground.losses import infoground_loss, reference_loss

    tmp = Path(tempfile.mkdtemp(prefix="bench_ig_"))
    try:
        t0 = time.perf_counter()
        write_grounding_artifacts(tmp, n_images=args.images, d_r=2048, d_w=768, distractors=args.regions - 2)
        print(f"artifacts: {args.images} images, {args.regions} regions, 2048-d regions, 768-d words "
              f"({time.perf_counter() - t0:.1f}s)")
        m = load_manifest(None, [f"output={tmp}", f"train.infoground.threads={args.threads}"])
        job = make_job(m.train.infoground, m, tmp / "train", torch.device("cpu"))
        torch.manual_seed(0)
        model = job.build_model().train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)

        def step(batch, fn):
            loss = fn(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        job_fn = lambda mdl, b: infoground_loss(mdl, b)[0]  # noqa: E731
        ref_fn = lambda mdl, b: reference_loss(mdl, b, dtype=torch.float32)  # noqa: E731
        batches = list(job.batches(0, 0))
        B = int(batches[0]["words"].shape[0])
        n_words = sum(int(b["word_mask"].sum()) for b in batches) / len(batches)
        print(f"{len(batches)} batches of {B} captions ({n_words:.0f} noun/adjective words, "
              f"{int(batches[0]['sample_ids'].shape[0])} images per batch)")
        step(batches[0], job_fn)  # warm-up

        def timed(fn, bs):
            t = time.perf_counter()
            for b in bs:
                step(b, fn)
            return len(bs) * B / (time.perf_counter() - t)

        mem = [batches[i % len(batches)] for i in range(args.steps)]
        job_sps = timed(job_fn, mem)
        ref_sps = timed(ref_fn, mem[: args.ref_steps])
        print(f"job       {job_sps:8.1f} samples/s (in-memory batches)")
        print(f"reference {ref_sps:8.1f} samples/s (per-word loops, float32)")
        print(f"ratio     {job_sps / ref_sps:8.1f}x  (target >= 5x)")

        # data path: the same steps fed by job.batches() (reading, regions join, collate) vs in memory
        def through_loader():
            t = time.perf_counter()
            n = 0
            epoch = 1
            while n < args.steps:
                for b in job.batches(epoch, 0):
                    step(b, job_fn)
                    n += 1
                    if n >= args.steps:
                        break
                epoch += 1
            return n * B / (time.perf_counter() - t)

        t = time.perf_counter()
        n_read = sum(1 for _ in job.batches(5, 0))
        data_only = n_read * B / (time.perf_counter() - t)
        # alternate the two measurements (the machine is shared: load drifts between them)
        loader_t = mem_t = 0.0
        for _ in range(args.rounds):
            loader_t += args.steps * B / through_loader()
            mem_t += args.steps * B / timed(job_fn, mem)
        loader_sps, mem_sps = args.rounds * args.steps * B / loader_t, args.rounds * args.steps * B / mem_t
        print(f"data path alone          {data_only:8.1f} samples/s (batches read and collated, no training)")
        print(f"training via job.batches {loader_sps:8.1f} samples/s")
        print(f"training from memory     {mem_sps:8.1f} samples/s")
        print(f"data path share          {100 * loader_sps / mem_sps:8.1f}%  (target >= 80%)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
