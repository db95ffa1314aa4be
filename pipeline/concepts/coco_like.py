"""Generator of COCO-like captions for the concept-mining benchmark and tests.

Each sample is a scene (a main subject, two objects, a colour, a place) described by
``captions_per_sample`` captions built from phrase templates, so captions of one sample share
nouns while sharing n-grams across samples the way COCO does ("a man riding a", "on top of a").
Content words come from a Zipfian vocabulary (exponent ``zipf_a``): a core of real caption words
followed by a long synthetic tail (``n12345``), giving a large, heavy-tailed vocabulary.  Mean
caption length is about 10.5 words (COCO train2017: 10.5).  Fully vectorised; deterministic per
``seed``.
"""
from __future__ import annotations

import numpy as np
import polars as pl

_NOUNS = ("man woman person dog cat bus train plate table pizza giraffe elephant horse bird "
          "boy girl car truck street kitchen room bed field grass water surfboard skateboard "
          "bench tennis racket baseball bat player frisbee clock building sign bathroom toilet "
          "sink umbrella beach food sandwich cake laptop computer phone zebra sheep cow kite snow "
          "ski motorcycle bike bicycle boat window tree child people group couple chair couch").split()
_ADJS = ("young old small large big little white black red blue green yellow brown tall wooden "
         "open empty busy tiny huge grassy sunny snowy dirty clean colorful").split()
_VERBS = ("riding holding sitting standing eating playing walking looking carrying flying "
          "laying parked throwing swinging wearing watching using crossing covered filled").split()
_PREPS = "on in with at near next to under behind over of by from beside".split()
_DETS = ["a", "a", "a", "the", "an", "two", "some", "a", "the", "a"]
_COLS = "white black red blue green yellow brown gray orange pink".split()

# slot codes: d=det, a=adj, n=noun(random), s=subject, o=object1, q=object2, v=verb, p=prep,
# c=colour, w=place(noun), k=literal word pieces inside templates
_TEMPLATES = [
    "d a s v p d o",              # a young man riding on a skateboard                 (7)
    "d s v d a o p d w",          # a man holding a red umbrella on the street          (9)
    "d a s v p d c o p d w",      # (11)
    "d s p d c o v p d a w",      # (11)
    "d c a s v d o p d w p d q",  # (13)
    "d a s v p k:top k:of d o",   # "... on top of a ..."                               (9)
    "d s v p d o k:next k:to d q",  # (10)
    "d a s k:is v d c o p d a w",  # (12)
    "d s k:and d o v p d w p d q",  # (12)
    "k:there k:is d a s v p d o",  # (10)
]


def _zipf_sampler(K: int, a: float, rng: np.random.Generator):
    w = 1.0 / np.arange(1, K + 1, dtype=np.float64) ** a
    cdf = np.cumsum(w)
    cdf /= cdf[-1]

    def draw(size):
        return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), K - 1)

    return draw


def coco_like_captions(n_captions: int, captions_per_sample: int = 5, seed: int = 0,
                       n_nouns: int = 40_000, n_adjs: int = 4_000, n_verbs: int = 4_000,
                       zipf_a: float = 1.07) -> pl.DataFrame:
    """DataFrame(sample_id int64, caption_id int64, text str), ``n_captions`` rows."""
    rng = np.random.default_rng(seed)
    nouns = pl.Series(_NOUNS + [f"n{i}" for i in range(n_nouns - len(_NOUNS))])
    adjs = pl.Series(_ADJS + [f"a{i}" for i in range(n_adjs - len(_ADJS))])
    verbs = pl.Series(_VERBS + [f"v{i}" for i in range(n_verbs - len(_VERBS))])
    znoun = _zipf_sampler(len(nouns), zipf_a, rng)
    zadj = _zipf_sampler(len(adjs), zipf_a, rng)
    zverb = _zipf_sampler(len(verbs), zipf_a, rng)
    n_samples = -(-n_captions // captions_per_sample)
    sample = np.arange(n_captions, dtype=np.int64) // captions_per_sample
    subj, obj1, obj2, place = (znoun(n_samples) for _ in range(4))
    colour = rng.integers(0, len(_COLS), n_samples)
    tmpl = rng.integers(0, len(_TEMPLATES), n_captions)
    cols = pl.Series(_COLS)
    out = []
    for t, spec in enumerate(_TEMPLATES):
        rows = np.flatnonzero(tmpl == t)
        if len(rows) == 0:
            continue
        s = sample[rows]
        m = len(rows)
        parts = []
        for code in spec.split():
            if code.startswith("k:"):
                parts.append(pl.repeat(code[2:], m, eager=True))
                continue
            if code == "d":
                parts.append(pl.Series(_DETS).gather(rng.integers(0, len(_DETS), m)))
            elif code == "a":
                parts.append(adjs.gather(zadj(m)))
            elif code == "v":
                parts.append(verbs.gather(zverb(m)))
            elif code == "p":
                parts.append(pl.Series(_PREPS).gather(rng.integers(0, len(_PREPS), m)))
            elif code == "c":
                # the scene colour most of the time, sometimes another one
                c = np.where(rng.random(m) < 0.7, colour[s], rng.integers(0, len(_COLS), m))
                parts.append(cols.gather(c))
            else:
                scene = {"s": subj, "o": obj1, "q": obj2, "w": place}[code][s]
                keep = rng.random(m) < 0.75  # captions of one image mostly name the same things
                parts.append(nouns.gather(np.where(keep, scene, znoun(m))))
        text = pl.DataFrame({f"c{i}": p for i, p in enumerate(parts)}).select(
            pl.concat_str(pl.all(), separator=" ").alias("text"))["text"]
        out.append(pl.DataFrame({"row": rows, "text": text}))
    df = pl.concat(out).sort("row")
    # a capitalised first word and a final period, as in COCO
    text = df["text"].str.slice(0, 1).str.to_uppercase() + df["text"].str.slice(1) + "."
    return pl.DataFrame({"sample_id": sample, "caption_id": np.arange(n_captions, dtype=np.int64),
                         "text": text})
