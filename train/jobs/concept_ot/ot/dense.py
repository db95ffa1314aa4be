"""Dense entropic unbalanced OT plans (Eq. 3) and their balanced limit, batched.

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
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from train.jobs.concept_ot.ot.common import (
    _NEG,
    _alpha,
    _damped,
    _default_chunk,
    _flatten,
    _log_mass,
    _scaled_mv,
    _split,
)


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
            c, _, s = _scaled_mv(Kmat, lx, mask)
            if bool((s < tiny).any()):
                # absorption fallback: exact log-sum-exp for this half-iteration
                ls = torch.logsumexp(logKmat + (lx - c)[:, None, :], dim=2)
                if mask is not None:
                    ls = torch.where(mask, ls, torch.zeros_like(ls))
            else:
                ls = torch.log(s)
            return _damped(lm, c, ls, alpha, fe_side, mask)

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


def uot_dense(
    C: Tensor, mu: Tensor, nu: Tensor,  # costs [..., N, M], reference masses [..., N], [..., M]
    eps: float, tau_v: Optional[float], tau_t: Optional[float], n_iter: int,  # Eq. 3's eps, tau; L iterations
    *,
    mask_v: Optional[Tensor] = None, mask_t: Optional[Tensor] = None,  # True = real token
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


def sinkhorn_balanced(C, mu, nu, eps, n_iter, *, mask_v=None, mask_t=None, method="scaling"):
    """Balanced entropic OT (the ``balanced-ot`` variant): hard marginals mu, nu (the limit
    tau_v, tau_t -> inf of Eq. 3). mu and nu must have equal total mass for a fixed point."""
    return uot_dense(C, mu, nu, eps, None, None, n_iter, mask_v=mask_v, mask_t=mask_t, method=method)


