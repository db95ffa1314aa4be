"""Benchmark the c3 trainer: its data path, its training step, and the concept-token cache.

    .venv/bin/python benchmarks/bench_c3.py [--images 384] [--steps 6] [--coco-captions 591753]

Data (sections 1-2): the small oracle testbed of the tests (tests/testbed_reduced.py: the testbed
manifest at ``--images`` generated images, 2 captions each) with ``models.clip: base-random`` (the
ViT-B/16 CLIP shapes with random weights, so the features are ViT-B-sized: the scene-oracle's are
16 x 32), through the real stages in-process, not timed: ingest, extract-clip-tokens, mine-concepts
(the testbed's settings), encode-concepts.

1. Data path alone (no model): triplet batches of 64 (partner + type-1 image + type-2 concept per
   row, concept tokens gathered from the memory-mapped cache) from ViT-B/16-shaped clip_tokens
   (196 x 768 fp16 patches, 512-d pooled), with the images read by random access from the shards
   (``image_cache: random``: kept maps; and with ``pread``, the path for artifacts larger than RAM)
   vs the plain reference in the same run: the same batches with every image already in one
   in-memory array (``image_cache: memory``). Target: random access >= 80% of in-memory.
2. Training step: triplet batches/s with the fusion forward + backward (the job's default model:
   2 co-attention layers of 256, ITM + MCP since 2026-11-26, MCP + MCC before; the fusion pairs of
   the concepts and, with ITM, of the caption pairs), and the same forward +
   backward on one pre-built batch (the plain reference: no data path).
3. Concept-token cache: the ``base-random`` CLIP (ViT-B/16 text tower shapes) encodes concept
   texts in the encode-concepts worker; bytes per concept on disk (tokens, pooled, index) and
   encoding rate. COCO-size: the vocabulary mined (paper defaults) from ``--coco-captions``
   COCO-like captions (pipeline.concepts.coco_like), its token-length distribution through the
   same tokenizer, and the cache's size for min_df 2 / 5 / 20, tokens and pooled-only.

torch uses 1 thread; the machine is shared, so each timing is the better of two runs.
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

import numpy as np
import torch

torch.set_num_threads(1)


def best(fn, reps: int = 2) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def write_data(root: Path, n_images: int) -> Path:
    """The real stages' clip_tokens, concepts and concept_tokens of ``n_images`` generated images
    (ViT-B/16-shaped: models.clip base-random); returns the manifest."""
    import ray

    from tests.testbed_reduced import run_stages, small_oracle_testbed

    man = small_oracle_testbed(root, [], n_images=n_images, shard_size=128)
    run_stages(man, ["ingest", "extract-clip-tokens", "mine-concepts", "encode-concepts"], ["models.clip=base-random"])
    ray.shutdown()  # the stages' embedded Ray
    return man


def job_for(man: Path, out: Path, extra=()):
    from pipeline.config import load_manifest
    from train.config import TrainerConfig
    from train.jobs.c3 import make_job

    no_h = ["train.c3.benchmarks_at_end=false"] if "benchmarks_at_end" in TrainerConfig.model_fields else []
    m = load_manifest(man, [f"output={out}", "models.clip=base-random", "train.c3.batch_size=64", "train.c3.threads=1", "train.c3.amp=off",
                             "train.c3.eval_splits=[test]", *no_h, *extra])
    return make_job(m.train.c3, m, out / "train" / "bench", torch.device("cpu"))


def bench_data_and_step(n_images: int, steps: int, reps: int = 3, with_step: bool = True) -> None:
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        man = write_data(Path(d), n_images)
        out = Path(d) / "testbed"
        print(f"{n_images} generated images through ingest, extract-clip-tokens (base-random), mine-concepts, "
              f"encode-concepts in {time.perf_counter() - t:.1f} s")
        mem = job_for(man, out, ["train.c3.image_cache=memory"])
        rnd = job_for(man, out, ["train.c3.image_cache=random"])
        prd = job_for(man, out, ["train.c3.image_cache=random"])
        prd.store.lazy = True  # pread: the path for shards larger than RAM
        nb = min(steps * 2, mem.batches_per_epoch())
        print(f"{len(mem.data.r_cid)} training rows, {mem.batches_per_epoch()} batches of 64 per epoch; timing {nb} batches")

        def drain(job):
            def f():
                for k, _ in enumerate(job.batches(0, 0)):
                    if k + 1 >= nb:
                        break
            return f

        # interleaved rounds (in-memory, map, pread, in-memory, ...): load drift hits all three alike
        times = {"mem": [], "rnd": [], "prd": []}
        for _ in range(reps):
            for key, job in (("mem", mem), ("rnd", rnd), ("prd", prd)):
                times[key].append(best(drain(job), reps=1))
        tm, tr, tp = (min(times[k]) for k in ("mem", "rnd", "prd"))
        print("\n1. data path (batches of 64 triplets; images 196x768 fp16)")
        print(f"   in-memory reference : {nb / tm:7.2f} batches/s")
        print(f"   random access (map) : {nb / tr:7.2f} batches/s  = {100 * tm / tr:5.1f}% of in-memory (target >= 80%)")
        print(f"   random access (pread): {nb / tp:6.2f} batches/s  = {100 * tm / tp:5.1f}% of in-memory")
        print(f"   (best of {reps} interleaved rounds)")
        if not with_step:
            return

        model = mem.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = [b for _, b in zip(range(steps), mem.batches(0, 0))]
        pairs = int(batches[0]["pair_img"].shape[0])

        def step(b):
            loss, _ = mem.loss(model, b)
            opt.zero_grad()
            loss.backward()
            opt.step()

        def full():
            for _, b in zip(range(steps), rnd.batches(0, 0)):
                step(b)

        def fixed():
            for b in batches:
                step(b)

        step(batches[0])  # warm-up
        tf = best(fixed)
        tfull = best(full)
        n_par = sum(p.numel() for p in model.parameters())
        print(f"\n2. training step (d_model 256, 2 co-attention layers, {n_par / 1e6:.2f} M parameters, "
              f"{pairs} fusion pairs per batch of 64 rows)")
        print(f"   fwd+bwd on pre-built batches: {steps / tf:6.3f} batches/s ({64 * steps / tf:6.1f} triplets/s)")
        print(f"   with the data path (random) : {steps / tfull:6.3f} batches/s = {100 * tf / tfull:5.1f}% of the former")


def bench_cache(coco_captions: int, n_encode: int) -> None:
    from pipeline.concepts import mining as M
    from pipeline.concepts.coco_like import coco_like_captions
    from pipeline.concepts.concept_tokens import encode_concepts, save_npy_atomic
    from pipeline.models.clip import load_clip

    print("\n3. concept-token cache (base-random CLIP: ViT-B/16 text tower, 512-d tokens, projection 512)")
    caps = coco_like_captions(coco_captions)
    t = time.perf_counter()
    concepts, vocab = M.mine(caps["sample_id"].to_numpy(), caps["text"], M.MiningParams())
    print(f"   COCO-size: {coco_captions:,} COCO-like captions -> vocabulary {vocab.num_rows:,} concepts "
          f"(paper defaults, mined in {time.perf_counter() - t:.0f} s)")
    model, _, tok, _ = load_clip("base-random")
    texts = vocab["text"].to_pylist()
    rng = np.random.default_rng(0)
    sample = [texts[i] for i in rng.choice(len(texts), min(n_encode, len(texts)), replace=False)]
    enc = {}
    te = best(lambda: enc.update(encode_concepts(model, tok, sample, 16, 256)), reps=1)
    with tempfile.TemporaryDirectory() as d:
        save_npy_atomic(Path(d) / "t.npy", enc["tokens"])
        save_npy_atomic(Path(d) / "p.npy", enc["pooled"])
        bt = os.path.getsize(Path(d) / "t.npy") / len(sample)
        bp = os.path.getsize(Path(d) / "p.npy") / len(sample)
    print(f"   encoding: {len(sample) / te:.0f} concepts/s on 1 thread ({len(sample)} sampled concepts, batch 256)")
    print(f"   on disk per concept: tokens {bt / 1024:.1f} KiB (M = {enc['tokens'].shape[1]}, the unit's longest), "
          f"pooled {bp / 1024:.2f} KiB")
    # token lengths over the whole vocabulary (same tokenizer): the padded cost per unit
    lens = np.asarray([len(x) for x in tok(texts, truncation=True, max_length=16)["input_ids"]])
    print(f"   token lengths (BOS/EOS incl.): mean {lens.mean():.1f}, p99 {np.percentile(lens, 99):.0f}, max {lens.max()}; "
          f"a ragged store would take {lens.mean() * 512 * 2 / 1024:.1f} KiB per concept")
    df = vocab["df"].to_numpy()
    print("   | min_df | concepts | tokens + pooled | pooled only |")
    for k in (2, 5, 20):
        n = int((df >= k).sum())
        print(f"   | {k} | {n:,} | {n * (bt + bp) / 2**30:.2f} GiB | {n * bp / 2**30:.3f} GiB |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=384)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--coco-captions", type=int, default=591_753)
    ap.add_argument("--encode", type=int, default=1024)
    ap.add_argument("--skip-cache", action="store_true")
    ap.add_argument("--skip-data", action="store_true")
    ap.add_argument("--skip-step", action="store_true", help="data path only (no training step)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved timing rounds of the data path")
    a = ap.parse_args()
    if not a.skip_data:
        bench_data_and_step(a.images, a.steps, a.reps, not a.skip_step)
    if not a.skip_cache:
        bench_cache(a.coco_captions, a.encode)


if __name__ == "__main__":
    main()
