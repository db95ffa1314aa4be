"""extract-visual-tokens throughput: tiny SAM on CPU, model vs post-processing, vit_h projection.

    .venv/bin/python benchmarks/bench_visual_tokens.py [--images 8] [--size 256] [--points 16] [--threads 2]

Measured in one run (each timed block is run ``--repeats`` times, the best kept; the CPU is
shared, so timings are noisy):

1. the stage's per-image work in-process (no Ray), on scenes of random ellipses:
   image encoder (one batched call), automatic mask generation (points grid -> decoder ->
   filters -> NMS -> RAM dedup), relation predictor (geometric), graph core (triplets,
   truncation, 4-NN, ranks) and sample encoding (RLE, .npy, tar write). "model" = encoder + AMG
   + relations, "post" = graph + encoding + tar.
2. baselines: (a) the segment-anything package's own ``SamAutomaticMaskGenerator`` (one image at
   a time) with the same settings vs our batched-encoder AMG; (b) the image encoder batched vs
   one image per call; (c) the graph core vs the brute-force loop reference of the tests, on a
   40-instance x 56-predicate scene.
3. post-processing at COCO scale (640x480, 40 instance masks, relation scores with ~2% over the
   threshold) per image, against the projected vit_h model time per image on one GPU.

Projection for vit_h on one GPU, from published SAM figures: the SAM image encoder takes
~0.15 s per image on an NVIDIA A100 (segment-anything.com FAQ; Kirillov et al. 2023). The
automatic mask generator adds the prompt decoder for a 32x32 point grid; its cost relative to the
encoder is counted here with ``torch.utils.flop_counter`` on the real vit_h architecture (meta
tensors, no weights): decoder FLOPs for 1024 prompts / encoder FLOPs, and the decoder is assumed
to run at the same utilisation as the encoder (an optimistic assumption, stated in the output
together with a 2x-slower-decoder bound).
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io.wds import ShardWriter, sample_key  # noqa: E402
from pipeline.models.relations import GeometricRelations, PredicateEncoder  # noqa: E402
from pipeline.models.sam import SamModel  # noqa: E402
from pipeline.models.segmenter import SamSegmenter, Segmentation  # noqa: E402
from pipeline.stages.extract_visual_tokens import sample_fields  # noqa: E402
from pipeline.visual_tokens.graph import build_graph  # noqa: E402
from pipeline.visual_tokens.predicates import DEFAULT_PREDICATE_MAP, PSG_PREDICATES, PredicateMapper  # noqa: E402

A100_ENCODER_S = 0.15  # published: SAM ViT-H image encoder per image on an A100


def scenes(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    out = []
    for _ in range(n):
        im = np.full((size, size, 3), rng.integers(150, 230, 3), dtype=np.uint8)
        for _ in range(rng.integers(3, 7)):
            cx, cy = rng.uniform(0.15, 0.85, 2) * size
            rx, ry = rng.uniform(0.05, 0.2, 2) * size
            m = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1
            im[m] = rng.integers(0, 255, 3)
        out.append(im)
    return out


def best(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def vit_h_ratio() -> tuple[float, float, float]:
    from segment_anything import sam_model_registry
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        sam = sam_model_registry["vit_h"]()
    x = torch.zeros(1, 3, 1024, 1024, device="meta")
    with FlopCounterMode(display=False) as fc:
        emb = sam.image_encoder(x)
    enc = fc.get_total_flops()
    n = 64  # prompts per decoder call (SAM's points_per_batch); dense prompt = "no mask" embedding
    sp = torch.zeros(n, 2, 256, device="meta")
    de = torch.zeros(n, 256, 64, 64, device="meta")
    with FlopCounterMode(display=False) as fc:
        sam.mask_decoder(image_embeddings=emb, image_pe=torch.zeros(1, 256, 64, 64, device="meta"),
                         sparse_prompt_embeddings=sp, dense_prompt_embeddings=de, multimask_output=True)  # fmt: skip
    dec_per_prompt = fc.get_total_flops() / n
    return enc, dec_per_prompt, dec_per_prompt * 1024 / enc


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--points", type=int, default=8, help="points per side of the AMG grid (SAM default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no oversubscription on a shared CPU)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="images per encoder call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    imgs = scenes(args.images, args.size)
    sam = SamModel("tiny-random")
    # a random SAM's IoU/stability predictions mean nothing: keep every mask (worst case for post-processing)
    amg = dict(points_per_side=args.points, points_per_batch=64, pred_iou_thresh=-100.0, stability_score_thresh=0.0,
               score_threshold=-100.0, box_nms_thresh=0.7, dedup_iou=0.8)  # fmt: skip
    seg = SamSegmenter(sam, embedding="decoder_token", width=512, **amg)
    mapper = PredicateMapper(PSG_PREDICATES, DEFAULT_PREDICATE_MAP)
    rel = GeometricRelations(PSG_PREDICATES, mapper)
    pred_emb = PredicateEncoder("tiny-random", 512).encode(PSG_PREDICATES).astype(np.float16)
    print(f"# tiny-random SAM on CPU ({args.threads} threads, shared machine), {args.images} images {args.size}x{args.size}, "
          f"{args.points}x{args.points} points, batch {args.batch}")  # fmt: skip

    # ---------------------------------------------------------------- 1. our per-image pipeline
    def run_ours():
        t = dict(encoder=0.0, amg=0.0, relations=0.0, graph=0.0, encode=0.0, tar=0.0)
        outs = []
        for s in range(0, len(imgs), args.batch):
            batch = imgs[s : s + args.batch]
            t0 = time.perf_counter()
            enc = sam.encode(batch)
            t["encoder"] += time.perf_counter() - t0
            for b, im in enumerate(batch):
                t0 = time.perf_counter()
                g = sam.generate(enc.embeddings[b : b + 1], enc.input_sizes[b], enc.original_sizes[b], **amg)
                sg = Segmentation(
                    masks=g["masks"].numpy(), boxes=g["boxes"].numpy(), scores=g["scores"].numpy(),
                    embeddings=seg._embed(enc.embeddings[b : b + 1], g["masks"], g["tokens"], enc.input_sizes[b]),
                    image_feature=enc.image_features[b], instance_ids=np.full(len(g["scores"]), -1), categories=[None] * len(g["scores"]),
                )  # fmt: skip
                t1 = time.perf_counter()
                scores, _ = rel.predict(sg, image_size=im.shape[:2])
                t2 = time.perf_counter()
                gr = build_graph(sg.scores, scores, sg.boxes)
                t3 = time.perf_counter()
                fields = sample_fields({"sample_id": s + b}, im.shape[:2], sg, gr, PSG_PREDICATES, pred_emb)
                t4 = time.perf_counter()
                t["amg"] += t1 - t0
                t["relations"] += t2 - t1
                t["graph"] += t3 - t2
                t["encode"] += t4 - t3
                outs.append((s + b, fields, len(sg.scores)))
        t0 = time.perf_counter()
        buf = Path("/tmp/bench_visual_tokens.tar")
        with ShardWriter(buf) as w:
            for sid, f, _ in outs:
                w.write(sample_key(sid), f)
        t["tar"] = time.perf_counter() - t0
        return t, outs

    reps = []
    for _ in range(args.repeats):
        reps.append(run_ours())
    t, outs = min(reps, key=lambda r: sum(r[0].values()))
    model = t["encoder"] + t["amg"] + t["relations"]
    post = t["graph"] + t["encode"] + t["tar"]
    n = len(imgs)
    v_mean = np.mean([o[2] for o in outs])
    print(f"ours: {n / (model + post):.2f} images/s end to end; mean {v_mean:.1f} instances/image")
    print("  per image [ms]: " + ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in t.items()))
    print(f"  model {1000 * model / n:.1f} ms/image, post-processing {1000 * post / n:.2f} ms/image = {100 * post / model:.2f}% of model time")

    # ---------------------------------------------------------------- 2a. package AMG baseline
    from segment_anything import SamAutomaticMaskGenerator

    pkg = SamAutomaticMaskGenerator(sam.sam, points_per_side=args.points, points_per_batch=64, pred_iou_thresh=0.0,
                                    stability_score_thresh=0.0, box_nms_thresh=0.7)  # fmt: skip
    tb, _ = best(lambda: [pkg.generate(im) for im in imgs], args.repeats)

    def ours_masks():
        for s in range(0, len(imgs), args.batch):
            enc = sam.encode(imgs[s : s + args.batch])
            for b in range(len(enc.original_sizes)):
                sam.generate(enc.embeddings[b : b + 1], enc.input_sizes[b], enc.original_sizes[b], **amg)

    to, _ = best(ours_masks, args.repeats)
    print(f"mask generation: ours {n / to:.2f} images/s vs segment-anything SamAutomaticMaskGenerator {n / tb:.2f} images/s "
          f"(x{tb / to:.2f}; ours also keeps decoder tokens and applies RAM dedup)")  # fmt: skip

    # ---------------------------------------------------------------- 2b. batched encoder
    te1, _ = best(lambda: [sam.encode([im]) for im in imgs], args.repeats)
    teb, _ = best(lambda: [sam.encode(imgs[s : s + args.batch]) for s in range(0, n, args.batch)], args.repeats)
    print(f"image encoder: batched ({args.batch}/call) {n / teb:.1f} images/s vs one per call {n / te1:.1f} images/s (x{te1 / teb:.2f})")

    # ---------------------------------------------------------------- 2c. graph core vs loop reference
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_visual_tokens_graph import ref_graph

    rng = np.random.default_rng(0)
    V = 40
    S = (rng.random((V, V, 56)) ** 40).astype(np.float32)  # ~7% of pair-predicates over 0.05
    boxes = np.concatenate([rng.uniform(0, 500, (V, 2)), rng.uniform(0, 500, (V, 2)) + 600], axis=1)
    inst = rng.random(V)
    tv, g = best(lambda: build_graph(inst, S, boxes), max(3, args.repeats))
    tl, _ = best(lambda: ref_graph(inst, S, boxes), 1)
    print(f"graph core ({V} instances, 56 predicates, T={g.n_tokens}): vectorised {1000 * tv:.2f} ms vs loop reference {1000 * tl:.0f} ms (x{tl / tv:.0f})")

    # ---------------------------------------------------------------- 3. COCO-scale post-processing
    H, W, V = 480, 640, 40
    yy, xx = np.mgrid[:H, :W]
    masks = np.zeros((V, H, W), bool)
    bx = np.zeros((V, 4), np.float32)
    for k in range(V):
        cx, cy, rx, ry = rng.uniform(40, 600), rng.uniform(40, 440), rng.uniform(10, 120), rng.uniform(10, 120)
        masks[k] = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1
        ys, xs = np.nonzero(masks[k])
        bx[k] = [xs.min(), ys.min(), xs.max(), ys.max()]
    sg = Segmentation(masks=masks, boxes=bx, scores=rng.random(V).astype(np.float32),
                      embeddings=rng.standard_normal((V, 512)).astype(np.float32), image_feature=np.zeros(5376, np.float32),
                      instance_ids=np.full(V, -1), categories=[None] * V)  # fmt: skip
    S = (rng.random((V, V, 56)) ** 50).astype(np.float32)

    def coco_post():
        gr = build_graph(sg.scores, S, sg.boxes)
        f = sample_fields({"sample_id": 0}, (H, W), sg, gr, PSG_PREDICATES, pred_emb)
        with tarfile.open(fileobj=io.BytesIO(), mode="w") as tf:
            from pipeline.io.wds import encode_field

            for name, val in f.items():
                data = encode_field(name, val)
                info = tarfile.TarInfo(f"x.{name}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return gr

    tp, gr = best(coco_post, max(3, args.repeats))
    enc_flops, dec_flops, ratio = vit_h_ratio()
    gpu = A100_ENCODER_S * (1 + ratio)
    gpu_slow = A100_ENCODER_S * (1 + 2 * ratio)
    print(f"COCO-scale post-processing (640x480, {V} masks, E={len(gr.triplets)}, T={gr.n_tokens}): {1000 * tp:.1f} ms/image on 1 CPU core")
    print(f"vit_h: encoder {enc_flops / 1e12:.2f} TFLOP, decoder {dec_flops / 1e9:.2f} GFLOP/prompt -> 32x32 grid = {ratio:.2f} x encoder")
    print(f"projected vit_h on one A100: {gpu:.3f} s/image = {1 / gpu:.1f} images/s (decoder at encoder utilisation); "
          f"{1 / gpu_slow:.1f} images/s if the decoder runs at half that")  # fmt: skip
    print(f"  post-processing / projected GPU model time = {100 * tp / gpu:.1f}% of a CPU core per GPU ({100 * tp / gpu_slow:.1f}% at the slower bound)")


if __name__ == "__main__":
    main()
