"""relation-head's boxes-only baseline: what the ground-truth boxes alone tell about the predicates.

On the generated scenes (and on any dataset whose relations are partly geometric) the boxes carry
``left of`` / ``over`` by themselves; a head that reads the visual tokens shows they add something
only above a classifier that sees the boxes and nothing else. :class:`BoxesOnly` scores every
ordered pair (s, o) from its 24 box numbers (``box_features`` of s and of o and their difference)
with a two-layer MLP into the C predicate logits; it is trained within the job run on the same
training images (BCE over every valid entry, as the head) and scored by the same recall@K code on
the same held-out images. It has the head's call signature (``model(emb, boxes, pad)`` -> [B, V, V, C]
logits) and ignores ``emb``.
"""

from __future__ import annotations

import torch
from torch import nn

from train.jobs.relation_head.batches import collate


class BoxesOnly(nn.Module):
    def __init__(self, n_predicates: int, hidden: int = 64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(24, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_predicates))

    def forward(self, emb, boxes, pad=None):
        B, V, _ = boxes.shape
        s, o = boxes[:, :, None, :].expand(B, V, V, 8), boxes[:, None, :, :].expand(B, V, V, 8)
        logits = self.mlp(torch.cat([s, o, s - o], dim=-1))
        bad = torch.eye(V, dtype=torch.bool, device=boxes.device)[None].expand(B, V, V)
        if pad is not None:
            bad = bad | pad[:, :, None] | pad[:, None, :]
        return logits.masked_fill(bad[..., None], float("-inf"))


def train_boxes_only(items, n_pred: int, d: int, seed: int, steps: int = 300, lr: float = 1e-2,
                     batch: int = 256) -> BoxesOnly:
    """A :class:`BoxesOnly` trained on ``items`` (the job's training graphs: (sample_id, tokens, box
    features, triplets)) for ``steps`` Adam steps of ``batch`` images (seeded epochs of a permutation);
    the caller's RNG untouched, trained with gradients even when called under ``torch.no_grad()``."""
    import numpy as np

    # the harness asks for the job's rows under torch.no_grad(): this training needs gradients regardless
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(int(seed))
        model = BoxesOnly(n_pred)
        items = [it for it in items if len(it[1]) > 1]
        if not items or steps <= 0:
            return model.eval()
        batches = [collate(items, n_pred, d)] if len(items) <= batch else None
        rng = np.random.default_rng([int(seed), 31])
        order: list[int] = []
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(int(steps)):
            if batches is not None:
                _, box, pad, tgt = batches[0]
            else:
                if len(order) < batch:
                    order += rng.permutation(len(items)).tolist()
                pick, order = order[:batch], order[batch:]
                _, box, pad, tgt = collate([items[i] for i in pick], n_pred, d)
            logits = model(None, box, pad)
            valid = torch.isfinite(logits)
            loss = nn.functional.binary_cross_entropy_with_logits(logits[valid], tgt[valid])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()
