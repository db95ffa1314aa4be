"""Context-preserving negative captions (InfoGround, Gupta et al. 2020, Sec. 2.4) and word features.

For a noun ``s`` in context ``c`` (the caption with ``s`` replaced by one ``[MASK]``):

1. ``p(s'|c)``: the masked LM's distribution at the mask; the ``top_k`` (30) most likely allowed
   vocabulary words are the candidates;
2. ``q(s'|s,c)``: the same LM's distribution at the noun's position in the *unmasked* caption,
   a proxy for how true ``(s', c)`` is when ``(s, c)`` is true (synonyms, hypernyms and the
   noun itself score high);
3. candidates are re-ranked by ``p/q`` and the best ``keep`` (25) are the negatives.

p and q are both softmax probabilities over the whole vocabulary (not renormalised over the
allowed words), exactly as the LM outputs them; ranking uses ``log p - log q``.

Choices the paper leaves open (each an option of :class:`MinerOptions`):

* Exclusions are applied *before* taking the top 30: the noun itself, its singular/plural forms,
  subword fragments (``##xx`` pieces, which are not words), non-alphabetic vocabulary entries and
  special tokens, and, optionally, words outside a noun vocabulary built from the dataset's
  captions (what the reference code did). The paper's Fig. 3 lists the noun itself among the
  candidates rejected by re-ranking; excluding it up front keeps 30 real alternatives in play.
* Multi-subword nouns ("skate ##board"): the whole subword span is replaced by ONE ``[MASK]``
  (as the reference code did), so candidates are single vocabulary words; ``q`` is pooled over
  the noun's subword positions of the unmasked pass (``q_pool``: ``mean`` of the probabilities,
  default, as every piece of the observed word votes on what else is true there; ``first``;
  ``max``).
* Long captions are truncated to ``max_tokens`` word pieces (default 128, far above caption
  lengths; BERT's limit is 512): words that do not fit entirely are dropped and the caption is
  reported (``caption_truncated``) with the number of dropped words.
* Word features are the encoder's last hidden layer pooled over a word's subword tokens
  (``word_pool``: ``mean`` default, or ``first``). Negative-noun features are the features of the
  substituted word in the negative caption (the caption text with the noun's character span
  replaced by the candidate word, re-tokenised by the word encoder's tokenizer). A span encoder
  (``scene-oracle``, :class:`pipeline.models.mlm.SpanEncoder`) gives the features of the same
  character spans directly, with no tokenizer or forward pass.

Efficiency by construction: one unmasked pass per caption gives q for all of its nouns and, when
the word encoder is the masked LM's own body, the positive word features; the masked passes of
all nouns of a batch run together; sequences are sorted by length and packed into batches of at
most ``batch_tokens`` padded tokens; the vocabulary head is applied only at the mask positions
and at the nouns' positions, never over whole sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.models.spacy_tagger import Word
from pipeline.negatives.inflect import inflections


@dataclass
class MinerOptions:
    top_k: int = 30
    keep: int = 25
    max_tokens: int = 128
    noun_pos: tuple[str, ...] = ("NOUN",)
    feature_pos: tuple[str, ...] = ("NOUN", "ADJ")
    # spaCy's small English model tags several common nouns as PROPN (e.g. "hexagon", "cyan" in
    # the generated captions): on, PROPN words are treated as nouns (substituted and given features)
    include_propn: bool = True
    exclude_self: bool = True
    exclude_inflections: bool = True
    exclude_subwords: bool = True
    alphabetic_only: bool = True
    min_chars: int = 2
    q_pool: str = "mean"
    word_pool: str = "mean"
    negative_features: str = "all"  # all | sampled | none
    negative_feature_k: int = 25
    batch_tokens: int = 4096
    max_batch: int = 128
    seed: int = 0
    positive_features: bool = True

    def noun_tags(self) -> frozenset[str]:
        """POS tags of the words substituted: ``noun_pos``, plus PROPN when ``include_propn``."""
        return frozenset(self.noun_pos) | ({"PROPN"} if self.include_propn else set())

    def feature_tags(self) -> frozenset[str]:
        """POS tags of the words given features: ``feature_pos`` and every noun tag."""
        return frozenset(self.feature_pos) | self.noun_tags()


@dataclass
class NounResult:
    word: Word
    cand_ids: np.ndarray  # int64 [n_kept], best score first
    logp: np.ndarray  # float32 [n_kept]
    logq: np.ndarray
    rejected_ids: np.ndarray  # top_k candidates dropped by the re-ranking, best score first
    candidates: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    neg_features: np.ndarray | None = None  # float32 [k, H]
    neg_valid: np.ndarray | None = None  # bool [k]


@dataclass
class CaptionResult:
    caption_id: int
    sample_id: int
    text: str
    words: list[Word]  # feature words (nouns and adjectives) that fit, in caption order
    features: np.ndarray  # float32 [len(words), H]
    nouns: list[NounResult]
    problems: list[tuple[str, str]] = field(default_factory=list)


def segment_pool(rows: torch.Tensor, seg: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    """Pool ``rows`` [P, H] into ``n`` segments given each row's segment id (rows are in order):
    ``mean`` of a segment's rows or its ``first`` row -> [n, H].

    This is how word pieces become one word feature (``word_pool``) and how a noun's per-piece q
    distributions become one (``q_pool``); the infoground job's harness scoring pools the word
    pieces of arbitrary texts with it too, so its word features are the stage's."""
    if mode == "first":
        first = torch.ones(len(seg), dtype=torch.bool)
        first[1:] = seg[1:] != seg[:-1]
        return rows[first]
    out = torch.zeros(n, rows.shape[1], dtype=rows.dtype).index_add_(0, seg, rows)
    cnt = torch.bincount(seg, minlength=n).clamp_min(1).to(rows.dtype)
    return out / cnt[:, None]


