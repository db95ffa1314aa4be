"""Low-rank unbalanced OT with r concept anchors (Nystrom, Algorithm 1; Appendix H stabilisation):
the implicit plan ``LowRankUOT``, its solver ``uot_lowrank`` (autograd through the iterations, or
the fused training path of ``lowrank_fused``), the score ``uot_lowrank_score`` and the anchors'
diversity regulariser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from train.jobs.concept_ot.ot.common import (
    _NEG,
    _Fallback,
    _alpha,
    _center_clamp,
    _log_mass,
    _mv,
    _normalize,
    _unit_scalings,
)
from train.jobs.concept_ot.ot.lowrank_fused import _LowRankScoreFn
from train.jobs.concept_ot.ot.pairs import _grouped_left


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
        return _unit_scalings(self.la, self.lb, self.mask_v, self.mask_t)

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
    Z: Tensor, Y: Tensor, P: Tensor,  # image tokens, text tokens, concept anchors
    mu: Tensor, nu: Tensor,
    eps: float, tau_v: Optional[float], tau_t: Optional[float], n_iter: int,  # Eq. 3's eps, tau; L iterations
    *,
    mask_v: Optional[Tensor] = None, mask_t: Optional[Tensor] = None,  # True = real token
    img_index: Optional[Tensor] = None, txt_index: Optional[Tensor] = None,  # pairs of images x captions
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
        return _center_clamp(x, mask, center, clamp)[0]

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
    Z: Tensor, Y: Tensor, P: Tensor,  # image tokens, text tokens, concept anchors
    mu: Tensor, nu: Tensor,
    eps: float, tau_v: Optional[float], tau_t: Optional[float], n_iter: int,  # Eq. 3's eps, tau; L iterations
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


def anchor_diversity(P: Tensor) -> Tensor:
    """Omega_div(P) = 1/(r(r-1)) sum_{k != l} (p_k . p_l)^2 on the unit-normalised anchors."""
    Pn = _normalize(P)
    G = Pn @ Pn.t()
    r = G.shape[0]
    off = G - torch.diag_embed(torch.diagonal(G))
    return (off ** 2).sum() / (r * (r - 1))
