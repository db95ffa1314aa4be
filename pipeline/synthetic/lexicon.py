"""Surface words of the generated captions: ``dataset.synthetic.vocabulary``.

``small`` (the default) is the original templated grammar: one word per colour, shape, size and
texture (~40 content words in all), so every other calibration of the generated dataset is unchanged.

``large`` (issue 27, cause 2: captions with real entropy) keeps the scenes, the caption templates,
the gold phrase spans and the hard negatives exactly as ``small`` draws them, and only re-words the
captions from a separate random stream (``[seed, image, 0x1E71C]``), so a caption's words are not
predictable from a word class:

* several single-word synonyms per colour, shape (with plurals), size and texture
  ("crimson" / "scarlet" for red, "disc" / "orb" for circle, "tiny" for small, "spotted" for dotted);
* an optional concept-free adjective inside a noun phrase ("a glossy crimson disc");
* paraphrases of the connecting text: relation phrases, verbs, list prefixes, regions, comparatives,
  counting nouns ("figures", "objects"), and an optional sentence opener ("In this picture, ...").

Every synonym names exactly one concept and none is a word of the ``small`` grammar (tested), so
:data:`CONCEPT_OF` maps a surface word back to its canonical word; the scene oracle
(:mod:`pipeline.models.scene_oracle`) reads words through it, so its features stay right. The
benchmark files (SugarCrepe, ARO, ...) keep the canonical words.
"""

from __future__ import annotations

import numpy as np

from pipeline.synthetic.scene import PLURALS

VOCABULARIES = ("small", "large")

# the canonical word first; single words only (the oracle reads whitespace-separated words)
COLOR_SYNONYMS = {
    "red": ["red", "crimson", "scarlet", "ruby", "cherry"],
    "green": ["green", "emerald", "jade", "grassy", "verdant"],
    "blue": ["blue", "azure", "cobalt", "sapphire", "navy"],
    "yellow": ["yellow", "golden", "lemon", "canary", "mustard"],
    "orange": ["orange", "tangerine", "amber", "apricot", "pumpkin"],
    "purple": ["purple", "violet", "plum", "grape", "indigo"],
    "pink": ["pink", "rose", "salmon", "fuchsia", "blush"],
    "brown": ["brown", "chocolate", "chestnut", "coffee", "mocha"],
    "black": ["black", "ebony", "jet", "inky", "coal"],
    "white": ["white", "ivory", "snowy", "pearl", "milky"],
    "gray": ["gray", "grey", "silver", "slate", "ash"],
    "cyan": ["cyan", "teal", "turquoise", "aqua", "aquamarine"],
}
# (singular, plural)
SHAPE_SYNONYMS = {
    "circle": [("circle", "circles"), ("disc", "discs"), ("disk", "disks"), ("orb", "orbs"), ("roundel", "roundels")],
    "square": [("square", "squares"), ("box", "boxes"), ("tile", "tiles"), ("block", "blocks")],
    "triangle": [("triangle", "triangles"), ("wedge", "wedges"), ("trigon", "trigons"), ("pyramid", "pyramids")],
    "diamond": [("diamond", "diamonds"), ("rhombus", "rhombuses"), ("lozenge", "lozenges"), ("kite", "kites")],
    "star": [("star", "stars"), ("starburst", "starbursts"), ("sparkle", "sparkles"), ("asterism", "asterisms")],
    "hexagon": [("hexagon", "hexagons"), ("hex", "hexes"), ("honeycomb", "honeycombs"), ("nut", "nuts")],
    "pentagon": [("pentagon", "pentagons"), ("shield", "shields"), ("badge", "badges"), ("plaque", "plaques")],
    "cross": [("cross", "crosses"), ("plus", "pluses"), ("crosslet", "crosslets"), ("intersection", "intersections")],
    "ring": [("ring", "rings"), ("hoop", "hoops"), ("loop", "loops"), ("donut", "donuts"), ("annulus", "annuli")],
    "ellipse": [("ellipse", "ellipses"), ("oval", "ovals"), ("egg", "eggs"), ("ovoid", "ovoids")],
}
SIZE_SYNONYMS = {
    "small": ["small", "tiny", "little", "petite", "miniature"],
    "medium": ["medium", "midsize", "moderate", "average", "middling"],
    "large": ["large", "big", "huge", "giant", "sizable"],
}
TEXTURE_SYNONYMS = {
    "striped": ["striped", "stripy", "banded", "lined", "pinstriped"],
    "dotted": ["dotted", "spotted", "speckled", "dappled", "freckled"],
}
# adjectives that name no concept (any shape may be called so): drawn for 1 noun phrase in 3
FILLERS = ["solid", "flat", "neat", "simple", "bright", "shiny", "glossy", "matte", "crisp", "bold", "clean",
           "smooth", "vivid", "sharp", "lone"]
