"""Recall@K for image->text and text->image retrieval, with the two-stage protocol of ConceptOT
Appendix G.4: global cosine similarities select the top-k candidates (k=128), which are reranked
by ``g + lambda * s_local``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def recall_at_k(scores: torch.Tensor, gt: torch.Tensor, ks: Sequence[int] = (1, 5, 10)) -> dict[int, float]:
    """scores [Q, G] (higher = better), gt [Q, G] bool (at least one True per query):
    fraction of queries with a correct item among their top K (ties broken by index)."""
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    hit = torch.gather(gt, 1, order)
    first = torch.where(hit.any(1), hit.float().argmax(1), torch.full((scores.shape[0],), scores.shape[1]))
    return {k: float((first < k).float().mean()) for k in ks}


def two_stage_scores(
    g: torch.Tensor,
    local_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    lam: float,
    top_k: int = 128,
    chunk_pairs: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reranked score matrices for both directions.

    g [I, T] global similarities; ``local_fn(img_idx, txt_idx) -> s_local`` for pairs. Returns
    (S_i2t [I, T], S_t2i [T, I]) where non-candidates keep ``-inf`` shifted global ranks below
    every candidate (they are never ranked above a candidate, as in the protocol)."""
    I, T = g.shape

    def direction(gq: torch.Tensor, pair_fn) -> torch.Tensor:
        Q, G = gq.shape
        k = min(top_k, G)
        top = gq.topk(k, dim=1).indices  # [Q, k]
        out = torch.full((Q, G), float("-inf"), dtype=torch.float64)
        # non-candidates: below all candidates, ordered by g (for completeness of the ranking)
        out[:] = gq.double() - 1e6
        qi = torch.arange(Q)[:, None].expand(Q, k).reshape(-1)
        gi = top.reshape(-1)
        if local_fn is None or lam == 0:
            s = gq[qi, gi].double()
        else:
            loc = torch.cat([pair_fn(qi[s:s + chunk_pairs], gi[s:s + chunk_pairs]).double()
                             for s in range(0, qi.numel(), chunk_pairs)])
            s = gq[qi, gi].double() + lam * loc
        out[qi, gi] = s
        return out

    s_i2t = direction(g, lambda q, c: local_fn(q, c))
    s_t2i = direction(g.t(), lambda q, c: local_fn(c, q))
    return s_i2t, s_t2i


def retrieval_report(g, local_fn, lam, img_of_caption: torch.Tensor, top_k: int = 128, ks=(1, 5, 10),
                     chunk_pairs: int = 2048) -> dict[str, float]:
    """R@K both directions for the global score alone and for the two-stage reranked score,
    plus the chance level of R@1. ``img_of_caption`` [T] is each caption's image row."""
    I, T = g.shape
    gt_i2t = torch.zeros(I, T, dtype=torch.bool)
    gt_i2t[img_of_caption, torch.arange(T)] = True
    out: dict[str, float] = {}
    for tag, fn in (("global", None), ("rerank", local_fn)):
        if tag == "rerank" and fn is None:
            continue
        s_i2t, s_t2i = two_stage_scores(g, fn, lam, top_k, chunk_pairs)
        r1 = recall_at_k(s_i2t, gt_i2t, ks)
        r2 = recall_at_k(s_t2i, gt_i2t.t(), ks)
        for k in ks:
            out[f"{tag}/i2t_R@{k}"] = 100 * r1[k]
            out[f"{tag}/t2i_R@{k}"] = 100 * r2[k]
        out[f"{tag}/avg_R@1"] = 100 * (r1[ks[0]] + r2[ks[0]]) / 2
    caps_per_img = torch.bincount(img_of_caption, minlength=I).double()
    out["chance/i2t_R@1"] = float(100 * (caps_per_img / T).mean())
    out["chance/t2i_R@1"] = 100.0 / I
    return out
