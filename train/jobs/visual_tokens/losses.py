"""CLIP loss and the similarity statistics of the paper's Fig. 4."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Symmetric InfoNCE over a batch of L2-normalised image / text embeddings [B, E] (row i of
    each is a positive pair): (CE(scale * I T^T, diag) + CE(scale * T I^T, diag)) / 2."""
    logits = scale * img.float() @ txt.float().t()
    labels = torch.arange(img.shape[0], device=img.device)
    l_i2t = F.cross_entropy(logits, labels)
    l_t2i = F.cross_entropy(logits.t(), labels)
    loss = 0.5 * (l_i2t + l_t2i)
    with torch.no_grad():
        st = similarity_stats(img, txt)
        acc = float((logits.argmax(1) == labels).float().mean()) * 100
    return loss, {"loss_i2t": float(l_i2t.detach()), "loss_t2i": float(l_t2i.detach()), "logit_scale": float(scale.detach()),
                  "batch_acc_i2t": acc, **st}


def similarity_stats(img: torch.Tensor, txt: torch.Tensor) -> dict[str, float]:
    """Mean cosine similarity of the matching pairs (diagonal) and of all other pairs
    (off-diagonal) of the [N, N] image-text matrix (Fig. 4 of the paper)."""
    S = img.float() @ txt.float().t()
    n = S.shape[0]
    diag = S.diagonal().mean()
    off = (S.sum() - S.diagonal().sum()) / max(1, n * n - n)
    return {"sim_diag": float(diag), "sim_offdiag": float(off)}
