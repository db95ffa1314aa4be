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




def _spans(counts):
    """(group, start, end) of the non-empty groups of pairs sorted by group."""
    s = 0
    for g, c in enumerate(counts):
        if c:
            yield g, s, s + c
            s += c






class _Layout:
    """Pairs grouped by an index (image or caption) for the fused low-rank path.

    Per-pair vectors are moved into a zero-padded [G, cmax, .] layout so that a per-group matrix
    (M1 of an image, K_PY of a caption) multiplies all its pairs' vectors in one batched product:
    each matrix is read once per group instead of being copied once per pair (gathering M1 per
    pair streamed 14 MB per mat-vec at the benchmark size, and autograd's backward of that gather
    cost more than the mat-vecs). All data movement is by ``index_select`` (a gather; on CPU it
    runs 5-10x faster than an indexed write of the same size). Without an index (independent
    pairs) every pair is its own group and the products are plain bmm's."""

    def __init__(self, index: Optional[Tensor], G: int, P: int):
        self.index = index
        self.G = G if index is not None else P
        self.slot = None
        self.order = self.inv = None
        self.spans = []
        if index is None:
            self.cmax = 1
            return
        dev = index.device
        counts = torch.bincount(index, minlength=G)
        self.cmax = max(int(counts.max()), 1) if P else 1
        order = torch.argsort(index, stable=True)
        start = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(index)
        rank[order] = torch.arange(P, device=dev) - start[index[order]]
        self.slot = index * self.cmax + rank  # padded position of each pair
        self.src = torch.full((self.G * self.cmax,), P, dtype=index.dtype, device=dev)
        self.src[self.slot] = torch.arange(P, device=dev)  # pair of each padded position (P: empty)
        if not bool((order == torch.arange(P, device=dev)).all()):
            self.order = order
            self.inv = torch.empty_like(order)
            self.inv[order] = torch.arange(P, device=dev)
        self.spans = list(_spans(counts.tolist()))

    def gather(self, x: Tensor) -> Tensor:
        """Per-group rows -> per-pair rows."""
        return x if self.index is None else x.index_select(0, self.index)

    def segsum(self, x: Tensor) -> Tensor:
        """Per-pair rows -> per-group sums (the adjoint of :meth:`gather`)."""
        if self.index is None:
            return x
        return x.new_zeros((self.G,) + tuple(x.shape[1:])).index_add_(0, self.index, x)

    def take(self, x: Tensor, s0: int, s1: int) -> Tensor:
        """Rows of x (pairs in the caller's order) of the pairs at sorted positions s0:s1."""
        return x[s0:s1] if self.order is None else x.index_select(0, self.order[s0:s1])

    def sorted(self, x: Tensor) -> Tensor:
        return x if self.order is None else x.index_select(0, self.order)

    def unsorted(self, x: Tensor) -> Tensor:
        return x if self.inv is None else x.index_select(0, self.inv)

    def pad(self, v: Tensor) -> Tensor:
        """[P, ...] -> [G, cmax, ...] (zeros in unused slots)."""
        if self.slot is None:
            return v.unsqueeze(1)
        tail = tuple(v.shape[1:])
        ext = torch.cat([v, v.new_zeros((1,) + tail)])
        return ext.index_select(0, self.src).view((self.G, self.cmax) + tail)

    def unpad(self, x: Tensor) -> Tensor:
        if self.slot is None:
            return x.squeeze(1)
        return x.reshape((self.G * self.cmax,) + tuple(x.shape[2:])).index_select(0, self.slot)

    def mv(self, X: Tensor, v: Tensor) -> Tensor:
        """out[p] = X[g_p] @ v[p] for X [G,n,m], v [P,m] -> [P,n]."""
        return self.unpad(torch.bmm(self.pad(v), X.transpose(1, 2)))

    def mvt(self, X: Tensor, w: Tensor) -> Tensor:
        """out[p] = X[g_p]^T @ w[p] for X [G,n,m], w [P,n] -> [P,m]."""
        return self.unpad(torch.bmm(self.pad(w), X))

    def outer_sum(self, Lm: Tensor, Rm: Tensor) -> Tensor:
        """out[g] = sum_{p in g} Lm[p]^T @ Rm[p] for Lm [P,k,n], Rm [P,k,m] -> [G,n,m]."""
        if self.slot is None:
            return torch.bmm(Lm.transpose(1, 2), Rm)
        if self.order is None:  # pairs already grouped: one GEMM per group, no padding
            n, m = Lm.shape[2], Rm.shape[2]
            out = Lm.new_zeros(self.G, n, m)
            for g, s0, s1 in self.spans:
                torch.mm(Lm[s0:s1].reshape(-1, n).t(), Rm[s0:s1].reshape(-1, m), out=out[g])
            return out
        k = Lm.shape[1]
        Lp = self.pad(Lm).reshape(self.G, self.cmax * k, -1)
        Rp = self.pad(Rm).reshape(self.G, self.cmax * k, -1)
        return torch.bmm(Lp.transpose(1, 2), Rp)


