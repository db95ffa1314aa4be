"""Where a CLIP trained here keeps or loses shape (issue 45): probes of an exported CLIP folder on a samples artifact.

    .venv/bin/python benchmarks/clip_shape_probe.py --manifest manifests/pixels.yaml --set output=runs/pixels \\
        [--clip runs/pixels/encoders/clip] [--samples corpus/samples] [--split test] [--untrained]

Three questions, each on the objects of the ``--split`` images (their ground-truth boxes and categories in the
artifact's ``instances`` table), read through the pipeline's own ``load_clip`` / ``encode_images`` / ``encode_texts``:

1. **Crops, zero-shot.** Each object's box with a 25% margin (a square, so a large object fills the model's input),
   against the prompts "a {shape}." (chance 1 / 10): does the CLIP read shape when the pixels are all one object?
   Overall and by the object's size; Wilson intervals clustered by image.
2. **Linear probes.** Logistic regression (scikit-learn) from the crops of ``--probe-train`` training-split objects
   to their shape and their colour, scored on the split's crops: from the pooled, projected image embedding (what
   every stage reads) and from the patch tokens (the pixels' information before pooling). ``--untrained``: the same
   on a randomly initialised CLIP of the folder's configuration (seed 0), the no-learning reference.
3. **Text prompts.** The mean cosine between the text embeddings of "a photo of a {shape}." over every pair of
   shapes, and the same over colours: near 1, the text tower does not tell the words apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARGIN = 0.25


def square_crop(image, box, margin: float = MARGIN):
    """The square around ``box`` (x0, y0, x1, y1) whose side is its longer side plus ``margin`` of it on each side."""
    x0, y0, x1, y1 = (float(v) for v in box)
    side = max(x1 - x0, y1 - y0) * (1 + 2 * margin)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    return image.crop((int(cx - side / 2), int(cy - side / 2), int(cx + side / 2), int(cy + side / 2)))


def linear_probe(f_train: np.ndarray, y_train, f_test: np.ndarray, y_test) -> float:
    """Accuracy of a logistic regression fit on (f_train, y_train), scored on (f_test, y_test), in [0, 1]."""
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(max_iter=2000).fit(f_train, np.asarray(y_train))
    return float((clf.predict(f_test) == np.asarray(y_test)).mean())


def prompt_separation(model, tokenizer, words: list[str]) -> float:
    """Mean cosine over every pair of distinct words between the text embeddings of "a photo of a {word}."."""
    from pipeline.models.clip import encode_texts

    e = encode_texts(model, tokenizer, [f"a photo of a {w}." for w in words])["text_embed"].float().numpy()
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    c = e @ e.T
    return float(c[~np.eye(len(words), dtype=bool)].mean())


def objects(manifest, samples: str, split: str) -> list[dict]:
    """The split's objects: sample id, image path, box, shape (category), colour and size (attributes)."""
    from pipeline.loaders.samples import image_resolver
    from train.job import open_artifact, resolve_artifact

    art = open_artifact(manifest, samples, "samples")
    if "instances" not in art.tables():
        raise SystemExit(f"clip_shape_probe: {samples} has no instances table (boxes and categories to probe)")
    s = art.read("samples", ["sample_id", "image", "split"]).to_pylist()
    image = {r["sample_id"]: r["image"] for r in s if r["split"] == split}
    resolve = image_resolver(resolve_artifact(manifest, samples), manifest)
    out = []
    for r in art.read("instances", ["sample_id", "category", "attributes", "box"]).to_pylist():
        if r["sample_id"] in image and r["category"] and r["box"] is not None:
            a = json.loads(r["attributes"]) if r["attributes"] else {}
            out.append({"sample_id": r["sample_id"], "image": resolve(image[r["sample_id"]]), "box": r["box"],
                        "shape": r["category"], "colour": a.get("color"), "size": a.get("size")})
    return out


def crop_features(model, processor, objs: list[dict], batch: int = 256) -> dict[str, np.ndarray]:
    import torch

    from pipeline.models.clip import encode_images, preprocess_images
    from pipeline.readers.images import open_image

    pooled, patches = [], []
    for b in range(0, len(objs), batch):
        crops = [square_crop(open_image(o["image"]), o["box"]) for o in objs[b : b + batch]]
        with torch.no_grad():
            e = encode_images(model, preprocess_images(processor, crops))
        pooled.append(e["image_embed"].float().numpy())
        patches.append(e["patch_tokens"].float().numpy().reshape(len(crops), -1))
    return {"pooled": np.concatenate(pooled), "patches": np.concatenate(patches)}


