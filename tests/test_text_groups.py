"""text-groups: tokenizer, grouping block (loop reference, padding, straight-through gradient),
phrase-discovery metric, bad input. Fast tests (the trainer's planted/end-to-end tests are in
tests/test_text_groups_train.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("one_thread")


# --- tokenizer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from train.jobs.text_groups.tokenizer import load_tokenizer

    return load_tokenizer()[0]


def test_config_importable_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from train.jobs.text_groups import Config, NAME\n"
            "c = Config(); assert NAME == 'text-groups' and c.lr == 1.6e-3 and c.n_groups == 4 and c.epochs == 30\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clip_ids(tok):
    from train.jobs.text_groups.tokenizer import EOT, SOT, encode

    assert len(tok) == 49408
    e = encode(tok, ["a photo of a cat", "A photo of a dog."])
    assert e.ids[0, :7].tolist() == [SOT, 320, 1125, 539, 320, 2368, EOT] and SOT == 49406 and EOT == 49407
    assert e.ids[1, :8].tolist() == [SOT, 320, 1125, 539, 320, 1929, 269, EOT]
    assert e.lengths.tolist() == [7, 8]


def _testbed_and_sugarcrepe_texts(tmp_path) -> list[str]:
    """The generated testbed's captions (small and large vocabulary) and SugarCrepe-like text: its
    generated positives/negatives and, where ../shared/data/sugarcrepe is present, the published files."""
    import json

    from pipeline.synthetic.generate import generate

    texts = []
    for vocab in ("small", "large"):
        paths = generate(tmp_path / vocab, n_images=40, seed=3, image_size=64, vocabulary=vocab)
        texts += [a["caption"] for a in json.loads(paths["captions"].read_text())["annotations"]]
        for f in sorted(paths["sugarcrepe"].glob("*.json")):
            texts += [t for it in json.loads(f.read_text()).values() for t in (it["caption"], it["negative_caption"])]
    from tests.conftest import SHARED

    published = SHARED / "data" / "sugarcrepe"
    for f in sorted(published.glob("*.json")) if published.is_dir() else []:
        texts += [t for it in json.loads(f.read_text()).values() for t in (it["caption"], it["negative_caption"])]
    return texts + ["It's 3 o'clock; the dog's toy isn't here!", "A man in a yellow-green jacket rides a unicycle",
                    "naïve café, 1999 — done.", "UPPER lower MiXeD"]


def test_same_ids_as_open_clip_get_tokenizer(tok, tmp_path):
    """open_clip's own tokenizer (open_clip.get_tokenizer) is the reference: identical ids, SOT/EOT included."""
    import open_clip

    from train.jobs.text_groups.tokenizer import encode

    texts = _testbed_and_sugarcrepe_texts(tmp_path)
    assert len(texts) > 1000
    ref = open_clip.get_tokenizer("ViT-B-16")(texts).numpy()  # [T, 77], zero-padded
    e = encode(tok, texts)
    for i, t in enumerate(texts):
        n = int(e.lengths[i])
        assert e.ids[i, :n].tolist() == ref[i, :n].tolist() and not ref[i, n:].any(), t


def test_truncation_empty_and_offsets(tok):
    from train.jobs.text_groups.tokenizer import EOT, char_span_to_tokens, encode

    long = " ".join(["dog"] * 100)
    e = encode(tok, [long, "", "   ", "red circle"])
    assert e.truncated == 1 and e.empty == 2
    assert e.lengths.tolist() == [77, 0, 0, 4] and e.ids[0, 76] == EOT
    off = e.offsets[3]
    assert char_span_to_tokens(off, 0, 3) == (0, 1) and char_span_to_tokens(off, 4, 10) == (1, 2)
    assert char_span_to_tokens(off, 0, 10) == (0, 2)
    assert char_span_to_tokens(off, 20, 30) is None  # outside the text
    # a span past the truncation point maps to no token
    assert char_span_to_tokens(e.offsets[0], len(long) - 3, len(long)) is None