def gather_forward(encoder, seqs: list[list[int]], positions: list[list[int]], pad_id: int, batch_tokens: int,
                   max_batch: int, stats: dict | None = None) -> torch.Tensor:
    """Last hidden states at ``positions[i]`` of ``seqs[i]``, concatenated in input order.

    Sequences are sorted by length and packed into batches of at most ``batch_tokens`` padded
    tokens (and ``max_batch`` rows), so padding stays small and batches stay large.
    """
    n = len(seqs)
    lens = np.fromiter((len(s) for s in seqs), np.int64, n)
    counts = np.fromiter((len(p) for p in positions), np.int64, n)
    starts = np.concatenate([[0], np.cumsum(counts)])
    hidden = None
    order = np.argsort(lens, kind="stable")
    order = order[counts[order] > 0]
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and j - i < max_batch and (j - i + 1) * lens[order[j]] <= batch_tokens:
            j += 1
        idx = order[i:j]
        lmax = int(lens[idx[-1]])
        ids = np.full((len(idx), lmax), pad_id, dtype=np.int64)
        att = np.zeros((len(idx), lmax), dtype=np.int64)
        for r, s in enumerate(idx):
            ids[r, : lens[s]] = seqs[s]
            att[r, : lens[s]] = 1
        t0 = time.perf_counter()
        dev = next(encoder.parameters()).device  # the stage's `device` (CPU unless the actor has a GPU)
        out = encoder(input_ids=torch.from_numpy(ids).to(dev), attention_mask=torch.from_numpy(att).to(dev)).last_hidden_state
        t_enc = time.perf_counter() - t0
        rows = np.repeat(np.arange(len(idx)), counts[idx])
        cols = np.concatenate([positions[s] for s in idx])
        dest = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in idx])
        picked = out[torch.from_numpy(rows).to(dev), torch.from_numpy(cols).to(dev)]
        if dev.type != "cpu":  # gathered on the device; the rest of the miner works on CPU in fp32
            picked = picked.float().cpu()
        if hidden is None:
            hidden = torch.empty(int(starts[-1]), out.shape[-1], dtype=picked.dtype)
        hidden[torch.from_numpy(dest)] = picked
        if stats is not None:
            stats["forward_batches"] = stats.get("forward_batches", 0) + 1
            stats["padded_tokens"] = stats.get("padded_tokens", 0) + int(ids.size)
            stats["real_tokens"] = stats.get("real_tokens", 0) + int(att.sum())
            stats["encoder_seconds"] = stats.get("encoder_seconds", 0.0) + t_enc
        i = j
    if hidden is None:
        hidden = torch.empty(0, 0)
    return hidden


