"""Hand-written backward of the fused low-rank score (``lowrank_fused._LowRankScoreFn``): the
score's products, the L iterations in reverse (kernel gradients of all mat-vecs summed as one
product per image / caption at the end), then the sub-kernels and K_PP^-1 back to Z, Y and the
anchors."""

from __future__ import annotations

import torch

from train.jobs.concept_ot.ot.common import _amax_grad


def lowrank_score_backward(ctx, g):
    """Gradients of (Z, Y, Pn, lmu, lnu) from the saved forward state; see ``_LowRankScoreFn``."""
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
        # The deliberately mirrored OT backward halves (this b half and the a half below: the
        # same steps with M1 and K_PY swapped; kept written out, the duplicate check's one exception).
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
        # Mirrors the b half above (the deliberately mirrored OT backward halves).
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
