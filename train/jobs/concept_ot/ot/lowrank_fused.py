"""The fused low-rank training computation: sub-kernels, the L iterations of Algorithm 1 and the
implicit Eq. 8 score in one autograd Function; its hand-written backward is in
``lowrank_fused_backward``."""

from __future__ import annotations

import torch

from train.jobs.concept_ot.ot.common import _NEG, _Fallback, _center_clamp, _unit_scalings
from train.jobs.concept_ot.ot.lowrank_fused_backward import lowrank_score_backward
from train.jobs.concept_ot.ot.pairs import _Layout


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
            la, k1 = _center_clamp(av * (lmu - row_shift - Lq) + row_shift, mask_v, center, clamp)
            Lq, s2 = logq(la, m1t_ev, kpyt_h)
            lb, k2 = _center_clamp(at * (lnu - col_shift - Lq) + col_shift, mask_t, center, clamp)
            saved.append((s1, k1, s2, k2))
        a, b = _unit_scalings(la, lb, mask_v, mask_t)

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
        return lowrank_score_backward(ctx, g)
