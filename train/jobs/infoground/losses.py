"""InfoGround's losses (Sec. 2.3-2.4, Eq. 8-9), vectorised, and a per-word loop reference.

Batch layout (``train.jobs.infoground.batches`` builds it; B captions, U distinct images)::

    region_features float [U, R, d_r]   region_mask bool [U, R]   image_of int64 [B] (caption -> image)
    words           float [B, T, d_w]   word_mask   bool [B, T]   (noun/adjective words of each caption)
    lang_words      float [B, 1+K, d_w] lang_mask   bool [B, 1+K] (slot 0: the caption's chosen noun,
                                                                    1..K: its negatives in context)

L_img (Eq. 8): every noun/adjective word w_j of caption b scores phi(R_u, w_j) against the U
images of the batch; -log softmax_u at the caption's own image. As the reference code
(``CapInfoNCE.forward``): mean over the caption's words, then mean over captions (captions with no
word are left out of the mean; the reference would count them as 0 in it). The batch's images
are deduplicated first: two captions of one image in a batch share one image column, so an
image is never its own negative.

L_lang (Eq. 9): the chosen noun w against its K negatives w'_l, each attending with its own
query over the caption's image: -log softmax at slot 0, over the valid slots (negatives past a
noun's stored count are masked out; the reference keeps no mask and always has 25). Mean over the
captions that have a noun with at least one valid negative (the reference: the same, by its
``valid_noun_mask``).
"""

from __future__ import annotations

import torch


def l_img(model, k: torch.Tensor, v: torch.Tensor, rmask: torch.Tensor, words: torch.Tensor, wmask: torch.Tensor,
          image_of: torch.Tensor) -> tuple[torch.Tensor, dict]:
    B, T, _ = words.shape
    q, vw = model.words(words, wmask)
    cap = torch.arange(B, device=words.device)[:, None].expand(B, T)[wmask]  # caption of each valid word
    if cap.numel() == 0:
        return words.new_zeros(()), {"img_acc": 0.0, "img_words": 0}
    phi, _ = model.attention_all(q[wmask], vw[wmask], k, v, rmask)  # [N, U]
    target = image_of[cap]
    logp = torch.log_softmax(phi, dim=1).gather(1, target[:, None])[:, 0]
    n_per = torch.bincount(cap, minlength=B).to(logp.dtype)
    per_cap = torch.zeros(B, dtype=logp.dtype, device=logp.device).index_add_(0, cap, logp)
    has = n_per > 0
    loss = -(per_cap[has] / n_per[has]).mean()
    acc = float((phi.argmax(1) == target).float().mean())
    return loss, {"img_acc": acc, "img_words": int(cap.numel())}


def l_lang(model, k: torch.Tensor, v: torch.Tensor, rmask: torch.Tensor, lang_words: torch.Tensor,
           lang_mask: torch.Tensor, image_of: torch.Tensor) -> tuple[torch.Tensor, dict]:
    valid = lang_mask[:, 0] & lang_mask[:, 1:].any(1)
    if not bool(valid.any()):
        return lang_words.new_zeros(()), {"lang_acc": 0.0, "lang_captions": 0}
    lw, lm = lang_words[valid], lang_mask[valid]
    img = image_of[valid]
    q, vw = model.words(lw, lm)
    phi, _ = model.attention_own(q, vw, k[img], v[img], rmask[img])  # [b, 1+K]
    phi = phi.masked_fill(~lm, float("-inf"))
    logp = torch.log_softmax(phi, dim=1)[:, 0]
    acc = float((phi.argmax(1) == 0).float().mean())
    return -logp.mean(), {"lang_acc": acc, "lang_captions": int(valid.sum())}


def infoground_loss(model, batch: dict, use_lang: bool = True) -> tuple[torch.Tensor, dict]:
    """L_img + L_lang (``use_lang`` False: L_img only, the ``negatives: none`` variant)."""
    rmask = batch["region_mask"]
    k, v = model.regions(batch["region_features"], rmask)
    li, logs = l_img(model, k, v, rmask, batch["words"], batch["word_mask"], batch["image_of"])
    loss = li
    logs = {"loss_img": float(li.detach()), **logs}
    if use_lang:
        ll, lg = l_lang(model, k, v, rmask, batch["lang_words"], batch["lang_mask"], batch["image_of"])
        loss = loss + ll
        logs.update({"loss_lang": float(ll.detach()), **lg})
    return loss, logs


# ------------------------------------------------------------------------------------ reference
def reference_loss(model, batch: dict, use_lang: bool = True, dtype=torch.float64) -> torch.Tensor:
    """The same L_img + L_lang written as the public code's math reads, one word at a time
    (for the equivalence test and the benchmark's baseline). The MLPs run on the same packed row
    sets as :func:`infoground_loss` (BatchNorm statistics are a property of the batch), then
    attention, phi and the InfoNCE terms are computed per word and per image in Python loops."""
    from train.jobs.infoground.model import packed

    rf, rm = batch["region_features"].to(dtype), batch["region_mask"]
    w, wm = batch["words"].to(dtype), batch["word_mask"]
    img_of = batch["image_of"].tolist()
    K = packed(model.k_r, rf, rm, model.d)
    V = packed(model.v_r, rf, rm, model.d)
    Q = packed(model.q_w, w, wm, model.d)
    VW = packed(model.v_w, w, wm, model.d)
    U, B = rf.shape[0], w.shape[0]
    scale = model.d ** -0.5

    def phi(q, vw, u):
        n = int(rm[u].sum())
        if n == 0:
            return torch.zeros((), dtype=dtype)
        s = torch.stack([q @ K[u, r] * scale for r in range(n)])
        a = torch.softmax(s, 0)
        vatt = sum(a[r] * V[u, r] for r in range(n))
        return vw @ vatt

    caps = []
    for b in range(B):
        terms = []
        for t in range(w.shape[1]):
            if not wm[b, t]:
                continue
            scores = torch.stack([phi(Q[b, t], VW[b, t], u) for u in range(U)])
            terms.append(-(scores[img_of[b]] - torch.logsumexp(scores, 0)))
        if terms:
            caps.append(sum(terms) / len(terms))
    loss = sum(caps) / len(caps) if caps else torch.zeros((), dtype=dtype)
    if not use_lang:
        return loss
    lw, lm = batch["lang_words"].to(dtype), batch["lang_mask"]
    LQ = packed(model.q_w, lw[lm[:, 0] & lm[:, 1:].any(1)], lm[lm[:, 0] & lm[:, 1:].any(1)], model.d)
    LV = packed(model.v_w, lw[lm[:, 0] & lm[:, 1:].any(1)], lm[lm[:, 0] & lm[:, 1:].any(1)], model.d)
    terms, i = [], 0
    for b in range(B):
        if not (lm[b, 0] and lm[b, 1:].any()):
            continue
        sc = torch.stack([phi(LQ[i, m], LV[i, m], img_of[b]) for m in range(lw.shape[1]) if lm[b, m]])
        terms.append(-(sc[0] - torch.logsumexp(sc, 0)))
        i += 1
    if terms:
        loss = loss + sum(terms) / len(terms)
    return loss