class Vocabulary:
    """Per-token facts of a tokenizer's vocabulary: word form, allowed as a candidate or not."""

    def __init__(self, tokenizer, opts: MinerOptions, noun_vocab: set[str] | None = None):
        size = len(tokenizer)
        toks = tokenizer.convert_ids_to_tokens(list(range(size)))
        toks = [t if t is not None else "" for t in toks]
        if any(t.startswith("##") for t in toks[:5000] + toks[-5000:]):
            scheme = "wordpiece"
        elif sum(t.startswith("\u0120") for t in toks) > size // 4:
            scheme = "bpe"
        elif sum(t.startswith("\u2581") for t in toks) > size // 4:
            scheme = "sentencepiece"
        else:
            scheme = "plain"
        words, initial = [], np.zeros(size, dtype=bool)
        for i, t in enumerate(toks):
            if scheme == "wordpiece":
                initial[i] = not t.startswith("##")
                words.append(t)
            elif scheme in ("bpe", "sentencepiece"):
                mark = "\u0120" if scheme == "bpe" else "\u2581"
                initial[i] = t.startswith(mark)
                words.append(t[1:] if initial[i] else t)
            else:
                initial[i] = True
                words.append(t)
        special = np.zeros(size, dtype=bool)
        special[[i for i in tokenizer.all_special_ids if i < size]] = True
        allowed = ~special
        if opts.exclude_subwords:
            allowed &= initial
        if opts.alphabetic_only:
            allowed &= np.array([w.isalpha() for w in words])
        allowed &= np.array([len(w) >= opts.min_chars for w in words])
        if noun_vocab is not None:
            allowed &= np.array([w.lower() in noun_vocab for w in words])
        self.size, self.words, self.scheme = size, words, scheme
        self.allowed = torch.from_numpy(allowed)
        self.by_lower: dict[str, list[int]] = {}
        for i, w in enumerate(words):
            if initial[i] and not special[i]:
                self.by_lower.setdefault(w.lower(), []).append(i)

    def excluded_ids(self, word: Word, opts: MinerOptions) -> list[int]:
        forms: set[str] = set()
        if opts.exclude_self:
            forms.add(word.text.lower())
        if opts.exclude_inflections:
            forms |= inflections(word.text, word.lemma)
        return [i for f in forms for i in self.by_lower.get(f, ())]


def choose_noun(caption_id: int, n_nouns: int, seed: int) -> int:
    """The noun a caption uses when only one per caption is sampled (reproducible per caption)."""
    return int(np.random.default_rng([seed, int(caption_id)]).integers(n_nouns))


