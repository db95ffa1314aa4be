"""The Eq. 8 score of the dense plan, sum(Pi * S) / sum(Pi): from a plan (``dense_score``), or
solved and scored chunk by chunk without keeping the plan (``uot_dense_score``), by default with
a fused hand-written backward of the unrolled scaling iterations."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from train.jobs.concept_ot.ot.common import (
    _NEG,
    _Fallback,
    _alpha,
    _damped,
    _default_chunk,
    _flatten,
    _log_mass,
    _mv,
    _scaled_mv,
    _split,
    _unit_scalings,
)
from train.jobs.concept_ot.ot.dense import _dense_solve


class _DenseScoreFn(torch.autograd.Function):
    """Fused dense UOT + Eq. 8 score for one chunk with a hand-written backward of the unrolled
    iterations. The backward needs no N x M temporaries per iteration: the kernel gradient of all
    2L mat-vecs is one batched [N, 2L] x [2L, M] product. Raises _Fallback when a mat-vec
    underflows (extreme costs): the caller then uses the autograd path with log-sum-exp fallback.
    Checked against autograd by tests/test_ot.py (gradcheck in float64)."""

    @staticmethod
    def forward(ctx, C, lmu, lnu, S, mask_v, mask_t, eps, av, at, n_iter):
        B, N, M = C.shape
        tiny = torch.finfo(C.dtype).tiny * 1e6
        valid = None
        if mask_v is not None:
            valid = mask_v[:, :, None].expand(B, N, M)
        if mask_t is not None:
            vt = mask_t[:, None, :].expand(B, N, M)
            valid = vt if valid is None else (valid & vt)
        Cm = C if valid is None else C.masked_fill(~valid, float("inf"))
        f = Cm.amin(dim=2)
        f = torch.where(torch.isfinite(f), f, torch.zeros_like(f))
        fe = f / eps
        K = torch.sub(fe[:, :, None].expand(B, N, M), C, alpha=1.0 / eps).exp_()
        if valid is not None:
            K.masked_fill_(~valid, 0.0)
        KT = K.transpose(1, 2)
        lv = torch.zeros_like(lnu)
        if mask_t is not None:
            lv = lv.masked_fill(~mask_t, _NEG)
        xs, ss, ys, ts = [], [], [], []
        lu = None
        for _ in range(int(n_iter)):
            c, x, sv = _scaled_mv(K, lv, mask_v)
            if bool((sv < tiny).any()):
                raise _Fallback()
            lu = _damped(lmu, c, torch.log(sv), av, fe, mask_v)
            c2, y, t = _scaled_mv(KT, lu, mask_t)
            if bool((t < tiny).any()):
                raise _Fallback()
            lv = _damped(lnu, c2, torch.log(t), at, None, mask_t)
            xs.append(x); ss.append(sv); ys.append(y); ts.append(t)
        if lu is None:
            lu = -fe
        u, v = _unit_scalings(lu, lv, mask_v, mask_t)
        Sx = (1.0 - C) if S is None else S
        KS = K * Sx
        KSv = _mv(KS, v)
        Kv = _mv(K, v)
        num = (u * KSv).sum(-1)
        den = (u * Kv).sum(-1).clamp_min(torch.finfo(C.dtype).tiny)
        ctx.save_for_backward(C, S, K, KS, u, v, KSv, Kv, num, den,
                              *(torch.stack(z, 1) if z else torch.zeros(B, 0) for z in (xs, ss, ys, ts)))
        ctx.masks = (mask_v, mask_t)
        ctx.consts = (eps, av, at, int(n_iter))
        return num / den

    @staticmethod
    def backward(ctx, g):
        C, S, K, KS, u, v, KSv, Kv, num, den, X, Ss, Ys, Ts = ctx.saved_tensors
        mask_v, mask_t = ctx.masks
        eps, av, at, L = ctx.consts
        dnum = g / den
        dden = -g * num / den ** 2
        # score = u^T (K*S) v / u^T K v
        du = dnum[:, None] * KSv + dden[:, None] * Kv
        uKS = torch.bmm(u[:, None, :], KS).squeeze(1)
        uK = torch.bmm(u[:, None, :], K).squeeze(1)
        dv = dnum[:, None] * uKS + dden[:, None] * uK
        glu = du * u
        glv = dv * v
        dlmu = torch.zeros_like(u)
        dlnu = torch.zeros_like(v)
        A_cols, B_rows = [], []
        for l in range(L - 1, -1, -1):
            x, sv, y, t = X[:, l], Ss[:, l], Ys[:, l], Ts[:, l]
            if mask_t is not None:
                glv = glv * mask_t
            dlnu = dlnu + at * glv
            dt = -at * glv / t
            A_cols.append(y); B_rows.append(dt)
            dy = _mv(K, dt)
            glu = glu + dy * y
            if mask_v is not None:
                glu = glu * mask_v
            dlmu = dlmu + av * glu
            ds = -av * glu / sv
            A_cols.append(ds); B_rows.append(x)
            dx = torch.bmm(ds[:, None, :], K).squeeze(1)
            glv = dx * x
            glu = torch.zeros_like(glu)
        W = torch.bmm(u[:, :, None], v[:, None, :])  # u v^T
        Sx = (1.0 - C) if S is None else S
        dK = W * (dnum[:, None, None] * Sx + dden[:, None, None])
        if A_cols:
            dK = dK + torch.bmm(torch.stack(A_cols, 2), torch.stack(B_rows, 1))
        dSx = dnum[:, None, None] * W * K
        dC = dK.mul_(K).mul_(-1.0 / eps)
        dS = None
        if S is None:
            dC = dC - dSx
        else:
            dS = dSx
        return dC, dlmu, dlnu, dS, None, None, None, None, None, None


def uot_dense_score(
    C: Tensor, mu: Tensor, nu: Tensor,  # costs [..., N, M], reference masses [..., N], [..., M]
    eps: float, tau_v: Optional[float], tau_t: Optional[float], n_iter: int,  # Eq. 3's eps, tau; L iterations
    *,
    sim: Optional[Tensor] = None,
    mask_v: Optional[Tensor] = None, mask_t: Optional[Tensor] = None,  # True = real token
    method: str = "fused",
    chunk: Optional[int] = None,
    tanh: bool = False,
) -> Tensor:
    """Local score sum(Pi * S) / sum(Pi) (Eq. 8 for the dense plan) without keeping the plan:
    solved chunk by chunk. ``sim`` defaults to 1 - C (cosine similarity for the cosine cost).
    ``method``: "fused" (default; scaling iterations with the hand-written backward, falling back
    to "scaling" per chunk on underflow), "scaling" or "log" (autograd through the loop).
    Returns [...]."""
    lead, C, mu, nu, mask_v, mask_t = _flatten(C, mu, nu, mask_v, mask_t)
    B, N, M = C.shape
    if sim is not None:
        sim = sim.reshape(-1, N, M)
    eps = float(eps)
    av, at = _alpha(tau_v, eps), _alpha(tau_t, eps)
    lmu = _log_mass(mu, mask_v)
    lnu = _log_mass(nu, mask_t)
    out = []
    ch = chunk if chunk is not None else _default_chunk(N, M)
    parts = [_split(x, ch) for x in (C, lmu, lnu, sim, mask_v, mask_t)]
    for k in range(len(parts[0])):
        Ck, lmk, lnk, S, mv, mt = (p[k] if p is not None else None for p in parts)
        if method == "fused":
            try:
                out.append(_DenseScoreFn.apply(Ck, lmk, lnk, S, mv, mt, eps, av, at, int(n_iter)))
                continue
            except _Fallback:
                pass
        m = "log" if method == "log" else "scaling"
        lu, lv, K, valid, fe, ge = _dense_solve(Ck, lmk, lnk, mv, mt, eps, av, at, n_iter, m)
        # common per-problem factors cancel in the ratio: shift both scalings to max 0
        u = torch.exp(lu - lu.amax(dim=1, keepdim=True))
        v = torch.exp(lv - lv.amax(dim=1, keepdim=True))
        Ku = torch.bmm(u[:, None, :], K).squeeze(1)  # [b, M] = K^T u
        den = (Ku * v).sum(-1)
        Sx = (1.0 - Ck) if S is None else S
        num = (torch.bmm(u[:, None, :], K * Sx).squeeze(1) * v).sum(-1)
        out.append(num / den.clamp_min(torch.finfo(den.dtype).tiny))
    sc = torch.cat(out).reshape(lead)
    return torch.tanh(sc) if tanh else sc


def dense_score(plan: Tensor, sim: Tensor, tanh: bool = False) -> Tensor:
    """Transported-mass-normalised average similarity sum(Pi * S) / sum(Pi) (Eq. 8, dense)."""
    num = (plan * sim).sum(dim=(-2, -1))
    den = plan.sum(dim=(-2, -1)).clamp_min(torch.finfo(plan.dtype).tiny)
    s = num / den
    return torch.tanh(s) if tanh else s


