"""CLIP's BPE tokenizer (49,408 ids, SOT 49406, EOT 49407), built offline.

The ``open_clip_torch`` wheel ships CLIP's merge list ``bpe_simple_vocab_16e6.txt.gz``. CLIP's
vocabulary is a pure function of it (``SimpleTokenizer`` in openai/CLIP): the 256 byte symbols,
the same with the end-of-word marker ``</w>``, one entry per merge (the first 48,894 merges) and
the two special tokens. We rebuild both in memory and hand them to ``CLIPTokenizerFast`` (the same normalisation and pre-tokenisation as
``openai/clip-vit-base-patch32``'s tokenizer; ids checked in tests/test_text_groups.py). The
package is located with ``importlib.util.find_spec`` so open_clip (and its torch/timm imports) is
never imported.

A ``models.groupvit`` folder (a real GroupViT) brings its own tokenizer; :func:`load_tokenizer`
takes it from there when the folder has tokenizer files.

:func:`encode` turns texts into padded id arrays of at most ``max_len`` = 77 tokens (SOT ... EOT;
longer captions are truncated, keeping EOT last, and counted) with the character offsets of every
token, which phrase discovery uses to map gold character spans onto tokens.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SOT, EOT, VOCAB_SIZE, MAX_LEN = 49406, 49407, 49408, 77
N_MERGES = 49152 - 256 - 2  # CLIP keeps the first 48,894 merges of the file


def bpe_vocab_path() -> Path:
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the text-groups tokenizer needs CLIP's BPE merges from the open_clip_torch package "
                           "(pip install open_clip_torch==3.3.0), or a models.groupvit folder with tokenizer files")
    p = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"
    if not p.exists():
        raise RuntimeError(f"{p} is missing from the open_clip_torch installation")
    return p


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary and merges, rebuilt from the open_clip merge file as CLIP's SimpleTokenizer does."""
    src = bpe_vocab_path()
    lines = gzip.decompress(src.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : N_MERGES + 1]]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    if len(vocab) != VOCAB_SIZE:
        raise RuntimeError(f"{src}: built {len(vocab)} vocabulary entries, CLIP has {VOCAB_SIZE}")
    return {v: i for i, v in enumerate(vocab)}, merges


@functools.lru_cache(maxsize=4)
def load_tokenizer(groupvit_spec: str | None = None):
    """CLIP's tokenizer: from a ``models.groupvit`` folder holding tokenizer files, else built from
    the open_clip merges. Returns ``(tokenizer, record)``; ``record`` goes into checkpoints."""
    from transformers import CLIPTokenizerFast

    if groupvit_spec and Path(groupvit_spec).is_dir() and (
        (Path(groupvit_spec) / "tokenizer.json").exists() or (Path(groupvit_spec) / "vocab.json").exists()
    ):
        tok = CLIPTokenizerFast.from_pretrained(groupvit_spec)
        source = f"models.groupvit folder {groupvit_spec}"
    else:
        vocab, merges = clip_vocab_and_merges()
        tok = CLIPTokenizerFast(vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>")
        source = f"CLIP BPE built from {bpe_vocab_path().name} (open_clip_torch)"
    sot, eot = tok.convert_tokens_to_ids("<|startoftext|>"), tok.convert_tokens_to_ids("<|endoftext|>")
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
