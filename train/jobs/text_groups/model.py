"""The Text Group Transformer (text-groups Sec. 2.1.1, 4.1) and the `vanilla` baseline.

Shapes: B captions, L tokens (batch trimmed to its longest caption, L <= 77), K groups, D = width.

TextGroupTransformer
    token embedding [V, D] + learned positions [77, D]; K learnable group tokens appended;
    ``layers_pre`` (6) pre-LN Transformer layers over [tokens; groups] (bidirectional, padding
    masked); one :class:`GroupingBlock`; ``layers_post`` (3) layers over the K groups; final LN.
GroupingBlock  (GroupViT's, NVlabs/GroupViT models/group_vit.py, with a padding mask added)
    LN on tokens and groups; token-mixing MLP across the groups (GroupViT's ``mlp_inter``, ratio 0.5);
    a cross-attention block (groups attend to tokens, ``pre_assign_attn``); then
    :class:`AssignAttention`; residual from the projected groups; channel MLP (ratio 4).
AssignAttention  (Eq. 1-4)
    A_raw = Q(g) K(t)^T / sqrt(D) [B, K, L]; softmax over the GROUPS axis, with Gumbel noise
    (tau = 1) in training; hard one-hot (argmax over groups) with the straight-through gradient
    (Eq. 3) in training, plain argmax one-hot in eval; padded tokens are zeroed; each group's
    row is normalised over tokens, A / (sum_j A + assign_eps) (GroupViT's assign_eps = 1);
    out = W (A V(t)).
Decoder  (Sec. 2.2.2, 4.1)
    one layer: causal self-attention (1 head), cross-attention to the K groups (1 head), MLP;
    input = shift-right (SOT, t_1, ..., t_n), target = (t_1, ..., t_n, EOT); token embedding
    tied with the encoder's (input and output); its own learned positions.
VanillaText  (Sec. 4.1 baseline)
    9 pre-LN layers over tokens with CLIP's causal mask, final LN, the EOT token's feature is the
    text representation (one "group").

Projections (Sec. 2.2.1): ``Linear(D, 256)`` on every text group and ``Linear(d_img, 256)`` on
every frozen image group (no bias, as CLIP's projections), mean-pooled, cosine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int | None = None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out or d_in)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head attention (queries x, keys/values y) with a boolean key mask / causal mask."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, y=None, key_mask=None, causal: bool = False, attn_mask=None):
        y = x if y is None else y
        B, Lq, D = x.shape
        Lk = y.shape[1]
        h = self.h
        q = self.q(x).view(B, Lq, h, D // h).transpose(1, 2)
        k = self.k(y).view(B, Lk, h, D // h).transpose(1, 2)
        v = self.v(y).view(B, Lk, h, D // h).transpose(1, 2)
        if attn_mask is not None:  # [B, Lq, Lk] boolean, True = attend (it holds the key mask too)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None])
        elif key_mask is not None:
            mask = key_mask[:, None, None, :]  # True = attend
            if causal:
                mask = mask & torch.ones(Lq, Lk, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o(out.transpose(1, 2).reshape(B, Lq, D))


class Block(nn.Module):
    """Pre-LN Transformer encoder layer (CLIP / GroupViT style), MLP ratio 4."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), Mlp(d, 4 * d)

    def forward(self, x, key_mask=None, causal: bool = False, attn_mask=None):
        x = x + self.attn(self.ln1(x), key_mask=key_mask, causal=causal, attn_mask=attn_mask)
        return x + self.mlp(self.ln2(x))


def gumbel_noise_like(x: torch.Tensor) -> torch.Tensor:
    """-log(Exp(1)) samples, as torch.nn.functional.gumbel_softmax draws them."""
    return -torch.empty_like(x, memory_format=torch.legacy_contiguous_format).exponential_().log()


class AssignAttention(nn.Module):
    """Eq. 1-4 (GroupViT's AssignAttention, one head) with a token padding mask."""

    def __init__(self, d: int, gumbel: bool = True, hard: bool = True, tau: float = 1.0, assign_eps: float = 1.0):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scale = d ** -0.5
        self.gumbel, self.hard, self.tau, self.assign_eps = gumbel, hard, tau, assign_eps

    def forward(self, groups, tokens, token_mask, noise=None):
        """groups [B, K, D], tokens [B, L, D], token_mask bool [B, L] -> (out [B, K, D],
        hard assignment A [B, K, L] (Eq. 3, with straight-through gradient in training),
        soft attention [B, K, L] (softmax over groups without noise, for visualisation))."""
        raw = torch.einsum("bkd,bld->bkl", self.q(groups), self.k(tokens)) * self.scale  # Eq. 1
        logits = raw
        if self.training and self.gumbel:
            logits = raw + (gumbel_noise_like(raw) if noise is None else noise)  # Eq. 2
        soft = F.softmax(logits / self.tau, dim=1)  # over the GROUPS axis (top-down attention)
        if self.hard:
            idx = soft.argmax(dim=1, keepdim=True)
            one_hot = torch.zeros_like(soft).scatter_(1, idx, 1.0)
            attn = one_hot - soft.detach() + soft  # Eq. 3 (straight-through)
        else:
            attn = soft
        attn = attn * token_mask[:, None, :].to(attn.dtype)  # padding takes part in no group
        attn = attn / (attn.sum(dim=-1, keepdim=True) + self.assign_eps)  # Eq. 4 normalisation over tokens
        out = self.o(torch.bmm(attn, self.v(tokens)))
        vis = F.softmax(raw, dim=1) * token_mask[:, None, :].to(raw.dtype)
        return out, attn, vis


