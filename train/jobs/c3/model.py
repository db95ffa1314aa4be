"""The C3 model over cached CLIP features (see train/jobs/c3/__init__.py): cls adapters (the LoRA
stand-in), METER-shaped co-attention fusion, phi_MCP, phi_MCC (and phi_ITM)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ClsAdapter(nn.Module):
    """h = e + U(gelu(D e + attn-pool_e(V2 gelu(V1 tokens)))): a rank-r residual on a frozen pooled
    embedding that re-reads its token states through a small per-token MLP (as the CLS of a
    LoRA-adapted encoder would: LoRA changes every token's processing, and a nonlinear per-token
    map lets the pooled summary keep conjunctions such as colour AND shape in one patch). U is
    zero-initialised, so h == e at initialisation (LoRA's B = 0)."""

    def __init__(self, d_e: int, d_tok: int, rank: int):
        super().__init__()
        self.down = nn.Linear(d_e, rank)
        self.q = nn.Linear(d_e, rank)
        self.k = nn.Linear(d_tok, rank) if d_tok else None
        self.v = nn.Linear(d_tok, 2 * rank) if d_tok else None
        self.v2 = nn.Linear(2 * rank, rank) if d_tok else None
        self.up = nn.Linear(rank, d_e)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.rank = rank

    def forward(self, e: torch.Tensor, tok: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        a = self.down(e)
        if tok is not None and self.k is not None:
            logits = torch.einsum("br,bnr->bn", self.q(e), self.k(tok)) / math.sqrt(self.rank)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            a = a + torch.einsum("bn,bnr->br", logits.softmax(-1), self.v2(F.gelu(self.v(tok))))
        return e + self.up(F.gelu(a))


class CoAttentionLayer(nn.Module):
    """One METER co-attention layer (Dou et al. 2022): per modality self-attention, cross-attention
    to the other modality's states of the previous layer, FFN; pre-LN residual blocks."""

    def __init__(self, d: int, heads: int, ffn_mult: int, dropout: float):
        super().__init__()
        self.sa = nn.ModuleList([nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True) for _ in range(2)])
        self.ca = nn.ModuleList([nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True) for _ in range(2)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(d, ffn_mult * d), nn.GELU(), nn.Dropout(dropout),
                                                nn.Linear(ffn_mult * d, d)) for _ in range(2)])
        self.ln = nn.ModuleList([nn.LayerNorm(d) for _ in range(6)])
        self.drop = nn.Dropout(dropout)

    def forward(self, xs: list[torch.Tensor], pads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        outs = []
        for m in range(2):
            x = xs[m]
            h = self.ln[3 * m](x)
            x = x + self.drop(self.sa[m](h, h, h, key_padding_mask=pads[m], need_weights=False)[0])
            outs.append(x)
        res = []
        for m in range(2):
            x, o = outs[m], outs[1 - m]
            h = self.ln[3 * m + 1](x)
            kv = self.ln[3 * (1 - m) + 1](o)
            x = x + self.drop(self.ca[m](h, kv, kv, key_padding_mask=pads[1 - m], need_weights=False)[0])
            x = x + self.drop(self.ffn[m](self.ln[3 * m + 2](x)))
            res.append(x)
        return res


def _mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.LayerNorm(d_hidden), nn.Linear(d_hidden, d_out))


