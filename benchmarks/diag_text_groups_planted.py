"""Diagnose the text-groups trainer's learning on the planted data (the planted-signal checks of
issue 14): train one run on tests/text_groups_planted.py data, then print

* phrase discovery (tIoU on captions with >= 2 gold phrases, val + test images) of the model beside
  its baselines (untrained, random = chance, one group, contiguous chunks);
* swapped-attribute accuracy (score(image, caption) > score(image, attribute-swapped caption), chance
  50%) on held-out (val + test) and training images, with a control: the same model scored against
  the image groups of another image (shuffled; must stay near 50%);
* whether the grouping is learnt at all: ``assign_stable`` (fraction of tokens whose training-time
  Gumbel assignment is the noiseless argmax used by evaluation; 1/K = noise), the mean cosine between
  the K group queries, and the reconstruction loss of the trained decoder with the model's own
  assignment, with a uniformly random token-to-group assignment, and with another caption's groups.

    .venv/bin/python benchmarks/diag_text_groups_planted.py [--steps 300] [--set lr=0.005 --set variant=vanilla ...]

Defaults: 600 images x 3 captions, the reduced encoder of the README's figures (width 32, 2 heads,
2 + 1 layers, 3 vanilla layers, K = 4), batch 32, ``recon_vocab: corpus``, one torch thread; every
other option is the job's default (paper's lr 1.6e-3, Gumbel, pre-assign attention, mean pooling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REDUCED = dict(width=32, heads=2, layers_pre=2, layers_post=1, vanilla_layers=3, n_groups=4, recon_vocab="corpus",
               threads=1, vanilla_run=None, figures=0, benchmarks_at_end=False, batch_size=32,
               discovery_splits=["val", "test"], log_every=50)


def _value(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def swap_accuracy(job, model, items, shuffle: bool = False, seed: int = 0) -> float:
    """% of (sample_id, caption, swapped caption) items where the caption outscores the swap; with
    ``shuffle`` each caption pair is scored against another image's groups (a derangement)."""
    sids = np.array([s for s, _, _ in items], np.int64)
    if shuffle:
        rng = np.random.default_rng(seed)
        perm = rng.permutation(len(sids))
        while len(sids) > 1 and (perm == np.arange(len(sids))).any():
            perm = rng.permutation(len(sids))
        sids = sids[perm]
    with torch.no_grad():
        sp = job.score_pairs(model, sids, [p for _, p, _ in items])
        sn = job.score_pairs(model, sids, [n for _, _, n in items])
    return 100.0 * float(np.mean(sp > sn))


