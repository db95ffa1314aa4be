"""Batched, differentiable entropic optimal transport solvers (ConceptOT, Kumar; Sections 2.2-2.5,
Algorithm 1, Appendix H).

All solvers take a leading batch dimension (any number of leading dims for the dense solvers) and
solve every problem of the batch at once as one tensor program; gradients flow by unrolling the
``n_iter`` generalised Sinkhorn iterations with autograd.

Problem (Eq. 3)::

    min_{Pi >= 0} <C, Pi> + eps * sum Pi (log Pi - 1) + tau_v KL(Pi 1 | mu) + tau_t KL(Pi^T 1 | nu)

solved with the generalised Sinkhorn scaling updates of Chizat et al. (the paper's Section 2.2,
Algorithm 1 order: ``a`` first from ``b``, starting from ``a = 1, b = 1``)::

    a <- (mu / K b) ** alpha_v,   b <- (nu / K^T a) ** alpha_t,   alpha = tau / (tau + eps)

This is exactly POT's ``ot.unbalanced.sinkhorn_unbalanced(mu, nu, C, eps, (tau_v, tau_t),
reg_type='entropy')`` (same initialisation, same update order), which the tests check.

Numerics (measured in ``benchmarks/bench_ot.py``; the plain log-domain loop, ``method="log"``,
does one exponential per kernel entry and iteration and is several times slower on CPU):

* ``method="scaling"`` (default): the Gibbs kernel is formed ONCE per problem, stabilised by the
  c-transform potentials ``f_i = min_j C_ij``, ``g_j = min_i (C_ij - f_i)`` (so every row and
  column of the stabilised kernel has maximum exactly 1 and no entry exceeds 1), and the scaling
  vectors are carried as logarithms. Each half-iteration is one batched mat-vec against
  ``exp(log v - max log v)``; the result is taken back to the log domain (only N + M logs).
  Whenever a mat-vec result underflows (possible only with costs / eps spreads beyond the float
  range, e.g. C/eps > 80 in float32), that half-iteration is recomputed exactly with a
  log-sum-exp against the stabilised log-kernel (the "absorption" fallback); it costs one extra
  kernel-sized exponential and happens only for such extreme problems.
  The potentials f, g are a pure reparametrisation (the plan does not depend on them), so they
  are detached: the gradient is exact.
* ``method="log"``: plain log-domain Sinkhorn (log-sum-exp every half-iteration), kept for the
  benchmark and as a reference.

Padding: ``mask_v`` [..., N] / ``mask_t`` [..., M] (True = real token). Padded tokens carry zero
mass and get zero rows / columns in the plan; no NaN appears in values or gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "uot_dense",
    "sinkhorn_balanced",
    "dense_score",
    "uot_dense_score",
    "uot_lowrank",
    "LowRankUOT",
    "uot_lowrank_score",
    "anchor_diversity",
    "pair_similarities",
]

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


def _dense_solve(C, lmu, lnu, mask_v, mask_t, eps, av, at, n_iter, method):
    """Core of :func:`uot_dense` on one chunk [b, N, M]. Returns (lu, lv, K, valid, fe, ge):
    the plan is exp(lu_i + lv_j) * K_ij (K = stabilised kernel, entries <= 1)."""
    B, N, M = C.shape
    valid = None
    if mask_v is not None or mask_t is not None:
        mv = mask_v if mask_v is not None else torch.ones(B, N, dtype=torch.bool, device=C.device)
        mt = mask_t if mask_t is not None else torch.ones(B, M, dtype=torch.bool, device=C.device)
        valid = mv[:, :, None] & mt[:, None, :]

    # Stabilising row potential f_i = min_j C_ij (detached: the plan is invariant to it), so that
    # every row of the kernel has maximum 1. Columns are handled by the log-domain vectors.
    with torch.no_grad():
        Cd = C.detach()
        if valid is not None:
            Cd = Cd.masked_fill(~valid, float("inf"))
        f = Cd.amin(dim=2)
        f = torch.where(torch.isfinite(f), f, torch.zeros_like(f))
    fe = f / eps
    ge = torch.zeros_like(lnu)

    # log kernel (f_i - C_ij) / eps <= 0; one fused pass (expand avoids a broadcast slow path)
    logK = torch.sub(fe[:, :, None].expand(B, N, M), C, alpha=1.0 / eps)
    if valid is not None:
        logK = logK.masked_fill(~valid, _NEG)

    lv = torch.zeros_like(lnu)  # b = 1
    if mask_t is not None:
        lv = lv.masked_fill(~mask_t, _NEG)
    lu = torch.zeros_like(lmu) - fe

    if method == "scaling":
        K = torch.exp(logK)
        KT = K.transpose(1, 2)
        logKT = logK.transpose(1, 2)
        tiny = torch.finfo(C.dtype).tiny * 1e6

        def half(Kmat, logKmat, lx, lm, fe_side, alpha, mask):
            # log (K x)_i relative to the stabilised kernel, then the damped update.
            c = lx.amax(dim=1, keepdim=True)
            s = _mv(Kmat, torch.exp(lx - c))
            if mask is not None:  # padded rows are exactly 0: keep them out of log / the check
                s = torch.where(mask, s, torch.ones_like(s))
            if bool((s < tiny).any()):
                # absorption fallback: exact log-sum-exp for this half-iteration
                ls = torch.logsumexp(logKmat + (lx - c)[:, None, :], dim=2)
                if mask is not None:
                    ls = torch.where(mask, ls, torch.zeros_like(ls))
            else:
                ls = torch.log(s)
            la = alpha * (lm - c - ls + fe_side) - fe_side
            if mask is not None:
                la = la.masked_fill(~mask, _NEG)
            return la

        for _ in range(int(n_iter)):
            lu = half(K, logK, lv, lmu, fe, av, mask_v)
            lv = half(KT, logKT, lu, lnu, ge, at, mask_t)
    elif method == "log":
        K = None
        logKT = logK.transpose(1, 2)
        for _ in range(int(n_iter)):
            lK = torch.logsumexp(logK + lv[:, None, :], dim=2) - fe
            lu = av * (lmu - lK) - fe
            if mask_v is not None:
                lu = lu.masked_fill(~mask_v, _NEG)
            lK = torch.logsumexp(logKT + lu[:, None, :], dim=2) - ge
            lv = at * (lnu - lK) - ge
            if mask_t is not None:
                lv = lv.masked_fill(~mask_t, _NEG)
        K = torch.exp(logK)
    else:
        raise ValueError(f"method must be 'scaling' or 'log', got {method!r}")
    if valid is not None:
        K = K * valid
    return lu, lv, K, valid, fe, ge


def _chunks(B: int, chunk: Optional[int]):
    chunk = B if not chunk or chunk <= 0 else int(chunk)
    return [(i, min(i + chunk, B)) for i in range(0, B, chunk)]


def _split(x: Optional[Tensor], chunk: int):
    """Chunks of x along dim 0 as ONE split op: autograd then concatenates the chunk gradients
    once, instead of materialising a full-size zero gradient per sliced chunk."""
    if x is None:
        return None
    return x.split(chunk)


def _default_chunk(N: int, M: int) -> int:
    # keep one chunk's kernel around 1 MiB (fits the per-core L2 cache; measured best on CPU)
    return max(1, (1 << 20) // (4 * N * M))


def uot_dense(
    C: Tensor,
    mu: Tensor,
    nu: Tensor,
    eps: float,
    tau_v: Optional[float],
    tau_t: Optional[float],
    n_iter: int,
    *,
    mask_v: Optional[Tensor] = None,
    mask_t: Optional[Tensor] = None,
    method: str = "scaling",
    chunk: Optional[int] = None,
    return_potentials: bool = False,
):
    """Entropic unbalanced OT plan for a batch of problems.

    C: [..., N, M] cost, mu: [..., N], nu: [..., M] positive reference masses.
    tau_v / tau_t = None (or inf) gives a hard marginal on that side (balanced when both are).
    Returns the plan Pi [..., N, M] (and (log_a, log_b) [..., N], [..., M] if
    ``return_potentials``), differentiable w.r.t. C, mu and nu. ``chunk`` pairs are solved per
    tensor program (default: ~1 MiB of kernel, cache-resident); all chunks use the same code.
    """
    lead, C, mu, nu, mask_v, mask_t = _flatten(C, mu, nu, mask_v, mask_t)
    B, N, M = C.shape
    eps = float(eps)
    av, at = _alpha(tau_v, eps), _alpha(tau_t, eps)
    lmu = _log_mass(mu, mask_v)
    lnu = _log_mass(nu, mask_t)
    plans, las, lbs = [], [], []
    ch = chunk if chunk is not None else _default_chunk(N, M)
    parts = [_split(x, ch) for x in (C, lmu, lnu, mask_v, mask_t)]
    for k in range(len(parts[0])):
        Ck, lmk, lnk, mv, mt = (p[k] if p is not None else None for p in parts)
        lu, lv, K, valid, fe, ge = _dense_solve(Ck, lmk, lnk, mv, mt, eps, av, at, n_iter, method)
        plans.append(torch.exp(lu)[:, :, None] * K * torch.exp(lv)[:, None, :])
        if return_potentials:
            las.append(lu + fe)
            lbs.append(lv + ge)
    plan = torch.cat(plans).reshape(*lead, N, M)
    if return_potentials:
        return plan, torch.cat(las).reshape(*lead, N), torch.cat(lbs).reshape(*lead, M)
    return plan


class _Fallback(Exception):
    pass


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
            c = lv.amax(dim=1, keepdim=True)
            x = torch.exp(lv - c)
            sv = _mv(K, x)
            if mask_v is not None:
                sv = torch.where(mask_v, sv, torch.ones_like(sv))
            if bool((sv < tiny).any()):
                raise _Fallback()
            lu = av * (lmu - c - torch.log(sv) + fe) - fe
            if mask_v is not None:
                lu = lu.masked_fill(~mask_v, _NEG)
            c2 = lu.amax(dim=1, keepdim=True)
            y = torch.exp(lu - c2)
            t = _mv(KT, y)
            if mask_t is not None:
                t = torch.where(mask_t, t, torch.ones_like(t))
            if bool((t < tiny).any()):
                raise _Fallback()
            lv = at * (lnu - c2 - torch.log(t))
            if mask_t is not None:
                lv = lv.masked_fill(~mask_t, _NEG)
            xs.append(x); ss.append(sv); ys.append(y); ts.append(t)
        if lu is None:
            lu = -fe
        u = torch.exp(lu - lu.amax(dim=1, keepdim=True))
        v = torch.exp(lv - lv.amax(dim=1, keepdim=True))
        if mask_v is not None:
            u = u * mask_v
        if mask_t is not None:
            v = v * mask_t
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
    C: Tensor,
    mu: Tensor,
    nu: Tensor,
    eps: float,
    tau_v: Optional[float],
    tau_t: Optional[float],
    n_iter: int,
    *,
    sim: Optional[Tensor] = None,
    mask_v: Optional[Tensor] = None,
    mask_t: Optional[Tensor] = None,
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


def sinkhorn_balanced(C, mu, nu, eps, n_iter, *, mask_v=None, mask_t=None, method="scaling"):
    """Balanced entropic OT (the ``balanced-ot`` variant): hard marginals mu, nu (the limit
    tau_v, tau_t -> inf of Eq. 3). mu and nu must have equal total mass for a fixed point."""
    return uot_dense(C, mu, nu, eps, None, None, n_iter, mask_v=mask_v, mask_t=mask_t, method=method)


def dense_score(plan: Tensor, sim: Tensor, tanh: bool = False) -> Tensor:
    """Transported-mass-normalised average similarity sum(Pi * S) / sum(Pi) (Eq. 8, dense)."""
    num = (plan * sim).sum(dim=(-2, -1))
    den = plan.sum(dim=(-2, -1)).clamp_min(torch.finfo(plan.dtype).tiny)
    s = num / den
    return torch.tanh(s) if tanh else s


# --------------------------------------------------------------------------------------------
# Low rank (Nystrom with concept anchors), Algorithm 1
# --------------------------------------------------------------------------------------------


def _grouped_left(W: Tensor, X: Tensor, index: Optional[Tensor]) -> Tensor:
    """out[p] = W[p] @ X[index[p]] for W [P,r,n], X [G,n,d]; without index, a plain bmm."""
    if index is None:
        return torch.bmm(W, X)
    P, r, n = W.shape
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=X.shape[0]).tolist()
    # one split / unbind each (not per-group slicing: autograd would build a full-size zero
    # gradient per slice)
    Wg = W[order].split(counts)
    Xg = X.unbind(0)
    outs = [(Wg[g].reshape(c * r, n) @ Xg[g]).reshape(c, r, -1) for g, c in enumerate(counts) if c]
    out = torch.cat(outs)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(P, device=order.device)
    return out[inv]


def _groups(index: Optional[Tensor], G: int):
    """(order or None when already sorted, inverse order, counts) of pairs grouped by index."""
    if index is None:
        return None
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=G).tolist()
    if bool((order == torch.arange(order.shape[0], device=order.device)).all()):
        return None, None, counts
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.shape[0], device=order.device)
    return order, inv, counts


def _spans(counts):
    """(group, start, end) of the non-empty groups of pairs sorted by group."""
    s = 0
    for g, c in enumerate(counts):
        if c:
            yield g, s, s + c
            s += c


def _gl(W: Tensor, X: Tensor, grp) -> Tensor:
    """out[p] = W[p] @ X[index[p]] for W [P,r,n], X [G,n,d] (grp = _groups(index)): one GEMM per
    group written in place; without grp, a plain bmm."""
    if grp is None:
        return torch.bmm(W, X)
    order, inv, counts = grp
    P, r, n = W.shape
    d = X.shape[2]
    Ws = (W if order is None else W[order]).contiguous()
    out = W.new_empty(P, r, d)
    s = 0
    for g, c in enumerate(counts):
        if c:
            torch.mm(Ws[s:s + c].view(c * r, n), X[g], out=out[s:s + c].view(c * r, d))
            s += c
    return out if order is None else out[inv]


def _gt(W: Tensor, D: Tensor, grp, G: int) -> Tensor:
    """out[g] = sum_{p: index[p] = g} W[p]^T @ D[p] for W [P,r,n], D [P,r,d] -> [G,n,d] (the
    adjoint of :func:`_gl` in X); without grp, a plain bmm."""
    if grp is None:
        return torch.bmm(W.transpose(1, 2), D)
    order, inv, counts = grp
    P, r, n = W.shape
    d = D.shape[2]
    Ws = (W if order is None else W[order]).contiguous()
    Ds = (D if order is None else D[order]).contiguous()
    out = W.new_empty(G, n, d)
    s = 0
    for g, c in enumerate(counts):
        if c:
            torch.mm(Ws[s:s + c].view(c * r, n).t(), Ds[s:s + c].view(c * r, d), out=out[g])
            s += c
        else:
            out[g].zero_()
    return out


def _amax_grad(x: Tensor, c: Tensor, gc: Tensor) -> Tensor:
    # autograd's amax backward: the gradient is shared evenly between tied maxima
    hit = (x == c).to(x.dtype)
    return hit * (gc / hit.sum(dim=1, keepdim=True))


class _LowRankScoreFn(torch.autograd.Function):
    """Fused low-rank iterations (Algorithm 1, as in :func:`uot_lowrank`) + implicit Eq. 8 score
    with a hand-written backward of the L unrolled iterations. The same operations as the
    autograd path (including the amax shifts, the q floor, centring and clamping, and their
    autograd sub-gradients); the kernel gradients of all 2L mat-vec pairs are two batched
    [.., 2L+1] x [2L+1, ..] products. The score's products are grouped per image / caption
    (one GEMM each) forward and backward. Raises _Fallback when the score's denominator is
    clamped (the caller then uses the autograd path). Checked against autograd by
    tests/test_ot.py (gradcheck in float64)."""

    @staticmethod
    def forward(ctx, M1, Kpy, row_shift, col_shift, lmu, lnu, Z, Y, mask_v, mask_t, img_index,
                txt_index, consts):
        av, at, n_iter, center, clamp, q_floor = consts
        M1T = M1.transpose(1, 2)
        KpyT = Kpy.transpose(1, 2)

        def post(x, mask):
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

        def logq(v_log, first, second_T):
            c = v_log.amax(dim=1, keepdim=True)
            ev = torch.exp(v_log - c)
            h = _mv(second_T, ev)
            q = _mv(first, h)
            thr = q_floor * q.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            ok = q >= thr
            q = q.clamp_min(thr)
            return c + torch.log(q), (v_log, c, ev, h, q, ok)

        lb = col_shift
        if mask_t is not None:
            lb = lb.masked_fill(~mask_t, _NEG)
        saved = []
        la = None
        for _ in range(int(n_iter)):
            Lq, s1 = logq(lb, M1, Kpy)
            la, k1 = post(av * (lmu - row_shift - Lq) + row_shift, mask_v)
            Lq, s2 = logq(la, KpyT, M1T)
            lb, k2 = post(at * (lnu - col_shift - Lq) + col_shift, mask_t)
            saved.append((s1, k1, s2, k2))
        a = torch.exp(la - la.amax(dim=1, keepdim=True))
        b = torch.exp(lb - lb.amax(dim=1, keepdim=True))
        if mask_v is not None:
            a = a * mask_v
        if mask_t is not None:
            b = b * mask_t
        B, N, r = M1.shape
        gi = _groups(img_index, Z.shape[0])
        gt = _groups(txt_index, Y.shape[0])
        Wt = torch.empty(B, r, N, dtype=M1.dtype, device=M1.device)
        torch.mul(M1.transpose(1, 2), a[:, None, :], out=Wt)  # [B,r,N] = (diag(a) M1)^T
        Vt = Kpy * b[:, None, :]
        M = Kpy.shape[2]
        d = Z.shape[2]
        A = _gl(Wt, Z, gi)  # [B,r,d] = M1^T diag(a) Z: image side, one GEMM per image
        # caption side in caption order: num = <A Y^T, diag-scaled Kpy> (A Y^T is [B,r,M]; the
        # [B,r,d] product Kpy diag(b) Y is only formed in the backward)
        if gt is None:
            ot = inv_t = None
            A_c, Vt_c = A, Vt
            G_c = torch.bmm(A, Y.transpose(1, 2))
        else:
            ot, inv_t, ct = gt
            A_c = A if ot is None else A[ot]
            Vt_c = Vt if ot is None else Vt[ot]
            G_c = A.new_empty(B, r, M)
            for g, s0, s1 in _spans(ct):
                torch.mm(A_c[s0:s1].view(-1, d), Y[g].t(), out=G_c[s0:s1].view(-1, M))
        num = (G_c * Vt_c).sum((1, 2))
        if inv_t is not None:
            num = num[inv_t]
        u1 = torch.bmm(a[:, None, :], M1).squeeze(1)
        w1 = _mv(Kpy, b)
        den = (u1 * w1).sum(-1)
        if bool((den.abs() < 1e-12).any()):
            raise _Fallback()
        ctx.save_for_backward(M1, Kpy, Z, Y, a, b, Wt, Vt_c, A_c, G_c, u1, w1, num, den)
        ctx.saved = saved
        ctx.extra = (mask_v, mask_t, gi, gt, ot, inv_t)
        ctx.consts = consts
        return num / den

    @staticmethod
    def backward(ctx, g):
        M1, Kpy, Z, Y, a, b, Wt, Vt_c, A_c, G_c, u1, w1, num, den = ctx.saved_tensors
        mask_v, mask_t, gi, gt, ot, inv_t = ctx.extra
        av, at, n_iter, center, clamp, q_floor = ctx.consts
        gn = g / den
        gd = -g * num / den ** 2
        # --- score ----------------------------------------------------------------------------
        # num = <A, Bm>, A = Wt Z (image side), Bm = Vt Y (caption side); Bmg = gn * Bm
        gn_c = gn if ot is None else gn[ot]
        dVt = G_c * gn_c[:, None, None]  # gn A Y^T
        if ot is not None:
            dVt = dVt[inv_t]
        Vg_c = Vt_c * gn_c[:, None, None]
        need_y = ctx.needs_input_grad[7]
        dY = None
        if gt is None:
            Bmg = torch.bmm(Vg_c, Y)
            if need_y:
                dY = torch.bmm(Vg_c.transpose(1, 2), A_c)
        else:
            B, r, M = Vg_c.shape
            d = Y.shape[2]
            Bmg = Vg_c.new_empty(B, r, d)
            if need_y:
                dY = Vg_c.new_zeros(Y.shape)
            for g, s0, s1 in _spans(gt[2]):
                Vg = Vg_c[s0:s1].view(-1, M)
                torch.mm(Vg, Y[g], out=Bmg[s0:s1].view(-1, d))
                if need_y:
                    torch.mm(Vg.t(), A_c[s0:s1].view(-1, d), out=dY[g])
            if ot is not None:
                Bmg = Bmg[inv_t]
        dWt = _gl(Bmg, Z.transpose(1, 2), gi)  # [B,r,N]
        dZ = _gt(Wt, Bmg, gi, Z.shape[0]) if ctx.needs_input_grad[6] else None
        du1 = gd[:, None] * w1
        dw1 = gd[:, None] * u1
        M1T = M1.transpose(1, 2).contiguous()
        dM1 = (dWt * a[:, None, :]).transpose(1, 2)
        dKpy = dVt * b[:, None, :]
        da = (dWt * M1T).sum(1) + _mv(M1, du1)
        db = (dVt * Kpy).sum(1) + torch.bmm(dw1[:, None, :], Kpy).squeeze(1)
        # rank-1 kernel terms, summed at the end as one product each
        m1_l, m1_r, kp_l, kp_r = [a], [du1], [dw1], [b]
        gla = da * a  # the max shift of a, b cancels exactly in the ratio
        glb = db * b
        grs = torch.zeros_like(gla)
        gcs = torch.zeros_like(glb)
        glmu = torch.zeros_like(gla)
        glnu = torch.zeros_like(glb)

        def post_back(gx, keep, mask):
            if mask is not None:
                gx = gx * mask
            if keep is not None:
                gx = gx * keep
            if center:
                if mask is None:
                    gx = gx - gx.mean(dim=1, keepdim=True)
                else:
                    cnt = mask.sum(dim=1, keepdim=True).clamp_min(1)
                    gx = gx - mask * (gx.sum(dim=1, keepdim=True) / cnt)
            return gx

        def logq_back(gL, s):
            v_log, c, ev, h, q, ok = s
            gq = torch.where(ok, gL / q, torch.zeros_like(gL))
            return gq, gL.sum(1, keepdim=True), v_log, c, ev, h

        for l in range(int(n_iter) - 1, -1, -1):
            s1, k1, s2, k2 = ctx.saved[l]
            # b half: lb = post(at * (lnu - cs - Lq2) + cs)
            gp = post_back(glb, k2, mask_t)
            glnu = glnu + at * gp
            gcs = gcs + (1.0 - at) * gp
            gq, gc, v_log, c, ev, h = logq_back(-at * gp, s2)
            # q = Kpy^T h, h = M1^T ev
            dh = _mv(Kpy, gq)
            kp_l.append(h); kp_r.append(gq)
            dev = _mv(M1, dh)
            m1_l.append(ev); m1_r.append(dh)
            t = dev * ev
            gla = gla + t + _amax_grad(v_log, c, gc - t.sum(1, keepdim=True))
            # a half: la = post(av * (lmu - rs - Lq1) + rs)
            gp = post_back(gla, k1, mask_v)
            glmu = glmu + av * gp
            grs = grs + (1.0 - av) * gp
            gq, gc, v_log, c, ev, h = logq_back(-av * gp, s1)
            # q = M1 h, h = Kpy ev
            dh = torch.bmm(gq[:, None, :], M1).squeeze(1)
            m1_l.append(gq); m1_r.append(h)
            dev = torch.bmm(dh[:, None, :], Kpy).squeeze(1)
            kp_l.append(dh); kp_r.append(ev)
            t = dev * ev
            glb = t + _amax_grad(v_log, c, gc - t.sum(1, keepdim=True))
            gla = torch.zeros_like(gla)
        if mask_t is not None:
            glb = glb * mask_t
        gcs = gcs + glb
        dM1 = torch.baddbmm(dM1, torch.stack(m1_l, 2), torch.stack(m1_r, 1))
        dKpy = torch.baddbmm(dKpy, torch.stack(kp_l, 2), torch.stack(kp_r, 1))
        return dM1, dKpy, grs, gcs, glmu, glnu, dZ, dY, None, None, None, None, None


@dataclass
class LowRankUOT:
    """Implicit low-rank plan  Pi~ = diag(a) K_ZP (K_PP + lam I)^-1 K_PY diag(b).

    Stored in stabilised form: ``Kzp`` [B,N,r] and ``Kpy`` [B,r,M] are the sub-kernels with their
    row (resp. column) maximum divided out (entries in (0, 1]); ``M1 = Kzp K_PP^-1`` [B,N,r];
    ``la`` / ``lb`` are the log-scalings relative to these normalised sub-kernels, i.e.
    log a = la - row_shift, log b = lb - col_shift (row_shift_i = max_k (z_i.p_k - 1)/eps).
    No N x M matrix is ever formed except by :meth:`plan` (tests, small heatmaps).
    """

    la: Tensor
    lb: Tensor
    Kzp: Tensor
    Kpy: Tensor
    M1: Tensor
    row_shift: Tensor
    col_shift: Tensor
    mask_v: Optional[Tensor]
    mask_t: Optional[Tensor]

    @property
    def log_a(self) -> Tensor:
        return self.la - self.row_shift

    @property
    def log_b(self) -> Tensor:
        return self.lb - self.col_shift

    def _ab(self):
        # scalings up to a common positive factor per problem (cancels in ratios)
        a = torch.exp(self.la - self.la.amax(dim=1, keepdim=True))
        b = torch.exp(self.lb - self.lb.amax(dim=1, keepdim=True))
        if self.mask_v is not None:
            a = a * self.mask_v
        if self.mask_t is not None:
            b = b * self.mask_t
        return a, b

    def plan(self) -> Tensor:
        """Materialise Pi~ [B,N,M] (only for tests / visualisation)."""
        K = torch.bmm(self.M1, self.Kpy)
        P = torch.exp(self.la[:, :, None] + self.lb[:, None, :]) * K
        if self.mask_v is not None:
            P = P * self.mask_v[:, :, None]
        if self.mask_t is not None:
            P = P * self.mask_t[:, None, :]
        return P

    def score(self, Z: Tensor, Y: Tensor, tanh: bool = False, img_index: Optional[Tensor] = None,
              txt_index: Optional[Tensor] = None) -> Tensor:
        """Implicit Eq. 8: Tr(Z^T Pi~ Y) / 1^T Pi~ 1 without any N x M matrix.

        Z [B,N,d], Y [B,M,d] per pair; or, with ``img_index`` / ``txt_index`` (as passed to
        :func:`uot_lowrank`), Z [Bi,N,d] per image and Y [Bt,M,d] per caption: the products are
        then one GEMM per image / caption over all its pairs, without gathering Z and Y per pair."""
        a, b = self._ab()
        W = self.M1 * a[:, :, None]  # [B,N,r]: M1^T diag(a) Z = W^T Z
        Vt = self.Kpy * b[:, None, :]  # [B,r,M]: Kpy diag(b) Y
        A = _grouped_left(W.transpose(1, 2), Z, img_index)  # [B,r,d]
        Bm = _grouped_left(Vt, Y, txt_index)  # [B,r,d]
        num = torch.bmm(A.reshape(A.shape[0], 1, -1), Bm.reshape(Bm.shape[0], -1, 1)).reshape(-1)
        den = (torch.bmm(a[:, None, :], self.M1).squeeze(1) * _mv(self.Kpy, b)).sum(-1)
        # The Nystrom plan can have negative entries; keep the denominator away from 0 with its sign.
        tiny = 1e-12
        den = torch.where(den.abs() < tiny, torch.full_like(den, tiny), den)
        s = num / den
        return torch.tanh(s) if tanh else s

    def heatmap(self, token_weights: Tensor) -> Tensor:
        """h_i = sum_j Pi~_ij w_j (Section 2.6) for phrase indicator / weights w [B,M] -> [B,N]
        in the units of the true plan (O((N+M) r))."""
        ea = torch.exp(self.la)
        eb = torch.exp(self.lb)
        if self.mask_v is not None:
            ea = ea * self.mask_v
        if self.mask_t is not None:
            eb = eb * self.mask_t
        q = _mv(self.Kpy, eb * token_weights)
        return ea * _mv(self.M1, q)


def _normalize(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _solve_right(Kpp: Tensor, Kzp: Tensor) -> Tensor:
    """Kzp @ Kpp^-1 for symmetric Kpp [r,r] (shared) or [B,r,r]; linalg.solve, lstsq fallback."""
    r = Kpp.shape[-1]
    if Kpp.dim() == 2:
        rhs = Kzp.reshape(-1, r).t()  # [r, B*N]
    else:
        rhs = Kzp.transpose(-1, -2)
    sol = None
    try:
        sol = torch.linalg.solve(Kpp, rhs)
        if not bool(torch.isfinite(sol).all()):
            sol = None
    except RuntimeError:  # torch.linalg.LinAlgError (singular) subclasses RuntimeError
        sol = None
    if sol is None:
        sol = torch.linalg.lstsq(Kpp, rhs).solution
    if Kpp.dim() == 2:
        return sol.t().reshape(Kzp.shape)
    return sol.transpose(-1, -2)


def uot_lowrank(
    Z: Tensor,
    Y: Tensor,
    P: Tensor,
    mu: Tensor,
    nu: Tensor,
    eps: float,
    tau_v: Optional[float],
    tau_t: Optional[float],
    n_iter: int,
    *,
    mask_v: Optional[Tensor] = None,
    mask_t: Optional[Tensor] = None,
    img_index: Optional[Tensor] = None,
    txt_index: Optional[Tensor] = None,
    kpp_reg: float = 1e-2,
    center: bool = False,
    clamp: Optional[float] = None,
    q_floor: float = 1e-8,
    normalize_anchors: bool = True,
    _score: Optional[bool] = None,
) -> LowRankUOT:
    """Low-rank generalised Sinkhorn with r concept anchors (Algorithm 1), batched.

    Z [B,N,d], Y [B,M,d] (unit-norm rows), P [r,d] shared anchors (or [B,r,d]); mu [B,N], nu [B,M].
    With ``img_index`` / ``txt_index`` (long [Bp]) Z, mu, mask_v are per image [Bi,...] and Y, nu,
    mask_t per caption [Bt,...], and the Bp solved pairs are (img_index[p], txt_index[p]): the
    sub-kernels K_ZP and K_PP^-1 are then computed once per image instead of once per pair.

    Appendix H stabilisation, all options:
    * sub-kernels in the log domain with row-max (K_ZP) / column-max (K_PY) subtraction (always);
    * ``kpp_reg``: diagonal regularisation lambda of K_PP (paper: 1e-2);
    * ``center`` / ``clamp``: centre (subtract the mean) and clamp to [-clamp, clamp] the
      log-scalings after every update (paper: True / 20). Both change the fixed point (the paper
      notes this over-regularises); the defaults here are the exact Algorithm 1 so that the
      low-rank plan converges to the dense one as r grows. The scalings they act on are the ones
      relative to the row-max-normalised sub-kernels (our choice: the raw log-scalings carry the
      +-(1 - max cos)/eps row offsets, which the clamp would otherwise cut).
    * ``q_floor``: the Nystrom product can be <= 0 (K~ is not entrywise positive); as in
      Algorithm 1 (q + 1e-8) it is floored before the division, relative to the vector's scale.
    * linear solves: ``torch.linalg.solve`` with a ``lstsq`` fallback when it fails.
    Returns a :class:`LowRankUOT` (scalings a, b and the implicit plan).
    """
    eps = float(eps)
    av, at = _alpha(tau_v, eps), _alpha(tau_t, eps)
    P = _normalize(P) if normalize_anchors else P
    shared_P = P.dim() == 2
    r = P.shape[-2]

    # --- sub-kernels (log domain, max-subtracted) --------------------------------------------
    if shared_P:
        logZP = (torch.matmul(Z, P.t()) - 1.0) / eps  # [Bi,N,r]
        logPY = (torch.matmul(P, Y.transpose(1, 2)) - 1.0) / eps  # [Bt,r,M]
        Kpp = torch.exp((P @ P.t() - 1.0) / eps)
    else:
        logZP = (torch.bmm(Z, P.transpose(1, 2)) - 1.0) / eps
        logPY = (torch.bmm(P, Y.transpose(1, 2)) - 1.0) / eps
        Kpp = torch.exp((torch.bmm(P, P.transpose(1, 2)) - 1.0) / eps)
    eye = torch.eye(r, dtype=Kpp.dtype, device=Kpp.device)
    Kpp = Kpp + kpp_reg * eye

    row_shift = logZP.amax(dim=2)  # [Bi,N]
    col_shift = logPY.amax(dim=1)  # [Bt,M]
    Kzp = torch.exp(logZP - row_shift[..., None])
    Kpy = torch.exp(logPY - col_shift[:, None, :])

    # M1 = Kzp Kpp^-1 (K_PP symmetric): M1^T = solve(Kpp, Kzp^T). With shared anchors this is ONE
    # factorisation and one multi-right-hand-side solve for the whole batch.
    M1 = _solve_right(Kpp, Kzp)

    unsort = None
    if _score is not None and img_index is not None and int(n_iter) >= 1:
        # fused path: pairs in image order, so that the score's per-image GEMMs read contiguous
        # slices (results are scattered back to the caller's order at the end)
        unsort = torch.argsort(img_index, stable=True)
        img_index = img_index[unsort]
        if txt_index is not None:
            txt_index = txt_index[unsort]
    if img_index is not None:
        Kzp, M1, row_shift, mu = Kzp[img_index], M1[img_index], row_shift[img_index], mu[img_index]
        if mask_v is not None:
            mask_v = mask_v[img_index]
    if txt_index is not None:
        Kpy, col_shift, nu = Kpy[txt_index], col_shift[txt_index], nu[txt_index]
        if mask_t is not None:
            mask_t = mask_t[txt_index]
    if mask_v is not None:
        mask_v = mask_v.to(torch.bool)
    if mask_t is not None:
        mask_t = mask_t.to(torch.bool)

    lmu = _log_mass(mu, mask_v)
    lnu = _log_mass(nu, mask_t)
    if _score is not None and int(n_iter) >= 1:
        try:
            s = _LowRankScoreFn.apply(M1, Kpy, row_shift, col_shift, lmu, lnu, Z, Y, mask_v, mask_t,
                                      img_index, txt_index, (av, at, int(n_iter), center, clamp, q_floor))
            s = torch.tanh(s) if _score else s
            return s if unsort is None else torch.empty_like(s).index_put((unsort,), s)
        except _Fallback:
            pass

    def post(x, mask):
        if center:
            if mask is None:
                x = x - x.mean(dim=1, keepdim=True)
            else:
                cnt = mask.sum(dim=1, keepdim=True).clamp_min(1)
                x = x - (x * mask).sum(dim=1, keepdim=True) / cnt
        if clamp is not None:
            x = x.clamp(-clamp, clamp)
        if mask is not None:
            x = x.masked_fill(~mask, _NEG)
        return x

    def logq(v_log, first, second_T):
        # log( first @ (second_T @ exp(v_log)) ) with a max shift; floored (Nystrom may be <= 0)
        c = v_log.amax(dim=1, keepdim=True)
        ev = torch.exp(v_log - c)
        q = _mv(first, _mv(second_T, ev))
        q = q.clamp_min(q_floor * q.detach().abs().amax(dim=1, keepdim=True).clamp_min(1e-30))
        return c + torch.log(q)

    # b = 1 initially:  lb = log b + col_shift
    lb = col_shift
    if mask_t is not None:
        lb = lb.masked_fill(~mask_t, _NEG)
    la = None
    KpyT = Kpy.transpose(1, 2)
    M1T = M1.transpose(1, 2)
    for _ in range(int(n_iter)):
        # q = K~ b ; true log q_i = logq - row_shift_i ... with b = exp(lb - col_shift):
        #   K~ b = e^{row_shift} * M1 Kpy e^{lb}  ->  log a = alpha (log mu - row_shift - L)
        #   la = log a + row_shift
        L = logq(lb, M1, Kpy)
        la = av * (lmu - row_shift - L) + row_shift
        la = post(la, mask_v)
        L = logq(la, KpyT, M1T)
        lb = at * (lnu - col_shift - L) + col_shift
        lb = post(lb, mask_t)
    if la is None:
        la = row_shift.clone()
    res = LowRankUOT(la, lb, Kzp, Kpy, M1, row_shift, col_shift, mask_v, mask_t)
    if _score is not None:
        s = res.score(Z, Y, tanh=_score, img_index=img_index, txt_index=txt_index)
        return s if unsort is None else torch.empty_like(s).index_put((unsort,), s)
    return res


def uot_lowrank_score(
    Z: Tensor,
    Y: Tensor,
    P: Tensor,
    mu: Tensor,
    nu: Tensor,
    eps: float,
    tau_v: Optional[float],
    tau_t: Optional[float],
    n_iter: int,
    *,
    tanh: bool = False,
    method: str = "fused",
    **kw,
) -> Tensor:
    """``uot_lowrank(Z, Y, P, ...).score(Z, Y, tanh, img_index, txt_index)`` (the same function,
    same keyword options as :func:`uot_lowrank`) computed by one fused pass with a hand-written
    backward of the iterations and of the score (``method="fused"``, the training path), falling
    back to the autograd path when the score's denominator is clamped; ``method="autograd"`` is
    the reference path. Returns [B] scores."""
    if method not in ("fused", "autograd"):
        raise ValueError(f"method must be 'fused' or 'autograd', got {method!r}")
    if method == "autograd":
        res = uot_lowrank(Z, Y, P, mu, nu, eps, tau_v, tau_t, n_iter, **kw)
        return res.score(Z, Y, tanh=tanh, img_index=kw.get("img_index"), txt_index=kw.get("txt_index"))
    return uot_lowrank(Z, Y, P, mu, nu, eps, tau_v, tau_t, n_iter, _score=bool(tanh), **kw)


def pair_similarities(Z: Tensor, Y: Tensor, img_index: Tensor, txt_index: Tensor):
    """Token similarities of pairs, grouped by image: returns (S, order) with
    S[k] = Z[img_index[order[k]]] @ Y[txt_index[order[k]]]^T  [P, N, M] and ``order`` the
    stable sort of the pairs by image. One [N, d] x [d, c*M] GEMM per image instead of P small
    ones (about 2x faster on CPU); callers gather the other per-pair inputs with ``order`` and
    scatter their per-pair results back with it."""
    order = torch.argsort(img_index, stable=True)
    counts = torch.bincount(img_index, minlength=Z.shape[0]).tolist()
    N, d = Z.shape[1:]
    M = Y.shape[1]
    Ys = Y[txt_index[order]].split(counts)
    Zs = Z.unbind(0)
    outs = [(Zs[g] @ Ys[g].reshape(c * M, d).t()).reshape(N, c, M).transpose(0, 1)
            for g, c in enumerate(counts) if c]
    return torch.cat(outs), order


def anchor_diversity(P: Tensor) -> Tensor:
    """Omega_div(P) = 1/(r(r-1)) sum_{k != l} (p_k . p_l)^2 on the unit-normalised anchors."""
    Pn = _normalize(P)
    G = Pn @ Pn.t()
    r = G.shape[0]
    off = G - torch.diag_embed(torch.diagonal(G))
    return (off ** 2).sum() / (r * (r - 1))