class C3Model(nn.Module):
    def __init__(self, cfg, d_v: int, d_t: int, P: int, n_patches: int):
        super().__init__()
        D = cfg.d_model
        self.cfg, self.P = cfg, P
        self.img_adapter = ClsAdapter(P, d_v, cfg.adapter_rank)
        self.con_adapter = ClsAdapter(P, d_t, cfg.adapter_rank)
        self.in_img_cls = nn.Linear(P, D)
        self.in_img_tok = nn.Linear(d_v, D)
        self.in_txt_cls = nn.Linear(P, D)
        self.in_txt_tok = nn.Linear(d_t, D) if d_t else None
        self.img_pos = nn.Parameter(torch.zeros(1, n_patches + 1, D))
        self.txt_pos = nn.Parameter(torch.zeros(1, 128, D))
        self.type_emb = nn.Parameter(torch.zeros(2, D))
        nn.init.normal_(self.img_pos, std=0.02)
        nn.init.normal_(self.txt_pos, std=0.02)
        nn.init.normal_(self.type_emb, std=0.02)
        self.layers = nn.ModuleList([CoAttentionLayer(D, cfg.heads, cfg.ffn_mult, cfg.dropout) for _ in range(cfg.layers)])
        self.ln_out = nn.ModuleList([nn.LayerNorm(D), nn.LayerNorm(D)])
        self.pool = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)])  # METER's poolers
        trip = cfg.formulation == "triplet"
        self.phi_mcp = _mlp((4 if trip else 2) * D, 2 * D, 1)
        self.phi_itm = _mlp(2 * D, 2 * D, 1) if cfg.itm else None
        self.phi_mcc = _mlp(P, cfg.mcc_hidden, P * cfg.mcc_rank)

    # unimodal (adapted) cls ----------------------------------------------------------------------
    def image_cls(self, embed: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        return self.img_adapter(embed.float(), patches.float())

    def concept_cls(self, pooled: torch.Tensor, tokens: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        return self.con_adapter(pooled.float(), None if tokens is None else tokens.float(), mask)

    # fusion ---------------------------------------------------------------------------------------
    def fuse(self, h_img, patches, h_txt, tokens, mask) -> torch.Tensor:
        """z(I, C) = [text cls; image cls] [B, 2D] for B aligned (image, text) pairs."""
        B = h_img.shape[0]
        v = torch.cat([self.in_img_cls(h_img)[:, None], self.in_img_tok(patches.float())], 1)
        v = v + self.img_pos[:, : v.shape[1]] + self.type_emb[1]
        parts = [self.in_txt_cls(h_txt)[:, None]]
        pad_t = torch.zeros(B, 1, dtype=torch.bool, device=h_img.device)
        if tokens is not None and self.in_txt_tok is not None:
            parts.append(self.in_txt_tok(tokens.float()))
            pad_t = torch.cat([pad_t, ~mask], 1)
        t = torch.cat(parts, 1)
        t = t + self.txt_pos[:, : t.shape[1]] + self.type_emb[0]
        xs = [t, v]
        pads = [pad_t if bool(pad_t.any()) else None, None]
        for layer in self.layers:
            xs = layer(xs, pads)
        zt = self.pool[0](self.ln_out[0](xs[0][:, 0]))
        zv = self.pool[1](self.ln_out[1](xs[1][:, 0]))
        return torch.cat([zt, zv], -1)

    def mcp_logit(self, z_a: torch.Tensor, z_b: torch.Tensor | None = None) -> torch.Tensor:
        x = z_a if z_b is None else torch.cat([z_a, z_b], -1)
        return self.phi_mcp(x).squeeze(-1)

    def psi(self, h_c: torch.Tensor) -> torch.Tensor:
        """psi_c [B, P, r] from the concept cls."""
        return self.phi_mcc(h_c).view(-1, self.P, self.cfg.mcc_rank)


def mcc_logits(psi: torch.Tensor, h_i: torch.Tensor, h_j: torch.Tensor) -> torch.Tensor:
    """[B, B]: logits[b, b'] = cos(psi_{b'}^T h_{i_b}, psi_{b'}^T h_{j_b'}) (Eq. 6's in-batch
    (I'_j, C') = (I_{j_b'}, C_{b'}); the diagonal holds the positives)."""
    a = F.normalize(torch.einsum("bp,kpr->bkr", h_i, psi), dim=-1)  # [B, B', r]
    bj = F.normalize(torch.einsum("kp,kpr->kr", h_j, psi), dim=-1)  # [B', r]
    return torch.einsum("bkr,kr->bk", a, bj)


def conditioned_sim(psi: torch.Tensor, h_q: torch.Tensor, h_k: torch.Tensor) -> torch.Tensor:
    """[Q, K] cos(psi^T h_q, psi^T h_k) for one concept's psi [P, r]."""
    return F.normalize(h_q @ psi, dim=-1) @ F.normalize(h_k @ psi, dim=-1).t()


def encode_batch(model: C3Model, batch: dict, device) -> tuple:
    """(patches, adapted image cls hI, text tokens, text mask, adapted concept/text cls hT) of a
    batch's distinct images and texts (the layout of :mod:`train.jobs.c3.batches`), on ``device``."""
    patches = batch["patches"].to(device)
    hI = model.image_cls(batch["embed"].to(device), patches)
    tok = batch.get("txt_tokens")
    mask = batch.get("txt_mask")
    tok = tok.to(device) if tok is not None else None
    mask = mask.to(device) if mask is not None else None
    hT = model.concept_cls(batch["txt_pooled"].to(device), tok, mask)
    return patches, hI, tok, mask, hT


def fuse_pairs(model: C3Model, patches, hI, tok, mask, hT, pi, pt, chunk: int | None = None) -> torch.Tensor:
    """z(I, T) [len(pi), 2D] of the (image ``pi``, text ``pt``) index pairs into :func:`encode_batch`'s
    output, ``chunk`` pairs per forward."""
    pi, pt = pi.to(patches.device), pt.to(patches.device)
    if chunk is None or len(pi) <= chunk:
        t = m = None
        if tok is not None:  # trailing padding that none of these texts uses is cut (masked keys: no effect)
            m = mask[pt]
            n = int(m.sum(1).max()) if len(pt) else 0
            t, m = tok[pt][:, :max(1, n)], m[:, :max(1, n)]
        return model.fuse(hI[pi], patches[pi], hT[pt], t, m)
    return torch.cat([fuse_pairs(model, patches, hI, tok, mask, hT, pi[s:s + chunk], pt[s:s + chunk])
                      for s in range(0, len(pi), chunk)])