class CrossAttnBlock(nn.Module):
    """GroupViT's pre-assign block: groups attend to tokens (softmax over tokens), MLP, post-LN."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_q, self.ln_k, self.attn = nn.LayerNorm(d), nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp, self.ln_post = nn.LayerNorm(d), Mlp(d, 4 * d), nn.LayerNorm(d)

    def forward(self, q, kv, key_mask):
        x = q + self.attn(self.ln_q(q), self.ln_k(kv), key_mask=key_mask)
        x = x + self.mlp(self.ln2(x))
        return self.ln_post(x)


class GroupingBlock(nn.Module):
    """GroupViT's grouping block (K groups in, K groups out) with a token padding mask."""

    def __init__(self, d: int, heads: int, n_groups: int, gumbel: bool = True, hard: bool = True,
                 tau: float = 1.0, assign_eps: float = 1.0, pre_assign: bool = True):
        super().__init__()
        self.pre_assign = pre_assign
        self.norm_tokens, self.norm_x = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp_inter = Mlp(n_groups, max(1, int(0.5 * d)), n_groups)
        self.norm_post_tokens = nn.LayerNorm(d)
        self.pre_assign_attn = CrossAttnBlock(d, heads)
        self.assign = AssignAttention(d, gumbel, hard, tau, assign_eps)
        self.norm_new_x, self.mlp_channels = nn.LayerNorm(d), Mlp(d, 4 * d)

    def forward(self, tokens, groups, token_mask, noise=None):
        x = self.norm_x(tokens)
        g = self.norm_tokens(groups)
        g = self.norm_post_tokens(self.mlp_inter(g.transpose(1, 2)).transpose(1, 2))
        if self.pre_assign:  # GroupViT's block; the paper's Eq. 4 goes straight to the assignment
            g = self.pre_assign_attn(g, x, token_mask)
        new, attn, vis = self.assign(g, x, token_mask, noise)
        new = new + g  # Eq. 4's residual (GroupViT: on the projected group tokens)
        new = new + self.mlp_channels(self.norm_new_x(new))
        return new, attn, vis


class Decoder(nn.Module):
    """One Transformer decoder layer: causal self-attention (1 head) + cross-attention to the groups (1 head)."""

    def __init__(self, d: int, max_len: int):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.01)
        self.ln1, self.self_attn = nn.LayerNorm(d), Attention(d, 1)
        self.ln2, self.ln_mem, self.cross = nn.LayerNorm(d), nn.LayerNorm(d), Attention(d, 1)
        self.ln3, self.mlp, self.ln_f = nn.LayerNorm(d), Mlp(d, 4 * d), nn.LayerNorm(d)

    def forward(self, emb_in, mask, memory):
        L = emb_in.shape[1]
        x = emb_in + self.pos[:L]
        x = x + self.self_attn(self.ln1(x), key_mask=mask, causal=True)
        x = x + self.cross(self.ln2(x), self.ln_mem(memory))
        x = x + self.mlp(self.ln3(x))
        return self.ln_f(x)


