"""Context-preserving negative captions (masked-LM p/q re-ranking) and contextual word features.

InfoGround (Gupta et al. 2020), Sec. 2.4 and 2.5; the method and every open choice are described
in :mod:`pipeline.negatives.core`. Output, the ``negatives`` artifact:

* table ``negatives``: one row per (caption, noun): caption_id, sample_id, word_index (spaCy
  token index), start/end (character span), noun, lemma, candidates (up to ``keep`` = 25 words,
  best p/q first), candidate_ids, p, q, score (= p/q), rejected (the top-30 candidates that
  re-ranking dropped) and feature_row (row of the sample's ``negs.npy``, -1 when not computed).
  Every noun of every caption is listed (the paper sampled one per caption at random; the
  trainer samples from this table reproducibly, see ``pipeline.loaders.negatives``).
* table ``words``: one row per noun/adjective of each caption with its ``feature_row`` in the
  sample's ``words.npy``.
* WebDataset shards ``shards/<unit>.tar``, one entry per sample (key ``sample_key(sample_id)``):
  ``words.npy`` float16 [W, d] contextual features of the caption words, ``words.json``
  (caption_id, word_index per row), ``negs.npy`` float16 [M, K, d] features of each noun's
  negatives in context (K = negative_feature_k, zero rows past ``count``), ``negs.json``
  (caption_id, word_index, count, valid per noun).

``models.word_encoder: scene-oracle`` (the testbed instrument, generated dataset only): the
feature of a word is ``SceneOracle.span_vector`` of its character span in the caption, and a
negative's the span vector of the candidate in the caption with the noun replaced; the masked LM
(``models.mlm``, never the oracle) still proposes and re-ranks the candidates.

Rejects: ``empty_caption`` (blank text), ``no_noun`` (nothing to substitute; the adjectives still
get features), ``caption_truncated`` (words beyond ``max_tokens`` are dropped).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.io.atomic import fingerprint, write_bytes_atomic, write_json_atomic
from pipeline.io.wds import ShardWriter, sample_key
from pipeline.models.device import Precision, device_field, fingerprinted, precision_field
from pipeline.stage import RunContext, StageConfig, StageError, run_units, unit_writer

NAME = "negative-captions"
READS = ["samples"]
WRITES = ["negatives"]


class Config(StageConfig):
    shard_size: int = Field(500, ge=1, description="samples per output shard (unit of resume)")
    top_k: int = Field(30, ge=1, description="candidates taken from p(s'|c) (paper: 30)")
    keep: int = Field(25, ge=1, description="negatives kept after re-ranking by p/q (paper: 25)")
    noun_pos: list[str] = Field(["NOUN"], description="universal POS tags of the words substituted")
    feature_pos: list[str] = Field(["NOUN", "ADJ"], description="POS tags of the words given features (paper: nouns and adjectives)")
    include_propn: bool = Field(True, description="treat PROPN as a noun tag (substituted, given features): the packaged spaCy model tags common nouns such as 'hexagon' or 'cyan' PROPN")
    exclude_self: bool = Field(True, description="never propose the noun itself")
    exclude_inflections: bool = Field(True, description="never propose its singular/plural forms")
    exclude_subwords: bool = Field(True, description="never propose subword fragments (##xx)")
    alphabetic_only: bool = Field(True, description="candidates must be alphabetic words")
    min_chars: int = Field(2, ge=1, description="shortest candidate word")
    restrict_to_noun_vocab: bool = Field(False, description="candidates only from nouns seen in the dataset's captions (reference code)")
    noun_vocab_min_count: int = Field(1, ge=1, description="occurrences a noun needs to enter that vocabulary")
    max_tokens: int = Field(128, ge=8, le=512, description="word pieces per caption; words past it are dropped and reported")
    q_pool: Literal["mean", "first", "max"] = Field("mean", description="q of a multi-piece noun: pooled over its pieces")
    word_pool: Literal["mean", "first"] = Field("mean", description="word feature: pooled over its pieces")
    negative_features: Literal["all", "sampled", "none"] = Field(
        "all", description="in-context features of the negatives: for every noun, one sampled noun per caption, or none"
    )
    negative_feature_k: int = Field(25, ge=0, description="negatives per noun that get in-context features")
    caption_batch: int = Field(256, ge=1, description="captions mined together (their masked passes share batches)")
    batch_tokens: int = Field(4096, ge=64, description="padded tokens per forward batch (length-bucketed)")
    torch_threads: int = Field(1, ge=1, description="torch threads per actor (and CPUs reserved per actor)")
    seed: int = Field(0, description="seed of the per-caption noun choice when negative_features=sampled")
    device: str = device_field()  # the MLM and word encoder (BERT passes: the stage's main cost); num_gpus reserves GPUs
    precision: Precision = precision_field()


NEGATIVES_SCHEMA = pa.schema(
    [
        ("caption_id", pa.int64()),
        ("sample_id", pa.int64()),
        ("word_index", pa.int32()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("noun", pa.string()),
        ("lemma", pa.string()),
        ("candidates", pa.list_(pa.string())),
        ("candidate_ids", pa.list_(pa.int32())),
        ("p", pa.list_(pa.float64())),
        ("q", pa.list_(pa.float64())),
        ("score", pa.list_(pa.float64())),
        ("rejected", pa.list_(pa.string())),
        ("feature_row", pa.int32()),
    ]
)
WORDS_SCHEMA = pa.schema(
    [
        ("caption_id", pa.int64()),
        ("sample_id", pa.int64()),
        ("word_index", pa.int32()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("text", pa.string()),
        ("pos", pa.string()),
        ("lemma", pa.string()),
        ("is_noun", pa.bool_()),
        ("feature_row", pa.int32()),
    ]
)


def miner_options(cfg: Config):
    from pipeline.negatives.core import MinerOptions

    return MinerOptions(
        top_k=cfg.top_k, keep=cfg.keep, max_tokens=cfg.max_tokens, noun_pos=tuple(cfg.noun_pos),
        feature_pos=tuple(sorted(set(cfg.feature_pos) | set(cfg.noun_pos))), include_propn=cfg.include_propn, exclude_self=cfg.exclude_self,
        exclude_inflections=cfg.exclude_inflections, exclude_subwords=cfg.exclude_subwords,
        alphabetic_only=cfg.alphabetic_only, min_chars=cfg.min_chars, q_pool=cfg.q_pool, word_pool=cfg.word_pool,
        negative_features=cfg.negative_features, negative_feature_k=min(cfg.negative_feature_k, cfg.keep),
        batch_tokens=cfg.batch_tokens, seed=cfg.seed,
    )


class NegativeCaptionsWorker:
    """Ray actor: loads the tagger, the masked LM and the word encoder once, then mines units."""

    def __init__(self, mlm: str, word_encoder: str, spacy: str, options: dict, noun_vocab: str | None = None,
                 torch_threads: int = 1, caption_batch: int = 256, device: str = "cpu", precision: str = "auto"):
        import dataclasses

        import torch

        from pipeline.models.device import resolve_device
        from pipeline.models.mlm import load_mlm, load_word_encoder
        from pipeline.models.spacy_tagger import Tagger
        from pipeline.negatives.core import MinerOptions, NegativeMiner

        torch.set_num_threads(torch_threads)
        opts = MinerOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
        vocab = set(json.loads(Path(noun_vocab).read_text())) if noun_vocab else None
        self.device, self.precision = resolve_device(device), precision
        self.mlm = load_mlm(mlm)
        self.mlm.model.to(self.device)  # the encoder body moves with it
        if self.mlm.head is not None and self.device != "cpu":
            head = self.mlm.head  # the miner hands it CPU hidden states and reads CPU logits
            self.mlm = dataclasses.replace(self.mlm, head=lambda h: head(h.to(self.device)).float().cpu())
        self.we = None if word_encoder == mlm else load_word_encoder(word_encoder)
        if getattr(self.we, "model", None) is not None:
            self.we.model.to(self.device)
        self.tagger = Tagger(spacy)
        self.miner = NegativeMiner(self.mlm, self.we, opts, vocab)
        self.caption_batch = caption_batch

    def mine_captions(self, rows: list[tuple[int, int, str]], on_error) -> list:
        """Mine (caption_id, sample_id, text) rows; blank ones go to ``on_error``; results by caption_id."""
        good = []
        for cid, sid, text in rows:
            if text is None or not text.strip():
                on_error("empty_caption", "caption text is empty", sample_id=sid, caption_id=cid)
            else:
                good.append((cid, sid, text))
        # length buckets: similar lengths mined together keep padding small in every pass
        good.sort(key=lambda r: (len(r[2]), r[0]))
        out = []
        from pipeline.models.device import autocast

        for i in range(0, len(good), self.caption_batch):
            chunk = good[i : i + self.caption_batch]
            tagged = self.tagger.tag([r[2] for r in chunk])
            with autocast(self.device, self.precision):  # fp16 on CUDA (precision: auto); a no-op on CPU
                out.extend(self.miner.mine(chunk, tagged))
        out.sort(key=lambda r: r.caption_id)
        return out

    def __call__(self, payload: dict) -> dict:
        w = unit_writer(payload)
        t = pq.read_table(payload["captions_path"], columns=["caption_id", "sample_id", "text"])
        sid = t.column("sample_id").to_numpy()
        keep = np.isin(sid, np.asarray(payload["sample_ids"], dtype=np.int64))
        t = t.filter(pa.array(keep))
        rows = list(zip(t.column("caption_id").to_pylist(), t.column("sample_id").to_pylist(), t.column("text").to_pylist()))
        results = self.mine_captions(rows, w.error)
        k_feat = self.miner.opts.negative_feature_k if self.miner.opts.negative_features != "none" else 0
        neg_rows, word_rows = [], []
        per_sample: dict[int, dict] = {}
        n_nouns = n_feats = 0
        for r in results:
            for reason, detail in r.problems:
                w.error(reason, detail, sample_id=r.sample_id, caption_id=r.caption_id)
            if not r.words:
                continue
            s = per_sample.setdefault(r.sample_id, {"wf": [], "wc": [], "wi": [], "nf": [], "nc": [], "ni": [], "nn": [], "nv": []})
            noun_by_index = {n.word.i: n for n in r.nouns}
            for j, wd in enumerate(r.words):
                word_rows.append(dict(caption_id=r.caption_id, sample_id=r.sample_id, word_index=wd.i, start=wd.start,
                                      end=wd.end, text=wd.text, pos=wd.pos, lemma=wd.lemma,
                                      is_noun=wd.i in noun_by_index, feature_row=len(s["wc"])))
                s["wf"].append(r.features[j])
                s["wc"].append(r.caption_id)
                s["wi"].append(wd.i)
            for n in r.nouns:
                row = -1
                if n.neg_features is not None and k_feat:
                    row = len(s["nc"])
                    f = np.zeros((k_feat, n.neg_features.shape[1]), np.float32)
                    f[: len(n.neg_features)] = n.neg_features
                    valid = np.zeros(k_feat, bool)
                    valid[: len(n.neg_valid)] = n.neg_valid
                    s["nf"].append(f)
                    s["nc"].append(r.caption_id)
                    s["ni"].append(n.word.i)
                    s["nn"].append(len(n.neg_features))
                    s["nv"].append(valid.tolist())
                    n_feats += 1
                p, q = np.exp(n.logp.astype(np.float64)), np.exp(n.logq.astype(np.float64))
                neg_rows.append(dict(
                    caption_id=r.caption_id, sample_id=r.sample_id, word_index=n.word.i, start=n.word.start,
                    end=n.word.end, noun=n.word.text, lemma=n.word.lemma, candidates=n.candidates,
                    candidate_ids=n.cand_ids.tolist(), p=p.tolist(), q=q.tolist(),
                    score=np.exp(n.logp.astype(np.float64) - n.logq.astype(np.float64)).tolist(),
                    rejected=n.rejected, feature_row=row,
                ))
                n_nouns += 1
        w.write_table("negatives", pa.Table.from_pylist(neg_rows, schema=NEGATIVES_SCHEMA))
        w.write_table("words", pa.Table.from_pylist(word_rows, schema=WORDS_SCHEMA))
        path = w.shard_path()
        with ShardWriter(path) as sw:
            for sample_id in sorted(per_sample):
                s = per_sample[sample_id]
                fields = {
                    "words.npy": np.stack(s["wf"]).astype(np.float16),
                    "words.json": {"caption_id": s["wc"], "word_index": s["wi"]},
                }
                if s["nc"]:
                    fields["negs.npy"] = np.stack(s["nf"]).astype(np.float16)
                    fields["negs.json"] = {"caption_id": s["nc"], "word_index": s["ni"], "count": s["nn"], "valid": s["nv"]}
                sw.write(sample_key(sample_id), fields)
        w.record_shard(path, len(per_sample))
        stats = {"rows": len(rows), "captions": len(rows), "nouns": n_nouns, "words": len(word_rows),
                 "negative_feature_sets": n_feats, "rejected": len(w.errors)}
        stats.update({k: v for k, v in self.miner.stats.items()})
        self.miner.stats.clear()
        res = w.commit(stats)
        return {"unit": res.unit, "stats": res.stats}


def _count_nouns(payload: dict) -> dict:
    """Task: noun counts (lower-cased surface forms and lemmas) of one captions file."""
    from pipeline.models.spacy_tagger import Tagger

    tagger = Tagger(payload["spacy"])
    texts = [t for t in pq.read_table(payload["path"], columns=["text"]).column("text").to_pylist() if t and t.strip()]
    c: Counter = Counter()
    pos = set(payload["noun_pos"])
    for words in tagger.tag(texts):
        for wd in words:
            if wd.pos in pos:
                c[wd.text.lower()] += 1
                if wd.lemma.lower() != wd.text.lower():
                    c[wd.lemma.lower()] += 1
    return {"counts": dict(c)}


def _noun_vocab(ctx: RunContext, entries: list[dict], samples, cfg: Config, models, out_dir: Path) -> tuple[str, str]:
    from pipeline.runtime import map_units

    units = [{"path": str(samples.local_file(e["path"])), "spacy": models.spacy,
              "noun_pos": list(cfg.noun_pos) + (["PROPN"] if cfg.include_propn else [])} for e in entries]
    path = out_dir / "noun_vocab.json"
    # The counts depend on the caption shards, the tagger and the options only: reuse them on a
    # rerun (no Ray pass over every caption when nothing changed).
    from pipeline.models.spacy_tagger import spacy_record

    key = fingerprint([e["sha256"] for e in entries], spacy_record(models.spacy), units[0]["noun_pos"] if units else [],
                      cfg.noun_vocab_min_count)
    key_path = out_dir / "noun_vocab.key"
    if path.is_file() and key_path.is_file() and key_path.read_text().strip() == key:
        try:
            vocab = json.loads(path.read_text())
            return str(path), fingerprint(vocab)
        except ValueError:
            pass
    total: Counter = Counter()
    for res in map_units(units, _count_nouns, ray_cfg=ctx.ray_cfg, actor=False):
        if res.get("failed"):
            raise StageError(f"{NAME}: counting nouns of {res.get('unit') or 'a captions file'} failed: {res['failed']}")
        total.update(res["counts"])
    vocab = sorted(w for w, n in total.items() if n >= cfg.noun_vocab_min_count)
    write_json_atomic(path, vocab)
    write_bytes_atomic(key_path, key.encode())
    return str(path), fingerprint(vocab)


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models import scene_oracle
    from pipeline.models.mlm import provenance

    if scene_oracle.is_oracle(ctx.manifest.models.word_encoder):
        scene_oracle.require_generated(ctx.manifest, "word_encoder")
    if scene_oracle.is_oracle(ctx.manifest.models.mlm):
        raise StageError("models.mlm: scene-oracle is a word encoder, not a masked LM: give a masked LM (e.g. tiny-random) "
                         "to propose the negatives")
    if cfg.keep > cfg.top_k:
        raise StageError(f"stages.negative_captions: keep ({cfg.keep}) must not exceed top_k ({cfg.top_k})")
    samples = ctx.artifact("samples")
    models = ctx.manifest.models
    try:
        entries = samples.shard_entries("captions")
    except KeyError:
        raise StageError("samples artifact has no captions table") from None
    out_dir = ctx.output / "negatives"
    out_dir.mkdir(parents=True, exist_ok=True)
    from pipeline.models.provenance import cached_info

    # cached: a rerun with nothing to do builds no model (a random preset is built to hash it)
    records = {"mlm": cached_info(ctx.output, "mlm", {"mlm": models.mlm}, lambda: provenance(models.mlm, "mlm"))}
    if models.word_encoder != models.mlm:
        records["word_encoder"] = cached_info(ctx.output, "word_encoder", {"word_encoder": models.word_encoder},
                                              lambda: provenance(models.word_encoder, "word_encoder"))
    else:
        records["word_encoder"] = dict(records["mlm"], role="word_encoder", shared_with="mlm")
    from pipeline.models.spacy_tagger import spacy_record

    records["spacy"] = spacy_record(models.spacy)
    vocab_path, vocab_fp = (None, None)
    if cfg.restrict_to_noun_vocab:
        vocab_path, vocab_fp = _noun_vocab(ctx, entries, samples, cfg, models, out_dir)
    params = {**cfg.model_dump(mode="json"), "noun_vocab": vocab_fp}
    params.pop("enabled", None)
    params = fingerprinted(params, cfg.device, cfg.precision, cfg.num_gpus)  # device: where; precision: only if not fp32
    writer = ctx.writer("negatives", NAME, params, inputs={"samples": samples.fingerprint}, models=records)

    units, remaining = [], ctx.limit
    for e in entries:
        if remaining is not None and remaining <= 0:
            break
        path = samples.local_file(e["path"])
        sids = np.unique(pq.read_table(path, columns=["sample_id"]).column("sample_id").to_numpy())
        if remaining is not None:
            sids = sids[:remaining]
            remaining -= len(sids)
        base = Path(e["path"]).stem
        for c, lo in enumerate(range(0, len(sids), cfg.shard_size)):
            chunk = sids[lo : lo + cfg.shard_size].tolist()
            name = f"{base}-{c:04d}"
            units.append((name, [e["sha256"], chunk[0], chunk[-1], len(chunk)], {"captions_path": str(path), "sample_ids": chunk}))
    if not units:
        raise StageError("samples artifact has no captions")
    opts = miner_options(cfg).__dict__
    kwargs = dict(mlm=models.mlm, word_encoder=models.word_encoder, spacy=models.spacy, options=opts,
                  noun_vocab=vocab_path, torch_threads=cfg.torch_threads, caption_batch=cfg.caption_batch,
                  device=cfg.device, precision=cfg.precision)
    names = run_units(ctx, writer, units, NegativeCaptionsWorker, actor=True, constructor_kwargs=kwargs,
                      num_cpus=cfg.torch_threads)
    m = writer.finalize(names, schema={"negatives": str(NEGATIVES_SCHEMA), "words": str(WORDS_SCHEMA),
                                       "shards": "words.npy float16 [W,d]; negs.npy float16 [M,K,d]; words.json; negs.json"},
                        extra={"feature_dim": _feature_dim(models), "negative_feature_k": opts["negative_feature_k"]
                               if cfg.negative_features != "none" else 0})
    return {
        "captions": m["stats"].get("captions", 0),
        "nouns": m["tables"].get("negatives", {}).get("rows", 0),
        "errors": m["errors"]["rows"],
        "path": str(writer.location),
    }


def _feature_dim(models) -> int | None:
    from transformers import AutoConfig

    from pipeline.models.mlm import BERT_BASE, TINY_BERT, is_random_spec, resolve_model_path
    from pipeline.models.provenance import is_tiny_random

    spec = models.word_encoder
    from pipeline.models.scene_oracle import SceneOracle, is_oracle

    if is_oracle(spec):
        return SceneOracle().d_t
    if is_random_spec(spec):
        return (TINY_BERT if is_tiny_random(spec) else BERT_BASE)["hidden_size"]
    try:
        return int(AutoConfig.from_pretrained(resolve_model_path(spec)).hidden_size)
    except Exception:
        return None


def inspect_view(artifact, n: int) -> str:
    t = artifact.read("negatives").slice(0, n).to_pylist()
    lines = []
    for r in t:
        lines.append(f"caption {r['caption_id']} noun {r['noun']!r} [{r['start']}:{r['end']}]")
        lines.append(f"  negatives: {', '.join(r['candidates'][:10])}{' ...' if len(r['candidates']) > 10 else ''}")
        lines.append(f"  rejected by p/q: {', '.join(r['rejected'])}")
    return "\n".join(lines)


