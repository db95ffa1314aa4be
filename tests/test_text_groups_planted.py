"""text-groups planted-signal checks (issue 14).

Planted signal B (binding), the part that emerges on a CPU budget: the planted ``image_groups``
artifact (tests/text_groups_planted.py: one slot per object holding a fixed random embedding of its
(colour, shape) PAIR, background slots, noise) with a restricted palette (``palette=(3, 3)``, two
objects of distinct colours and distinct shapes per scene), so that scenes with the same colours and
shapes paired the other way are frequent in-batch negatives that only binding separates. With the
full palette (12 colours x 10 shapes, 1-4 objects) two scenes of a batch almost never share their
colour and shape sets, the contrastive loss never asks for binding and no model binds (docs/jobs/text-groups.md,
text-groups).

Measured (``benchmarks/diag_text_groups_planted.py --palette 3 3 --objects 2 2``; reduced encoder:
width 32, 2 heads, 3 `vanilla` layers, batch 32, lr 5e-3, ``recon_vocab: corpus``; 600 images x 3
captions; swapped-attribute accuracy = score(image, caption) > score(image, attribute-swapped
caption), chance 50%), seeds 0 / 1 / 2 after 400 steps:

* `vanilla` on the training images (n = 540): 99.8 / 99.8 / 100.0%; held-out (n = 60): 100.0 / 98.3 /
  100.0%;
* control, the same model scored against another image's groups (a derangement), all 600 items:
  47.5 / 51.4 / 50.0%.

Thresholds: binding >= 90% on training images and >= 85% held out (the held-out n = 60 has a
standard error of ~5 points near 90%); control within 50 +- 7 (n = 600: standard error 2 points).

NOT asserted, because it does not hold: the issue's "grouped above vanilla". The paper's grouped
model (same reduced widths, 2 + 1 layers, K = 4) reaches only 58.9% (train) / 58.3% (held-out) after
800 steps with Gumbel noise and 59.3% / 71.7% with ``gumbel: false`` (controls 51.7 / 50.7%); the
token-to-group assignment is not learnt (docs/jobs/text-groups.md: a random assignment reconstructs as
well). Planted signal A (phrase discovery above untrained / random / one group) does not emerge
either, so it has no test; the figures are in docs/jobs/text-groups.md. What does hold is tested last: with the
caption forced through the assignment, reconstruction alone learns an assignment the decoder depends
on (its groups are word classes, not phrases).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.conftest import make_manifest  # noqa: E402
from tests.text_groups_planted import write_planted  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

VANILLA = dict(variant="vanilla", width=32, heads=2, vanilla_layers=3, recon_vocab="corpus", threads=1,
               vanilla_run=None, figures=0, baselines=False, benchmarks_at_end=False, batch_size=32, lr=5e-3,
               max_steps=400, log_every=100, discovery_splits=["val", "test"],
               reconstruction_reduction="mean")  # calibrated before Eq. 10 became a sum over tokens


def _swap_accuracy(job, model, items, sids) -> float:
    with torch.no_grad():
        pos = job.score_pairs(model, sids, [p for _, p, _ in items])
        neg = job.score_pairs(model, sids, [n for _, _, n in items])
    assert np.isfinite(pos).all() and np.isfinite(neg).all()
    return 100.0 * float(np.mean(pos > neg))


def test_planted_binding_vanilla_with_shuffled_control(tmp_path):
    from train.jobs.text_groups import Config, make_job
    from train.loop import load_checkpoint, train

    info = write_planted(tmp_path / "d", n_images=600, captions_per_image=3, palette=(3, 3), min_objects=2,
                         max_objects=2)
    items = info["negatives"]["swap_att"]
    split = info["splits"]
    assert len(items) == 600  # two objects of distinct colours and shapes: every scene has a swap pair
    m = make_manifest(tmp_path, [f"output={tmp_path / 'd'}"])
    job = make_job(Config(**VANILLA), m, tmp_path / "run", torch.device("cpu"))
    train(job, resume=False, progress=False)
    model = job.build_model()
    model.load_state_dict(load_checkpoint(tmp_path / "run" / "checkpoints" / "final.pt")["model"])
    model.eval()

    tr = [x for x in items if split[x[0]] == "train"]
    ho = [x for x in items if split[x[0]] != "train"]
    acc_train = _swap_accuracy(job, model, tr, [s for s, _, _ in tr])
    acc_held = _swap_accuracy(job, model, ho, [s for s, _, _ in ho])
    rng = np.random.default_rng(0)
    sids = np.array([s for s, _, _ in items])
    perm = rng.permutation(len(sids))
    while (perm == np.arange(len(sids))).any():
        perm = rng.permutation(len(sids))
    control = _swap_accuracy(job, model, items, sids[perm])
    msg = f"binding train {acc_train:.1f}% (n={len(tr)}), held-out {acc_held:.1f}% (n={len(ho)}), control {control:.1f}%"
    assert acc_train >= 90.0, msg
    assert acc_held >= 85.0, msg
    assert abs(control - 50.0) <= 7.0, msg


ISOLATED = dict(variant="no-contrastive", width=32, heads=2, layers_pre=2, layers_post=1, n_groups=4,
                recon_vocab="corpus", threads=1, vanilla_run=None, figures=0, baselines=False,
                benchmarks_at_end=False, batch_size=32, lr=5e-3, max_steps=600, log_every=100,
                discovery_splits=["val", "test"], pre_assign_attn=False, isolate_groups=True, gumbel=False,
                hard_assignment=False, reconstruction_reduction="mean")  # as calibrated


@torch.no_grad()
def _reconstruction(job, model, random_assignment: bool, n_batches: int = 8) -> float:
    """Mean reconstruction CE over training batches, with the model's own assignment or with a
    uniformly random hard one (Gumbel noise >> logits)."""
    from train.jobs.text_groups.losses import reconstruction

    a = model.grouping.assign
    flags = a.gumbel, a.hard, a.training
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        if random_assignment:
            a.gumbel, a.hard = True, True
            a.train()
        for _, b in zip(range(n_batches), job.batches(0, 0)):
            noise = None
            if random_assignment:
                B, L = b["ids"].shape
                noise = 1e4 * -torch.empty(B, model.n_groups, L).exponential_(generator=gen).log()
            g = model.encode(b["ids"], b["mask"], noise=noise)["groups"]
            lo, t, m = model.reconstruction_logits(b["ids"], b["mask"], g)
            out.append(float(reconstruction(lo, t, m)))
    finally:
        a.gumbel, a.hard = flags[:2]
        a.train(flags[2])
    return float(np.mean(out))


def test_isolated_grouping_is_learnt_by_reconstruction(tmp_path):
    """When the caption can reach the groups only through the assignment (``isolate_groups``, no
    pre-assign attention, soft assignment) and reconstruction is the only loss, the block learns a
    token-to-group assignment the decoder depends on: replacing it by a random one costs
    reconstruction. Measured (data + model seeds 0 / 1 / 2, 600 steps): own 0.62 / 0.61 / 0.65 nats,
    random assignment 1.51 / 1.54 / 1.33 (gap 0.68-0.93; this test, seed 0: 0.616 / 1.493). Controls: the
    untrained model (gap 0.000: its decoder uses nothing) and the paper's block trained the same way
    (own 0.537, random 0.555: the caption reaches its groups around the assignment). Thresholds: gap
    >= 0.4 nats trained, <= 0.1 untrained, <= 0.15 for the paper's block. (The learnt groups are word
    classes, not phrases: README, text-groups; so this is not the issue's planted signal A.)"""
    from train.jobs.text_groups import Config, make_job
    from train.loop import load_checkpoint, train

    write_planted(tmp_path / "d", n_images=600, captions_per_image=3)
    m = make_manifest(tmp_path, [f"output={tmp_path / 'd'}"])
    job = make_job(Config(**ISOLATED), m, tmp_path / "run", torch.device("cpu"))
    untrained = job.untrained_model()
    gap0 = _reconstruction(job, untrained, True) - _reconstruction(job, untrained, False)
    train(job, resume=False, progress=False)
    model = job.build_model()
    model.load_state_dict(load_checkpoint(tmp_path / "run" / "checkpoints" / "final.pt")["model"])
    model.eval()
    own, rnd = _reconstruction(job, model, False), _reconstruction(job, model, True)
    # control: the paper's block (group tokens attend to the caption, GroupViT's pre-assign attention,
    # Gumbel + hard assignment), trained the same way: the caption reaches the groups around the
    # assignment, and a random assignment reconstructs as well
    paper = dict(ISOLATED, pre_assign_attn=True, isolate_groups=False, gumbel=True, hard_assignment=True)
    cjob = make_job(Config(**paper), m, tmp_path / "control", torch.device("cpu"))
    train(cjob, resume=False, progress=False)
    control = cjob.build_model()
    control.load_state_dict(load_checkpoint(tmp_path / "control" / "checkpoints" / "final.pt")["model"])
    control.eval()
    c_own, c_rnd = _reconstruction(cjob, control, False), _reconstruction(cjob, control, True)
    msg = (f"isolated: own {own:.3f} nats, random assignment {rnd:.3f}; untrained gap {gap0:.3f}; "
           f"paper's block: own {c_own:.3f}, random {c_rnd:.3f}")
    print(msg)
    assert rnd - own >= 0.4, msg
    assert abs(gap0) <= 0.1, msg
    assert abs(c_rnd - c_own) <= 0.15, msg
