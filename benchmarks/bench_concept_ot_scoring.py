"""Throughput of concept-ot's harness interface (``score_pairs``) against the plain in-memory path.

    .venv/bin/python benchmarks/bench_concept_ot_scoring.py            # 400 images, 8 pairs each
    .venv/bin/python benchmarks/bench_concept_ot_scoring.py --images 1000 --variant dense-uot

Data: the small oracle testbed of the tests (tests/testbed_reduced.py, ``small_oracle_testbed``: the
testbed manifest at ``--images`` generated images, ingest and extract-clip-tokens run in-process, not
timed; the scene-oracle's 16 patches, 32-d vision, 24-d text, and its text encoder through the job's
own ``_encode_texts``), an untrained model of the variant, SugarCrepe-like pairs (every image with 8
texts "<colour> <shape> and <colour> <shape>" over the generated scenes' words). Reported, in pairs/s:

* ``score_pairs``: what the harness calls: images by random access into the shards, texts through
  the per-text cache, chunks of ``eval_pairs_chunk`` pairs, g + lambda * s_local;
* ``score_pairs (boxes)``: the same with a box per pair (the local score over the patches the box
  overlaps: one feature pass per distinct (image, patch subset));
* reference: every image and text read and encoded once, held in memory, one
  ``model.score_pairs`` over all pairs (the in-job SugarCrepe path);

and the time ratio score_pairs / reference (the price of random access, chunking and the cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--texts", type=int, default=8, help="texts per image")
    ap.add_argument("--variant", default="conceptot")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import ray

    from pipeline.config import load_manifest
    from pipeline.synthetic.scene import COLOR_NAMES, SHAPES
    from tests.testbed_reduced import small_oracle_testbed
    from train.jobs.concept_ot import make_job
    from train.jobs.concept_ot.model import _normalize

    with tempfile.TemporaryDirectory() as tmp:
        man = small_oracle_testbed(Path(tmp), ["ingest", "extract-clip-tokens"], n_images=a.images, shard_size=64)
        ray.shutdown()  # the stages' embedded Ray
        out = Path(tmp) / "testbed"
        m = load_manifest(man, [f"train.concept_ot.variant={a.variant}", "train.concept_ot.d_c=64",
                                "train.concept_ot.rank=16", "train.concept_ot.eval_splits=[test]"])
        job = make_job(m.train.concept_ot, m, out / "run", torch.device("cpu"))
        encode = job._encode_texts  # models.clip: scene-oracle

        torch.manual_seed(0)
        model = job.build_model().eval()
        rng = np.random.default_rng(0)
        ids = job.scorable_sample_ids()
        vocab = [f"{c} {s}" for c in COLOR_NAMES for s in SHAPES]
        sids = np.repeat(ids, a.texts)
        texts = [" and ".join(rng.choice(vocab, 2, replace=False)) for _ in sids]
        boxes = np.tile([[0.0, 0.0, 80.0, 80.0]], (len(sids), 1))  # 128 px images
        P = len(sids)
        encode(texts[:4])  # warm up

        def best(fn):
            ts = []
            for _ in range(a.reps):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return min(ts)

        def via_interface(b=None):
            job._text_cache.clear()  # every repetition encodes its texts again, as a fresh evaluation
            job._text_cache_bytes = 0
            with torch.no_grad():
                return job.score_pairs(model, sids, texts, b)

        def reference():
            with torch.no_grad():
                rows = job._load_images(sorted(set(ids.tolist())))
                row_of = {s["sample_id"]: k for k, s in enumerate(rows)}
                u = sorted(set(texts))
                tok = encode(u)
                img = model.image_features(torch.from_numpy(np.stack([r["patch_tokens"] for r in rows])))
                txt = model.text_features(tok["tokens"], tok["mask"])
                ie = _normalize(torch.from_numpy(np.stack([r["image_embed"] for r in rows])).float())
                te = _normalize(tok["embed"])
                ii = torch.tensor([row_of[int(s)] for s in sids])
                t_of = {t: k for k, t in enumerate(u)}
                tt = torch.tensor([t_of[t] for t in texts])
                g = (ie[ii] * te[tt]).sum(-1).double()
                return (g + job.cfg.lambda_local * model.score_pairs(img, txt, ii, tt).double()).numpy()

        agree = float(np.abs(via_interface() - reference()).max())
        t_if, t_box, t_ref = best(via_interface), best(lambda: via_interface(boxes)), best(reference)
        print(f"concept-ot scoring, variant {a.variant}: {a.images} images x {a.texts} texts = {P} pairs, "
              f"{len(set(texts))} distinct texts, threads {a.threads}, best of {a.reps}")
        print(f"  score_pairs            {P / t_if:10.0f} pairs/s  ({t_if:.2f} s)")
        print(f"  score_pairs (boxes)    {P / t_box:10.0f} pairs/s  ({t_box:.2f} s)")
        print(f"  reference (in memory)  {P / t_ref:10.0f} pairs/s  ({t_ref:.2f} s)")
        print(f"  score_pairs / reference time = {t_if / t_ref:.2f}x; max |difference| {agree:.2e}")


if __name__ == "__main__":
    main()
