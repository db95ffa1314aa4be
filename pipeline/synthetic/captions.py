"""Captions with grounded phrase spans, and SugarCrepe-style hard negatives, from a scene.

Templates (each caption picks one; an image's captions use different templates first):
``list`` (attribute + noun phrases), ``relation`` (spatial predicate), ``count`` (by shape or
colour), ``background``, ``position`` (region of the image), ``compare`` (bigger / smaller),
``superlative`` (largest / smallest). Noun phrases vary the attributes they mention, determiners
and verbs, so n-gram statistics are non-trivial. Every noun phrase that names objects becomes a
phrase span linked to those object indices.

The surface words come from a :class:`~pipeline.synthetic.lexicon.Lexicon`: ``small`` (the default)
is the grammar above, ``large`` re-words the same captions with synonyms and paraphrases from its own
random stream (``dataset.synthetic.vocabulary``; see :mod:`pipeline.synthetic.lexicon`).

Negatives are built only from objects whose colour+shape description is unique in the image and
are checked to be false for the image (e.g. a swapped-attribute caption must not describe other
objects that happen to exist).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.synthetic.lexicon import Lexicon
from pipeline.synthetic.scene import COLOR_NAMES, INVERSE, SHAPES, Scene

NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
PRED_PHRASES = {
    "left of": ["to the left of", "left of", "on the left side of"],
    "right of": ["to the right of", "right of", "on the right side of"],
    "above": ["above", "over", "higher than"],
    "below": ["below", "under", "beneath", "lower than"],
    "in front of": ["in front of", "partly covering", "overlapping and in front of"],
    "behind": ["behind", "partly hidden behind", "partly covered by"],
}
VERBS = ["is", "sits", "appears", "is placed", "is drawn"]
LIST_PREFIX = ["", "A picture of ", "An image of ", "A drawing of ", "A scene with ", "This image shows ",
               "Shapes: "]
REGIONS = [["in the top left corner", "at the top", "in the top right corner"],
           ["on the left side", "in the center", "on the right side"],
           ["in the bottom left corner", "at the bottom", "in the bottom right corner"]]
SMALL = Lexicon()
TEMPLATES = ["list", "relation", "count", "background", "position", "compare", "superlative"]


def article(word: str) -> str:
    return "an" if word[0] in "aeio" else "a"


class Builder:
    """Concatenates text pieces and remembers the character span of each grounded phrase."""

    def __init__(self, opener: str = "") -> None:
        self.parts: list[str] = [opener]
        self.n = len(opener)
        self.opener = len(opener)
        self.spans: list[tuple[int, int, list[int]]] = []

    def add(self, text: str, ids: list[int] | None = None) -> "Builder":
        if ids is not None:
            self.spans.append((self.n, self.n + len(text), list(ids)))
        self.parts.append(text)
        self.n += len(text)
        return self

    def build(self) -> tuple[str, list[tuple[int, int, str, list[int]]]]:
        text = "".join(self.parts)
        if self.opener:  # "In this picture, there is ..."
            text = text[: self.opener] + text[self.opener: self.opener + 1].lower() + text[self.opener + 1:]
        text = text[:1].upper() + text[1:]  # same length, so spans stay valid
        return text, [(s, e, text[s:e], ids) for s, e, ids in self.spans]


def noun_phrase(scene: Scene, k: int, rng: np.random.Generator, det: str = "a", style: int | None = None,
                lex: Lexicon = SMALL) -> str:
    o = scene.objects[k]
    styles = ["{c} {s}", "{z} {c} {s}", "{c} {s}", "{z} {s}", "{c} {s}"]
    if o.texture != "plain":
        styles += ["{t} {c} {s}", "{z} {t} {c} {s}"]
    fmt = styles[rng.integers(len(styles))] if style is None else styles[style % len(styles)]
    words = lex.filler() + fmt.format(c=lex.color(o.color), s=lex.shape(o.shape), z=lex.size(o.size),
                                      t=lex.texture(o.texture))
    if det == "a":
        det = article(words)
    return f"{det} {words}" if det else words


def _list(scene, rng, b, lex):
    ids = list(rng.permutation(len(scene.objects)))
    b.add(lex.text(LIST_PREFIX[rng.integers(len(LIST_PREFIX))]))
    for n, k in enumerate(ids):
        if n:
            b.add(" and " if n == len(ids) - 1 else ", ")
        b.add(noun_phrase(scene, k, rng, lex=lex), [int(k)])
    b.add(".")
    return b


def _relation(scene, rng, b, rels, lex):
    if not rels:
        return None
    i, j, p = rels[rng.integers(len(rels))]
    phrase = PRED_PHRASES[p][rng.integers(len(PRED_PHRASES[p]))]
    if rng.integers(3) == 0:
        b.add(lex.text("There is ")).add(noun_phrase(scene, i, rng, lex=lex), [i]).add(f" {lex.text(phrase)} ")
        b.add(noun_phrase(scene, j, rng, lex=lex), [j])
    else:
        verb = "is" if phrase.startswith(("partly", "overlapping")) else VERBS[rng.integers(len(VERBS))]
        det = "the" if rng.integers(2) else "a"
        b.add(noun_phrase(scene, i, rng, det, lex=lex), [i]).add(f" {lex.text(verb)} {lex.text(phrase)} ")
        b.add(noun_phrase(scene, j, rng, lex=lex), [j])
    b.add(".")
    return b


def _count(scene, rng, b, lex):
    objs = scene.objects
    by_color = rng.integers(2) == 1
    key = (lambda o: o.color) if by_color else (lambda o: o.shape)
    groups: dict[str, list[int]] = {}
    for k, o in enumerate(objs):
        groups.setdefault(key(o), []).append(k)
    names = sorted(groups, key=lambda g: (-len(groups[g]), g))
    total = len(objs)
    if rng.integers(2):
        b.add(f"{NUMBERS[total] if total < len(NUMBERS) else total} {lex.text('shapes' if total != 1 else 'shape')}: ")
    for n, g in enumerate(names):
        if n:
            b.add(" and " if n == len(names) - 1 else ", ")
        c = len(groups[g])
        noun = (f"{lex.color(g)} {lex.text('shapes' if c > 1 else 'shape')}") if by_color else lex.shape(g, c > 1)
        num = (NUMBERS[c] if c < len(NUMBERS) else str(c)) if c > 1 else article(noun)
        b.add(f"{num} {noun}", groups[g])
    b.add(".")
    return b


def _background(scene, rng, b, lex):
    if scene.pattern == "plain":
        bg = [scene.background, f"plain {scene.background}"][rng.integers(2)]
    else:
        bg = [f"{scene.background} {scene.pattern}", f"{scene.pattern} {scene.background}"][rng.integers(2)]
    bg_np = f"{article(bg)} {bg} background"
    if len(scene.objects) == 1 or rng.integers(2):
        k = int(np.argmax([o.area for o in scene.objects]))
        b.add(noun_phrase(scene, k, rng, lex=lex), [k]).add(lex.text(" on ")).add(bg_np).add(".")
    else:
        n = len(scene.objects)
        b.add(f"{NUMBERS[n] if n < len(NUMBERS) else n} {lex.text('shapes')}", list(range(n)))
        b.add(lex.text(" on ")).add(bg_np).add(".")
    return b


def _position(scene, rng, b, lex):
    k = int(rng.integers(len(scene.objects)))
    cx, cy = scene.objects[k].center
    S = scene.size
    region = REGIONS[min(int(3 * cy / S), 2)][min(int(3 * cx / S), 2)]
    lead = ["", "There is "][rng.integers(2)]
    b.add(lex.text(lead)).add(noun_phrase(scene, k, rng, lex=lex), [k]).add(lex.text(f" {region} of the image."))
    return b


def _compare(scene, rng, b, lex):
    objs = scene.objects
    pairs = [(i, j) for i in range(len(objs)) for j in range(len(objs))
             if i != j and objs[i].area >= 1.8 * objs[j].area]
    if not pairs:
        return None
    i, j = pairs[rng.integers(len(pairs))]
    if rng.integers(2):
        word = ["bigger", "larger"][rng.integers(2)]
    else:
        i, j, word = j, i, "smaller"
    b.add(noun_phrase(scene, i, rng, "the", style=0, lex=lex), [i]).add(f" is {lex.text(word)} than ")
    b.add(noun_phrase(scene, j, rng, "the", style=0, lex=lex), [j]).add(".")
    return b


def _superlative(scene, rng, b, lex):
    areas = [o.area for o in scene.objects]
    if len(areas) < 2:
        return None
    order = np.argsort(areas)
    largest = rng.integers(2) == 1
    k, other = (order[-1], order[-2]) if largest else (order[0], order[1])
    # skip near ties: "largest" must be visibly true
    big, small = (areas[k], areas[other]) if largest else (areas[other], areas[k])
    if big < 1.3 * small:
        return None
    word = "largest" if largest else "smallest"
    b.add(f"The {lex.text(word)} {lex.text('shape')} is ").add(noun_phrase(scene, int(k), rng, lex=lex), [int(k)]).add(".")
    return b


def make_captions(scene: Scene, rels: list[tuple[int, int, str]], n: int, rng: np.random.Generator,
                  lex: Lexicon = SMALL):
    """n captions -> [(text, [(start, end, text, object indices)])]; ``lex`` words them (default: the
    small grammar; a ``large`` lexicon draws only from its own stream, so ``rng`` advances identically)."""
    if not scene.objects:
        bg = scene.background if scene.pattern == "plain" else f"{scene.pattern} {scene.background}"
        forms = [f"An empty {bg} background.", f"A {bg} background with no shapes.", f"Nothing but {article(bg)} {bg} background."]
        return [(forms[k % len(forms)], []) for k in range(n)]
    fns = {"list": _list, "relation": lambda s, r, b, x: _relation(s, r, b, rels, x), "count": _count,
           "background": _background, "position": _position, "compare": _compare, "superlative": _superlative}
    out = []
    order = list(rng.permutation(TEMPLATES))
    t = 0
    while len(out) < n:
        name = order[t % len(order)]
        t += 1
        b = fns[name](scene, rng, Builder(lex.opener()), lex)
        if b is not None:  # None: template not applicable (e.g. a relation with one object)
            out.append(b.build())
    return out


# -- hard negatives ----------------------------------------------------------------------------

def _desc(o) -> tuple[str, str]:
    return (o.color, o.shape)


def make_negatives(scene: Scene, rels: list[tuple[int, int, str]], rng: np.random.Generator) -> dict[str, tuple[str, str]]:
    """{"swap_att"|"swap_obj"|"replace_att"|"replace_obj"|"replace_rel": (caption, negative)}."""
    objs = scene.objects
    present = {_desc(o) for o in objs}
    counts = Counter(_desc(o) for o in objs)
    unique = [k for k, o in enumerate(objs) if counts[_desc(o)] == 1]

    def np_(c, s):
        return f"{article(c)} {c} {s}"

    def cap(text):
        return text[:1].upper() + text[1:]

    out: dict[str, tuple[str, str]] = {}
    uniq_rels = [(i, j, p) for i, j, p in rels if i in unique and j in unique and i < j]
    if uniq_rels:
        i, j, p = uniq_rels[rng.integers(len(uniq_rels))]
        a, c = objs[i], objs[j]
        phrase = PRED_PHRASES[p][0]
        pos = f"{np_(a.color, a.shape)} is {phrase} {np_(c.color, c.shape)}."
        out["swap_obj"] = (cap(pos), cap(f"{np_(c.color, c.shape)} is {phrase} {np_(a.color, a.shape)}."))
        out["replace_rel"] = (cap(pos), cap(f"{np_(a.color, a.shape)} is {PRED_PHRASES[INVERSE[p]][0]} {np_(c.color, c.shape)}."))
    pairs = [(i, j) for i in unique for j in unique
             if i < j and objs[i].color != objs[j].color and objs[i].shape != objs[j].shape
             and (objs[j].color, objs[i].shape) not in present and (objs[i].color, objs[j].shape) not in present]
    if pairs:
        i, j = pairs[rng.integers(len(pairs))]
        a, c = objs[i], objs[j]
        out["swap_att"] = (cap(f"{np_(a.color, a.shape)} and {np_(c.color, c.shape)}."),
                           cap(f"{np_(c.color, a.shape)} and {np_(a.color, c.shape)}."))
    if unique:
        k = unique[rng.integers(len(unique))]
        o = objs[k]
        bg = f"{article(scene.background)} {scene.background} background"
        colors = [c for c in COLOR_NAMES if (c, o.shape) not in present]
        shapes = [s for s in SHAPES if (o.color, s) not in present]
        if colors:
            c = colors[rng.integers(len(colors))]
            out["replace_att"] = (cap(f"{np_(o.color, o.shape)} on {bg}."), cap(f"{np_(c, o.shape)} on {bg}."))
        if shapes:
            s = shapes[rng.integers(len(shapes))]
            out["replace_obj"] = (cap(f"{np_(o.color, o.shape)} on {bg}."), cap(f"{np_(o.color, s)} on {bg}."))
    return out