# --- grouping block -------------------------------------------------------------------------
def _assign_reference(block, g, t, mask, noise, training):
    """Eq. 1-4 by explicit loops (float64)."""
    q = block.q(g).detach().numpy()
    k = block.k(t).detach().numpy()
    v = block.v(t).detach().numpy()
    B, K, D = q.shape
    L = k.shape[1]
    out = np.zeros((B, K, D))
    hard = np.zeros((B, K, L))
    for b in range(B):
        for j in range(L):
            if not mask[b, j]:
                continue
            logits = [sum(q[b, kk, d] * k[b, j, d] for d in range(D)) / np.sqrt(D) for kk in range(K)]
            if training:
                logits = [x + noise[b, kk, j] for kk, x in enumerate(logits)]
            hard[b, int(np.argmax(logits)), j] = 1.0
        for kk in range(K):
            s = hard[b, kk].sum() + block.assign_eps
            acc = np.zeros(D)
            for j in range(L):
                acc += hard[b, kk, j] / s * v[b, j]
            out[b, kk] = acc
    W, bias = block.o.weight.detach().numpy(), block.o.bias.detach().numpy()
    return out @ W.T + bias, hard


@pytest.mark.parametrize("training", [False, True])
def test_assign_attention_matches_loop_reference(training):
    from train.jobs.text_groups.model import AssignAttention

    torch.manual_seed(0)
    B, K, L, D = 3, 4, 7, 8
    blk = AssignAttention(D).double().train(training)
    g, t = torch.randn(B, K, D, dtype=torch.float64), torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    noise = -torch.empty(B, K, L, dtype=torch.float64).exponential_().log()
    out, attn, soft = blk(g, t, mask, noise=noise)
    ref, hard = _assign_reference(blk, g, t, mask.numpy(), noise.numpy(), training)
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-10, atol=1e-12)
    assert ((attn.detach().numpy() > 0) == (hard > 0)).all()
    assert (attn[~mask[:, None, :].expand_as(attn)] == 0).all()
    np.testing.assert_allclose(soft.sum(1).detach().numpy(), mask.double().numpy(), atol=1e-12)  # softmax over groups


def test_straight_through_gradient():
    """Forward = hard one-hot (Eq. 3); gradient = the gradient through the (Gumbel-)softmax."""
    from train.jobs.text_groups.model import AssignAttention

    torch.manual_seed(1)
    B, K, L, D = 2, 3, 5, 6
    blk = AssignAttention(D).double().train()
    g, t = torch.randn(B, K, D, dtype=torch.float64), torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3:] = False
    noise = -torch.empty(B, K, L, dtype=torch.float64).exponential_().log()
    w = torch.randn(B, K, D, dtype=torch.float64)
    out, _, _ = blk(g, t, mask, noise=noise)
    (out * w).sum().backward()
    got = blk.q.weight.grad.clone()

    # reference: dL/dA at A = one-hot, pushed through d softmax((raw + noise)/tau) / d q.weight
    blk.zero_grad()
    raw = torch.einsum("bkd,bld->bkl", blk.q(g), blk.k(t)) / np.sqrt(D)
    soft = torch.softmax((raw + noise) / blk.tau, dim=1)
    A = torch.zeros_like(soft).scatter_(1, soft.argmax(1, keepdim=True), 1.0).requires_grad_(True)
    Am = A * mask[:, None, :].double()
    f = blk.o(torch.bmm(Am / (Am.sum(-1, keepdim=True) + blk.assign_eps), blk.v(t)))
    (gA,) = torch.autograd.grad((f * w).sum(), A, retain_graph=True)
    (ref,) = torch.autograd.grad(soft, blk.q.weight, grad_outputs=gA)
    # the value/output path adds no q gradient, so the two must agree exactly
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-9, atol=1e-12)
    assert got.abs().sum() > 0