class TextSide(nn.Module):
    """Shared parts: token + position embeddings, decoder, projection heads."""

    def _init_common(self, vocab: int, d: int, max_len: int, d_img: int, d_proj: int, decoder: bool,
                     pos_init_std: float = 0.01):
        self.token_embedding = nn.Embedding(vocab, d)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(max_len, d) * pos_init_std)
        self.text_proj = nn.Linear(d, d_proj, bias=False)
        self.image_proj = nn.Linear(d_img, d_proj, bias=False)
        self.decoder = Decoder(d, max_len) if decoder else None

    def image_embed(self, image_groups: torch.Tensor) -> torch.Tensor:
        """Frozen image groups [B, K_img, d_img] -> normalised mean of projected groups [B, 256]."""
        return F.normalize(self.image_proj(image_groups).mean(1), dim=-1)

    def text_embed(self, groups: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_proj(groups).mean(1), dim=-1)

    def set_output_vocab(self, ids) -> None:
        """Restrict the decoder's softmax to these token ids (``recon_vocab: corpus``); None: all."""
        if ids is None:
            self.out_vocab = None
            self.out_index = None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).unique()
        index = torch.full((self.token_embedding.num_embeddings,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        self.register_buffer("out_vocab", ids)
        self.register_buffer("out_index", index)

    def reconstruction_logits(self, ids, mask, groups, full: bool = False):
        """(logits, targets, target mask). ``full=False``: logits [n_real, V] at the real target
        positions only (targets [n_real]); ``full=True``: [B, L-1, V] everywhere (targets [B, L-1],
        the reference the benchmark compares against). V = the whole vocabulary, or the corpus ids
        after :meth:`set_output_vocab`."""
        E = self.token_embedding.weight
        h = self.decoder(self.token_embedding(ids[:, :-1]), mask[:, :-1], groups)  # shift right
        tgt_mask = mask[:, 1:]
        targets = ids[:, 1:]
        out_vocab = getattr(self, "out_vocab", None)
        if out_vocab is not None:
            E = E[out_vocab]
            targets = self.out_index[targets].clamp(min=0)
        if full:
            return h @ E.t(), targets, tgt_mask
        return h[tgt_mask] @ E.t(), targets[tgt_mask], tgt_mask


class TextGroupTransformer(TextSide):
    def __init__(self, vocab: int = 49408, d: int = 128, heads: int = 4, n_groups: int = 4, layers_pre: int = 6,
                 layers_post: int = 3, max_len: int = 77, d_img: int = 384, d_proj: int = 256, decoder: bool = True,
                 gumbel: bool = True, hard: bool = True, gumbel_tau: float = 1.0, assign_eps: float = 1.0,
                 pre_assign: bool = True, isolate_groups: bool = False, group_init_std: float = 0.02,
                 pos_init_std: float = 0.01):
        super().__init__()
        self._init_common(vocab, d, max_len, d_img, d_proj, decoder, pos_init_std)
        self.n_groups = n_groups
        self.isolate_groups = isolate_groups
        self.group_tokens = nn.Parameter(torch.empty(1, n_groups, d))
        nn.init.trunc_normal_(self.group_tokens, std=group_init_std, a=-2 * max(1.0, group_init_std), b=2 * max(1.0, group_init_std))
        self.pre = nn.ModuleList(Block(d, heads) for _ in range(layers_pre))
        self.grouping = GroupingBlock(d, heads, n_groups, gumbel, hard, gumbel_tau, assign_eps, pre_assign)
        self.post = nn.ModuleList(Block(d, heads) for _ in range(layers_post))
        self.ln_final = nn.LayerNorm(d)

    def encode(self, ids, mask, noise=None) -> dict:
        """ids int64 [B, L], mask bool [B, L] -> {"groups" [B, K, D], "assign" (hard, [B, K, L]),
        "soft" [B, K, L], "tokens" [B, L, D] (token features entering the grouping block)}."""
        B, L = ids.shape
        K = self.n_groups
        x = self.token_embedding(ids) + self.pos[:L]
        x = torch.cat([x, self.group_tokens.expand(B, -1, -1)], dim=1)
        m = torch.cat([mask, torch.ones(B, K, dtype=torch.bool, device=mask.device)], dim=1)
        am = None
        if self.isolate_groups:  # group tokens see only group tokens before the block: the caption
            am = m[:, None, :].expand(B, L + K, L + K).clone()  # reaches the groups through Eq. 4 alone
            am[:, L:, :L] = False
        for blk in self.pre:
            x = blk(x, key_mask=m, attn_mask=am)
        tokens, groups = x[:, :L], x[:, L:]
        g, assign, soft = self.grouping(tokens, groups, mask, noise)
        for blk in self.post:
            g = blk(g)
        return {"groups": self.ln_final(g), "assign": assign, "soft": soft, "tokens": tokens}


class VanillaText(TextSide):
    """The paper's baseline: 9 layers over tokens (CLIP's causal mask), pooled at EOT."""

    def __init__(self, vocab: int = 49408, d: int = 128, heads: int = 4, layers: int = 9, max_len: int = 77,
                 d_img: int = 384, d_proj: int = 256, decoder: bool = True, causal: bool = True):
        super().__init__()
        self._init_common(vocab, d, max_len, d_img, d_proj, decoder)
        self.n_groups = 1
        self.causal = causal
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(d)

    def encode(self, ids, mask, noise=None) -> dict:
        L = ids.shape[1]
        x = self.token_embedding(ids) + self.pos[:L]
        for blk in self.blocks:
            x = blk(x, key_mask=mask, causal=self.causal)
        x = self.ln_final(x)
        eot = mask.long().sum(1).clamp(min=1) - 1
        pooled = x[torch.arange(len(ids), device=ids.device), eot][:, None]
        return {"groups": pooled, "tokens": x}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["AssignAttention", "GroupingBlock", "TextGroupTransformer", "VanillaText", "n_params", "math"]
