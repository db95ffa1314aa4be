"""Throughput of the batched OT solvers of train/jobs/concept_ot/ot/ vs POT solving the same pairs one by one.

    .venv/bin/python benchmarks/bench_ot.py            # full run (~2-4 min on 2 cores)
    .venv/bin/python benchmarks/bench_ot.py --quick    # fewer repetitions, no scaling sweeps

Setting of the paper's efficiency table (Appendix I): N=196 patches, M=48 tokens, d_c=256, r=32,
L=5, eps=0.07, tau=0.2. A training batch of B=64 pairs with K_h=4 hard negatives both ways
solves B * (1 + 2 K_h) = 576 pairs; that is the default batch here.

Reported per pair (best of --reps runs; the CPU is shared, so timings are noisy):
* POT: ``ot.unbalanced.sinkhorn_unbalanced(reg_type='entropy', numItermax=L, stopThr=0)`` on numpy
  (forward) and on torch tensors with autograd (forward + backward of the Eq. 8 score), one pair
  at a time; the same cost matrices as ours.
* dense-uot: plan (``uot_dense``), Eq. 8 score (``uot_dense_score``) forward and forward+backward,
  for the three numerical schemes (fused scaling with hand-written backward, scaling with
  autograd, plain log domain).
* balanced-ot: the same with hard marginals.
* conceptot: ``uot_lowrank`` from Z, Y, P (sub-kernels + K_PP solve + iterations), with the
  implicit Eq. 8 score, forward and forward+backward; independent pairs, and the training-batch
  structure (64 images x 64 captions shared across the 576 pairs via img_index / txt_index);
  autograd through the iterations (``uot_lowrank(...).score(...)``) and the fused training path
  (``uot_lowrank_score``, hand-written backward), in float32 and with the score's large products
  in bfloat16 (``gemm_dtype=torch.bfloat16``: concept-ot's ``ot_gemm_dtype``, or ``amp: bf16``).
* a full training step's local work: cost matrices from the projected tokens + score + backward.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from train.jobs.concept_ot.ot import pair_similarities, uot_dense, uot_dense_score, uot_lowrank, uot_lowrank_score

EPS, TAU, L = 0.07, 0.2, 5


CLOCK = time.perf_counter


def best_time(fn, reps):
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def make_batch(B, N, M, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    Z = torch.nn.functional.normalize(torch.randn(B, N, d, generator=g), dim=-1)
    Y = torch.nn.functional.normalize(torch.randn(B, M, d, generator=g), dim=-1)
    # add shared structure so that costs are not all ~1 (closer to real CLIP tokens)
    common = torch.nn.functional.normalize(torch.randn(1, 1, d, generator=g), dim=-1)
    Z = torch.nn.functional.normalize(Z + 1.5 * common, dim=-1)
    Y = torch.nn.functional.normalize(Y + 1.5 * common, dim=-1)
    mu = torch.softmax(torch.randn(B, N, generator=g), -1)
    nu = torch.softmax(torch.randn(B, M, generator=g), -1)
    return Z, Y, mu, nu


def pot_numpy(C, mu, nu, n):
    import ot

    Cn, mun, nun = C[:n].double().numpy(), mu[:n].double().numpy(), nu[:n].double().numpy()

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(n):
                ot.unbalanced.sinkhorn_unbalanced(mun[k], nun[k], Cn[k], EPS, (TAU, TAU),
                                                  reg_type="entropy", numItermax=L, stopThr=0.0)
    return run


def pot_torch_fwd_bwd(C, mu, nu, n):
    import ot

    Cs = [C[k].clone().requires_grad_() for k in range(n)]

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(n):
                P = ot.unbalanced.sinkhorn_unbalanced(mu[k], nu[k], Cs[k], EPS, (TAU, TAU),
                                                      reg_type="entropy", numItermax=L, stopThr=0.0)
                s = (P * (1 - Cs[k])).sum() / P.sum()
                s.backward()
    return run


def training_pairs(B, Kh, seed=0):
    """(img_index, txt_index) of a training batch: positives, Kh hard captions per image and Kh hard
    images per caption (random stand-ins for the mined ones; the cost does not depend on which)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(B)
    neg = (idx[:, None] + 1 + torch.stack([torch.randperm(B - 1, generator=g)[:Kh] for _ in range(B)])) % B
    img = torch.cat([idx, idx.repeat_interleave(Kh), neg.reshape(-1)])
    txt = torch.cat([idx, neg.reshape(-1), idx.repeat_interleave(Kh)])
    return img, txt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pot-pairs", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time (use with --threads 1 on a shared, oversubscribed machine: "
                         "it excludes time spent descheduled)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # as the trainer runs (TrainerConfig.flush_denormal)
    reps = 2 if a.quick else a.reps
    N, M, d, r, Bimg, Kh = 196, 48, 256, 32, 64, 4
    img, txt = training_pairs(Bimg, Kh)
    P_pairs = len(img)  # 576
    Zi, Yi, mui, nui = make_batch(Bimg, N, M, d)
    Z, Y, mu, nu = Zi[img], Yi[txt], mui[img], nui[txt]
    C = 1 - torch.bmm(Z, Y.transpose(1, 2))
    anchors = torch.randn(r, d, generator=torch.Generator().manual_seed(1)) * 0.02
    out = {"setting": dict(N=N, M=M, d=d, r=r, L=L, pairs=P_pairs, threads=a.threads, clock=a.clock)}

    def per_pair(fn, n=P_pairs):
        return best_time(fn, reps) / n * 1e3  # ms / pair

    print(f"N={N} M={M} d={d} r={r} L={L} pairs/batch={P_pairs} threads={a.threads} clock={a.clock}")
    npot = a.pot_pairs
    t_pot = per_pair(pot_numpy(C, mu, nu, npot), npot)
    t_pot_fb = per_pair(pot_torch_fwd_bwd(C, mu, nu, min(npot, 32)), min(npot, 32))
    out["pot_numpy_fwd_ms"] = t_pot
    out["pot_torch_fwd_bwd_ms"] = t_pot_fb
    print(f"POT one by one            fwd {t_pot:8.4f} ms/pair   fwd+bwd (torch backend) {t_pot_fb:8.4f} ms/pair")

    Cg = C.clone().requires_grad_()
    rows = []

    def rec(name, fwd, fb):
        rows.append((name, fwd, fb))
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fb}
        fbs = f"{fb:8.4f}" if fb is not None else "      - "
        ratio_f = t_pot / fwd
        ratio_b = (t_pot_fb / fb) if fb else float("nan")
        print(f"{name:34s} fwd {fwd:8.4f} ms/pair ({1e3 / fwd:9.0f} pairs/s, {ratio_f:6.1f}x POT)"
              f"  fwd+bwd {fbs} ms/pair ({ratio_b:6.1f}x POT)")

    with torch.no_grad():
        t_plan = per_pair(lambda: uot_dense(C, mu, nu, EPS, TAU, TAU, L))
        t_plan_log = per_pair(lambda: uot_dense(C, mu, nu, EPS, TAU, TAU, L, method="log"))
    rec("dense-uot plan [scaling]", t_plan, per_pair(lambda: uot_dense(Cg, mu, nu, EPS, TAU, TAU, L).sum().backward()))
    rec("dense-uot plan [log]", t_plan_log, per_pair(lambda: uot_dense(Cg, mu, nu, EPS, TAU, TAU, L, method="log").sum().backward()))
    for meth in ("fused", "scaling", "log"):
        with torch.no_grad():
            tf = per_pair(lambda: uot_dense_score(C, mu, nu, EPS, TAU, TAU, L, method=meth))
        tb = per_pair(lambda: uot_dense_score(Cg, mu, nu, EPS, TAU, TAU, L, method=meth).sum().backward())
        rec(f"dense-uot score [{meth}]", tf, tb)
    with torch.no_grad():
        tf = per_pair(lambda: uot_dense_score(C, mu, nu, EPS, None, None, L))
    rec("balanced-ot score [fused]", tf, per_pair(lambda: uot_dense_score(Cg, mu, nu, EPS, None, None, L).sum().backward()))

    # conceptot, independent pairs (Z, Y per pair)
    Zg, Yg, Pg = Z.clone().requires_grad_(), Y.clone().requires_grad_(), anchors.clone().requires_grad_()
    lr_kw = dict(kpp_reg=1e-2, center=True, clamp=20.0)
    with torch.no_grad():
        t_solve = per_pair(lambda: uot_lowrank(Z, Y, anchors, mu, nu, EPS, TAU, TAU, L, **lr_kw))
        t_score = per_pair(lambda: uot_lowrank(Z, Y, anchors, mu, nu, EPS, TAU, TAU, L, **lr_kw).score(Z, Y, tanh=True))
    rec("conceptot solver (pairs)", t_solve, None)
    rec("conceptot solver+score (pairs)", t_score, per_pair(
        lambda: uot_lowrank(Zg, Yg, Pg, mu, nu, EPS, TAU, TAU, L, **lr_kw).score(Zg, Yg, tanh=True).sum().backward()))
    # conceptot, training-batch structure (sub-kernels once per image / caption)
    Zig, Yig = Zi.clone().requires_grad_(), Yi.clone().requires_grad_()

    def lr_batch(Zb, Yb, Pb):
        res = uot_lowrank(Zb, Yb, Pb, mui, nui, EPS, TAU, TAU, L, img_index=img, txt_index=txt, **lr_kw)
        return res.score(Zb, Yb, tanh=True, img_index=img, txt_index=txt)

    with torch.no_grad():
        t_sb = per_pair(lambda: uot_lowrank(Zi, Yi, anchors, mui, nui, EPS, TAU, TAU, L, img_index=img, txt_index=txt, **lr_kw))
    rec("conceptot solver (batch)", t_sb, None)
    with torch.no_grad():
        t_b = per_pair(lambda: lr_batch(Zi, Yi, anchors))
    rec("conceptot solver+score (batch)", t_b, per_pair(lambda: lr_batch(Zig, Yig, Pg).sum().backward()))

    # the training path (train/jobs/concept_ot/job.py): the same function, fused, hand-written backward
    def lr_fused(Zb, Yb, Pb):
        return uot_lowrank_score(Zb, Yb, Pb, mui, nui, EPS, TAU, TAU, L, img_index=img, txt_index=txt,
                                 tanh=True, **lr_kw)

    with torch.no_grad():
        t_f = per_pair(lambda: lr_fused(Zi, Yi, anchors))
    rec("conceptot score [fused] (batch)", t_f, per_pair(lambda: lr_fused(Zig, Yig, Pg).sum().backward()))

    # the same with the score's N x r x d / M x r x d products in bfloat16 (concept-ot's
    # ot_gemm_dtype=bfloat16, or amp: bf16); everything else float32
    def lr_fused16(Zb, Yb, Pb):
        return uot_lowrank_score(Zb, Yb, Pb, mui, nui, EPS, TAU, TAU, L, img_index=img, txt_index=txt,
                                 tanh=True, gemm_dtype=torch.bfloat16, **lr_kw)

    with torch.no_grad():
        t_f16 = per_pair(lambda: lr_fused16(Zi, Yi, anchors))
    rec("conceptot score [fused, bf16 GEMMs] (batch)", t_f16,
        per_pair(lambda: lr_fused16(Zig, Yig, Pg).sum().backward()))
    # the floor of the training path: only the score's products (forward A = M1^T diag(a) Z and
    # A Y^T; backward Vg Y, Vg^T A, Bmg Z^T, W^T Bmg), one GEMM per image / caption as the fused
    # Function runs them, nothing else
    def score_gemms(dt):
        gi = [int(c) for c in torch.bincount(img, minlength=Bimg)]
        gt = [int(c) for c in torch.bincount(txt, minlength=Bimg)]
        Zd, Yd = Zi.to(dt), Yi.to(dt)
        Wi = [torch.randn(c * r, N).to(dt) for c in gi]
        Bi_ = [torch.randn(c * r, d).to(dt) for c in gi]
        At = [torch.randn(c * r, d).to(dt) for c in gt]
        Vt = [torch.randn(c * r, M).to(dt) for c in gt]

        def run():
            for g in range(Bimg):
                Wi[g] @ Zd[g]
                Bi_[g] @ Zd[g].t()
                Wi[g].t() @ Bi_[g]
                At[g] @ Yd[g].t()
                Vt[g] @ Yd[g]
                Vt[g].t() @ At[g]
        return run

    print(f"{'score products alone (fwd+bwd)':34s} float32 {per_pair(score_gemms(torch.float32)):.4f} ms/pair, "
          f"bf16 {per_pair(score_gemms(torch.bfloat16)):.4f} ms/pair  (the floor of the training path)")

    # bf16 products against float64, on this batch: scores and gradients of a random weighting
    w = torch.randn(P_pairs, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    acc = {}
    for name, gd, dt in (("f64", None, torch.float64), ("f32", None, torch.float32),
                         ("bf16", torch.bfloat16, torch.float32)):
        ins = [x.to(dt).requires_grad_() for x in (Zi, Yi, anchors)]
        sc = uot_lowrank_score(*ins, mui.to(dt), nui.to(dt), EPS, TAU, TAU, L, img_index=img, txt_index=txt,
                               tanh=True, gemm_dtype=gd, **lr_kw)
        acc[name] = (sc.detach().double(), [x.double() for x in torch.autograd.grad((sc * w.to(dt)).sum(), ins)])
    for name in ("f32", "bf16"):
        (sc, gr), (s0, g0) = acc[name], acc["f64"]
        cos = [float(torch.nn.functional.cosine_similarity(u.flatten(), v.flatten(), dim=0)) for u, v in zip(gr, g0)]
        rel = float((sc - s0).norm() / s0.norm())
        out[f"accuracy_{name}"] = {"score_rel_err": rel, "grad_cos_Z_Y_P": cos}
        print(f"conceptot training path, {name} vs float64: score rel. error {rel:.1e}, gradient cosine "
              f"Z {cos[0]:.5f} Y {cos[1]:.5f} anchors {cos[2]:.4f}")

    with torch.no_grad():
        t_fp = per_pair(lambda: uot_lowrank_score(Z, Y, anchors, mu, nu, EPS, TAU, TAU, L, tanh=True, **lr_kw))
    rec("conceptot score [fused] (pairs)", t_fp, per_pair(
        lambda: uot_lowrank_score(Zg, Yg, Pg, mu, nu, EPS, TAU, TAU, L, tanh=True, **lr_kw).sum().backward()))

    # full local work of a dense-uot training step: costs from tokens, score, backward
    def dense_step(Zb, Yb):  # as the concept-ot job does it: pairs grouped by image
        S, order = pair_similarities(Zb, Yb, img, txt)
        return uot_dense_score(1 - S, mui[img[order]], nui[txt[order]], EPS, TAU, TAU, L, sim=S)

    with torch.no_grad():
        t_ds = per_pair(lambda: dense_step(Zi, Yi))
    rec("dense-uot step (costs+score)", t_ds, per_pair(lambda: dense_step(Zig, Yig).sum().backward()))

    if not a.quick:
        # conceptot here is the training path: batch structure (B images, B captions, K_h=4 hard
        # negatives both ways -> 9B pairs), fused, float32 / bf16 score GEMMs
        def lr_train(Bimg_, N_, r_, gemm):
            img_, txt_ = training_pairs(Bimg_, Kh)
            Zs, Ys, mus, nus = make_batch(Bimg_, N_, M, d, seed=2)
            Zs.requires_grad_()
            Ys.requires_grad_()
            Ps = (torch.randn(r_, d, generator=torch.Generator().manual_seed(1)) * 0.02).requires_grad_()
            return len(img_), lambda: uot_lowrank_score(Zs, Ys, Ps, mus, nus, EPS, TAU, TAU, L, img_index=img_,
                                                        txt_index=txt_, tanh=True, gemm_dtype=gemm,
                                                        **lr_kw).sum().backward()

        def lr_row(Bimg_, N_, r_):
            n32, f32 = lr_train(Bimg_, N_, r_, None)
            n16, f16 = lr_train(Bimg_, N_, r_, torch.bfloat16)
            return per_pair(f32, n32), per_pair(f16, n16)

        print("\nscaling (fwd+bwd ms/pair): batch size (pairs); conceptot = training path, float32 / bf16 GEMMs")
        out["scaling_batch"] = {}
        for Bi in (8, 32, 64, 128):
            Bp = Bi * (1 + 2 * Kh)
            Cb = torch.cat([Cg.detach()] * 2)[:Bp].clone().requires_grad_()
            mb, nb = torch.cat([mu] * 2)[:Bp], torch.cat([nu] * 2)[:Bp]
            td = per_pair(lambda: uot_dense_score(Cb, mb, nb, EPS, TAU, TAU, L).sum().backward(), Bp)
            tl, tl16 = lr_row(Bi, N, r)
            out["scaling_batch"][Bp] = {"dense": td, "conceptot": tl, "conceptot_bf16": tl16}
            print(f"  B={Bp:5d}  dense-uot {td:.4f}  conceptot {tl:.4f} / {tl16:.4f}")
        print("scaling (fwd+bwd ms/pair, 576 pairs): N patches")
        out["scaling_N"] = {}
        for Nn in (49, 196, 576):
            Zn, Yn, mun, nun = make_batch(P_pairs, Nn, M, d, seed=2)
            Cn = (1 - torch.bmm(Zn, Yn.transpose(1, 2))).requires_grad_()
            td = per_pair(lambda: uot_dense_score(Cn, mun, nun, EPS, TAU, TAU, L).sum().backward())
            tl, tl16 = lr_row(Bimg, Nn, r)
            out["scaling_N"][Nn] = {"dense": td, "conceptot": tl, "conceptot_bf16": tl16}
            print(f"  N={Nn:5d}  dense-uot {td:.4f}  conceptot {tl:.4f} / {tl16:.4f}")
        print("scaling (conceptot training path, 576 pairs, fwd+bwd ms/pair float32 / bf16): rank r")
        out["scaling_r"] = {}
        for rr in (8, 16, 32, 64, 128):
            tl, tl16 = lr_row(Bimg, N, rr)
            out["scaling_r"][rr] = {"fwd_bwd": tl, "fwd_bwd_bf16": tl16}
            print(f"  r={rr:4d}  fwd+bwd {tl:.4f} / {tl16:.4f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
