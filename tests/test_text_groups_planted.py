"""text-groups planted-signal checks (issue 14).

Planted signal B (binding), the part that emerges on a CPU budget: the planted ``image_groups``
artifact (tests/text_groups_planted.py: one slot per object holding a fixed random embedding of its
(colour, shape) PAIR, background slots, noise) with a restricted palette (``palette=(3, 3)``, two
objects of distinct colours and distinct shapes per scene), so that scenes with the same colours and
shapes paired the other way are frequent in-batch negatives that only binding separates. With the
full palette (12 colours x 10 shapes, 1-4 objects) two scenes of a batch almost never share their
colour and shape sets, the contrastive loss never asks for binding and no model binds (README,
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
token-to-group assignment is not learnt (README, text-groups: a random assignment reconstructs as
well). Planted signal A (phrase discovery above untrained / random / one group) does not emerge
either, so it has no test; the figures are in the README.
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
               max_steps=400, log_every=100, discovery_splits=["val", "test"])


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
