"""InfoGround's side of the evaluation harness (train/eval/interface.py): s(I, text) = mean over
the text's noun/adjective words w of phi(R_I, w) (Gupta et al. 2020, Eq. 6-7).

Arbitrary texts are turned into word features as the negatives stage turns captions into them
(:class:`TextWords`): spaCy tags, the words with the artifact's feature tags, each the mean of its
word pieces' last hidden states of the word encoder the artifact used.
"""

from __future__ import annotations

import numpy as np
import torch

from train.jobs.infoground.metrics import centre_in


class TextWords:
    """Word features of arbitrary texts, computed as the negatives stage computes them: spaCy POS
    tags (``models.spacy``), words with the negatives artifact's feature tags (NOUN, ADJ and, with
    its ``include_propn``, PROPN), each the mean of its word pieces' last hidden states of
    ``models.word_encoder`` (the MLM's body when the artifact shared it; a ``scene-oracle`` span
    encoder gives each word's feature from its character span). Results are cached per text."""

    def __init__(self, manifest, params: dict):
        self.manifest, self.params = manifest, params
        self._loaded = None
        self.cache: dict[str, np.ndarray] = {}

    def _load(self):
        if self._loaded is None:
            from pipeline.models.mlm import load_feature_encoder
            from pipeline.models.spacy_tagger import Tagger
            from pipeline.negatives.core import MinerOptions

            m = self.manifest.models
            we = load_feature_encoder(m.mlm, m.word_encoder)
            spans_of = getattr(we, "span_features", None)
            model, tok = (spans_of, None) if spans_of is not None else (we.model, we.tokenizer)
            p = self.params
            opts = MinerOptions(noun_pos=tuple(p.get("noun_pos", ["NOUN"])),
                                feature_pos=tuple(p.get("feature_pos", ["NOUN", "ADJ"])),
                                include_propn=bool(p.get("include_propn", False)))
            if spans_of is None:
                model.eval()
            self._loaded = (Tagger(m.spacy), model, tok, opts.feature_tags(), int(p.get("max_tokens", 128)),
                            p.get("word_pool", "mean"))
        return self._loaded

    @torch.no_grad()
    def encode(self, texts: list[str]) -> list[np.ndarray]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if todo:
            from pipeline.negatives.core import segment_pool

            tagger, model, tok, tags, max_tokens, pool = self._load()
            tagged = tagger.tag(todo)
            if tok is None:  # a span encoder: model(text, spans) -> [n, d]
                for t, words in zip(todo, tagged):
                    self.cache[t] = model(t, [(w.start, w.end) for w in words if w.pos in tags and any(ch.isalnum() for ch in w.text)])
                return [self.cache[t] for t in texts]
            enc = tok(todo, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                      max_length=max_tokens, add_special_tokens=True, padding=True, return_tensors="pt")
            hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state.float()
            for i, (t, words) in enumerate(zip(todo, tagged)):
                fw = [w for w in words if w.pos in tags and any(ch.isalnum() for ch in w.text)]
                spans, _ = align_words(enc, i, fw)
                rows, seg = [], []
                for j, sp in enumerate([s for s in spans if s is not None]):
                    rows.extend(range(sp[0], sp[1]))
                    seg.extend([j] * (sp[1] - sp[0]))
                if not rows:
                    self.cache[t] = np.zeros((0, hidden.shape[-1]), np.float32)
                    continue
                h = hidden[i, torch.as_tensor(rows)]
                self.cache[t] = segment_pool(h, torch.as_tensor(seg), max(seg) + 1, pool).numpy()
        return [self.cache[t] for t in texts]


def align_words(enc, i: int, words) -> tuple[list, bool]:
    """Token span [a, b) of each word in row ``i`` of a padded encoding (None when it did not fit)."""
    offs = enc["offset_mapping"][i].numpy().reshape(-1, 2)
    special = enc["special_tokens_mask"][i].numpy().astype(bool) | (enc["attention_mask"][i].numpy() == 0)
    content = (~special) & (offs[:, 1] > offs[:, 0])
    cs, ce = offs[:, 0], offs[:, 1]
    out = []
    for w in words:
        idx = np.nonzero(content & (cs < w.end) & (ce > w.start))[0]
        out.append(None if len(idx) == 0 or ce[idx[-1]] < w.end else (int(idx[0]), int(idx[-1]) + 1))
    return out, False


@torch.no_grad()
def score_word_features(model, regions, sample_ids, word_feats: list[np.ndarray], boxes=None,
                        device=None) -> np.ndarray:
    """Mean over words of phi(R_I, w) for P pairs (sample_ids[p], word_feats[p] [W_p, d_w]); NaN
    where a text has no word or the image no region. ``boxes`` [P, 4] (NaN rows = none) keeps the
    regions whose centre lies in the box (all regions when none does). ``regions``: the job's
    :class:`pipeline.loaders.regions.RegionsReader`."""
    dev = device if device is not None else torch.device("cpu")
    out = np.full(len(sample_ids), np.nan, dtype=np.float64)
    by_img: dict[int, list[int]] = {}
    for p, s in enumerate(sample_ids):
        if word_feats[p] is not None and len(word_feats[p]):
            by_img.setdefault(int(s), []).append(p)
    for sid, ps in by_img.items():
        r = regions.get(sid, ("boxes.npy", "features.npy"))
        if r is None or len(r["boxes"]) == 0:
            continue
        R = len(r["boxes"])
        k, v = model.regions(torch.from_numpy(r["features"].astype(np.float32)).to(dev)[None],
                             torch.ones(1, R, dtype=torch.bool, device=dev))
        # every word of every pair of this image in one pass; a pair with a box gets its own region mask
        masks = np.ones((len(ps), R), bool)
        if boxes is not None:
            rb = r["boxes"].astype(np.float64)
            for i, p in enumerate(ps):
                b = np.asarray(boxes[p], np.float64)
                if not np.isnan(b).any():
                    inside = centre_in(rb, b[None])
                    if inside.any():
                        masks[i] = inside
        uniq, which = np.unique(masks, axis=0, return_inverse=True)
        which = np.asarray(which).reshape(-1)
        n_words = np.asarray([len(word_feats[p]) for p in ps])
        words = torch.from_numpy(np.concatenate([np.asarray(word_feats[p], np.float32) for p in ps])).to(dev)
        q, vw = model.words(words, None)
        k_u = k.expand(len(uniq), R, k.shape[-1])
        v_u = v.expand(len(uniq), R, v.shape[-1])
        phi, _ = model.attention_all(q, vw, k_u, v_u, torch.from_numpy(uniq).to(dev))  # [words, masks]
        col = torch.from_numpy(np.repeat(which, n_words)).to(dev)
        phi = phi.gather(1, col[:, None])[:, 0].double()
        seg = torch.from_numpy(np.repeat(np.arange(len(ps)), n_words)).to(dev)
        mean = torch.zeros(len(ps), dtype=torch.float64, device=dev).index_add_(0, seg, phi) / torch.from_numpy(
            n_words).to(dev)
        out[np.asarray(ps)] = mean.cpu().numpy()
    return out