def test_gumbel_off_trains_on_the_noiseless_argmax():
    """``gumbel: false``: the training forward is the evaluation forward (hard argmax of the noiseless
    softmax), with the straight-through gradient still reaching the assignment logits."""
    from train.jobs.text_groups.model import AssignAttention

    torch.manual_seed(4)
    B, K, L, D = 2, 3, 6, 8
    blk = AssignAttention(D, gumbel=False).double()
    g, t = torch.randn(B, K, D, dtype=torch.float64), torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 4:] = False
    out_tr, attn, soft = blk.train()(g, t, mask)
    out_ev, _, _ = blk.eval()(g, t, mask)
    np.testing.assert_allclose(out_tr.detach().numpy(), out_ev.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert (attn.argmax(1)[mask] == soft.argmax(1)[mask]).all()
    out_tr.sum().backward()
    assert blk.q.weight.grad.abs().sum() > 0
    noisy = AssignAttention(D).double().train()
    noisy.load_state_dict(blk.state_dict())
    big = 50 * -torch.empty(B, K, L, dtype=torch.float64).exponential_().log()
    _, a2, s2 = noisy(g, t, mask, noise=big)  # with (large) Gumbel noise the training assignment differs
    assert (a2.argmax(1)[mask] != s2.argmax(1)[mask]).any()


def test_encoder_ignores_padding():
    """Groups (and the hard assignment over real tokens) do not depend on padding."""
    from train.jobs.text_groups.model import TextGroupTransformer

    torch.manual_seed(2)
    m = TextGroupTransformer(vocab=100, d=32, heads=4, n_groups=3, layers_pre=2, layers_post=1, max_len=20,
                             d_img=8).double().eval()
    ids = torch.randint(1, 100, (1, 6))
    a = m.encode(ids, torch.ones(1, 6, dtype=torch.bool))
    padded = torch.cat([ids, torch.randint(1, 100, (1, 5))], 1)
    mask = torch.zeros(1, 11, dtype=torch.bool)
    mask[0, :6] = True
    b = m.encode(padded, mask)
    np.testing.assert_allclose(a["groups"].detach().numpy(), b["groups"].detach().numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(a["soft"].argmax(1).numpy(), b["soft"].argmax(1)[:, :6].numpy())
    assert (b["assign"][:, :, 6:] == 0).all()


def test_real_token_logits_equal_full_logits():
    from train.jobs.text_groups.losses import reconstruction
    from train.jobs.text_groups.model import TextGroupTransformer

    torch.manual_seed(3)
    m = TextGroupTransformer(vocab=50, d=16, heads=2, n_groups=2, layers_pre=1, layers_post=1, max_len=12,
                             d_img=8).double().eval()
    ids = torch.randint(1, 50, (3, 9))
    mask = torch.arange(9)[None] < torch.tensor([[9], [5], [3]])
    out = m.encode(ids, mask)
    a = reconstruction(*m.reconstruction_logits(ids, mask, out["groups"]))
    b = reconstruction(*m.reconstruction_logits(ids, mask, out["groups"], full=True))
    assert abs(float(a) - float(b)) < 1e-10
    m.set_output_vocab(torch.arange(50))  # the whole vocabulary as "corpus": same loss
    c = reconstruction(*m.reconstruction_logits(ids, mask, out["groups"]))
    assert abs(float(a) - float(c)) < 1e-10
    # Eq. 10 summed over each caption's tokens, averaged over captions: = mean x (real targets / captions)
    n_tgt = int(mask[:, 1:].sum())
    for full in (False, True):
        s = reconstruction(*m.reconstruction_logits(ids, mask, out["groups"], full=full), reduction="sum")
        assert abs(float(s) - float(a) * n_tgt / 3) < 1e-9


# --- phrase discovery metric ----------------------------------------------------------------
def test_caption_scores():
    from train.jobs.text_groups.discovery import caption_scores

    assert caption_scores(np.array([0, 0, 1, 1, 2, 2]), [(0, 2), (2, 4)]) == (1.0, 1.0, 1.0, 1.0)
    # one group over everything, 2 phrases of 2 tokens (tokens 4-5 unannotated: outside the union)
    iou, p, r, f = caption_scores(np.zeros(6, int), [(0, 2), (2, 4)])
    assert (iou, p, r) == (0.5, 0.5, 1.0) and abs(f - 2 / 3) < 1e-12
    # the union rule: one group covering a one-phrase caption scores 1
    assert caption_scores(np.zeros(5, int), [(1, 3)])[0] == 1.0
    # Hungarian picks the best 1-1 pairs: group 1 -> phrase (3,6) (IoU 2/3), group 0 -> (0,3) (IoU 3/4)
    iou, p, r, _ = caption_scores(np.array([0, 0, 0, 1, 1, 0]), [(0, 3), (3, 6)])
    assert abs(iou - (3 / 4 + 2 / 3) / 2) < 1e-12 and abs(r - (1 + 2 / 3) / 2) < 1e-12 and abs(p - (3 / 4 + 1) / 2) < 1e-12


def test_gold_captions_counts_bad_input(tok):
    from train.jobs.text_groups.discovery import gold_captions, score_labels

    long = "a red circle " + " ".join(["and"] * 90) + " a blue square"
    caps = [(1, "A red circle and a blue square."), (2, ""), (3, long), (4, "No phrase here."), (5, "A star.")]
    spans = {1: [(0, 12), (17, 30)], 2: [(0, 3)], 3: [(0, 12), (len(long) - 13, len(long))], 5: [(40, 50), (0, 6)]}
    g = gold_captions(tok, caps, spans)
    assert g.caption_ids == [1, 3, 5]
    assert g.skipped == {"no_gold_phrase": 1, "empty_after_tokenisation": 1}
    assert g.truncated == 1 and g.phrases_dropped == 2  # caption 3's second phrase, caption 5's bad span
    assert g.phrases[0] == [(0, 3), (4, 7)]
    s = score_labels([np.zeros(n, int) for n in g.n_tokens], g)
    assert s["all"]["n"] == 3 and s["ge2_phrases"]["n"] == 1
    for sub in ("all", "ge2_phrases"):  # bootstrap intervals over captions, in each metric's unit
        for m in ("tIoU", "P", "R", "F1"):
            lo, hi = s[sub][f"{m}_ci"]
            assert lo <= s[sub][m] + 1e-9 and s[sub][m] <= hi + 1e-9, (sub, m)
    assert s["ge2_phrases"]["F1_ci"] == pytest.approx((s["ge2_phrases"]["F1"],) * 2)  # one caption: no spread


def test_isolated_groups_see_the_caption_only_through_the_assignment():
    """``isolate_groups`` + ``pre_assign_attn: false``: the caption reaches the groups through Eq. 4's
    W(A V) term alone. With that term zeroed, two different captions give identical groups; without
    isolation (or with GroupViT's pre-assign attention) they differ."""
    from train.jobs.text_groups.model import TextGroupTransformer

    ids = torch.tensor([[5, 17, 33, 8, 2], [9, 41, 12, 60, 3]])
    mask = torch.ones(2, 5, dtype=torch.bool)

    def groups(isolate, pre_assign):
        torch.manual_seed(3)
        m = TextGroupTransformer(vocab=100, d=16, heads=2, n_groups=3, layers_pre=2, layers_post=1, max_len=20,
                                 d_img=8, isolate_groups=isolate, pre_assign=pre_assign).double().eval()
        with torch.no_grad():
            m.grouping.assign.o.weight.zero_()
            m.grouping.assign.o.bias.zero_()
        return m.encode(ids, mask)["groups"].detach().numpy()

    g = groups(True, False)
    np.testing.assert_allclose(g[0], g[1], rtol=1e-12, atol=1e-12)
    for isolate, pre_assign in ((False, False), (True, True)):
        g = groups(isolate, pre_assign)
        assert np.abs(g[0] - g[1]).max() > 1e-3, (isolate, pre_assign)


def test_soft_assignment_is_the_masked_softmax_over_groups():
    """``hard_assignment: false`` (GroupViT's ``hard=False``): the groups take the soft assignment
    (softmax over the groups, padding zeroed, rows normalised with assign_eps), in training and in
    evaluation alike, and its argmax is what phrase discovery scores."""
    from train.jobs.text_groups.model import AssignAttention

    torch.manual_seed(5)
    B, K, L, D = 2, 3, 6, 8
    blk = AssignAttention(D, gumbel=False, hard=False).double()
    g, t = torch.randn(B, K, D, dtype=torch.float64), torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 3:] = False
    out, attn, vis = blk.train()(g, t, mask)
    raw = torch.einsum("bkd,bld->bkl", blk.q(g), blk.k(t)) / D ** 0.5
    a = torch.softmax(raw, 1) * mask[:, None]
    a = a / (a.sum(-1, keepdim=True) + blk.assign_eps)
    np.testing.assert_allclose(attn.detach().numpy(), a.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.detach().numpy(), blk.o(a @ blk.v(t)).detach().numpy(), rtol=1e-12, atol=1e-12)
    out_ev, _, _ = blk.eval()(g, t, mask)
    np.testing.assert_allclose(out_ev.detach().numpy(), out.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert ((attn > 0) & (attn < 1)).all(dim=1)[mask].all()  # every real token is shared among the groups


def test_init_scales_reach_the_model():
    """``group_init_std`` / ``pos_init_std`` set the init std of the group tokens (GroupViT's 0.02)
    and of the encoder's positions (CLIP's 0.01); the job builds the model from its config."""
    from train.jobs.text_groups.model import TextGroupTransformer

    torch.manual_seed(0)
    d = TextGroupTransformer(vocab=50, d=64, heads=2, n_groups=16, layers_pre=1, layers_post=0, d_img=8)
    w = TextGroupTransformer(vocab=50, d=64, heads=2, n_groups=16, layers_pre=1, layers_post=0, d_img=8,
                             group_init_std=1.0, pos_init_std=0.5)
    assert 0.015 < float(d.group_tokens.std()) < 0.025 and 0.8 < float(w.group_tokens.std()) < 1.2
    assert 0.008 < float(d.pos.std()) < 0.012 and 0.45 < float(w.pos.std()) < 0.55
