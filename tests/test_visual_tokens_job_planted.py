"""Planted signal for the Visual Token Encoder on hand-made token sets, and the attention path.

Scenes of two objects; a tangible token = emb(colour) + emb(shape) + noise (no position), the
intangible token = emb(predicate), ranks from :func:`pipeline.visual_tokens.graph.build_graph`
(the subject -> object pair ranked 7, the reverse only by its kNN rank). Captions are
"colour shape predicate colour shape" + EOS as hand-made cached text tokens, contextual like CLIP's
(tanh(A word_i + B word_{i-1}) + position vector), read by the trainable text head.

* subject/object swap: the swapped scene has the *same tokens in the same order*; only the rank
  matrix differs. ``no-additive`` therefore computes bit-identical image embeddings for a scene and
  its swap, so over items that hold both (image X: caption of X vs caption of its swap, and the
  same for the swap's image) exactly one of the two items is right: pairwise accuracy is exactly
  50% (asserted to 1e-9). ``additive`` must reach >= 70%.
* attribute swap (colours exchanged between the two objects): the tangible tokens differ, so
  both variants must beat chance (50%) by a margin: >= 70%.
Calibration (seed 0, 1 thread): additive reaches ~90-100% on swaps, attributes ~90-100% for both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.visual_tokens.graph import build_graph
from train.jobs.visual_tokens import Config
from train.jobs.visual_tokens.losses import clip_loss
from train.jobs.visual_tokens.model import (
    Block,
    RankWeights,
    VisualTokensModel,
    attention_bias,
    rank_weight_table,
    reference_attention,
)

D, DT, N_COL, N_SHAPE, N_PRED = 32, 32, 6, 6, 4


class World:
    def __init__(self, seed: int = 0):
        g = np.random.default_rng(seed)
        self.col, self.shape, self.pred = (g.normal(size=(n, D)) for n in (N_COL, N_SHAPE, N_PRED))
        self.words = g.normal(size=(N_COL + N_SHAPE + N_PRED, DT))  # text-side word vectors
        self.pos = g.normal(size=(6, DT)) * 0.5
        self.eos = g.normal(size=DT)
        self.wa, self.wb = g.normal(size=(2, DT, DT)) / np.sqrt(DT)

    def scene(self, g):
        """(objects [(c, s), (c, s)], predicate, token order) with distinct colours and shapes."""
        c = g.choice(N_COL, 2, replace=False)
        s = g.choice(N_SHAPE, 2, replace=False)
        return [(int(c[0]), int(s[0])), (int(c[1]), int(s[1]))], int(g.integers(N_PRED)), g.permutation(2)

    def image(self, objs, p, order, subject: int, noise):
        """Token set with ``subject`` (0/1, index into objs) -> the other, tokens in ``order``."""
        tang = (np.stack([self.col[c] + self.shape[s] for c, s in objs]) + noise)[order]
        pos = {o: k for k, o in enumerate(order)}  # object index -> token position
        S = np.zeros((2, 2, N_PRED), np.float32)
        S[pos[subject], pos[1 - subject], p] = 1
        gr = build_graph(np.ones(2), S, np.array([[0, 0, 10, 10], [20, 0, 30, 10]], float))
        return tang, self.pred[gr.predicates], gr.ranks

    def caption(self, objs, p, subject: int):
        a, b = objs[subject], objs[1 - subject]
        ids = [a[0], N_COL + a[1], N_COL + N_SHAPE + p, b[0], N_COL + b[1]]
        x = np.concatenate([self.words[ids], self.eos[None]])
        prev = np.concatenate([np.zeros((1, DT)), x[:-1]])
        # contextual, like cached CLIP text tokens: each token also carries the word before it
        return np.tanh(x @ self.wa + prev @ self.wb) + self.pos


def batch_of(images, captions, g):
    B = len(images)
    L = max(1 + len(t) + len(u) for t, u, _ in images)
    tokens = torch.zeros(B, L, D)
    types = torch.full((B, L), 3)
    ranks = torch.zeros(B, L, L, dtype=torch.uint8)
    for i, (t, u, r) in enumerate(images):
        T = 1 + len(t) + len(u)
        tokens[i, 1:1 + len(t)] = torch.from_numpy(t).float()
        tokens[i, 1 + len(t):T] = torch.from_numpy(u).float()
        types[i, 0], types[i, 1:1 + len(t)], types[i, 1 + len(t):T] = 0, 1, 2
        ranks[i, :T, :T] = torch.from_numpy(r)
    return {"tokens": tokens, "image_feature": torch.from_numpy(g.normal(size=(B, 8))).float() * 0,  # no signal
            "type_ids": types, "ranks": ranks, "pad_mask": types == 3,
            "text_tokens": torch.from_numpy(np.stack(captions)).float(), "text_mask": torch.ones(B, 6, dtype=torch.bool)}


def variants_of(w: World, g):
    """A scene, its subject/object swap (same tokens, same order) and its colour swap."""
    objs, p, order = w.scene(g)
    noise = 0.1 * g.normal(size=(2, D))
    att = [(objs[1][0], objs[0][1]), (objs[0][0], objs[1][1])]
    return [(w.image(objs, p, order, 0, noise), w.caption(objs, p, 0)),
            (w.image(objs, p, order, 1, noise), w.caption(objs, p, 1)),
            (w.image(att, p, order, 0, noise), w.caption(att, p, 0))]


def small_cfg(variant: str, **kw) -> Config:
    return Config(variant=variant, width=64, heads=4, layers=2, ff_dim=128, embed_dim=32, image_mlp_hidden=32,
                  dropout=0.0, text_layers=1, **kw)


def train_planted(variant: str, steps: int = 120, seed: int = 0, kinds=(0, 1, 2)):
    torch.manual_seed(seed)
    w = World(0)
    cfg = small_cfg(variant)
    model = VisualTokensModel(cfg, {"d_token": D, "d_image": 8, "d_text": DT, "d_pooled": 8})
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = np.random.default_rng(seed + 1)
    for _ in range(steps):
        items = [v for _ in range(48 // len(kinds)) for k, v in enumerate(variants_of(w, g)) if k in kinds]
        b = batch_of([i for i, _ in items], [c for _, c in items], g)
        img = model.encode_image(b, "cpu")
        txt = model.encode_text(b["text_tokens"], b["text_mask"], None, "cpu")
        loss, _ = clip_loss(img, txt, model.scale())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, w


def pairwise(model, w: World, n: int = 150, seed: int = 99):
    """(subject/object swap accuracy, attribute swap accuracy, max |e(X) - e(swap X)|)."""
    model.eval()
    g = np.random.default_rng(seed)
    vs = [variants_of(w, g) for _ in range(n)]
    flat = [x for v in vs for x in v]
    b = batch_of([i for i, _ in flat], [c for _, c in flat], g)
    with torch.no_grad():
        e = model.encode_image(b, "cpu").double()
        t = model.encode_text(b["text_tokens"], b["text_mask"], None, "cpu").double()
    e, t = e.view(n, 3, -1), t.view(n, 3, -1)
    s = torch.einsum("nid,njd->nij", e, t)  # [n, image variant, caption variant]
    def acc(pos, neg):
        return float(100 * ((pos > neg).double() + 0.5 * (pos == neg).double()).mean())
    swap = acc(torch.cat([s[:, 0, 0], s[:, 1, 1]]), torch.cat([s[:, 0, 1], s[:, 1, 0]]))
    att = acc(s[:, 0, 0], s[:, 0, 2])
    return swap, att, float((e[:, 0] - e[:, 1]).abs().max())


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def test_planted_additive_vs_no_additive():
    m_add, w = train_planted("additive")
    swap_a, att_a, _ = pairwise(m_add, w)
    m_no, w = train_planted("no-additive")
    swap_n, att_n, gap = pairwise(m_no, w)
    print(f"additive swap {swap_a:.1f} att {att_a:.1f}; no-additive swap {swap_n:.1f} att {att_n:.1f}")
    assert gap == 0.0  # identical inputs up to the ranks: bit-identical embeddings
    assert abs(swap_n - 50.0) < 1e-9  # exactly chance
    assert swap_a >= 70.0
    assert att_a >= 70.0 and att_n >= 70.0


# ------------------------------------------------------------------------- attention correctness
def test_sdpa_with_bias_equals_reference_attention():
    torch.manual_seed(0)
    B, H, T, d = 3, 4, 9, 8
    q, k, v = (torch.randn(B, H, T, d, requires_grad=True) for _ in range(3))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 6:] = True
    pad[2, 3:] = True
    ranks = torch.randint(0, 8, (B, T, T))
    a = torch.randn(H, 7, requires_grad=True) * 0.3
    bias = attention_bias(rank_weight_table(a), ranks, pad)
    assert bias.shape == (B, H, T, T) and torch.isinf(bias[0, :, :, 6:]).all()
    o1 = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    o2 = reference_attention(q, k, v, bias)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)  # float32 (SDPA's CPU kernel is not bitwise the same)
    g1 = torch.autograd.grad((o1 * v.detach()).sum(), [q, k, a], retain_graph=True)
    g2 = torch.autograd.grad((o2 * v.detach()).sum(), [q, k, a])
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    # the bias is w[A]: explicit loop
    w = rank_weight_table(a).detach()
    for b_ in range(B):
        for i in range(T):
            for j in range(T):
                want = float("-inf") if pad[b_, j] else w[:, ranks[b_, i, j]]
                assert torch.equal(bias[b_, :, i, j].detach(), torch.as_tensor(want, dtype=torch.float32).expand(H))


@pytest.mark.parametrize("mode", ["shared", "per-head", "per-layer", "per-layer-head"])
def test_model_sdpa_equals_reference_and_rank_weight_modes(mode):
    torch.manual_seed(1)
    cfg = small_cfg("additive", rank_weights=mode)
    m = VisualTokensModel(cfg, {"d_token": D, "d_image": 8, "d_text": DT, "d_pooled": 8}).eval()
    w = m.rank_weights()
    assert w.shape == {"shared": (1, 1, 8), "per-head": (1, 4, 8), "per-layer": (2, 1, 8), "per-layer-head": (2, 4, 8)}[mode]
    torch.testing.assert_close(w, torch.arange(8.0).expand_as(w))  # init w_r = r
    g = np.random.default_rng(0)
    vs = [x for _ in range(4) for x in variants_of(World(0), g)]
    b = batch_of([i for i, _ in vs], [c for _, c in vs], g)
    b["tokens"][-1, 2:] = 0  # make one sample shorter: padding inside the batch
    b["type_ids"][-1, 2:] = 3
    b["pad_mask"] = b["type_ids"] == 3
    b["ranks"][-1, 2:] = 0
    b["ranks"][-1, :, 2:] = 0
    with torch.no_grad():
        e1 = m.encode_image(b, "cpu")
        for blk in m.image.encoder.blocks:
            blk.attention = "reference"
        e2 = m.encode_image(b, "cpu")
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=1e-6)


def test_rank_weights_monotone_and_fixed():
    a = torch.randn(5, 7)
    w = rank_weight_table(a)
    assert (w[:, 0] == 0).all() and (w[:, 1:] > w[:, :-1]).all()
    fixed = RankWeights("shared", 8, 8, learn=False)
    assert not any(True for _ in fixed.parameters())
    assert fixed.table().flatten().tolist() == list(range(8))


def test_padding_does_not_change_the_embedding():
    """The same sample padded to its own length or to 77 gives the same embedding (pad_to)."""
    torch.manual_seed(2)
    m = VisualTokensModel(small_cfg("additive"), {"d_token": D, "d_image": 8, "d_text": DT, "d_pooled": 8}).eval()
    g = np.random.default_rng(3)
    vs = variants_of(World(0), g)
    b = batch_of([i for i, _ in vs], [c for _, c in vs], g)
    L = b["tokens"].shape[1]
    big = {k: v.clone() for k, v in b.items()}
    big["tokens"] = torch.nn.functional.pad(b["tokens"], (0, 0, 0, 77 - L))
    big["type_ids"] = torch.nn.functional.pad(b["type_ids"], (0, 77 - L), value=3)
    big["ranks"] = torch.nn.functional.pad(b["ranks"], (0, 77 - L, 0, 77 - L))
    big["pad_mask"] = big["type_ids"] == 3
    with torch.no_grad():
        torch.testing.assert_close(m.encode_image(b, "cpu"), m.encode_image(big, "cpu"), rtol=1e-5, atol=1e-6)


def test_block_matches_torch_transformer_encoder_layer():
    """Without a rank bias, a Block is torch.nn.TransformerEncoderLayer (post-norm, ReLU): the
    paper's "PyTorch implementation of the Transformer model"."""
    torch.manual_seed(3)
    W, H = 32, 4
    ref = torch.nn.TransformerEncoderLayer(W, H, 64, dropout=0.0, batch_first=True).eval()
    blk = Block(W, H, 64, 0.0).eval()
    with torch.no_grad():
        blk.qkv.weight.copy_(ref.self_attn.in_proj_weight)
        blk.qkv.bias.copy_(ref.self_attn.in_proj_bias)
        blk.out.weight.copy_(ref.self_attn.out_proj.weight)
        blk.out.bias.copy_(ref.self_attn.out_proj.bias)
        for a, b_ in ((blk.ff1, ref.linear1), (blk.ff2, ref.linear2), (blk.ln1, ref.norm1), (blk.ln2, ref.norm2)):
            a.weight.copy_(b_.weight)
            a.bias.copy_(b_.bias)
        x = torch.randn(2, 7, W)
        pad = torch.zeros(2, 7, dtype=torch.bool)
        pad[1, 5:] = True
        want = ref(x, src_key_padding_mask=pad)
        got = blk(x, attention_bias(None, None, pad))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :5], want[1, :5], rtol=1e-5, atol=1e-5)
