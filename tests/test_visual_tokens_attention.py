"""The Visual Token Encoder's attention path: SDPA with the additive rank bias equals the plain
reference (values and gradients), the rank-weight modes and their initialisation w_r = r, padding
invariance, and a Block equal to torch's TransformerEncoderLayer. (Learning itself is shown through
the real commands on the testbed: tests/test_testbed_visual_tokens.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from train.jobs.visual_tokens import Config
from train.jobs.visual_tokens.model import (
    Block,
    RankWeights,
    VisualTokensModel,
    attention_bias,
    rank_weight_table,
    reference_attention,
)

D, DT = 32, 32


def random_batch(n: int, g: np.random.Generator) -> dict:
    """n token sets (image slot, 2-3 tangible, 1-2 intangible tokens, random ranks) + captions."""
    sizes = [(int(g.integers(2, 4)), int(g.integers(1, 3))) for _ in range(n)]
    L = max(1 + v + u for v, u in sizes)
    tokens = torch.zeros(n, L, D)
    types = torch.full((n, L), 3)
    ranks = torch.zeros(n, L, L, dtype=torch.uint8)
    for i, (v, u) in enumerate(sizes):
        T = 1 + v + u
        tokens[i, 1:T] = torch.from_numpy(g.normal(size=(T - 1, D))).float()
        types[i, 0], types[i, 1:1 + v], types[i, 1 + v:T] = 0, 1, 2
        ranks[i, :T, :T] = torch.from_numpy(g.integers(0, 8, size=(T, T))).to(torch.uint8)
    return {"tokens": tokens, "image_feature": torch.from_numpy(g.normal(size=(n, 8))).float(),
            "type_ids": types, "ranks": ranks, "pad_mask": types == 3,
            "text_tokens": torch.from_numpy(g.normal(size=(n, 6, DT))).float(), "text_mask": torch.ones(n, 6, dtype=torch.bool)}


def small_cfg(variant: str, **kw) -> Config:
    return Config(variant=variant, width=64, heads=4, layers=2, ff_dim=128, embed_dim=32, image_mlp_hidden=32,
                  dropout=0.0, text_layers=1, **kw)


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


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
    b = random_batch(12, np.random.default_rng(0))
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
    b = random_batch(3, np.random.default_rng(3))
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
