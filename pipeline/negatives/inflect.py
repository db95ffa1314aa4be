"""Singular/plural variants of an English noun, to exclude a noun's own inflections as negatives.

Rule-based on purpose (no extra dependency): regular suffix rules plus the common irregular
nouns of image captions. Over-generation is harmless here (a non-word matches no vocabulary
entry); what matters is that "dog" excludes "dogs", "man" excludes "men", "bus" excludes "buses".
"""

from __future__ import annotations

IRREGULAR = {
    "man": "men", "woman": "women", "child": "children", "person": "people", "foot": "feet",
    "tooth": "teeth", "goose": "geese", "mouse": "mice", "ox": "oxen", "louse": "lice",
    "die": "dice", "sheep": "sheep", "deer": "deer", "fish": "fish", "moose": "moose",
    "cactus": "cacti", "fungus": "fungi", "wolf": "wolves", "knife": "knives", "leaf": "leaves",
    "calf": "calves", "half": "halves", "shelf": "shelves", "loaf": "loaves", "life": "lives",
    "wife": "wives", "thief": "thieves", "scarf": "scarves", "elf": "elves", "tomato": "tomatoes",
    "potato": "potatoes", "hero": "heroes", "policeman": "policemen", "fireman": "firemen",
    "businessman": "businessmen", "gentleman": "gentlemen", "fisherman": "fishermen",
}
_SINGULAR = {v: k for k, v in IRREGULAR.items()}
_VOWELS = set("aeiou")


def plurals(w: str) -> set[str]:
    out = {w + "s"}
    if w in IRREGULAR:
        out.add(IRREGULAR[w])
    if w.endswith(("s", "x", "z", "ch", "sh", "o")):
        out.add(w + "es")
    if len(w) > 1 and w.endswith("y") and w[-2] not in _VOWELS:
        out.add(w[:-1] + "ies")
    if w.endswith("f"):
        out.add(w[:-1] + "ves")
    if w.endswith("fe"):
        out.add(w[:-2] + "ves")
    return out


def singulars(w: str) -> set[str]:
    out = set()
    if w in _SINGULAR:
        out.add(_SINGULAR[w])
    if w.endswith("ies") and len(w) > 3:
        out.add(w[:-3] + "y")
    if w.endswith("ves") and len(w) > 3:
        out.update({w[:-3] + "f", w[:-3] + "fe"})
    if w.endswith("es") and len(w) > 2:
        out.add(w[:-2])
    if w.endswith("s") and not w.endswith("ss") and len(w) > 1:
        out.add(w[:-1])
    return out


def inflections(surface: str, lemma: str | None = None) -> set[str]:
    """The lower-cased surface form, its lemma, and their singular/plural variants."""
    base = {surface.lower()} | ({lemma.lower()} if lemma else set())
    out = set(base)
    for w in base:
        out |= plurals(w) | singulars(w)
    return {w for w in out if w}
