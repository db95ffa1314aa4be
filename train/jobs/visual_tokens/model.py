"""The Visual Token Encoder (Kalibhat et al. Sec. 4.2 / 5.1), its ViT baseline over cached CLIP
patches and the text head (see train/jobs/visual_tokens/__init__.py for every choice)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N_RANKS = 8  # ranks 0..7 of pipeline.visual_tokens.graph
TOKEN_IMAGE, TOKEN_TANGIBLE, TOKEN_INTANGIBLE, TOKEN_PAD = 0, 1, 2, 3


def rank_weight_table(a: torch.Tensor) -> torch.Tensor:
    """w [..., 8] from the free parameters a [..., 7]: w_0 = 0, w_r = sum_{k<=r} exp(a_k)
    (the paper's cumsum(exp(a)) with its first element 0; monotone; a = 0 gives w_r = r)."""
    return F.pad(torch.cumsum(torch.exp(a), dim=-1), (1, 0))


class RankWeights(nn.Module):
    """The learned rank weights of additive attention, shared or per head / layer / both."""

    SHAPES = {"shared": (1, 1), "per-head": (1, None), "per-layer": (None, 1), "per-layer-head": (None, None)}

    def __init__(self, mode: str, layers: int, heads: int, learn: bool = True):
        super().__init__()
        lw, hw = self.SHAPES[mode]
        shape = (layers if lw is None else 1, heads if hw is None else 1, N_RANKS - 1)
        a = torch.zeros(shape)
        if learn:
            self.a = nn.Parameter(a)
        else:  # fixed-w: w_r = r
            self.register_buffer("a", a)
        self.mode = mode

    def table(self) -> torch.Tensor:
        """w [L', H', 8]."""
        return rank_weight_table(self.a)

    def per_layer(self) -> bool:
        return self.a.shape[0] > 1


def attention_bias(w: torch.Tensor | None, ranks: torch.Tensor | None, pad_mask: torch.Tensor) -> torch.Tensor:
    """The additive float mask [B, H', T, T] of one layer: w[h, A[b, i, j]] (``w`` [H', 8], or None:
    no rank bias) with -inf on padded keys (padding folded into the same mask)."""
    B, T = pad_mask.shape
    if w is None:
        bias = torch.zeros(B, 1, T, T, device=pad_mask.device)
    else:
        bias = w[:, ranks.long()].permute(1, 0, 2, 3)  # [B, H', T, T]
    return bias.masked_fill(pad_mask[:, None, None, :], float("-inf"))


def reference_attention(q, k, v, bias, dropout_p: float = 0.0, training: bool = False):
    """Plain attention: softmax(q k^T / sqrt(d) + bias) v (what SDPA with a float mask computes)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    if dropout_p and training:
        p = F.dropout(p, dropout_p)
    return p @ v


class Block(nn.Module):
    """One layer in torch.nn.TransformerEncoderLayer's form (post-norm by default, ReLU FFN,
    dropout on attention weights, attention output and FFN) with SDPA and an additive mask."""

    def __init__(self, width: int, heads: int, ff: int, dropout: float, norm_first: bool = False,
                 attention: str = "sdpa"):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.h, self.dh = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ff1, self.ff2 = nn.Linear(width, ff), nn.Linear(ff, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.p, self.norm_first, self.attention = dropout, norm_first, attention

    def _attn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        m = None if bias is None else bias.to(q.dtype)
        p = self.p if self.training else 0.0
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
        else:
            o = reference_attention(q, k, v, m, p, self.training)
        return self.drop(self.out(o.transpose(1, 2).reshape(B, T, D)))

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.ff2(self.drop(F.relu(self.ff1(x)))))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.norm_first:
            x = x + self._attn(self.ln1(x), bias)
            return x + self._ff(self.ln2(x))
        x = self.ln1(x + self._attn(x, bias))
        return self.ln2(x + self._ff(x))


class Encoder(nn.Module):
    """``layers`` Blocks; ``rank_weights`` (None: no rank bias) gives each layer its w."""

    def __init__(self, cfg, rank_weights: RankWeights | None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.ff_dim, cfg.dropout, cfg.norm_first, cfg.attention)
                                    for _ in range(cfg.layers))
        self.rank_weights = rank_weights
        self.final_ln = nn.LayerNorm(cfg.width) if cfg.norm_first else nn.Identity()

    def forward(self, x: torch.Tensor, ranks: torch.Tensor | None, pad_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        if pad_mask is None:
            pad_mask = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        rw = self.rank_weights
        table = rw.table() if rw is not None else None
        bias = None
        for i, blk in enumerate(self.blocks):
            if bias is None or (table is not None and rw.per_layer()):
                bias = attention_bias(None if table is None else table[i if rw.per_layer() else 0], ranks, pad_mask)
            x = blk(x, bias)
        return self.final_ln(x)


def _norm(kind: str, d: int) -> nn.Module:
    return nn.LayerNorm(d) if kind == "layernorm" else nn.Identity()


class VisualTokenEncoder(nn.Module):
    """T = {I} + V + U -> one embedding (see the package docstring)."""

    def __init__(self, cfg, d_token: int, d_image: int):
        super().__init__()
        W = cfg.width
        self.norm_v, self.norm_u, self.norm_i = _norm(cfg.input_norm, d_token), _norm(cfg.input_norm, d_token), _norm(cfg.input_norm, d_image)
        # tokens wider/narrower than the model (only when the artifact's width != cfg.width): one linear map
        self.token_in = nn.Identity() if d_token == W else nn.Linear(d_token, W)
        H = cfg.image_mlp_hidden
        self.image_mlp = nn.Sequential(nn.Linear(d_image, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, W))
        self.type_emb = nn.Parameter(torch.randn(3, W) * 0.02)  # p_I, p_v, p_u
        additive = cfg.variant not in ("no-additive",)
        rw = RankWeights(cfg.rank_weights, cfg.layers, cfg.heads, learn=cfg.variant != "fixed-w") if additive else None
        self.encoder = Encoder(cfg, rw)
        self.pool = cfg.pool
        self.proj = nn.Linear(W, cfg.embed_dim)

    def forward(self, tokens, image_feature, type_ids, ranks, pad_mask) -> torch.Tensor:
        tok = tokens.float()
        types = type_ids[..., None]
        x = torch.where(types == TOKEN_TANGIBLE, self.norm_v(tok), torch.where(types == TOKEN_INTANGIBLE, self.norm_u(tok), torch.zeros_like(tok)))
        x = self.token_in(x)
        img = self.image_mlp(self.norm_i(image_feature.float()))
        x = torch.cat([img[:, None, :], x[:, 1:]], dim=1)  # slot 0 is the image feature
        x = x + self.type_emb[type_ids.clamp(max=2)] * (~pad_mask)[..., None]
        h = self.encoder(x, ranks, pad_mask)
        if self.pool == "image":
            z = h[:, 0]
        else:
            valid = (~pad_mask).float()[..., None]
            z = (h * valid).sum(1) / valid.sum(1).clamp_min(1)
        return self.proj(z)


class ViTOverPatches(nn.Module):
    """Baseline ``vit``: the same encoder over cached (pretrained) CLIP patch tokens: linear
    projection, learned 2-D position embeddings (row + column), a CLS token (pooled)."""

    def __init__(self, cfg, d_patch: int, n_patches: int):
        super().__init__()
        side = int(round(math.sqrt(n_patches)))
        if side * side != n_patches:
            raise ValueError(f"vit: {n_patches} patch tokens are not a square grid")
        W = cfg.width
        self.side = side
        self.proj_in = nn.Linear(d_patch, W)
        self.row = nn.Parameter(torch.randn(side, W) * 0.02)
        self.col = nn.Parameter(torch.randn(side, W) * 0.02)
        self.cls = nn.Parameter(torch.randn(W) * 0.02)
        self.encoder = Encoder(cfg, None)
        self.proj = nn.Linear(W, cfg.embed_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        B = patches.shape[0]
        pos = (self.row[:, None, :] + self.col[None, :, :]).reshape(self.side * self.side, -1)
        x = self.proj_in(patches.float()) + pos
        x = torch.cat([self.cls.expand(B, 1, -1), x], dim=1)
        return self.proj(self.encoder(x, None, None)[:, 0])


class TextHead(nn.Module):
    """``tokens``: LayerNorm -> Linear(d_t, width) -> ``text_layers`` Blocks over the valid
    tokens -> the last valid token (CLIP's EOS pooling) -> LayerNorm -> Linear(width, embed_dim);
    ``pooled``: Linear(P, embed_dim) on the frozen pooled CLIP text embedding."""

    def __init__(self, cfg, d_text: int, d_pooled: int):
        super().__init__()
        self.mode = cfg.text
        if self.mode == "pooled":
            self.proj = nn.Linear(d_pooled, cfg.embed_dim)
            return
        W = cfg.width
        self.ln_in = nn.LayerNorm(d_text)
        self.inp = nn.Linear(d_text, W)
        self.blocks = nn.ModuleList(Block(W, cfg.heads, cfg.ff_dim, cfg.dropout, cfg.norm_first, cfg.attention)
                                    for _ in range(cfg.text_layers))
        self.ln_out = nn.LayerNorm(W)
        self.proj = nn.Linear(W, cfg.embed_dim)

    def forward(self, tokens: torch.Tensor | None, mask: torch.Tensor | None, pooled: torch.Tensor | None) -> torch.Tensor:
        if self.mode == "pooled":
            return self.proj(pooled.float())
        x = self.inp(self.ln_in(tokens.float()))
        m = mask.bool()
        bias = attention_bias(None, None, ~m) if len(self.blocks) else None
        for blk in self.blocks:
            x = blk(x, bias)
        last = (m.long().sum(1) - 1).clamp_min(0)
        return self.proj(self.ln_out(x[torch.arange(x.shape[0], device=x.device), last]))


class VisualTokensModel(nn.Module):
    def __init__(self, cfg, dims: dict):
        super().__init__()
        self.variant = cfg.variant
        if cfg.variant == "vit":
            self.image = ViTOverPatches(cfg, dims["d_patch"], dims["n_patches"])
        else:
            self.image = VisualTokenEncoder(cfg, dims["d_token"], dims["d_image"])
        self.text = TextHead(cfg, dims["d_text"], dims["d_pooled"])
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / cfg.temperature_init)))
        self.max_log_scale = math.log(cfg.max_logit_scale)

    def scale(self) -> torch.Tensor:
        """exp(logit_scale) clamped to max_logit_scale (CLIP clamps the parameter at log 100)."""
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def encode_image(self, batch: dict, device) -> torch.Tensor:
        if self.variant == "vit":
            z = self.image(batch["patch_tokens"].to(device))
        else:
            z = self.image(batch["tokens"].to(device), batch["image_feature"].to(device), batch["type_ids"].to(device),
                           batch["ranks"].to(device), batch["pad_mask"].to(device))
        return F.normalize(z.float(), dim=-1)

    def encode_text(self, tokens, mask, pooled, device) -> torch.Tensor:
        z = self.text(None if tokens is None else tokens.to(device), None if mask is None else mask.to(device),
                      None if pooled is None else pooled.to(device))
        return F.normalize(z.float(), dim=-1)

    def rank_weights(self) -> torch.Tensor | None:
        """w [L', H', 8] (None for vit / no-additive)."""
        enc = getattr(self.image, "encoder", None)
        rw = getattr(enc, "rank_weights", None)
        return None if rw is None else rw.table().detach()
