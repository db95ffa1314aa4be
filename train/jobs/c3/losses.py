"""C3's objectives (Song et al. 2024, Sec. 3.3):

* MCP (Eq. 5): binary cross-entropy of phi_MCP([z(I_i, C); z(I_j, C)]) (pairwise: phi_MCP(z(I, C)))
  over the batch's positives and type-1 / type-2 negatives;
* MCC (Eq. 6): InfoNCE of s = cos(psi_c^T h_i, psi_c^T h_j) of each positive against the batch's
  other (I'_j, C') triplets at ``mcc_temperature``, in-batch triplets that are in fact positive
  masked out;
* ITM (``itm``): binary matching of a cached caption with its image against another image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.jobs.c3.batches import TYPE1, TYPE2, TYPE_POS
from train.jobs.c3.model import C3Model, encode_batch, fuse_pairs, mcc_logits


def c3_loss(model: C3Model, batch: dict, cfg, dev) -> tuple[torch.Tensor, dict[str, float]]:
    """w_mcp L_MCP + w_mcc L_MCC (+ w_itm L_ITM) of a batch, with its logs."""
    patches, hI, tok, mask, hT = encode_batch(model, batch, dev)
    loss = torch.zeros((), device=dev)
    logs: dict[str, float] = {}
    z = None
    if len(batch["pair_img"]):
        # the concept pairs and ITM's caption pairs in two forwards: each padded to its own longest text
        pi, pt = batch["pair_img"], batch["pair_txt"]
        p0 = int(batch["itm_pair"][0]) if "itm_pair" in batch else len(pi)
        z = torch.cat([fuse_pairs(model, patches, hI, tok, mask, hT, pi[s:e], pt[s:e])
                       for s, e in ((0, p0), (p0, len(pi))) if e > s])
    if "mcp_a" in batch:
        za = z[batch["mcp_a"].to(dev)]
        zb = z[batch["mcp_b"].to(dev)] if "mcp_b" in batch else None
        logit = model.mcp_logit(za, zb).float()
        y = batch["mcp_y"].to(dev)
        l_mcp = F.binary_cross_entropy_with_logits(logit, y)
        loss = loss + cfg.w_mcp * l_mcp
        with torch.no_grad():
            t = batch["mcp_type"].to(dev)
            logs["loss_mcp"] = float(l_mcp)
            logs["mcp_acc"] = 100.0 * float(((logit > 0).float() == y).float().mean())
            logs["mcp_pos_rows"] = float((t == TYPE_POS).sum())
            logs["mcp_type1_rows"] = float((t == TYPE1).sum())
            logs["mcp_type2_rows"] = float((t == TYPE2).sum())
    if "mcc_i" in batch:
        psi = model.psi(hT[batch["mcc_c"].to(dev)])
        lg = mcc_logits(psi.float(), hI[batch["mcc_i"].to(dev)].float(), hI[batch["mcc_j"].to(dev)].float())
        lg = lg.masked_fill(batch["mcc_fn"].to(dev), float("-inf")) / cfg.mcc_temperature
        l_mcc = F.cross_entropy(lg, torch.arange(lg.shape[0], device=dev))
        loss = loss + cfg.w_mcc * l_mcc
        logs["loss_mcc"] = float(l_mcc.detach())
        logs["mcc_false_neg_masked"] = float(batch["mcc_fn"].sum())
    if "itm_pair" in batch:
        li = model.phi_itm(z[batch["itm_pair"].to(dev)]).squeeze(-1).float()
        l_itm = F.binary_cross_entropy_with_logits(li, batch["itm_y"].to(dev))
        loss = loss + cfg.w_itm * l_itm
        logs["loss_itm"] = float(l_itm.detach())
    return loss, logs
