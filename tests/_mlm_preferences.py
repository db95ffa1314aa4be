"""A tiny masked LM whose preferences are known, trained in seconds on generated captions.

Captions "a man is riding a bike on the road" etc. are generated from concepts, each with
interchangeable surface forms (synonyms) and a hypernym: the ride concept BIKE is said "bike",
"bicycle" or "vehicle"; HORSE "horse", "pony" or "animal"; CAMEL "camel" or "animal"; ELEPHANT
"elephant" or "animal". Masked-LM training uses BERT's corruption with one addition that encodes
what is *true*: a selected token is sometimes replaced by another true description of the same
thing (a synonym or the hypernym) and the model must restore the original. So, by construction:

* p(s'|c) at a masked ride slot follows the surface-form frequencies: bicycle is as likely as
  bike, camel and elephant, far above vehicle, horse or pony;
* q(s'|s,c) at an observed "bike" spreads over the true alternatives {bicycle, vehicle} and gives
  almost nothing to horse, pony, camel, elephant or animal (those would be false).

The p/q re-ranking must therefore drop bicycle and vehicle and keep the plausible alternatives.
"""

from __future__ import annotations

import numpy as np
import torch

AGENTS = [["man", "guy"], ["woman", "lady"]]
PLACES = [["road", "street"], ["beach", "shore"], ["field", "meadow"]]
# ride concepts: (weight, surface forms with probabilities)
RIDES = [
    (0.4, {"bike": 0.4, "bicycle": 0.4, "vehicle": 0.2}),
    (0.2, {"horse": 0.4, "pony": 0.4, "animal": 0.2}),
    (0.2, {"camel": 0.8, "animal": 0.2}),
    (0.2, {"elephant": 0.8, "animal": 0.2}),
]
TEMPLATES = ["a {a} is riding a {r} on the {p}", "a {a} rides a {r} along the {p}", "the {a} is on a {r} near the {p}"]


def _draw(rng, forms: dict) -> str:
    keys = list(forms)
    return keys[rng.choice(len(keys), p=np.array([forms[k] for k in keys]))]


def generate(rng, n: int) -> list[tuple[str, dict]]:
    """Captions and, per caption, the true alternative surface forms of each slot word."""
    out = []
    for _ in range(n):
        ag = AGENTS[rng.integers(len(AGENTS))]
        pl = PLACES[rng.integers(len(PLACES))]
        ride = RIDES[rng.choice(len(RIDES), p=np.array([w for w, _ in RIDES]))][1]
        a, p, r = ag[rng.integers(2)], pl[rng.integers(2)], _draw(rng, ride)
        text = TEMPLATES[rng.integers(len(TEMPLATES))].format(a=a, r=r, p=p)
        alts = {a: [x for x in ag if x != a], p: [x for x in pl if x != p], r: [x for x in ride if x != r]}
        out.append((text, alts))
    return out


def small_tokenizer(folder):
    """A real WordPiece tokenizer over the generated captions' words only (fast to train on)."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    words = sorted({w for t in TEMPLATES for w in t.split() if "{" not in w}
                   | {w for g in AGENTS + PLACES for w in g} | {w for _, f in RIDES for w in f})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##s"] + words) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "tokenizer_class": "BertTokenizer"}))
    return AutoTokenizer.from_pretrained(str(folder))


def train_preference_mlm(folder, steps: int = 400, seed: int = 0, batch: int = 64):
    """Returns a trained tiny BertForMaskedLM (eval mode) and its tokenizer (written to ``folder``)."""
    from transformers import BertConfig, BertForMaskedLM

    tok = small_tokenizer(folder)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = generate(rng, 4000)
    enc = tok([t for t, _ in data], padding=True, return_tensors="pt")
    all_ids, all_att = enc["input_ids"], enc["attention_mask"]
    # per caption position: up to two true alternatives (token ids), -1 where none
    alt = torch.full(all_ids.shape + (2,), -1, dtype=torch.long)
    for n, (text, alts) in enumerate(data):
        for k, w in enumerate(text.split()):  # each word is one token, at position k + 1
            for j, a in enumerate(alts.get(w, [])[:2]):
                alt[n, k + 1, j] = tok.convert_tokens_to_ids(a)
    content = (all_att == 1) & (all_ids != tok.cls_token_id) & (all_ids != tok.sep_token_id)
    model.train()
    for step in range(steps):
        rows = torch.randint(len(data), (batch,), generator=g)
        ids, att = all_ids[rows].clone(), all_att[rows]
        sel = content[rows] & (torch.rand(ids.shape, generator=g) < 0.15)
        labels = torch.where(sel, ids, torch.full_like(ids, -100))
        u = torch.rand(ids.shape, generator=g)
        choice = alt[rows].gather(2, torch.randint(2, ids.shape + (1,), generator=g)).squeeze(2)
        choice = torch.where(choice >= 0, choice, alt[rows][..., 0])
        rand_tok = torch.randint(5, len(tok), ids.shape, generator=g)
        ids = torch.where(sel & (u < 0.6), tok.mask_token_id, ids)
        ids = torch.where(sel & (u >= 0.6) & (u < 0.7), rand_tok, ids)
        # u in [0.7, 0.8): kept; u >= 0.8: another true description of the same thing (if any)
        ids = torch.where(sel & (u >= 0.8) & (choice >= 0), choice, ids)
        ids = torch.where(sel & (u >= 0.8) & (choice < 0), tok.mask_token_id, ids)
        if not sel.any():
            continue
        hidden = model.bert(input_ids=ids, attention_mask=att).last_hidden_state
        # the vocabulary head only where there is a target
        loss = torch.nn.functional.cross_entropy(model.cls(hidden[sel]), labels[sel])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok
