"""Frozen CLIP text encodings of the C3 concept vocabulary and the concepts' full membership.

The C3 trainer (``train run c3``, :mod:`train.jobs.c3`) fuses concept tokens with image tokens; it
never loads a text encoder, so the concept texts are encoded once here, with the same CLIP
(``models.clip``) that wrote ``clip_tokens`` (the trainer checks the weights hash).

* :func:`encode_concepts`: CLIP text tower over the concept texts (``pipeline.models.clip``,
  the same activations as ``extract-clip-tokens``): token states [M, d_t] (last hidden state after
  the final LayerNorm; valid tokens are a prefix BOS .. EOS, so a count ``n_tokens`` is the mask)
  and the EOS-pooled projected embedding [P], both float16. ``pooled_only`` keeps only the latter:
  at ViT-B a concept costs M x 512 x 2 B of tokens (16 KiB at M = 16) against 1 KiB pooled.
* :func:`membership`: which samples' captions contain each concept (as a contiguous word sequence
  of one caption, after the miner's normalisation, :mod:`pipeline.concepts.normalize`). The
  ``concepts`` table keeps at most K1 partners and K2 concepts per sample, and the coverage rule
  drops concepts inside longer ones, so it cannot tell that an image does *not* contain a concept;
  MCP's negatives need exactly that (a type-1 image whose text does not contain C, a type-2
  concept neither image contains).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from pipeline.concepts.normalize import Normalizer


def membership(caption_sample_ids: Sequence[int] | np.ndarray, texts: Sequence[str] | pl.Series,
               vocab_ids: np.ndarray, vocab_texts: Sequence[str], normalizer: Normalizer,
               n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(concept_id int64 [R], sample_id int64 [R]) for every (concept, sample) where one of the
    sample's captions contains the concept; sorted by (concept_id, sample_id), no duplicates.

    Vectorised (polars): every caption's word n-grams for n <= ``n_max`` (within a caption, never
    across two) joined to the vocabulary texts (normalised words joined by single spaces, as
    ``vocab.text`` is written)."""
    texts = texts if isinstance(texts, pl.Series) else pl.Series("text", list(texts), dtype=pl.String)
    caps = pl.DataFrame({"sample_id": np.asarray(caption_sample_ids, np.int64), "tok": normalizer.token_lists(texts)})
    words = (caps.with_row_index("cap").explode("tok").drop_nulls("tok")
             .with_columns(pl.int_range(pl.len()).over("cap").alias("pos")))
    vocab = pl.DataFrame({"concept_id": np.asarray(vocab_ids, np.int64), "gram": pl.Series(list(vocab_texts), dtype=pl.String)})
    lens = vocab["gram"].str.count_matches(" ") + 1
    parts = []
    for n in range(1, n_max + 1):
        want = vocab.filter(lens == n)
        if want.height == 0:
            continue
        g = words
        if n > 1:
            g = g.with_columns([pl.col("tok").shift(-k).alias(f"t{k}") for k in range(1, n)]
                               + [pl.col("cap").shift(-(n - 1)).alias("cap_end")])
            g = g.filter(pl.col("cap_end") == pl.col("cap")).with_columns(
                pl.concat_str(["tok"] + [f"t{k}" for k in range(1, n)], separator=" ").alias("gram"))
        else:
            g = g.rename({"tok": "gram"})
        parts.append(g.select("sample_id", "gram").join(want, on="gram", how="inner").select("concept_id", "sample_id"))
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    m = pl.concat(parts).unique().sort("concept_id", "sample_id")
    return m["concept_id"].to_numpy().astype(np.int64), m["sample_id"].to_numpy().astype(np.int64)


def encode_concepts(model, tokenizer, texts: Sequence[str], max_tokens: int, batch: int = 256,
                    pooled_only: bool = False, project_tokens: bool = False) -> dict[str, np.ndarray]:
    """CLIP text tower over ``texts`` -> ``pooled`` float16 [U, P], ``n_tokens`` int32 [U] and,
    unless ``pooled_only``, ``tokens`` float16 [U, M, d_t] (M = the longest valid length, zero
    beyond each row's ``n_tokens``)."""
    import torch

    from pipeline.models.clip import encode_texts

    toks, pooled, lens = [], [], []
    with torch.no_grad():
        for s in range(0, len(texts), batch):
            o = encode_texts(model, tokenizer, list(texts[s:s + batch]), max_tokens, project_tokens)
            mask = o["text_mask"].cpu().numpy()
            lens.append(mask.sum(1).astype(np.int32))
            pooled.append(o["text_embed"].float().cpu().numpy().astype(np.float16))
            if not pooled_only:
                t = o["text_tokens"].float().cpu().numpy()
                t[~mask] = 0
                toks.append(t.astype(np.float16))
    n_tokens = np.concatenate(lens) if lens else np.zeros(0, np.int32)
    out = {"n_tokens": n_tokens,
           "pooled": np.concatenate(pooled) if pooled else np.zeros((0, 0), np.float16)}
    if not pooled_only:
        M = int(n_tokens.max()) if len(n_tokens) else 0
        d = toks[0].shape[-1] if toks else 0
        arr = np.zeros((len(n_tokens), M, d), np.float16)
        r = 0
        for t in toks:
            arr[r:r + len(t), : t.shape[1]] = t[:, :M]
            r += len(t)
        out["tokens"] = arr
    return out


def save_npy_atomic(path, arr: np.ndarray) -> None:
    """``np.save`` to a temporary name, renamed when complete (a killed run leaves no half file)."""
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(arr))
    os.replace(tmp, path)
