"""concept-ot's objective (Eq. 9-10) and its hard-negative mining (Alg. 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.jobs.concept_ot.index_negatives import index_hits
from train.jobs.concept_ot.model import ConceptOTModel, _normalize
from train.jobs.concept_ot.ot import anchor_diversity


def mine_pairs(g: torch.Tensor, K: int, bad: torch.Tensor):
    """Hard negatives of Alg. 2 line 6 from global scores g [B, B] (g[i, j] = s_g(I_i, x_j)):
    N_X(i) = top-K_h_{j != i} g[i, j] (captions), N_I(i) = top-K_h_{j != i} g[j, i] (images);
    ``bad`` [B, B] marks excluded (i, j) (the diagonal, duplicate captions).
    Returns (img_idx, txt_idx) of the B (1 + 2K) pairs [positives; (i, N_X(i)); (N_I(i), i)],
    the negative indices [B, K] both ways and their global scores (-inf where excluded)."""
    B = g.shape[0]
    vx, neg_x = g.masked_fill(bad, float("-inf")).topk(K, dim=1)
    vi, neg_i = g.t().masked_fill(bad, float("-inf")).topk(K, dim=1)
    idx = torch.arange(B, device=g.device)
    ii = torch.cat([idx, idx.repeat_interleave(K), neg_i.reshape(-1)])
    tt = torch.cat([idx, neg_x.reshape(-1), idx.repeat_interleave(K)])
    return ii, tt, neg_x, neg_i, vx, vi


def concept_ot_loss(cfg, model: ConceptOTModel, batch: dict, dev: torch.device) -> tuple[torch.Tensor, dict]:
    """Eq. 9-10: L_global (symmetric InfoNCE on the frozen pooled embeddings; constant, logged)
    + lambda_l (L_I->X + L_X->I) / 2 over K_h hard negatives mined both ways from the global scores
    (Alg. 2 line 6), + beta Omega_div (conceptot). Logs the loss terms, the mean positive / negative
    local scores and, with index neighbours attached to the batch, ``hn_index_hit``."""
    ie = _normalize(batch["image_embed"].to(dev).float())
    te = _normalize(batch["text_embed"].to(dev).float())
    B = ie.shape[0]
    g = ie @ te.t()  # [B, B] global similarities (frozen)
    labels = torch.arange(B, device=dev)
    l_global = 0.5 * (F.cross_entropy(g / cfg.global_temperature, labels)
                      + F.cross_entropy(g.t() / cfg.global_temperature, labels))
    logs = {"loss_global": float(l_global)}
    if cfg.variant == "global-only":
        return l_global, logs
    bad = torch.eye(B, dtype=torch.bool, device=dev)
    if cfg.exclude_duplicate_captions:
        bad = bad | ((te @ te.t()) > 1 - 1e-6)
    ii, tt, neg_x, neg_i, vx, vi = mine_pairs(g, min(cfg.k_hard, B - 1), bad)
    K = neg_x.shape[1]
    img = model.image_features(batch["patch_tokens"].to(dev))
    txt = model.text_features(batch["text_tokens"].to(dev), batch["text_mask"].to(dev))
    s = model.score_pairs(img, txt, ii, tt)
    s_pos, s_x, s_i = s[:B], s[B:B + B * K].view(B, K), s[B + B * K:].view(B, K)
    s_x = s_x.masked_fill(~torch.isfinite(vx), float("-inf"))
    s_i = s_i.masked_fill(~torch.isfinite(vi), float("-inf"))
    zero = torch.zeros(B, dtype=torch.long, device=dev)
    l_i2x = F.cross_entropy(torch.cat([s_pos[:, None], s_x], 1) / cfg.tau_local, zero)
    l_x2i = F.cross_entropy(torch.cat([s_pos[:, None], s_i], 1) / cfg.tau_local, zero)
    loss = l_global + cfg.lambda_local * 0.5 * (l_i2x + l_x2i)
    negs = torch.cat([s_x, s_i], 1).detach()
    logs.update({"loss_i2x": float(l_i2x.detach()), "loss_x2i": float(l_x2i.detach()),
                 "s_pos": float(s_pos.detach().mean()), "s_neg": float(negs[torch.isfinite(negs)].mean())})
    if "index_neighbours" in batch:
        # share of the mined negatives (both directions) that are index neighbours of their anchor
        sid, nbs = batch["sample_id"], batch["index_neighbours"]
        hx, nx_ = index_hits(sid, neg_x, torch.isfinite(vx), nbs)
        hi, ni_ = index_hits(sid, neg_i, torch.isfinite(vi), nbs)
        hits, mined = (hx + hi).cpu(), (nx_ + ni_).cpu()
        logs["hn_index_hit"] = float(hits.sum()) / max(1, int(mined.sum()))
        if "seed_mask" in batch:  # the rows whose neighbours were brought into the batch
            sm = batch["seed_mask"]
            logs["hn_index_hit_seeds"] = float(hits[sm].sum()) / max(1, int(mined[sm].sum()))
            logs["seed_batch_share"] = float(sm.float().mean())
    if cfg.variant == "conceptot" and cfg.beta_div > 0:
        div = anchor_diversity(model.anchors)
        loss = loss + cfg.beta_div * div
        logs["anchor_div"] = float(div.detach())
    return loss, logs
