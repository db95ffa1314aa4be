"""CLIP's BPE tokenizer (49,408 ids, SOT 49406, EOT 49407): open_clip's own, with character offsets.

The vocabulary and merges are those of ``open_clip.get_tokenizer("ViT-B-16")`` (CLIP's
``SimpleTokenizer``), handed to ``CLIPTokenizerFast`` for the offsets phrase discovery needs
(:func:`pipeline.models.clip_bpe.fast_clip_tokenizer`; its ids equal open_clip's on the testbed
captions and SugarCrepe's text, tests/test_text_groups.py).

A ``models.groupvit`` folder (a real GroupViT) brings its own tokenizer; :func:`load_tokenizer`
takes it from there when the folder has tokenizer files.

:func:`encode` turns texts into padded id arrays of at most ``max_len`` = 77 tokens (SOT ... EOT;
longer captions are truncated, keeping EOT last, and counted) with the character offsets of every
token, which phrase discovery uses to map gold character spans onto tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SOT, EOT, VOCAB_SIZE, MAX_LEN = 49406, 49407, 49408, 77
OPEN_CLIP_ARCH = "ViT-B-16"  # any CLIP-tokenizer arch: they share one BPE


@functools.lru_cache(maxsize=4)
def load_tokenizer(groupvit_spec: str | None = None):
    """CLIP's tokenizer: from a ``models.groupvit`` folder holding tokenizer files, else open_clip's
    (:func:`pipeline.models.clip_bpe.fast_clip_tokenizer`). Returns ``(tokenizer, record)``; ``record``
    goes into checkpoints."""
    from transformers import CLIPTokenizerFast

    if groupvit_spec and Path(groupvit_spec).is_dir() and (
        (Path(groupvit_spec) / "tokenizer.json").exists() or (Path(groupvit_spec) / "vocab.json").exists()
    ):
        from pipeline.models.hf_folder import load_tokenizer as load_checked

        tok = load_checked(groupvit_spec, VOCAB_SIZE, CLIPTokenizerFast)  # LFS pointers, size: one line
        source = f"models.groupvit folder {groupvit_spec}"
    else:
        from pipeline.models.clip_bpe import fast_clip_tokenizer

        tok = fast_clip_tokenizer(OPEN_CLIP_ARCH)
        source = f"open_clip.get_tokenizer({OPEN_CLIP_ARCH!r}) (open_clip_torch)"
    sot, eot = tok.bos_token_id, tok.eos_token_id
    if (sot, eot, len(tok)) != (SOT, EOT, VOCAB_SIZE):
        raise RuntimeError(f"tokenizer ({source}) is not CLIP's: SOT {sot}, EOT {eot}, {len(tok)} ids "
                           f"(expected {SOT}, {EOT}, {VOCAB_SIZE})")
    return tok, {"kind": "clip-bpe", "source": source, "vocab_size": VOCAB_SIZE, "sot": SOT, "eot": EOT, "max_len": MAX_LEN}


@dataclass
class Encoded:
    """Padded token ids of a list of texts. ``ids`` int64 [T, L] (SOT, tokens, EOT, zeros), ``lengths``
    [T] (0 for an empty text: nothing but SOT/EOT after tokenisation), ``offsets`` per text: int
    [n_i, 2] character spans of its word tokens (SOT/EOT excluded), ``truncated`` the texts cut to fit."""

    ids: np.ndarray
    lengths: np.ndarray
    offsets: list[np.ndarray] = field(default_factory=list)
    truncated: int = 0
    empty: int = 0


def encode(tok, texts: list[str], max_len: int = MAX_LEN) -> Encoded:
    """SOT + BPE tokens + EOT, at most ``max_len`` ids (truncated keeping EOT last; counted).
    A text with no BPE token (empty or whitespace) gets length 0 and is counted in ``empty``."""
    texts = [t if isinstance(t, str) else "" for t in texts]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else {"input_ids": [], "offset_mapping": []}
    T = len(texts)
    ids = np.zeros((T, max_len), np.int64)
    lengths = np.zeros(T, np.int64)
    offsets, trunc, empty = [], 0, 0
    room = max_len - 2
    for i, (x, off) in enumerate(zip(enc["input_ids"], enc["offset_mapping"])):
        if not x:
            empty += 1
            offsets.append(np.zeros((0, 2), np.int64))
            continue
        if len(x) > room:
            trunc += 1
            x, off = x[:room], off[:room]
        n = len(x) + 2
        ids[i, 0], ids[i, 1 : n - 1], ids[i, n - 1] = SOT, x, EOT
        lengths[i] = n
        offsets.append(np.asarray(off, np.int64).reshape(-1, 2))
    return Encoded(ids, lengths, offsets, trunc, empty)


def char_span_to_tokens(offsets: np.ndarray, start: int, end: int) -> tuple[int, int] | None:
    """Word-token index range [a, b) (0-based over the BPE tokens, SOT excluded) of the tokens that
    overlap the character span [start, end); None when no kept token overlaps it (the span lies
    past a truncation, or is empty/outside the text)."""
    if end <= start or len(offsets) == 0:
        return None
    hit = np.nonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))[0]
    if len(hit) == 0:
        return None
    return int(hit[0]), int(hit[-1]) + 1
