"""Throughput of concept-ot's harness interface (``score_pairs``) against the plain in-memory path.

    .venv/bin/python benchmarks/bench_concept_ot_scoring.py            # 400 images, 8 pairs each
    .venv/bin/python benchmarks/bench_concept_ot_scoring.py --images 1000 --variant dense-uot

Generated clip_tokens (tests/cot_planted.py: 16 patches, 32-d vision, 24-d text; the planted text
encoder stands in for the CLIP text tower), an untrained model of the variant, SugarCrepe-like
pairs (every image with 8 texts, half of them shared across images). Reported, in pairs/s:

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cot_planted import COLORS, SHAPES, write_planted  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--texts", type=int, default=8, help="texts per image")
    ap.add_argument("--variant", default="conceptot")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from pipeline.config import load_manifest
    from train.jobs.concept_ot import make_job
    from train.jobs.concept_ot.model import _normalize

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        pl_ = write_planted(out, n_images=a.images, captions_per_image=2, shard_size=64, seed=0)
        m = load_manifest(None, [f"output={out}", f"train.concept_ot.variant={a.variant}", "train.concept_ot.d_c=64",
                                 "train.concept_ot.rank=16", "train.concept_ot.eval_splits=[test]"])
        job = make_job(m.train.concept_ot, m, out / "run", torch.device("cpu"))

        def encode(texts):
            enc = [pl_.text(t) for t in texts]
            return {"tokens": torch.nn.utils.rnn.pad_sequence([torch.tensor(t).float() for t, _ in enc], batch_first=True),
                    "mask": torch.nn.utils.rnn.pad_sequence([torch.ones(len(t), dtype=torch.bool) for t, _ in enc],
                                                            batch_first=True),
                    "embed": torch.tensor(np.stack([e for _, e in enc])).float()}

        job._encode_texts = encode
        torch.manual_seed(0)
        model = job.build_model().eval()
        rng = np.random.default_rng(0)
        ids = job.scorable_sample_ids()
        vocab = [f"{c} {s}" for c in COLORS for s in SHAPES]
        sids = np.repeat(ids, a.texts)
        texts = [" and ".join(rng.choice(vocab, 2, replace=False)) for _ in sids]
        boxes = np.tile([[0.0, 0.0, 40.0, 40.0]], (len(sids), 1))
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
