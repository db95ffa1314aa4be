"""SAM's mask losses (Kirillov et al. 2023, App. A "Losses"): a linear combination of focal and dice loss
(20:1), as DETR / MaskFormer define them, and the IoU head's mean squared error.

* focal (Lin et al. 2017): per pixel ``alpha_t (1 - p_t)^gamma BCE(logit, target)``, alpha 0.25, gamma 2
  (the DETR / MaskFormer values SAM cites; the paper gives none), averaged over the mask's pixels;
* dice (Milletari et al. 2016, DETR's form): ``1 - (2 sum(p t) + 1) / (sum(p) + sum(t) + 1)`` on the sigmoid;
* IoU head: ``(predicted IoU - IoU(logits > 0, target))^2``, the target IoU not differentiated.

Each returns one value per mask (the last two dimensions are the mask's pixels; the target broadcast to the
logits' shape, [n, 1, H, W] against the [n, 3, H, W] multimask outputs), so the multimask
"minimum loss over the outputs" (:func:`mask_loss` then ``min``) is taken per prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FOCAL_ALPHA = 0.25
FOCAL_GAMMA = 2.0


def focal(logits: torch.Tensor, target: torch.Tensor, alpha: float = FOCAL_ALPHA, gamma: float = FOCAL_GAMMA) -> torch.Tensor:
    """Sigmoid focal loss averaged over each mask's pixels: [..., H, W] -> [...]."""
    t = target.to(logits.dtype).expand_as(logits)
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * t + (1 - alpha) * (1 - t)) * loss
    return loss.flatten(-2).mean(-1)


def dice(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Dice loss of the sigmoid against the binary target, one per mask: [..., H, W] -> [...]."""
    p = torch.sigmoid(logits).flatten(-2)
    t = target.to(p.dtype).expand_as(logits).flatten(-2)
    return 1 - (2 * (p * t).sum(-1) + 1) / (p.sum(-1) + t.sum(-1) + 1)


def mask_iou(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """IoU of ``logits > 0`` with the binary target, one per mask (an empty union: 1)."""
    pred = (logits > 0).flatten(-2)
    t = target.bool().expand_as(logits).flatten(-2)
    inter = (pred & t).sum(-1).float()
    union = (pred | t).sum(-1).float()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))


def mask_loss(logits: torch.Tensor, target: torch.Tensor, focal_weight: float, dice_weight: float,
              alpha: float = FOCAL_ALPHA, gamma: float = FOCAL_GAMMA) -> torch.Tensor:
    """``focal_weight * focal + dice_weight * dice`` per mask (SAM: 20 : 1)."""
    return focal_weight * focal(logits, target, alpha, gamma) + dice_weight * dice(logits, target)


def iou_loss(pred_iou: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The IoU head's squared error against the mask's actual IoU (not differentiated), per mask."""
    return (pred_iou - mask_iou(logits.detach(), target)) ** 2
