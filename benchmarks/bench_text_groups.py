"""Benchmark the text-groups trainer: training samples/s of the paper's model (width 128, 6 + 3
layers, K = 4, CLIP vocabulary 49,408, tied decoder).

    .venv/bin/python benchmarks/bench_text_groups.py [--images 400] [--steps 6] [--batch 32]

Measured in the same run, one torch thread, best of ``--repeats``:

* ``real-token logits`` (the job's default): the batch is trimmed to its longest caption and the
  decoder's vocabulary logits are computed at the real (non-pad) target positions only;
* ``full logits`` (reference): every caption padded to M = 77 and B x 76 x 49,408 logits;
* ``data path``: the job's own batches (``job.batches``: tokenised-caption gather, image-group gather
  from the mapped shards) against the same batches prepared in memory beforehand (ratio >= 0.8 wanted).

Data: the small oracle testbed of the tests (tests/testbed_reduced.py, ``small_oracle_testbed``: the
testbed manifest at ``--images`` generated images, 2 captions each, ~13 BPE tokens; ``ingest`` and
``extract-image-groups`` with the scene-oracle GroupViT run in-process into a temporary folder, not
timed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

torch.set_num_threads(1)


def _job(out: Path, tmp: Path, **opts):
    from tests.conftest import make_manifest
    from train.jobs.text_groups import Config, make_job

    m = make_manifest(tmp, [f"output={out}"])
    cfg = Config(threads=1, vanilla_run=None, **opts)
    return make_job(cfg, m, tmp / "run", torch.device("cpu"))


def _steps(job, model, opt, batches) -> tuple[float, int]:
    n = 0
    t0 = time.perf_counter()
    for b in batches:
        loss, _ = job.loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += len(b["ids"])
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    import ray

    from tests.testbed_reduced import small_oracle_testbed

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t = time.perf_counter()
        small_oracle_testbed(tmp, ["ingest", "extract-image-groups"], n_images=a.images, shard_size=100)
        ray.shutdown()  # the stages' embedded Ray
        print(f"data: {a.images} generated images through ingest + extract-image-groups in {time.perf_counter() - t:.0f} s")
        rows = {}
        for name, full in (("real-token logits", False), ("full logits", True)):
            job = _job(tmp / "testbed", tmp, batch_size=a.batch, full_logits=full)
            torch.manual_seed(0)
            model = job.build_model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            mem = [b for _, b in zip(range(a.steps), job.batches(0, 0))]
            _steps(job, model, opt, mem[:1])  # warm-up
            best_mem = best_stream = 0.0
            for _ in range(a.repeats):
                dt, n = _steps(job, model, opt, mem)
                best_mem = max(best_mem, n / dt)
                it = (b for _, b in zip(range(a.steps), job.batches(1, 0)))
                dt, n = _steps(job, model, opt, it)
                best_stream = max(best_stream, n / dt)
            rows[name] = (best_mem, best_stream, float(sum(b["mask"].sum() for b in mem)) / sum(b["mask"].numel() for b in mem))
        print(f"text-groups training, batch {a.batch}, {a.steps} steps, 1 thread (best of {a.repeats})")
        for name, (mem, stream, fill) in rows.items():
            print(f"  {name:18s} in-memory {mem:7.1f} samples/s   job.batches {stream:7.1f} samples/s   "
                  f"data path / in-memory {stream / mem:5.2f}   real tokens {100 * fill:4.1f}% of the batch")
        r, f = rows["real-token logits"][0], rows["full logits"][0]
        print(f"  real-token logits / full B x 77 x V logits: {r / f:.2f}x")


if __name__ == "__main__":
    main()