@torch.no_grad()
def grouping_diagnostics(job, model, n_batches: int = 8) -> dict:
    import train.jobs.text_groups.model as M
    from train.jobs.text_groups.losses import reconstruction

    out: dict[str, float] = {}
    if not hasattr(model, "grouping"):
        return out
    cap = {}
    hook = model.grouping.assign.register_forward_hook(lambda mod, inp, o: cap.__setitem__("g", inp[0]))
    rec = {"own": [], "random_assignment": [], "other_captions_groups": []}
    stable = []
    gen = torch.Generator().manual_seed(0)
    batches = [b for _, b in zip(range(n_batches), job.batches(0, 0))]
    model.eval()
    for batch in batches:
        enc = model.encode(batch["ids"], batch["mask"])
        g = enc["groups"]
        for name, gg in (("own", g), ("other_captions_groups", g[torch.randperm(len(g), generator=gen)])):
            lo, t, m = model.reconstruction_logits(batch["ids"], batch["mask"], gg)
            rec[name].append(float(reconstruction(lo, t, m)))
    q = torch.nn.functional.normalize(model.grouping.assign.q(cap["g"]), dim=-1)
    K = q.shape[1]
    out["group_query_cos"] = float(((q @ q.transpose(1, 2)).sum((1, 2)) - K).mean() / max(1, K * K - K))
    hook.remove()
    model.grouping.assign.train()  # Gumbel noise on: the training-time assignment
    for batch in batches:
        enc = model.encode(batch["ids"], batch["mask"])
        stable.append(float((enc["assign"].argmax(1) == enc["soft"].argmax(1))[batch["mask"]].float().mean()))
    orig = M.gumbel_noise_like
    M.gumbel_noise_like = lambda x: 1e4 * orig(x)  # noise >> logits: a uniformly random assignment
    assign = model.grouping.assign
    flags = assign.gumbel, assign.hard
    assign.gumbel, assign.hard = True, True  # also under `gumbel: false` / `hard_assignment: false`
    try:
        for batch in batches:
            g = model.encode(batch["ids"], batch["mask"])["groups"]
            lo, t, m = model.reconstruction_logits(batch["ids"], batch["mask"], g)
            rec["random_assignment"].append(float(reconstruction(lo, t, m)))
    finally:
        M.gumbel_noise_like = orig
        assign.gumbel, assign.hard = flags
        model.eval()
    out["assign_stable"] = float(np.mean(stable))
    out["assign_stable_chance"] = 1.0 / K
    out.update({f"recon_{k}": float(np.mean(v)) for k, v in rec.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--palette", type=int, nargs=2, default=None, metavar=("COLOURS", "SHAPES"),
                    help="restricted palette (write_planted's palette), e.g. 3 3 with --objects 2 2")
    ap.add_argument("--objects", type=int, nargs=2, default=(1, 4), metavar=("MIN", "MAX"))
    ap.add_argument("--set", action="append", default=[], help="a text-groups option, key=value (JSON value)")
    ap.add_argument("--out", default=None, help="folder for the data and the run (default: a temporary folder)")
    a = ap.parse_args()

    from tests.conftest import make_manifest
    from tests.text_groups_planted import write_planted
    from train.jobs.text_groups import Config, make_job
    from train.loop import load_checkpoint, train

    opts = dict(REDUCED, max_steps=a.steps)
    for kv in a.set:
        k, v = kv.split("=", 1)
        opts[k] = _value(v)
    tmp = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="tg_diag_"))
    data = tmp / "data"
    info = write_planted(data, n_images=a.images, captions_per_image=3, seed=a.data_seed,
                         palette=tuple(a.palette) if a.palette else None, min_objects=a.objects[0],
                         max_objects=a.objects[1])
    run = tmp / "run"
    job = make_job(Config(**opts), make_manifest(tmp, [f"output={data}"]), run, torch.device("cpu"))
    t0 = time.time()
    res = train(job, resume=False, progress=False)
    train_s = time.time() - t0
    model = job.build_model()
    model.load_state_dict(load_checkpoint(run / "checkpoints" / "final.pt")["model"])
    model.eval()
    report = {"options": {k: v for k, v in opts.items() if k not in REDUCED or REDUCED[k] != v},
              "train_seconds": round(train_s, 1)}
    report["phrase_discovery_ge2_tIoU"] = {k.replace("pd_ge2_tIoU", "model").replace("model_", ""): round(v, 3)
                                           for k, v in res.items() if k.startswith("pd_ge2_tIoU")}
    report["val_r1_i2t"] = [round(res.get("val_r1_i2t", float("nan")), 1), "chance", round(res.get("val_r1_chance", 0), 1)]
    if opts.get("variant") != "no-contrastive":
        for name, want in (("heldout", {"val", "test"}), ("train", {"train"})):
            items = [x for x in info["negatives"]["swap_att"] if info["splits"][x[0]] in want]
            report[f"swap_att_{name}"] = {"model": round(swap_accuracy(job, model, items), 1),
                                          "shuffled_images": round(swap_accuracy(job, model, items, shuffle=True), 1),
                                          "n": len(items), "chance": 50.0}
    report["grouping"] = {k: round(v, 3) for k, v in grouping_diagnostics(job, model).items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
