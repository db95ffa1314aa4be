"""InfoGround's compatibility function phi (Gupta et al. 2020, Sec. 2.3, Eq. 6-7).

Four MLPs map regions to keys and values (k_r, v_r: d_r -> d) and words to queries and values
(q_w, v_w: d_w -> d). With ``hidden_layers`` h (paper: 1; Fig. 4 compares 0, 1, 2), each is
``h x (Linear(d_in, d_in) -> BatchNorm1d -> ReLU)`` followed by ``Linear(d_in, d)``; d defaults to
d_w / 2 (384 for 768-d BERT), as the paper and the reference code.

Padding (documented difference from the reference): every MLP runs on the *packed* valid rows
only, so padded regions and padded word slots neither enter the BatchNorm batch statistics nor
the attention (padded regions get -inf scores before the softmax). The reference pads regions
with zero features to 30 and words to 6 slots and lets both into BatchNorm and the softmax: an
image with few boxes then gives attention mass to all-zero "regions", and the statistics depend
on how much padding the batch has.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(d_in: int, d_out: int, hidden_layers: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(hidden_layers):
        layers += [nn.Linear(d_in, d_in), nn.BatchNorm1d(d_in), nn.ReLU()]
    layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


def packed(f: nn.Module, x: torch.Tensor, mask: torch.Tensor | None, d_out: int) -> torch.Tensor:
    """``f`` applied to the rows of ``x`` [..., d_in] where ``mask`` [...] is True (zeros elsewhere),
    so BatchNorm sees only real rows."""
    if mask is None:
        return f(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], d_out)
    out = x.new_zeros(*x.shape[:-1], d_out)
    if bool(mask.any()):
        out[mask] = f(x[mask]).to(out.dtype)
    return out


class InfoGroundModel(nn.Module):
    def __init__(self, d_r: int, d_w: int, d: int | None = None, hidden_layers: int = 1):
        super().__init__()
        self.d_r, self.d_w = int(d_r), int(d_w)
        self.d = int(d) if d else max(1, self.d_w // 2)
        self.k_r = mlp(self.d_r, self.d, hidden_layers)
        self.v_r = mlp(self.d_r, self.d, hidden_layers)
        self.q_w = mlp(self.d_w, self.d, hidden_layers)
        self.v_w = mlp(self.d_w, self.d, hidden_layers)
        self.scale = 1.0 / math.sqrt(self.d)

    def regions(self, feats: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [U, R, d] of padded regions [U, R, d_r] (mask [U, R])."""
        return packed(self.k_r, feats, mask, self.d), packed(self.v_r, feats, mask, self.d)

    def words(self, feats: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and values [..., d] of word features [..., d_w]."""
        return packed(self.q_w, feats, mask, self.d), packed(self.v_w, feats, mask, self.d)

    def attention_all(self, q: torch.Tensor, vw: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every word against every image: q, vw [N, d]; k, v [U, R, d]; rmask [U, R].
        Returns phi [N, U] (Eq. 6-7 and phi = v_w^T v_att) and the attention [N, U, R].

        phi = sum_r a_r (v_w . v_r), so the attended value [N, U, d] is never formed: two GEMMs
        [N, d] x [d, U R] give the scores and the value products."""
        U, R, d = k.shape
        s = (q @ k.reshape(U * R, d).t()).view(-1, U, R) * self.scale
        s = s.masked_fill(~rmask[None], float("-inf"))
        a = torch.softmax(s, dim=-1)
        a = torch.nan_to_num(a, nan=0.0)  # an image with no regions (never trained on; safe in scoring)
        g = (vw @ v.reshape(U * R, d).t()).view(-1, U, R)
        return (a * g).sum(-1), a

    def attention_own(self, q: torch.Tensor, vw: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Words against their own image: q, vw [B, M, d]; k, v [B, R, d]; rmask [B, R].
        Returns phi [B, M] and the attention [B, M, R]."""
        s = torch.einsum("bmd,brd->bmr", q, k) * self.scale
        s = s.masked_fill(~rmask[:, None, :], float("-inf"))
        a = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        g = torch.einsum("bmd,brd->bmr", vw, v)
        return (a * g).sum(-1), a