def probe(manifest, clip: str, samples: str = "corpus/samples", split: str = "test", probe_train: int = 3000,
          untrained: bool = False, seed: int = 0) -> dict:
    import torch

    from pipeline.models.clip import encode_texts, load_clip
    from pipeline.synthetic.scene import COLOR_NAMES, SHAPES
    from train.eval.intervals import wilson_of

    model, processor, tokenizer, _ = load_clip(clip)
    if untrained:
        from transformers import CLIPModel

        torch.manual_seed(seed)
        model = CLIPModel(model.config).eval()
    test, train = objects(manifest, samples, split), objects(manifest, samples, "train")
    if not test or not train:
        raise SystemExit(f"clip_shape_probe: {samples} has {len(test)} objects in split {split!r} and {len(train)} in "
                         "'train': nothing to probe")
    rng = np.random.default_rng(seed)
    train = [train[i] for i in np.sort(rng.choice(len(train), min(probe_train, len(train)), replace=False))]
    f_test, f_train = crop_features(model, processor, test), crop_features(model, processor, train)
    prompts = encode_texts(model, tokenizer, [f"a {s}." for s in SHAPES])["text_embed"].float().numpy()
    prompts /= np.linalg.norm(prompts, axis=1, keepdims=True)
    e = f_test["pooled"] / np.linalg.norm(f_test["pooled"], axis=1, keepdims=True)
    hit = np.asarray(SHAPES)[(e @ prompts.T).argmax(1)] == np.asarray([o["shape"] for o in test])
    images = np.asarray([o["sample_id"] for o in test])
    sizes = np.asarray([o["size"] for o in test])
    zs = {"all": (float(hit.mean()), wilson_of(hit, 1.0, images), int(hit.size))}
    for z in ("small", "medium", "large"):
        sel = sizes == z
        if sel.any():
            zs[z] = (float(hit[sel].mean()), wilson_of(hit[sel], 1.0, images[sel]), int(sel.sum()))
    lin = {(k, attr): linear_probe(f_train[k], [o[attr] for o in train], f_test[k], [o[attr] for o in test])
           for k in ("pooled", "patches") for attr in ("shape", "colour")}
    return {"clip": clip, "untrained": untrained, "split": split, "objects": len(test), "images": len(set(images.tolist())),
            "probe_train": len(train), "zero_shot_crops": zs, "linear": lin, "chance_shape": 1 / len(SHAPES),
            "text_cos_shape": prompt_separation(model, tokenizer, SHAPES),
            "text_cos_colour": prompt_separation(model, tokenizer, COLOR_NAMES)}


def report(r: dict) -> str:
    head = f"{r['clip']}{' (UNTRAINED: random init, its configuration)' if r['untrained'] else ''}"
    lines = [f"{head}: {r['objects']} objects of {r['images']} {r['split']} images, probes fit on {r['probe_train']} "
             "training-split objects"]
    for k, (acc, (lo, hi), n) in r["zero_shot_crops"].items():
        lines.append(f"  zero-shot shape on crops, {k:6s} {100 * acc:5.1f} [{lo * 100:.1f}, {hi * 100:.1f}] "
                     f"(chance {100 * r['chance_shape']:.1f}, n {n})")
    for (k, attr), acc in r["linear"].items():
        lines.append(f"  linear probe {attr:6s} from {k:7s} {100 * acc:5.1f}")
    lines.append(f"  text prompts 'a photo of a ...': mean cosine between shapes {r['text_cos_shape']:.3f}, "
                 f"between colours {r['text_cos_colour']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from pipeline.config import load_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default="manifests/pixels.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="manifest override (repeatable)")
    ap.add_argument("--clip", default=None, help="the CLIP folder (default: the manifest's models.clip)")
    ap.add_argument("--samples", default="corpus/samples", help="samples artifact with instances (boxes, categories)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--probe-train", type=int, default=3000, help="training-split objects the linear probes fit on")
    ap.add_argument("--untrained", action="store_true", help="a randomly initialised CLIP of the folder's configuration")
    a = ap.parse_args(argv)
    m = load_manifest(a.manifest, a.sets)
    print(report(probe(m, a.clip or m.models.clip, a.samples, a.split, a.probe_train, a.untrained)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
