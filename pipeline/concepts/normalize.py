"""Caption normalisation and tokenisation for C3 concept mining.

The C3 paper (Song et al. 2024, Sec. 3.2) mines *word* n-grams but does not say how captions are
normalised.  We choose, and make configurable:

* Unicode normalisation ``NFKC`` (folds full-width forms, ligatures, curly quotes stay distinct);
* lower-casing (``"A Man"`` and ``"a man"`` are the same concept);
* tokens are maximal runs of letters/digits, optionally joined by an ASCII apostrophe
  (``"man's"`` is one token); every other character (punctuation, hyphens, underscores,
  whitespace) separates tokens, so ``"black-and-white"`` gives ``black and white``.
  This matches the COCO-style captions of Table 4, where punctuation is not part of a concept.

The vectorised path (polars, Rust ``regex``) and the plain-Python reference path (``re``) use the
same pattern; tests check that they agree on real captions.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_TOKEN_PATTERN = r"[^\W_]+(?:'[^\W_]+)*"

# NLTK's English stopword list (179 words, closed-class function words).  Chosen over spaCy's
# 326-word list because spaCy's also contains content-bearing caption words ("top", "front",
# "two", "several", "empty", "side" ...) which are legitimate visual concepts.
NLTK_ENGLISH_STOPWORDS = frozenset(
    """i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
    yourselves he him his himself she she's her hers herself it it's its itself they them their
    theirs themselves what which who whom this that that'll these those am is are was were be been
    being have has had having do does did doing a an the and but if or because as until while of
    at by for with about against between into through during before after above below to from up
    down in out on off over under again further then once here there when where why how all any
    both each few more most other some such no nor not only own same so than too very s t can will
    just don don't should should've now d ll m o re ve y ain aren aren't couldn couldn't didn
    didn't doesn doesn't hadn hadn't hasn hasn't haven haven't isn isn't ma mightn mightn't mustn
    mustn't needn needn't shan shan't shouldn shouldn't wasn wasn't weren weren't won won't wouldn
    wouldn't""".split()
)


def stopword_set(spec: str | Sequence[str] | None) -> frozenset[str]:
    """``"nltk"`` (default), ``"spacy"`` (spaCy's English list), ``"none"``/None, or a word list.
    Lower-case words; tokens are compared lower-cased (so ``lowercase=False`` still finds "The")."""
    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return frozenset()
    if isinstance(spec, str):
        if spec.lower() == "nltk":
            return NLTK_ENGLISH_STOPWORDS
        if spec.lower() == "spacy":
            from spacy.lang.en.stop_words import STOP_WORDS

            return frozenset(w.lower() for w in STOP_WORDS)
        raise ValueError(f"stopwords: expected 'nltk', 'spacy', 'none' or a list of words, got {spec!r}")
    return frozenset(str(w).lower() for w in spec)


@dataclass(frozen=True)
class Normalizer:
    lowercase: bool = True
    unicode_form: str | None = "NFKC"  # None | NFC | NFKC | NFD | NFKD
    token_pattern: str = DEFAULT_TOKEN_PATTERN

    # ---- plain Python (reference) -------------------------------------------------------
    def tokens(self, text: str | None) -> list[str]:
        if text is None:
            return []
        if self.unicode_form:
            text = unicodedata.normalize(self.unicode_form, text)
        if self.lowercase:
            text = text.lower()
        return re.findall(self.token_pattern, text)

    # ---- vectorised ---------------------------------------------------------------------
    def token_lists(self, texts: pl.Series) -> pl.Series:
        s = texts.cast(pl.String)
        if self.unicode_form:
            # ASCII text is invariant under every Unicode normal form: normalise only the others
            non_ascii = s.str.contains(r"[^\x00-\x7F]")
            if non_ascii.any():
                s = pl.select(pl.when(pl.lit(non_ascii)).then(pl.lit(s).str.normalize(self.unicode_form))
                              .otherwise(pl.lit(s))).to_series().alias(texts.name)
        if self.lowercase:
            s = s.str.to_lowercase()
        return s.str.extract_all(self.token_pattern)


@dataclass
class Tokenized:
    """Flat token ids of all captions, in caption order.

    ``tokens[cap_off[c]:cap_off[c+1]]`` are caption c's token ids; ids are ranks of the word in the
    sorted (code-point order) vocabulary ``words`` so that id order equals string order and ids do
    not depend on chunking.
    """

    tokens: np.ndarray  # int32 [L]
    cap_len: np.ndarray  # int32 [n_captions]
    words: list[str]  # id -> word


@dataclass
class _VocabBuilder:
    index: dict = field(default_factory=dict)
    words: list = field(default_factory=list)

    def map(self, dictionary: Iterable[str]) -> np.ndarray:
        idx, words = self.index, self.words
        out = np.empty(len(dictionary), dtype=np.int64)  # type: ignore[arg-type]
        for i, w in enumerate(dictionary):  # once per distinct word per chunk, not per token
            j = idx.get(w)
            if j is None:
                j = idx[w] = len(words)
                words.append(w)
            out[i] = j
        return out


def tokenize(texts: pl.Series | Sequence[str], normalizer: Normalizer, chunk_size: int = 500_000) -> Tokenized:
    """Tokenise captions chunk by chunk (bounded string memory) into global int32 token ids."""
    if not isinstance(texts, pl.Series):
        texts = pl.Series("text", list(texts), dtype=pl.String)
    vb = _VocabBuilder()
    tok_parts, len_parts = [], []
    for start in range(0, len(texts), chunk_size):
        lists = normalizer.token_lists(texts.slice(start, chunk_size))
        lens = lists.list.len().fill_null(0).to_numpy().astype(np.int32)
        words = lists.explode().drop_nulls()
        assert len(words) == int(lens.sum())
        enc = pc.dictionary_encode(words.to_arrow())
        if isinstance(enc, pa.ChunkedArray):
            enc = enc.combine_chunks()
        local = vb.map(enc.dictionary.to_pylist())
        tok_parts.append(local[enc.indices.to_numpy(zero_copy_only=False)].astype(np.int32))
        len_parts.append(lens)
    V = len(vb.words)
    if V >= 2**31:
        raise ValueError("vocabulary too large for int32 token ids")
    order = sorted(range(V), key=vb.words.__getitem__)
    rank = np.empty(V, dtype=np.int32)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(V, dtype=np.int32)
    tokens = rank[np.concatenate(tok_parts)] if tok_parts else np.zeros(0, np.int32)
    cap_len = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int32)
    return Tokenized(tokens=tokens.astype(np.int32, copy=False), cap_len=cap_len,
                     words=[vb.words[i] for i in order])
