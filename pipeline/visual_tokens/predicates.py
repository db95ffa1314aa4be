"""Predicate vocabulary of the intangible tokens and how other datasets' predicates map into it.

Default vocabulary: the 56 predicate classes of Panoptic Scene Graph Generation (PSG; Yang et
al., ECCV 2022), on which the Relate-Anything Model (RAM) used by Kalibhat et al. is trained.
Source: OpenPSG's ``psg_categories`` / RelateAnything ``utils.py`` ``relation_classes``, same order
(the order fixes each predicate's index in triplets' scores and checkpoints).

Mapping other predicates (``predicate_map`` in the stage config). A dataset's predicate string is
lower-cased and stripped, then:

1. kept as is when it is in the vocabulary;
2. else looked up in the map; a value ``"p"`` renames it to vocabulary predicate ``p``, a value
   ``"~p"`` renames it to ``p`` *with subject and object swapped* (``a below b`` -> ``b over a``);
3. else it is dropped and counted (stat ``unmapped_predicates``).

The default map covers the generated (synthetic) dataset's six spatial predicates, none of which
PSG has verbatim: ``above`` -> ``over``, ``below`` -> ``~over``, ``in front of`` (kept),
``behind`` -> ``~in front of``, and ``left of`` / ``right of`` -> ``beside`` (PSG has no
left/right; ``beside`` is the PSG class for side-by-side objects, so the direction is lost there,
which is also what a PSG-trained RAM would say). Mapping can make two source relations the same
triplet (``a above b`` and ``b below a`` both become ``a over b``); duplicates are merged.
A run that wants the synthetic predicates verbatim sets ``predicates: synthetic`` (or any list).
"""

from __future__ import annotations

PSG_PREDICATES = [
    "over", "in front of", "beside", "on", "in", "attached to", "hanging from", "on back of",
    "falling off", "going down", "painted on", "walking on", "running on", "crossing", "standing on",
    "lying on", "sitting on", "flying over", "jumping over", "jumping from", "wearing", "holding",
    "carrying", "looking at", "guiding", "kissing", "eating", "drinking", "feeding", "biting",
    "catching", "picking", "playing with", "chasing", "climbing", "cleaning", "playing", "touching",
    "pushing", "pulling", "opening", "cooking", "talking to", "throwing", "slicing", "driving",
    "riding", "parked on", "driving on", "about to hit", "kicking", "swinging", "entering", "exiting",
    "enclosing", "leaning on",
]  # fmt: skip
assert len(PSG_PREDICATES) == 56

SYNTHETIC_PREDICATES = ["left of", "right of", "above", "below", "in front of", "behind"]

VOCABULARIES = {"psg56": PSG_PREDICATES, "synthetic": SYNTHETIC_PREDICATES}

DEFAULT_PREDICATE_MAP = {
    "above": "over",
    "below": "~over",
    "under": "~over",
    "behind": "~in front of",
    "left of": "beside",
    "right of": "beside",
    "next to": "beside",
    "near": "beside",
    "on top of": "on",
    "inside": "in",
    "contains": "enclosing",
}


def resolve_vocabulary(spec: str | list[str]) -> list[str]:
    if isinstance(spec, str):
        if spec not in VOCABULARIES:
            raise ValueError(f"unknown predicate vocabulary {spec!r}; known: {sorted(VOCABULARIES)} or a list")
        return list(VOCABULARIES[spec])
    names = [p.strip().lower() for p in spec]
    if len(set(names)) != len(names) or not names:
        raise ValueError("predicate vocabulary must be a non-empty list of distinct names")
    return names


class PredicateMapper:
    def __init__(self, vocabulary: list[str], predicate_map: dict[str, str] | None = None):
        self.vocabulary = list(vocabulary)
        self.index = {p: i for i, p in enumerate(self.vocabulary)}
        self.map: dict[str, tuple[int, bool]] = {}
        for src, dst in (predicate_map or {}).items():
            rev = dst.startswith("~")
            name = dst[1:].strip().lower() if rev else dst.strip().lower()
            if name in self.index:  # map entries into predicates absent from this vocabulary are inert
                self.map[src.strip().lower()] = (self.index[name], rev)

    def __call__(self, predicate: str) -> tuple[int, bool] | None:
        """(vocabulary index, swap subject/object) or None when it cannot be mapped."""
        p = predicate.strip().lower()
        if p in self.index:
            return self.index[p], False
        return self.map.get(p)