# whole connector phrases of the small grammar -> their paraphrases (the canonical phrase stays one of them)
PHRASES = {
    "to the left of": ["to the left of", "leftward of", "just left of", "on the left of", "left of"],
    "left of": ["left of", "to the left of", "west of", "at the left of"],
    "on the left side of": ["on the left side of", "on the left hand side of", "beside and left of"],
    "to the right of": ["to the right of", "rightward of", "just right of", "on the right of", "right of"],
    "right of": ["right of", "to the right of", "east of", "at the right of"],
    "on the right side of": ["on the right side of", "on the right hand side of", "beside and right of"],
    "above": ["above", "atop", "up from", "further up than"],
    "over": ["over", "higher up than", "located above"],
    "higher than": ["higher than", "positioned above", "placed above"],
    "below": ["below", "underneath", "down from", "further down than"],
    "under": ["under", "lower down than", "located below"],
    "beneath": ["beneath", "positioned below", "placed below"],
    "lower than": ["lower than", "sitting under", "under"],
    "in front of": ["in front of", "before", "ahead of", "on top of"],
    "partly covering": ["partly covering", "overlapping", "partially covering", "covering part of"],
    "overlapping and in front of": ["overlapping and in front of", "laid over", "stacked over"],
    "behind": ["behind", "in back of", "back of", "underlying"],
    "partly hidden behind": ["partly hidden behind", "partially hidden behind", "half hidden behind"],
    "partly covered by": ["partly covered by", "partially covered by", "overlapped by", "obscured by"],
    "is": ["is", "is"],
    "sits": ["sits", "rests", "lies", "stands"],
    "appears": ["appears", "can be seen", "is visible", "shows up"],
    "is placed": ["is placed", "is located", "is positioned", "is found"],
    "is drawn": ["is drawn", "is painted", "is rendered", "is sketched"],
    "There is": ["There is", "There's", "You can see", "One can spot", "We see"],
    "A picture of": ["A picture of", "A photo of", "A snapshot of", "A render of"],
    "An image of": ["An image of", "An illustration of", "A graphic of"],
    "A drawing of": ["A drawing of", "A sketch of", "A painting of", "A diagram of"],
    "A scene with": ["A scene with", "A canvas with", "A composition with", "A layout with"],
    "This image shows": ["This image shows", "This picture contains", "Here we have", "The frame holds"],
    "Shapes:": ["Shapes:", "Objects:", "Figures:", "Contents:", "Items:"],
    "shape": ["shape", "figure", "form", "object", "item"],
    "shapes": ["shapes", "figures", "forms", "objects", "items"],
    "bigger": ["bigger", "larger", "greater", "chunkier"],
    "larger": ["larger", "bigger", "roomier", "wider"],
    "smaller": ["smaller", "tinier", "littler", "slimmer"],
    "largest": ["largest", "biggest", "greatest", "widest"],
    "smallest": ["smallest", "tiniest", "littlest", "slimmest"],
    "top": ["top", "upper", "topmost"],
    "bottom": ["bottom", "lower", "lowest"],
    "corner": ["corner", "area", "quadrant", "region"],
    "center": ["center", "middle", "centre", "midst"],
    "side": ["side", "half", "part", "edge"],
    "image": ["image", "picture", "frame", "scene", "canvas"],
    "on": ["on", "against", "over", "upon"],
}
OPENERS = ["", "", "", "In this picture, ", "Here, ", "We can see that ", "In the image, ", "Apparently, ",
           "At a glance, ", "Clearly, ", "Notice that ", "Look: "]

CONCEPT_OF: dict[str, str] = {}
for _table in (COLOR_SYNONYMS, SIZE_SYNONYMS, TEXTURE_SYNONYMS):
    for _c, _ws in _table.items():
        CONCEPT_OF.update({w: _c for w in _ws})
for _c, _ws in SHAPE_SYNONYMS.items():
    CONCEPT_OF.update({w: _c for pair in _ws for w in pair})
CONCEPT_OF.update({p: _c for _c, _ws in SHAPE_SYNONYMS.items() for s, p in _ws[:1]})  # canonical plurals


def concept(word: str) -> str:
    """The canonical word of a surface word (itself when it is no synonym)."""
    return CONCEPT_OF.get(word, word)


class Lexicon:
    """Renders canonical words: identity for ``small`` (``rng`` None, no draws), synonyms for ``large``."""

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = rng

    @property
    def large(self) -> bool:
        return self.rng is not None

    def _pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def color(self, c: str) -> str:
        return self._pick(COLOR_SYNONYMS[c]) if self.large and c in COLOR_SYNONYMS else c

    def shape(self, s: str, plural: bool = False) -> str:
        if self.large and s in SHAPE_SYNONYMS:
            return self._pick(SHAPE_SYNONYMS[s])[int(plural)]
        return PLURALS[s] if plural else s

    def size(self, z: str) -> str:
        return self._pick(SIZE_SYNONYMS[z]) if self.large and z in SIZE_SYNONYMS else z

    def texture(self, t: str) -> str:
        return self._pick(TEXTURE_SYNONYMS[t]) if self.large and t in TEXTURE_SYNONYMS else t

    def filler(self) -> str:
        """A concept-free adjective plus a space, for one noun phrase in three (``large`` only)."""
        if not self.large or self.rng.integers(3):
            return ""
        return self._pick(FILLERS) + " "

    def text(self, s: str) -> str:
        """Connector text: a whole known phrase is paraphrased, else each known word; spacing kept."""
        if not self.large or not s.strip():
            return s
        core = s.strip()
        lead, trail = s[: len(s) - len(s.lstrip())], s[len(s.rstrip()):]
        if core in PHRASES:
            return lead + self._pick(PHRASES[core]) + trail
        return lead + " ".join(self._word(w) for w in core.split(" ")) + trail

    def _word(self, w: str) -> str:
        bare = w.rstrip(".,:;")
        return self._pick(PHRASES[bare]) + w[len(bare):] if bare in PHRASES else w

    def opener(self) -> str:
        return self._pick(OPENERS) if self.large else ""