class NegativeMiner:
    """Runs the two LM steps and the feature passes for batches of tagged captions."""

    def __init__(self, mlm, word_encoder=None, opts: MinerOptions | None = None, noun_vocab: set[str] | None = None):
        self.opts = opts or MinerOptions()
        if mlm.head is None:
            raise ValueError(
                f"masked LM {type(mlm.model).__name__}: its vocabulary head is not known to the adapter, "
                "so it cannot be applied at selected positions only"
            )
        self.mlm = mlm
        self.tok = mlm.tokenizer
        # word_encoder None: the masked LM's own body gives the word features (one shared pass)
        self.shared = word_encoder is None
        self.we = word_encoder
        # a span encoder (scene-oracle): features of character spans, no tokenizer nor forward pass
        self.spans_of = getattr(word_encoder, "span_features", None)
        if self.spans_of is not None:
            self.H = word_encoder.hidden_size
            self.we_model, self.we_tok = mlm.encoder, mlm.tokenizer  # unused for features; keeps the limits below
        else:
            self.we_model = mlm.encoder if self.shared else word_encoder.model
            self.we_tok = mlm.tokenizer if self.shared else word_encoder.tokenizer
            self.H = int(self.we_model.config.hidden_size)
        self.vocab = Vocabulary(self.tok, self.opts, noun_vocab)
        self.mask_id = self.tok.mask_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.we_pad = self.we_tok.pad_token_id if self.we_tok.pad_token_id is not None else 0
        limit = getattr(self.we_model.config, "max_position_embeddings", 512)
        self.neg_max_tokens = min(int(limit), self.opts.max_tokens + 32)
        self.stats: dict = {}

    # ---------- tokenisation and alignment ----------
    @staticmethod
    def _align(enc, i: int, words: list[Word]) -> tuple[list[tuple[int, int] | None], bool]:
        """Token span [a, b) of each word in encoding ``i`` (None when it does not fit); truncated?"""
        offs = np.asarray(enc["offset_mapping"][i], dtype=np.int64).reshape(-1, 2)
        special = np.asarray(enc["special_tokens_mask"][i], dtype=bool)
        content = (~special) & (offs[:, 1] > offs[:, 0])
        cs, ce = offs[:, 0], offs[:, 1]
        truncated = bool(enc.encodings[i].overflowing) if getattr(enc, "encodings", None) else False
        out = []
        for w in words:
            idx = np.nonzero(content & (cs < w.end) & (ce > w.start))[0]
            # a word cut by truncation keeps only its first pieces: drop it rather than encode half
            if len(idx) == 0 or (truncated and ce[idx[-1]] < w.end):
                out.append(None)
            else:
                out.append((int(idx[0]), int(idx[-1]) + 1))
        return out, truncated

    def _encode(self, tok, texts: list[str], max_len: int):
        return tok(texts, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                   max_length=max_len, add_special_tokens=True)

    # ---------- the miner ----------
    @torch.inference_mode()
    def mine(self, captions: list[tuple[int, int, str]], tagged: list[list[Word]]) -> list[CaptionResult]:
        o = self.opts
        results: list[CaptionResult] = []
        for (cid, sid, text), words in zip(captions, tagged):
            fw = [w for w in words if w.pos in o.feature_tags() and any(ch.isalnum() for ch in w.text)]
            results.append(CaptionResult(int(cid), int(sid), text, fw, np.zeros((0, self.H), np.float32), []))
        live = [r for r in results if r.words]
        if not live:
            self._flag_nounless(results)
            return results
        enc = self._encode(self.tok, [r.text for r in live], o.max_tokens)
        same = self.shared or self.spans_of is not None  # word spans of the MLM's encoding serve the features
        we_enc = enc if same else self._encode(self.we_tok, [r.text for r in live], o.max_tokens)
        spans, we_spans = [], []
        for k, r in enumerate(live):
            sp, trunc = self._align(enc, k, r.words)
            wsp, wtrunc = (sp, trunc) if same else self._align(we_enc, k, r.words)
            keep = [j for j in range(len(r.words)) if sp[j] is not None and wsp[j] is not None]
            dropped = len(r.words) - len(keep)
            if dropped:
                reason = "caption_truncated" if (trunc or wtrunc) else "untokenizable_word"
                lost = ", ".join(repr(r.words[j].text) for j in range(len(r.words)) if j not in keep)
                r.problems.append((reason, f"{dropped} word(s) not encoded within max_tokens={o.max_tokens}: {lost}"[:500]))
            r.words = [r.words[j] for j in keep]
            spans.append([sp[j] for j in keep])
            we_spans.append([wsp[j] for j in keep])

        ids = [list(x) for x in enc["input_ids"]]
        # nouns: (live caption index, word index within r.words)
        nouns = [(k, j) for k, r in enumerate(live) for j, w in enumerate(r.words) if w.pos in o.noun_tags()]

        # ---- pass 1: unmasked captions (q for every noun; positive features when shared)
        q_pos: list[list[int]] = [[] for _ in live]
        for k, j in nouns:
            a, b = spans[k][j]
            q_pos[k].extend(range(a, b))
        feat_pos: list[list[int]] = [[] for _ in live]
        feat_seg: list[int] = []
        n_feat = 0
        if o.positive_features and self.spans_of is None:
            for k, r in enumerate(live):
                for j in range(len(r.words)):
                    a, b = we_spans[k][j]
                    feat_pos[k].extend(range(a, b))
                    feat_seg.extend([n_feat] * (b - a))
                    n_feat += 1
        if self.shared:
            pos1 = [q + f for q, f in zip(q_pos, feat_pos)]
            h1 = gather_forward(self.mlm.encoder, ids, pos1, self.pad_id, o.batch_tokens, o.max_batch, self.stats)
            # split gathered rows back into the q part and the feature part (per caption order)
            nq = np.array([len(q) for q in q_pos])
            nf = np.array([len(f) for f in feat_pos])
            starts = np.concatenate([[0], np.cumsum(nq + nf)])
            qi = np.concatenate([np.arange(starts[k], starts[k] + nq[k]) for k in range(len(live))]).astype(np.int64)
            fi = np.concatenate([np.arange(starts[k] + nq[k], starts[k + 1]) for k in range(len(live))]).astype(np.int64)
            hq, hf = h1[torch.from_numpy(qi)], h1[torch.from_numpy(fi)]
        else:
            hq = gather_forward(self.mlm.encoder, ids, q_pos, self.pad_id, o.batch_tokens, o.max_batch, self.stats)
            hf = None
            if o.positive_features and self.spans_of is None:
                we_ids = [list(x) for x in we_enc["input_ids"]]
                hf = gather_forward(self.we_model, we_ids, feat_pos, self.we_pad, o.batch_tokens, o.max_batch, self.stats)
        if o.positive_features and self.spans_of is not None:
            for r in live:
                r.features = self.spans_of(r.text, [(w.start, w.end) for w in r.words])
        elif o.positive_features and n_feat:
            feats = segment_pool(hf.float(), torch.tensor(feat_seg), n_feat, o.word_pool).numpy()
            f0 = 0
            for r in live:
                r.features = feats[f0 : f0 + len(r.words)]
                f0 += len(r.words)
        for r in live:
            if len(r.features) != len(r.words):  # positive_features off
                r.features = np.zeros((len(r.words), self.H), np.float32)
        if not nouns:
            self._flag_nounless(results)
            return results

        # ---- q: head at the nouns' positions only, pooled over each noun's pieces
        logq_pos = torch.log_softmax(self.mlm.head(hq).float(), dim=-1)
        seg = torch.tensor([n for n, (k, j) in enumerate(nouns) for _ in range(spans[k][j][1] - spans[k][j][0])])
        # order of q rows: caption by caption, nouns in word order == order of `nouns`
        if o.q_pool == "mean":
            logq = torch.log(segment_pool(logq_pos.exp(), seg, len(nouns), "mean"))
        elif o.q_pool == "first":
            logq = segment_pool(logq_pos, seg, len(nouns), "first")
        elif o.q_pool == "max":
            logq = torch.full((len(nouns), logq_pos.shape[1]), -torch.inf).index_reduce_(0, seg, logq_pos, "amax")
        else:
            raise ValueError(f"q_pool {o.q_pool!r}")

        # ---- pass 2: every noun of the batch masked (one [MASK] for its whole subword span)
        mseqs, mpos = [], []
        for k, j in nouns:
            a, b = spans[k][j]
            mseqs.append(ids[k][:a] + [self.mask_id] + ids[k][b:])
            mpos.append([a])
        hm = gather_forward(self.mlm.encoder, mseqs, mpos, self.pad_id, o.batch_tokens, o.max_batch, self.stats)
        logp = torch.log_softmax(self.mlm.head(hm).float(), dim=-1)

        # ---- exclusions, top_k by p, re-rank by p/q, keep
        allowed = self.vocab.allowed.unsqueeze(0).expand(len(nouns), -1).clone()
        rows, cols = [], []
        for n, (k, j) in enumerate(nouns):
            ex = self.vocab.excluded_ids(live[k].words[j], o)
            rows.extend([n] * len(ex))
            cols.extend(ex)
        if rows:
            allowed[torch.tensor(rows), torch.tensor(cols)] = False
        masked_logp = logp.masked_fill(~allowed, -torch.inf)
        top = min(o.top_k, logp.shape[1])
        cand_lp, cand = torch.topk(masked_logp, top, dim=1)
        cand_lq = torch.gather(logq, 1, cand)
        score = (cand_lp - cand_lq).masked_fill(~torch.isfinite(cand_lp), -torch.inf)
        order = torch.sort(score, dim=1, descending=True, stable=True).indices
        cand, cand_lp, cand_lq, score = (torch.gather(t, 1, order) for t in (cand, cand_lp, cand_lq, score))
        valid = torch.isfinite(cand_lp).numpy()
        cand_np, lp_np, lq_np = cand.numpy(), cand_lp.numpy(), cand_lq.numpy()
        noun_results = []
        for n, (k, j) in enumerate(nouns):
            v = np.nonzero(valid[n])[0]
            kept, rej = v[: o.keep], v[o.keep :]
            nr = NounResult(live[k].words[j], cand_np[n, kept].astype(np.int64), lp_np[n, kept], lq_np[n, kept],
                            cand_np[n, rej].astype(np.int64))
            nr.candidates = [self.vocab.words[t] for t in nr.cand_ids]
            nr.rejected = [self.vocab.words[t] for t in nr.rejected_ids]
            live[k].nouns.append(nr)
            noun_results.append((k, nr))

        # ---- pass 3: negative captions through the word encoder (all of the batch together)
        if o.negative_features != "none" and o.negative_feature_k > 0:
            self._negative_features(live, noun_results)
        self._flag_nounless(results)
        return results

    def _flag_nounless(self, results: list[CaptionResult]) -> None:
        for r in results:
            if not r.nouns:
                r.problems.append(("no_noun", "no noun found by the POS tagger (or none fits max_tokens)"))

    def _negative_features(self, live: list[CaptionResult], noun_results: list[tuple[int, NounResult]]) -> None:
        o = self.opts
        chosen: set[int] = set()
        if o.negative_features == "sampled":
            for k, r in enumerate(live):
                if r.nouns:
                    chosen.add(id(r.nouns[choose_noun(r.caption_id, len(r.nouns), o.seed)]))
        texts, spans, owner = [], [], []
        for k, nr in noun_results:
            if o.negative_features == "sampled" and id(nr) not in chosen:
                continue
            r, w = live[k], nr.word
            for c in nr.candidates[: o.negative_feature_k]:
                c = c[:1].upper() + c[1:] if w.text[:1].isupper() else c
                texts.append(r.text[: w.start] + c + r.text[w.end :])
                spans.append((w.start, w.start + len(c)))
                owner.append(nr)
        if not texts:
            return
        if self.spans_of is not None:
            feats = np.concatenate([self.spans_of(t, [sp]) for t, sp in zip(texts, spans)])
            self._assign_negatives(owner, feats, np.ones(len(texts), dtype=bool))
            return
        H = self.H
        enc = self._encode(self.we_tok, texts, self.neg_max_tokens)
        seqs, pos, seg, ok = [], [], [], np.zeros(len(texts), dtype=bool)
        n_ok = 0
        for i, (s, e) in enumerate(spans):
            ab, _ = self._align(enc, i, [Word(0, s, e, "", "", "")])
            seqs.append(list(enc["input_ids"][i]))
            if ab[0] is None:
                pos.append([])
                continue
            ok[i] = True
            a, b = ab[0]
            pos.append(list(range(a, b)))
            seg.extend([n_ok] * (b - a))
            n_ok += 1
        feats = np.zeros((len(texts), H), np.float32)
        if n_ok:
            h = gather_forward(self.we_model, seqs, pos, self.we_pad, o.batch_tokens, o.max_batch, self.stats)
            feats[ok] = segment_pool(h.float(), torch.tensor(seg), n_ok, o.word_pool).numpy()
        self._assign_negatives(owner, feats, ok)

    @staticmethod
    def _assign_negatives(owner: list, feats: np.ndarray, ok: np.ndarray) -> None:
        """Each noun's consecutive rows of ``feats`` (texts in ``owner`` order) and their validity."""
        i = 0
        while i < len(owner):
            nr = owner[i]
            j = i
            while j < len(owner) and owner[j] is nr:
                j += 1
            nr.neg_features, nr.neg_valid = feats[i:j], ok[i:j]
            i = j
