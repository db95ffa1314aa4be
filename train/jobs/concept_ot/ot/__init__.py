"""Batched, differentiable entropic optimal transport solvers (ConceptOT, Kumar; Sections 2.2-2.5,
Algorithm 1, Appendix H).

All solvers take a leading batch dimension (any number of leading dims for the dense solvers) and
solve every problem of the batch at once as one tensor program; gradients flow by unrolling the
``n_iter`` generalised Sinkhorn iterations (with autograd, or with the hand-written backward
passes of the fused score paths).

Problem (Eq. 3)::

    min_{Pi >= 0} <C, Pi> + eps * sum Pi (log Pi - 1) + tau_v KL(Pi 1 | mu) + tau_t KL(Pi^T 1 | nu)

solved with the generalised Sinkhorn scaling updates of Chizat et al. (the paper's Section 2.2,
Algorithm 1 order: ``a`` first from ``b``, starting from ``a = 1, b = 1``)::

    a <- (mu / K b) ** alpha_v,   b <- (nu / K^T a) ** alpha_t,   alpha = tau / (tau + eps)

This is exactly POT's ``ot.unbalanced.sinkhorn_unbalanced(mu, nu, C, eps, (tau_v, tau_t),
reg_type='entropy')`` (same initialisation, same update order), which tests/test_ot.py checks.

Padding: ``mask_v`` [..., N] / ``mask_t`` [..., M] (True = real token). Padded tokens carry zero
mass and get zero rows / columns in the plan; no NaN appears in values or gradients.

Modules:

* ``common``: shared kernel pieces (batched mat-vec, log masses, damping exponents, scaling
  half-steps, chunking, the fused paths' fallback signal).
* ``dense``: dense unbalanced / balanced Sinkhorn plans (``uot_dense``, ``sinkhorn_balanced``).
* ``dense_score``: the Eq. 8 score of the dense plan, with a fused hand-written backward.
* ``pairs``: pairs grouped by image / caption (``pair_similarities`` and the fused path's layout).
* ``lowrank``: low-rank (Nystrom, concept anchors) unbalanced OT, Algorithm 1 (``uot_lowrank``,
  ``LowRankUOT``, ``uot_lowrank_score``, ``anchor_diversity``).
* ``lowrank_fused`` / ``lowrank_fused_backward``: the fused low-rank training computation
  (sub-kernels, iterations, score) and its hand-written backward.
"""

from train.jobs.concept_ot.ot.dense import sinkhorn_balanced, uot_dense
from train.jobs.concept_ot.ot.dense_score import dense_score, uot_dense_score
from train.jobs.concept_ot.ot.lowrank import LowRankUOT, anchor_diversity, uot_lowrank, uot_lowrank_score
from train.jobs.concept_ot.ot.pairs import pair_similarities

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
