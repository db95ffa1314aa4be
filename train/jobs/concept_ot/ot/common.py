"""Pieces every OT solver of this package shares: the batched mat-vec, log masses with padding,
the damping exponent of the unbalanced updates, batch flattening and chunking, and the signal by
which a fused path hands a problem back to its autograd path."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# Large negative number used instead of -inf for log-masses of padded tokens: keeps every value and
# gradient finite (exp underflows to exactly 0).
_NEG = -1e4


def _mv(A: Tensor, x: Tensor) -> Tensor:
    """Batched mat-vec A [B,n,m] @ x [B,m] -> [B,n], written as the row-vector product
    x^T A^T: on CPU (MKL) the [B,1,m] x [B,m,n] form is ~6x faster than [B,n,m] x [B,m,1]."""
    return torch.bmm(x.unsqueeze(1), A.transpose(1, 2)).squeeze(1)


def _flatten(C: Tensor, mu: Tensor, nu: Tensor, mask_v, mask_t):
    lead = C.shape[:-2]
    N, M = C.shape[-2:]
    C = C.reshape(-1, N, M)
    mu = mu.reshape(-1, N)
    nu = nu.reshape(-1, M)
    if mask_v is not None:
        mask_v = mask_v.reshape(-1, N).to(torch.bool)
    if mask_t is not None:
        mask_t = mask_t.reshape(-1, M).to(torch.bool)
    return lead, C, mu, nu, mask_v, mask_t


def _log_mass(m: Tensor, mask: Optional[Tensor]) -> Tensor:
    if mask is None:
        return torch.log(m)
    safe = torch.where(mask, m, torch.ones_like(m))
    return torch.where(mask, torch.log(safe), torch.full_like(m, _NEG))


def _alpha(tau: Optional[float], eps: float) -> float:
    # tau = None or inf: balanced (hard) marginal, exponent 1.
    if tau is None or tau == float("inf"):
        return 1.0
    return float(tau) / (float(tau) + float(eps))


def _split(x: Optional[Tensor], chunk: int):
    """Chunks of x along dim 0 as ONE split op: autograd then concatenates the chunk gradients
    once, instead of materialising a full-size zero gradient per sliced chunk."""
    if x is None:
        return None
    return x.split(chunk)


def _default_chunk(N: int, M: int) -> int:
    # keep one chunk's kernel around 1 MiB (fits the per-core L2 cache; measured best on CPU)
    return max(1, (1 << 20) // (4 * N * M))


class _Fallback(Exception):
    """Raised by a fused path (hand-written backward) when its problem needs the autograd path
    (a mat-vec underflow, a singular K_PP, a clamped score denominator)."""


def _amax_grad(x: Tensor, c: Tensor, gc: Tensor, dim: int = 1) -> Tensor:
    # autograd's amax backward: the gradient is shared evenly between tied maxima
    hit = (x == c).to(x.dtype)
    return hit * (gc / hit.sum(dim=dim, keepdim=True))


def _normalize(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _unit_scalings(la: Tensor, lb: Tensor, mask_v: Optional[Tensor], mask_t: Optional[Tensor]):
    """exp of the log-scalings shifted to max 0 (zero on padding): the plan up to one positive
    factor per problem, which cancels in every score ratio."""
    a = torch.exp(la - la.amax(dim=1, keepdim=True))
    b = torch.exp(lb - lb.amax(dim=1, keepdim=True))
    if mask_v is not None:
        a = a * mask_v
    if mask_t is not None:
        b = b * mask_t
    return a, b


def _scaled_mv(K: Tensor, lx: Tensor, mask: Optional[Tensor]):
    """One scaling half-step's mat-vec against exp(lx - c), c = max lx: returns (c, x, s = K x),
    with padded rows of s set to 1 (they are exactly 0: kept out of the logs and the underflow
    checks)."""
    c = lx.amax(dim=1, keepdim=True)
    x = torch.exp(lx - c)
    s = _mv(K, x)
    if mask is not None:
        s = torch.where(mask, s, torch.ones_like(s))
    return c, x, s


def _damped(lm: Tensor, c: Tensor, ls: Tensor, alpha: float, shift: Optional[Tensor], mask: Optional[Tensor]):
    """The damped log-scaling update alpha (log m - log(K x)) given log(K x) = c + ls in the kernel
    stabilised by the potential ``shift`` (None: no potential on this side); padding -> _NEG."""
    if shift is None:
        la = alpha * (lm - c - ls)
    else:
        la = alpha * (lm - c - ls + shift) - shift
    if mask is not None:
        la = la.masked_fill(~mask, _NEG)
    return la


def _center_clamp(x: Tensor, mask: Optional[Tensor], center: bool, clamp: Optional[float]):
    """Appendix H's optional stabilisation of low-rank log-scalings after each update: centre
    (mean over real tokens) and clamp to [-clamp, clamp]; padding -> _NEG. Returns (x, keep),
    keep = the entries the clamp left alone (None without clamp), for the hand-written backward."""
    keep = None
    if center:
        if mask is None:
            x = x - x.mean(dim=1, keepdim=True)
        else:
            cnt = mask.sum(dim=1, keepdim=True).clamp_min(1)
            x = x - (x * mask).sum(dim=1, keepdim=True) / cnt
    if clamp is not None:
        keep = (x >= -clamp) & (x <= clamp)
        x = x.clamp(-clamp, clamp)
    if mask is not None:
        x = x.masked_fill(~mask, _NEG)
    return x, keep
