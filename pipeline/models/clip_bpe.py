"""CLIP's BPE tokenizer from open_clip's own (``open_clip.get_tokenizer``), with character offsets.

open_clip's ``SimpleTokenizer`` (openai/CLIP's) gives ids but no character spans, which phrase and
concept alignment need; :func:`fast_clip_tokenizer` hands its vocabulary (``encoder``) and merges
(``bpe_ranks``, in rank order) to ``CLIPTokenizerFast``, whose ids are tested identical to
open_clip's on the testbed captions and SugarCrepe-like text (tests/test_open_clip.py). Used by the
``open_clip:`` CLIP specs (pipeline/models/open_clip_adapter.py) and the text-groups job's tokenizer.
"""
from __future__ import annotations

import functools




@functools.lru_cache(maxsize=4)
def open_clip_tokenizer(arch: str = "ViT-B-16"):
    """``open_clip.get_tokenizer(arch)`` (offline: the built-in CLIP archs read the BPE file in the wheel)."""
    import open_clip

    return open_clip.get_tokenizer(arch)


@functools.lru_cache(maxsize=4)
def fast_clip_tokenizer(arch: str = "ViT-B-16"):
    """``CLIPTokenizerFast`` over the vocabulary and merges of ``open_clip.get_tokenizer(arch)``."""
    from transformers import CLIPTokenizerFast

    oc = open_clip_tokenizer(arch)
    if not hasattr(oc, "bpe_ranks"):
        raise ValueError(f"open_clip:{arch}: its tokenizer ({type(oc).__name__}) is not CLIP's BPE; "
                         "only CLIP-tokenizer archs are supported (ViT-B-16, ViT-L-14, ...)")
    merges = [m for m, _ in sorted(oc.bpe_ranks.items(), key=lambda kv: kv[1])]
    sot, eot = oc.decoder[oc.sot_token_id], oc.decoder[oc.eot_token_id]  # open_clip's names: <start_of_text>, ...
    return CLIPTokenizerFast(vocab=dict(oc.encoder), merges=merges, unk_token=eot, bos_token=sot, eos_token=eot,
                             pad_token=eot, model_max_length=oc.context_length)
