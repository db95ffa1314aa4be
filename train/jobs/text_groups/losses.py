"""Losses of the text-groups paper (Sec. 2.2): L = L_contrastive + lambda * L_reconstruction."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def info_nce(text: torch.Tensor, image: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric InfoNCE (Eq. 6-8) over a batch of L2-normalised embeddings [B, P] (cosine / tau).
    Returns (loss, [B, B] similarity logits, rows = images)."""
    logits = image @ text.t() / tau  # [B_img, B_txt]
    target = torch.arange(len(text), device=text.device)
    loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
    return loss, logits


def reconstruction(logits: torch.Tensor, targets: torch.Tensor, tgt_mask: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the decoder (Eq. 10). ``reduction="mean"``: averaged over the real target
    tokens of the batch; ``"sum"``: summed over each caption's tokens (Eq. 10's CE of a caption),
    averaged over the B captions (as the InfoNCE terms of Eq. 6-7 are; the paper's sum over the batch
    would scale the term by B against them).

    Either ``logits`` [n_real, V] with ``targets`` [n_real] (the real positions only, the default
    path), or ``logits`` [B, L-1, V] with ``targets`` [B, L-1] (every position; pads are masked out
    of the mean)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    n_captions = max(1, tgt_mask.shape[0])
    if logits.dim() == 2:
        if reduction == "sum":
            return F.cross_entropy(logits, targets, reduction="sum") / n_captions
        return F.cross_entropy(logits, targets)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    m = tgt_mask.reshape(-1).to(ce.dtype)
    if reduction == "sum":
        return (ce * m).sum() / n_captions
    return (ce * m).sum() / m.sum().clamp(min=1)
