"""The concept-ot model: projections, mass heads, anchors and the local scores of every variant
(Sec. 2.1-2.5; see train/jobs/concept_ot/__init__.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from train.jobs.concept_ot.ot import pair_similarities, uot_dense, uot_dense_score, uot_lowrank, uot_lowrank_score
from train.loop import amp_settings

TRANSPORT = ("conceptot", "dense-uot", "balanced-ot")


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _masses(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Eq. 1-2: softplus(w.x + b) normalised over the (valid) tokens."""
    w = F.softplus(logits)
    if mask is not None:
        w = w * mask
    return w / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)


class ConceptOTModel(nn.Module):
    """Trainable parts: projections W_v, W_t (d -> d_c, no bias), mass heads (Linear d -> 1),
    anchors P [r, d_c] ~ N(0, 0.02) (conceptot), query/key projections (text-attn)."""

    def __init__(self, cfg, d_v: int, d_t: int, device: torch.device | None = None):
        super().__init__()
        self.cfg = cfg
        v = cfg.variant
        self.variant = v
        g = cfg.ot_gemm_dtype
        if g == "auto":  # follow the trainer's mixed precision (train.loop.amp_settings)
            on, dt, _ = amp_settings(cfg.amp, device or torch.device("cpu"))
            g = "bfloat16" if on and dt == torch.bfloat16 else "float32"
        self.gemm_dtype = torch.bfloat16 if g == "bfloat16" else None
        if v != "global-only":
            self.W_v = nn.Linear(d_v, cfg.d_c, bias=False)
            self.W_t = nn.Linear(d_t, cfg.d_c, bias=False)
        if v in TRANSPORT:
            self.mass_v = nn.Linear(d_v, 1)
            self.mass_t = nn.Linear(d_t, 1)
        if v == "conceptot":
            self.anchors = nn.Parameter(torch.randn(cfg.rank, cfg.d_c) * cfg.anchor_init_std)
        if v == "text-attn":
            self.W_q = nn.Linear(d_t, cfg.d_c, bias=False)
            self.W_k = nn.Linear(d_v, cfg.d_c, bias=False)

    # -- features ------------------------------------------------------------------------------
    def image_features(self, patches: torch.Tensor) -> dict:
        if self.variant == "global-only":
            return {}
        v = patches.float()
        out = {"z": _normalize(self.W_v(v))}
        if self.variant in TRANSPORT:
            out["mu"] = _masses(self.mass_v(v).squeeze(-1), None)
        if self.variant == "text-attn":
            out["k"] = self.W_k(v)
        return out

    def text_features(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict:
        if self.variant == "global-only":
            return {}
        t = tokens.float()
        m = mask.bool()
        out = {"y": _normalize(self.W_t(t)) * m[..., None], "mask": m}
        if self.variant in TRANSPORT:
            out["nu"] = _masses(self.mass_t(t).squeeze(-1), m)
        if self.variant == "text-attn":
            out["q"] = self.W_q(t)
        return out

    # -- local score s_l(I, x) for pairs (img_idx[p], txt_idx[p]) --------------------------------
    def score_pairs(self, img: dict, txt: dict, ii: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        cfg, v = self.cfg, self.variant
        if v == "global-only":
            return torch.zeros(ii.shape[0])
        with torch.autocast(ii.device.type, enabled=False):
            # solvers and scores in float32 even under AMP (features may come out of autocast)
            img = {k: (x.float() if x.is_floating_point() else x) for k, x in img.items()}
            txt = {k: (x.float() if x.is_floating_point() else x) for k, x in txt.items()}
            mask = txt["mask"][tt]
            if v == "global-patch":
                zbar = img["z"].mean(1)
                ybar = txt["y"].sum(1) / txt["mask"].sum(1, keepdim=True).clamp_min(1)
                return (zbar[ii] * ybar[tt]).sum(-1)
            if v == "conceptot":
                # fused solver + score (hand-written backward); same function as
                # uot_lowrank(...).score(...)
                return uot_lowrank_score(img["z"], txt["y"], self.anchors, img["mu"], txt["nu"], cfg.eps, cfg.tau_v,
                                         cfg.tau_t, cfg.n_iter, mask_t=txt["mask"], img_index=ii, txt_index=tt,
                                         kpp_reg=cfg.kpp_reg, center=cfg.lr_center, clamp=cfg.lr_clamp,
                                         tanh=cfg.score_tanh, gemm_dtype=self.gemm_dtype)
            if v == "text-attn":
                logits = torch.bmm(txt["q"][tt], img["k"][ii].transpose(1, 2)) / math.sqrt(cfg.d_c)  # [P,M,N]
                att = torch.softmax(logits, dim=-1)
                pooled = _normalize(torch.bmm(att, img["z"][ii]))  # [P,M,dc]
                sim = (pooled * txt["y"][tt]).sum(-1)
                return (sim * mask).sum(1) / mask.sum(1).clamp_min(1)
            # [P,N,M] cosine similarities, pairs sorted by image (one GEMM per image)
            S, order = pair_similarities(img["z"], txt["y"], ii, tt)
            iis, tts = ii[order], tt[order]
            mask = txt["mask"][tts]
            if v == "filip":
                i2t = S.masked_fill(~mask[:, None, :], float("-inf")).amax(2).mean(1)
                t2i = S.amax(1)
                t2i = (t2i * mask).sum(1) / mask.sum(1).clamp_min(1)
                sc = 0.5 * (i2t + t2i)
            else:
                tau = (None, None) if v == "balanced-ot" else (cfg.tau_v, cfg.tau_t)
                sc = uot_dense_score(1.0 - S, img["mu"][iis], txt["nu"][tts], cfg.eps, tau[0], tau[1], cfg.n_iter,
                                     sim=S, mask_t=mask, chunk=cfg.ot_chunk)
            return torch.empty_like(sc).index_put((order,), sc)

    def phrase_heatmap(self, img: dict, txt: dict, i: int, t: int, token_weights: torch.Tensor) -> torch.Tensor:
        """[N] patch heatmap for a phrase (token weights [M]) of caption t on image i (Sec. 2.6)."""
        dev = token_weights.device
        return self.phrase_heatmaps(img, txt, torch.tensor([i], device=dev), torch.tensor([t], device=dev),
                                    token_weights[None])[0]

    def phrase_heatmaps(self, img: dict, txt: dict, ii: torch.Tensor, tt: torch.Tensor,
                        token_weights: torch.Tensor) -> torch.Tensor:
        """[P, N] patch heatmaps h_i(J) = sum_{j in J} Pi_ij (Sec. 2.6) for P (image ii[p], caption
        tt[p], token weights [P, M]) triples; transport variants aggregate their plan, text-attn its
        attention, filip / global-patch the positive cosine similarities; global-only has none
        (an empty [P, 0])."""
        cfg, v = self.cfg, self.variant
        if v == "global-only":
            return torch.zeros(ii.shape[0], 0)
        with torch.autocast(ii.device.type, enabled=False):
            img = {k: (x.float() if x.is_floating_point() else x) for k, x in img.items()}
            txt = {k: (x.float() if x.is_floating_point() else x) for k, x in txt.items()}
            mask = txt["mask"][tt]
            w = token_weights.float() * mask
            if v == "conceptot":
                res = uot_lowrank(img["z"], txt["y"], self.anchors, img["mu"], txt["nu"], cfg.eps, cfg.tau_v, cfg.tau_t,
                                  cfg.n_iter, mask_t=txt["mask"], img_index=ii, txt_index=tt, kpp_reg=cfg.kpp_reg,
                                  center=cfg.lr_center, clamp=cfg.lr_clamp)
                return res.heatmap(w)
            if v == "text-attn":
                logits = torch.bmm(txt["q"][tt], img["k"][ii].transpose(1, 2)) / math.sqrt(cfg.d_c)
                return (torch.softmax(logits, -1) * w[..., None]).sum(1)
            S = torch.bmm(img["z"][ii], txt["y"][tt].transpose(1, 2))  # [P,N,M]
            if v in ("dense-uot", "balanced-ot"):
                tau = (None, None) if v == "balanced-ot" else (cfg.tau_v, cfg.tau_t)
                P = uot_dense(1 - S, img["mu"][ii], txt["nu"][tt], cfg.eps, tau[0], tau[1], cfg.n_iter, mask_t=mask)
                return (P * w[:, None, :]).sum(-1)
            return (S.clamp_min(0) * w[:, None, :]).sum(-1)  # filip, global-patch
