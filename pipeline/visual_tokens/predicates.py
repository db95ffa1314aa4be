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
``behind`` -> ``~in front of``, and ``left of`` / ``right of``: under ``psg56`` both become
``beside`` (PSG has no left/right; ``beside`` is the PSG class for side-by-side objects, so the
direction is lost there, which is also what a PSG-trained RAM would say). Mapping can make two
source relations the same triplet (``a above b`` and ``b below a`` both become ``a over b``);
duplicates are merged. A run that wants the synthetic predicates verbatim sets
``predicates: synthetic`` (or any list).

A map value may list alternatives separated by ``|``; the first whose predicate is in the
vocabulary is used (``"~left of|beside"``: ``left of`` with subject/object swapped where the
vocabulary has it, else ``beside``).

Directed relations on generated data (vocabulary ``psg56+left``). With ``beside`` a left/right
pair of the generated scenes is ranked 7 in both directions, so "A left of B" and "A right of B"
give the same rank matrix and ranks 6/5 never tell subject from object: the generated
relation-swap negatives on left/right would be undecidable on the visual-token side.
``psg56+left`` is PSG's 56 classes followed by ``left of`` (index 56, so PSG's indices do not
move); ``left of`` stays itself and ``right of`` becomes ``~left of`` (``a right of b`` -> ``b
left of a``), exactly as ``below`` -> ``~over``. Then every generated predicate (left/right,
above/below, in front of/behind) is stored as one directed triplet per pair and the rank matrix
holds 7 only from subject to object. The stage's default ``predicates: auto`` resolves to
``psg56+left`` for the generated dataset (``dataset.kind: synthetic``) and to ``psg56`` for every
real dataset (the PSG mapping, which a PSG-trained RAM reproduces, is kept there).
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

# PSG's 56 classes + a directed left/right class for the generated dataset (see the module docstring)
PSG_LEFT_PREDICATES = PSG_PREDICATES + ["left of"]

VOCABULARIES = {"psg56": PSG_PREDICATES, "psg56+left": PSG_LEFT_PREDICATES, "synthetic": SYNTHETIC_PREDICATES}


def default_vocabulary(dataset_kind: str) -> str:
    """``predicates: auto``: the directed ``psg56+left`` for generated data, ``psg56`` otherwise."""
    return "psg56+left" if dataset_kind == "synthetic" else "psg56"

DEFAULT_PREDICATE_MAP = {
    "above": "over",
    "below": "~over",
    "under": "~over",
    "behind": "~in front of",
    "left of": "left of|beside",
    "right of": "~left of|beside",
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
        for src, dsts in (predicate_map or {}).items():
            for dst in dsts.split("|"):  # alternatives: the first one present in the vocabulary wins
                dst = dst.strip()
                rev = dst.startswith("~")
                name = dst[1:].strip().lower() if rev else dst.lower()
                if name in self.index:  # map entries into predicates absent from this vocabulary are inert
                    self.map[src.strip().lower()] = (self.index[name], rev)
                    break

    def __call__(self, predicate: str) -> tuple[int, bool] | None:
        """(vocabulary index, swap subject/object) or None when it cannot be mapped."""
        p = predicate.strip().lower()
        if p in self.index:
            return self.index[p], False
        return self.map.get(p)