def _amax_grad(x: Tensor, c: Tensor, gc: Tensor, dim: int = 1) -> Tensor:
    # autograd's amax backward: the gradient is shared evenly between tied maxima
    hit = (x == c).to(x.dtype)
    return hit * (gc / hit.sum(dim=dim, keepdim=True))


class _LowRankScoreFn(torch.autograd.Function):
    """The whole conceptot training computation in one Function with a hand-written backward:
    sub-kernels (K_ZP per image, K_PY per caption, K_PP^-1 once for the shared anchors), the L
    low-rank iterations (Algorithm 1, as in :func:`uot_lowrank`) and the implicit Eq. 8 score.
    The same operations as the autograd path (including the amax shifts, the q floor, centring and
    clamping, and their autograd sub-gradients), except that kernel entries and products below
    the dtype's smallest normal number are flushed to 0 (denormals made the GEMMs ~10x slower).
    Inputs: Z [Bi,N,d] per image, Y [Bt,M,d] per caption, unit anchors Pn [r,d], per-pair log
    masses; pairs must be sorted by image. The iterations' mat-vecs use :class:`_Layout` (each
    M1 / K_PY read once per image / caption), the kernel gradients of all 2L mat-vec pairs are
    one product per image / caption, and the score's N x r x d and M x r x d products are one
    GEMM per image / caption, forward and backward, optionally in bfloat16 (``gemm_dtype``; the
    sub-kernels, iterations, denominator and all reductions stay in the input dtype). Raises
    _Fallback when K_PP cannot be inverted or the score's denominator is clamped (the caller
    then uses the autograd path). Checked against autograd by tests/test_ot.py (values and
    float64 gradients to 1e-9, gradcheck)."""

    @staticmethod
    def forward(ctx, Z, Y, Pn, lmu, lnu, mask_v, mask_t, img_index, txt_index, consts):
        av, at, n_iter, center, clamp, q_floor, gemm_dtype, eps, kpp_reg = consts
        P = lmu.shape[0]
        im = _Layout(img_index, Z.shape[0], P)
        tx = _Layout(txt_index, Y.shape[0], P)
        if im.order is not None:
            raise ValueError("_LowRankScoreFn: pairs must be sorted by image")
        # sub-kernels as in uot_lowrank (log domain, max-subtracted), once per image / caption
        r = Pn.shape[0]
        tiny = torch.finfo(Z.dtype).tiny
        logZP = torch.matmul(Z, Pn.t()).sub_(1.0).div_(eps)  # [Bi,N,r]
        rs_i = logZP.amax(dim=2)
        Kzp = torch.exp(logZP - rs_i[..., None])
        Kzp.masked_fill_(Kzp < tiny, 0.0)  # no denormals (they run ~10x slower in the GEMMs)
        logPY = torch.matmul(Pn, Y.transpose(1, 2)).sub_(1.0).div_(eps)  # [Bt,r,M]
        cs_t = logPY.amax(dim=1)
        Kpy = torch.exp(logPY - cs_t[:, None, :])
        Kpy.masked_fill_(Kpy < tiny, 0.0)
        Kpp_e = torch.exp((Pn @ Pn.t() - 1.0) / eps)
        inv, info = torch.linalg.inv_ex(Kpp_e + kpp_reg * torch.eye(r, dtype=Z.dtype, device=Z.device))
        if int(info) != 0 or not bool(torch.isfinite(inv).all()):
            raise _Fallback()
        M1 = torch.matmul(Kzp, inv)  # Kzp K_PP^-1 (K_PP^-1 symmetric)
        row_shift = im.gather(rs_i)
        col_shift = tx.gather(cs_t)

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

        def logq(v_log, inner, outer):
            c = v_log.amax(dim=1, keepdim=True)
            ev = torch.exp(v_log - c)
            h = inner(ev)
            q = outer(h)
            thr = q_floor * q.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            ok = q >= thr
            q = q.clamp_min(thr)
            return c + torch.log(q), (v_log, c, ev, h, q, ok)

        def kpy_ev(ev):
            return tx.mv(Kpy, ev)

        def m1_h(h):
            return im.mv(M1, h)

        def m1t_ev(ev):
            return im.mvt(M1, ev)

        def kpyt_h(h):
            return tx.mvt(Kpy, h)

        lb = col_shift
        if mask_t is not None:
            lb = lb.masked_fill(~mask_t, _NEG)
        saved = []
        la = None
        for _ in range(int(n_iter)):
            Lq, s1 = logq(lb, kpy_ev, m1_h)
            la, k1 = post(av * (lmu - row_shift - Lq) + row_shift, mask_v)
            Lq, s2 = logq(la, m1t_ev, kpyt_h)
            lb, k2 = post(at * (lnu - col_shift - Lq) + col_shift, mask_t)
            saved.append((s1, k1, s2, k2))
        a = torch.exp(la - la.amax(dim=1, keepdim=True))
        b = torch.exp(lb - lb.amax(dim=1, keepdim=True))
        if mask_v is not None:
            a = a * mask_v
        if mask_t is not None:
            b = b * mask_t

        # --- score numerator <A_p, Kpy_t diag(b_p) Y_t>, A_p = M1_g^T diag(a_p) Z_g -----------
        N, r = M1.shape[1:]
        M = Kpy.shape[2]
        d = Z.shape[2]
        gd = gemm_dtype or Z.dtype
        M1T = M1.transpose(1, 2).contiguous()  # [G, r, N]: per-pair slices below are contiguous
        # Z in the GEMM dtype: whole for independent pairs, else one image at a time (no Z-sized copy)
        Zc = Z.to(gd) if im.slot is None else None
        Yc = Y.to(gd)
        A = Z.new_empty(P, r, d, dtype=gd)  # image order
        if im.slot is None:
            torch.bmm((M1T * a[:, None, :]).to(gd), Zc, out=A)
        else:
            wbuf = A.new_empty(im.cmax * r * N)  # W_p = M1_g^T diag(a_p), written in the GEMM dtype
            for g, s0, s1 in im.spans:
                Wg = wbuf[:(s1 - s0) * r * N].view(s1 - s0, r, N)
                torch.mul(M1T[g], a[s0:s1, None, :], out=Wg)
                torch.mm(Wg.view(-1, N), Z[g].to(gd), out=A[s0:s1].view(-1, d))
        # caption side, one GEMM per caption over its pairs: G_p = A_p Y_t^T [r, M], then
        # GK_p = sum_k G_p[k, :] * Kpy_t[k, :] and num_p = GK_p . b_p
        # G and GK are kept in caption order (tx.sorted); A is read per caption by a gather
        if tx.slot is None:
            G = torch.bmm(A, Yc.transpose(1, 2)).to(Z.dtype)
            GK = (G * Kpy).sum(1)
        else:
            G = a.new_empty(P, r, M)
            GK = a.new_empty(P, M)
            for t, s0, s1 in tx.spans:
                Gt = (tx.take(A, s0, s1).view(-1, d) @ Yc[t].t()).view(s1 - s0, r, M)
                G[s0:s1] = Gt
                torch.sum(G[s0:s1] * Kpy[t], 1, out=GK[s0:s1])
            GK = tx.unsorted(GK)
        num = (GK * b).sum(1)
        u1 = im.mvt(M1, a)  # a^T M1
        w1 = tx.mv(Kpy, b)  # Kpy b
        den = (u1 * w1).sum(-1)
        if bool((den.abs() < 1e-12).any()):
            raise _Fallback()
        ctx.save_for_backward(M1, M1T, Kpy, Z, Y, Zc if Zc is not None else Z, Yc, a, b, A, G, GK, u1, w1, num, den,
                              Pn, logZP, rs_i, Kzp, logPY, cs_t, Kpp_e, inv)
        ctx.saved = saved
        ctx.extra = (mask_v, mask_t, im, tx)
        ctx.consts = consts
        return num / den

    @staticmethod
    def backward(ctx, g):
        (M1, M1T, Kpy, Z, Y, Zc, Yc, a, b, A, G, GK, u1, w1, num, den,
         Pn, logZP, rs_i, Kzp, logPY, cs_t, Kpp_e, inv) = ctx.saved_tensors
        mask_v, mask_t, im, tx = ctx.extra
        av, at, n_iter, center, clamp, q_floor, gemm_dtype, eps, kpp_reg = ctx.consts
        gdt = gemm_dtype or Z.dtype
        P = a.shape[0]
        N, r = M1.shape[1:]
        M, d = Y.shape[1:]
        gn = g / den
        gd = -g * num / den ** 2
        need_z, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # --- score, caption side: Vg_p = gn_p Kpy_t diag(b_p); Bmg_p = Vg_p Y_t = dnum/dA_p;
        # dY_t = sum_p Vg_p^T A_p; dKpy_t = sum_p gn_p G_p diag(b_p); db_p = gn_p GK_p
        gb = gn[:, None] * b  # [P, M]
        db = gn[:, None] * GK
        dY = Y.new_zeros(Y.shape) if (need_y and tx.slot is not None) else None
        if tx.slot is None:
            Vg = (Kpy * gb[:, None, :])
            Bmg = torch.bmm(Vg.to(gdt), Yc)
            dKpy = G * gb[:, None, :]
            if need_y:
                dY = torch.bmm(Vg.to(gdt).transpose(1, 2), A).to(Y.dtype)
        else:
            Bmg_c = A.new_empty(P, r, d)  # caption order
            dKpy = Kpy.new_zeros(Kpy.shape)
            gb_c = tx.sorted(gb)
            for t, s0, s1 in tx.spans:
                c = s1 - s0
                gbt = gb_c[s0:s1, None, :]  # [c, 1, M]
                Vg = (Kpy[t] * gbt).to(gdt).view(-1, M)  # [c*r, M]
                torch.mm(Vg, Yc[t], out=Bmg_c[s0:s1].view(-1, d))
                torch.sum(G[s0:s1] * gbt, 0, out=dKpy[t])
                if need_y:
                    dY[t] = (Vg.t() @ tx.take(A, s0, s1).view(-1, d)).to(Y.dtype)
        # --- score, image side (pairs in image order): dWt_p = Bmg_p Z_g^T [r, N];
        # dM1_g = sum_p (dWt_p diag(a_p))^T; da_p = sum_k dWt_p * M1_g^T; dZ_g = sum_p Wt_p^T Bmg_p
        dZ = None
        if im.slot is None:
            if tx.slot is not None:
                Bmg = tx.unsorted(Bmg_c)
            D = torch.bmm(Bmg, Zc.transpose(1, 2))  # [P, r, N]
            dM1 = (D * a[:, None, :]).transpose(1, 2)
            da = (D * M1T).sum(1)
            if need_z:
                dZ = torch.bmm((M1 * a[:, :, None]).to(gdt), Bmg).to(Z.dtype)  # (diag(a) M1) Bmg
        else:
            dM1 = M1.new_zeros(M1.shape)
            da = a.new_empty(a.shape)
            if need_z:
                # images without pairs stay 0; in bf16 each image's product goes through a small scratch
                dZ = Z.new_empty(Z.shape)
                zbuf = None if gdt == Z.dtype else Z.new_empty((N, d), dtype=gdt)
                covered = torch.zeros(im.G, dtype=torch.bool)
                covered[[s[0] for s in im.spans]] = True
                if not bool(covered.all()):
                    dZ[~covered] = 0
            wbuf = A.new_empty(im.cmax * r * N)
            for gi, s0, s1 in im.spans:
                if tx.slot is None:
                    Bg = Bmg[s0:s1].view(-1, d)
                elif tx.inv is None:
                    Bg = Bmg_c[s0:s1].view(-1, d)
                else:
                    Bg = Bmg_c.index_select(0, tx.inv[s0:s1]).view(-1, d)  # [c*r, d]
                D = (Bg @ Z[gi].to(gdt).t()).view(s1 - s0, r, N)  # GEMM dtype; promoted in the products
                ag = a[s0:s1, None, :]
                torch.sum(D * ag, 0, out=dM1[gi].t())
                torch.sum(D * M1T[gi], 1, out=da[s0:s1])
                if need_z:
                    Wg = wbuf[:(s1 - s0) * r * N].view(-1, N)
                    torch.mul(M1T[gi], ag, out=Wg.view(s1 - s0, r, N))
                    if zbuf is None:
                        torch.mm(Wg.t(), Bg, out=dZ[gi])
                    else:
                        dZ[gi].copy_(torch.mm(Wg.t(), Bg, out=zbuf))
        du1 = gd[:, None] * w1
        dw1 = gd[:, None] * u1
        da = da + im.mv(M1, du1)
        db = db + tx.mvt(Kpy, dw1)
        # rank-1 kernel terms, summed at the end as one product per side
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
            # b half: lb = post(at * (lnu - cs - Lq2) + cs); q2 = Kpy^T h, h = M1^T ev
            gp = post_back(glb, k2, mask_t)
            glnu = glnu + at * gp
            gcs = gcs + (1.0 - at) * gp
            gq, gc, v_log, c, ev, h = logq_back(-at * gp, s2)
            dh = tx.mv(Kpy, gq)
            kp_l.append(h)
            kp_r.append(gq)
            dev = im.mv(M1, dh)
            m1_l.append(ev)
            m1_r.append(dh)
            t = dev * ev
            gla = gla + t + _amax_grad(v_log, c, gc - t.sum(1, keepdim=True))
            # a half: la = post(av * (lmu - rs - Lq1) + rs); q1 = M1 h, h = Kpy ev
            gp = post_back(gla, k1, mask_v)
            glmu = glmu + av * gp
            grs = grs + (1.0 - av) * gp
            gq, gc, v_log, c, ev, h = logq_back(-av * gp, s1)
            dh = im.mvt(M1, gq)
            m1_l.append(gq)
            m1_r.append(h)
            dev = tx.mvt(Kpy, dh)
            kp_l.append(dh)
            kp_r.append(ev)
            t = dev * ev
            glb = t + _amax_grad(v_log, c, gc - t.sum(1, keepdim=True))
            gla = torch.zeros_like(gla)
        if mask_t is not None:
            glb = glb * mask_t
        gcs = gcs + glb
        dM1 = dM1 + im.outer_sum(torch.stack(m1_l, 1), torch.stack(m1_r, 1))
        dKpy = dKpy + tx.outer_sum(torch.stack(kp_l, 1), torch.stack(kp_r, 1))
        # --- sub-kernels: M1 = Kzp K_PP^-1, Kzp = exp(logZP - rs), rs = max_k logZP,
        # logZP = (Z Pn^T - 1)/eps; the same for K_PY (max over anchors); K_PP = exp((Pn Pn^T - 1)/eps) + lam I
        tiny = torch.finfo(Z.dtype).tiny
        r = Pn.shape[0]
        dKzp = torch.matmul(dM1, inv)
        dinv = Kzp.reshape(-1, r).t() @ dM1.reshape(-1, r)
        tz = dKzp * Kzp
        tz.masked_fill_(tz.abs() < tiny, 0.0)
        drs = im.segsum(grs) - tz.sum(2)
        dlogZP = tz + _amax_grad(logZP, rs_i[..., None], drs[..., None], dim=2)
        tp = dKpy * Kpy
        tp.masked_fill_(tp.abs() < tiny, 0.0)
        dcs = tx.segsum(gcs) - tp.sum(1)
        dlogPY = tp + _amax_grad(logPY, cs_t[:, None, :], dcs[:, None, :], dim=1)
        dS = -(inv @ dinv @ inv) * Kpp_e / eps
        dPn = ((dlogZP.reshape(-1, r).t() @ Z.reshape(-1, d)
                + dlogPY.transpose(0, 1).reshape(r, -1) @ Y.reshape(-1, d)) / eps
               + (dS + dS.t()) @ Pn)
        if need_z:
            dZ.view(-1, d).addmm_(dlogZP.reshape(-1, r), Pn, alpha=1.0 / eps)
        if need_y:
            dY.view(-1, d).addmm_(dlogPY.transpose(1, 2).reshape(-1, r), Pn, alpha=1.0 / eps)
        return dZ, dY, dPn, glmu, glnu, None, None, None, None, None


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
    """Kzp @ Kpp^-1 for symmetric Kpp [r,r] (shared) or [B,r,r].

    Shared anchors: the r x r inverse once, then one GEMM (a triangular solve with B*N right-hand
    sides ran about 10x slower than the GEMM on CPU, forward and backward); per-problem anchors:
    ``linalg.solve``. Either falls back to ``lstsq`` when the factorisation fails or is not finite."""
    r = Kpp.shape[-1]
    if Kpp.dim() == 2:
        inv, info = torch.linalg.inv_ex(Kpp)
        if int(info) == 0 and bool(torch.isfinite(inv).all()):
            return torch.matmul(Kzp, inv)  # Kpp^-1 is symmetric
        sol = torch.linalg.lstsq(Kpp, Kzp.reshape(-1, r).t()).solution
        return sol.t().reshape(Kzp.shape)
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
    _gemm_dtype: Optional[torch.dtype] = None,
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

    if _score is not None and shared_P and int(n_iter) >= 1:
        # fused path (the training path): sub-kernels, iterations and score in one Function with a
        # hand-written backward; M1 stays per image and K_PY per caption (see _Layout). Pairs in
        # image order, so that the score's per-image GEMMs read contiguous slices (results are
        # scattered back to the caller's order at the end).
        im_i, tx_i, unsort = img_index, txt_index, None
        if im_i is not None:
            unsort = torch.argsort(im_i, stable=True)
            im_i = im_i[unsort]
            if tx_i is not None:
                tx_i = tx_i[unsort]
        mu_p = mu if im_i is None else mu[im_i]
        mv_p = mask_v if (mask_v is None or im_i is None) else mask_v[im_i]
        nu_p = nu if tx_i is None else nu[tx_i]
        mt_p = mask_t if (mask_t is None or tx_i is None) else mask_t[tx_i]
        mv_p = None if mv_p is None else mv_p.to(torch.bool)
        mt_p = None if mt_p is None else mt_p.to(torch.bool)
        try:
            s = _LowRankScoreFn.apply(Z, Y, P, _log_mass(mu_p, mv_p), _log_mass(nu_p, mt_p), mv_p, mt_p, im_i, tx_i,
                                      (av, at, int(n_iter), center, clamp, q_floor, _gemm_dtype, eps, float(kpp_reg)))
            s = torch.tanh(s) if _score else s
            return s if unsort is None else torch.empty_like(s).index_put((unsort,), s)
        except _Fallback:
            pass

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

    # M1 = Kzp Kpp^-1 (K_PP symmetric). With shared anchors: ONE r x r inverse and one GEMM for the
    # whole batch.
    M1 = _solve_right(Kpp, Kzp)

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
    if _score is not None:  # the fused path fell back (clamped denominator or singular K_PP)
        return res.score(Z, Y, tanh=_score, img_index=img_index, txt_index=txt_index)
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
    gemm_dtype: Optional[torch.dtype] = None,
    **kw,
) -> Tensor:
    """``uot_lowrank(Z, Y, P, ...).score(Z, Y, tanh, img_index, txt_index)`` (the same function,
    same keyword options as :func:`uot_lowrank`) computed by one fused pass with a hand-written
    backward of the iterations and of the score (``method="fused"``, the training path), falling
    back to the autograd path when the score's denominator is clamped; ``method="autograd"`` is
    the reference path. Returns [B] scores.

    ``gemm_dtype`` (fused path only): dtype of the score's N x r x d and M x r x d products, the
    bulk of the arithmetic (forward and backward). None keeps the input dtype; torch.bfloat16
    runs them 3-5x faster on CPUs with native bf16 (AVX512-BF16 / AMX) and on GPUs, with float32
    accumulation inside each product; the Sinkhorn iterations, the denominator and all
    reductions stay in the input dtype (mixed precision, as under autocast)."""
    if method not in ("fused", "autograd"):
        raise ValueError(f"method must be 'fused' or 'autograd', got {method!r}")
    if method == "autograd":
        res = uot_lowrank(Z, Y, P, mu, nu, eps, tau_v, tau_t, n_iter, **kw)
        return res.score(Z, Y, tanh=tanh, img_index=kw.get("img_index"), txt_index=kw.get("txt_index"))
    return uot_lowrank(Z, Y, P, mu, nu, eps, tau_v, tau_t, n_iter, _score=bool(tanh), _gemm_dtype=gemm_dtype,
                       **kw)


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
