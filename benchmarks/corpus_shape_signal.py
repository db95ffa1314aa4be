"""Why a CLIP trained on the generated corpus reads colour but hardly shape: what the data offers (issue 45).

    .venv/bin/python benchmarks/corpus_shape_signal.py [--n-images 600] [--seed 1] [--max-objects 6] [--batch 64]
        [--twins 2 --hard-batches 1 --hard-order grouped]

From the generator alone (pipeline/synthetic/: the corpus's scenes and captions, nothing written), three questions:

1. Do the captions name shapes? The share of captions naming a shape word (singular or plural) and a colour word.
2. Does a contrastive batch separate images by shape? For each caption drawn as training draws it (one of its image's
   captions) in random batches of ``--batch`` images: whether its shape words alone fit no other image of the batch
   (every shape it names is among that image's objects), whether its colour words alone do, and both together. A
   signal the loss can use only to the extent the words single out the image. ``--twins`` draws the corpus as
   ``corpus.twins`` does (groups that differ only in their shapes), ``--hard-batches`` batches as clip-encoder's
   ``hard_batches`` and ``--hard-order`` as its ``hard_order`` (``epoch_batches``: that share of the batches from images
   sorted by their colour sets, or grouped by them).
3. Are the objects big enough? Each object's diameter (2 r) in patches at each (image size, patch size) the CLIP
   could be given, median and 10th percentile (the scenes are ``--image-size`` px; the processor resizes).

Plus whether shape is confounded with colour: how many of the 12 x 10 colour-shape pairs occur.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = [(64, 8), (64, 16), (128, 16), (128, 8)]  # (model image size, patch size)


def shape_words(text: str) -> set[str]:
    from pipeline.synthetic.scene import PLURALS, SHAPES

    word = {s: s for s in SHAPES} | {p: s for s, p in PLURALS.items()}
    return {word[w] for w in re.findall(r"[a-z]+", text.lower()) if w in word}


def colour_words(text: str) -> set[str]:
    """The object colours a caption names (a background's "pale green", "light gray" left out)."""
    from pipeline.synthetic.scene import BACKGROUND_COLORS, COLOR_NAMES

    text = text.lower()
    for bg in BACKGROUND_COLORS:
        text = text.replace(bg, " ")
    return {w for w in re.findall(r"[a-z]+", text) if w in COLOR_NAMES}


def signal(n_images: int = 600, seed: int = 1, max_objects: int = 6, image_size: int = 128, batch: int = 64,
           batches: int = 200, twins: int = 1, hard_batches: float = 0.0, hard_order: str = "sorted") -> dict:
    from pipeline.synthetic.generate import _scene_captions
    from train.jobs.clip_encoder.job import epoch_batches

    cfg = {"seed": seed, "S": image_size, "cpi": 5, "min_objects": 1, "max_objects": max_objects, "vocabulary": "small",
           "twins": twins}
    grid = np.mgrid[0:image_size, 0:image_size].astype(np.float32)
    scenes, caps = [], []
    for i in range(n_images):
        _, scene, _, cs = _scene_captions(cfg, i, grid)
        scenes.append(scene)
        caps.append([t for t, _ in cs])
    texts = [c for cs in caps for c in cs]
    shapes = [{o.shape for o in s.objects} for s in scenes]
    colours = [{o.color for o in s.objects} for s in scenes]
    rng = np.random.default_rng(0)
    alone = {"shape": [], "colour": [], "both": []}
    keys = [tuple(sorted(c)) for c in colours]
    picks: list[np.ndarray] = []
    while len(picks) < batches:
        picks += epoch_batches(keys, min(batch, n_images), hard_batches, rng, hard_order)
    for pick in picks[:batches]:
        for i in pick:
            t = caps[i][rng.integers(len(caps[i]))]
            sw, cw = shape_words(t), colour_words(t)
            others = [j for j in pick if j != i]
            fit_s = {j for j in others if sw <= shapes[j]}
            fit_c = {j for j in others if cw <= colours[j]}
            alone["shape"].append(not fit_s)
            alone["colour"].append(not fit_c)
            alone["both"].append(not (fit_s & fit_c))
    r = np.asarray([o.r for s in scenes for o in s.objects])
    sizes = {f"{res}/{p}": (float(np.median(2 * r * res / image_size / p)), float(np.percentile(2 * r * res / image_size / p, 10)),
                            float(np.median(2 * r * res / image_size)))
             for res, p in SETTINGS}
    pairs = {(o.color, o.shape) for s in scenes for o in s.objects}
    named = [shape_words(t) <= sh and colour_words(t) <= co for cs, sh, co in zip(caps, shapes, colours) for t in cs]
    return {"captions": len(texts), "captions_true": float(np.mean(named)), "name_shape": float(np.mean([bool(shape_words(t)) for t in texts])),
            "name_colour": float(np.mean([bool(colour_words(t)) for t in texts])),
            "objects_per_scene": float(np.mean([len(s.objects) for s in scenes])),
            **{f"unique_by_{k}": float(np.mean(v)) for k, v in alone.items()},
            "diameter_patches": sizes, "colour_shape_pairs": len(pairs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-images", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-objects", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--twins", type=int, default=1, help="the corpus's twins (1: none)")
    ap.add_argument("--hard-batches", type=float, default=0.0, help="clip-encoder's hard_batches (0: random batches)")
    ap.add_argument("--hard-order", choices=["sorted", "grouped"], default="sorted", help="clip-encoder's hard_order")
    a = ap.parse_args(argv)
    s = signal(a.n_images, a.seed, a.max_objects, batch=a.batch, twins=a.twins, hard_batches=a.hard_batches,
               hard_order=a.hard_order)
    print(f"{a.n_images} scenes (seed {a.seed}, 1-{a.max_objects} objects, {s['objects_per_scene']:.2f} on average, "
          f"twins {a.twins}, hard_batches {a.hard_batches:g} {a.hard_order}), {s['captions']} captions")
    print(f"captions naming a shape {100 * s['name_shape']:.1f}%, a colour {100 * s['name_colour']:.1f}%")
    print(f"a caption's image is the only one of a batch of {a.batch} its words fit: by its shape words alone "
          f"{100 * s['unique_by_shape']:.1f}%, by its colour words alone {100 * s['unique_by_colour']:.1f}%, by both "
          f"{100 * s['unique_by_both']:.1f}%")
    for k, (med, p10, px) in s["diameter_patches"].items():
        print(f"model input {k} (image px / patch px): object diameter {med:.2f} patches median ({px:.1f} px), "
              f"{p10:.2f} at the 10th percentile")
    print(f"colour-shape pairs that occur: {s['colour_shape_pairs']} of 120 (no confound: drawn independently)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
