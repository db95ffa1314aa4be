"""Benchmark: negative-captions stage vs a faithful naive implementation vs bare encoder forwards.

    .venv/bin/python benchmarks/bench_negative_captions.py [--n 2000] [--naive-n 100] [--negatives none|all]

Captions: the first ``--n`` distinct captions of ``../shared/data/sugarcrepe/*.json`` (skips when
absent). Model: ``random-bert-base`` (BERT-base-sized, random weights: the cost is the same), used
as masked LM and as word encoder (the stage then shares the unmasked pass between q and the word
features).

* stage: ``run_stage("negative-captions")`` on the embedded Ray (2 actors x 1 torch thread),
  timed from the call to the finished artifact (actor start and model construction included);
* naive: what the reference implementation did, in-process with ``--threads`` (2) torch threads: per noun, the
  masked caption and the unmasked caption each in its own batch-1 pass through the whole masked
  LM (vocabulary head at every position), then per (caption, noun) the caption through the word
  encoder in a batch-1 pass (and, with ``--negatives all``, the 25 negative captions in one call);
  run on the first ``--naive-n`` captions (a rate is a rate) and checked to give the same
  candidates as the stage;
* bare: only the encoder forwards of the passes the stage must make (the unmasked captions,
  one masked copy per noun [, the negative captions]), length-bucketed, 2 threads, no head, no
  tagging, no I/O (``--threads`` torch threads). On an oversubscribed machine 2 threads in one
  process can be much slower than 2 single-thread processes; ``--threads 1`` gives the per-core
  view (then the stage uses twice the cores of the baselines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SUGARCREPE = REPO.parent / "shared" / "data" / "sugarcrepe"


def load_captions(n: int) -> list[str]:
    seen, out = set(), []
    for f in sorted(SUGARCREPE.glob("*.json")):
        for rec in json.loads(f.read_text()).values():
            c = rec.get("caption")
            if c and c not in seen:
                seen.add(c)
                out.append(c)
                if len(out) >= n:
                    return out
    return out


def write_samples(out: Path, captions: list[str]) -> None:
    import pyarrow as pa

    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages.ingest import CAPTIONS_SCHEMA, SAMPLES_SCHEMA

    w = ArtifactWriter(out, "samples", "ingest", {"bench": len(captions)})
    uw = w.unit_writer("00000", w.unit_fingerprint("00000", captions))
    uw.write_table("samples", pa.Table.from_pylist(
        [{"sample_id": i, "source_id": str(i), "image": None, "width": 1, "height": 1, "split": "bench"} for i in range(len(captions))],
        schema=SAMPLES_SCHEMA))
    uw.write_table("captions", pa.Table.from_pylist(
        [{"caption_id": i, "sample_id": i, "text": t} for i, t in enumerate(captions)], schema=CAPTIONS_SCHEMA))
    uw.commit({"rows": len(captions)})
    w.finalize(["00000"])


def run_stage_timed(out: Path, captions: list[str], negatives: str, shard: int) -> tuple[float, object]:
    from pipeline.config import load_manifest
    from pipeline.io.artifacts import Artifact
    from pipeline.runtime import ensure_ray
    from pipeline.stage import RunContext, run_stage

    write_samples(out, captions)
    m = load_manifest(REPO / "manifests" / "tiny.yaml", [
        f"output={out}", "ray.num_cpus=2", "ray.actors=2", "ray.object_store_memory=268435456",
        "models.mlm=random-bert-base", "models.word_encoder=random-bert-base",
        f"stages.negative_captions.negative_features={negatives}", f"stages.negative_captions.shard_size={shard}",
        "stages.negative_captions.torch_threads=1",
    ])
    ensure_ray(m.ray)
    t0 = time.perf_counter()
    run_stage("negative-captions", RunContext(m, force=True))
    return time.perf_counter() - t0, Artifact(out / "negatives")


class Naive:
    """The reference procedure, pass by pass (see the module docstring)."""

    def __init__(self, negatives: str):
        import torch

        from pipeline.models.mlm import load_mlm
        from pipeline.models.spacy_tagger import Tagger
        from pipeline.negatives.core import MinerOptions, Vocabulary

        self.torch = torch
        self.mlm = load_mlm("random-bert-base")
        self.tok = self.mlm.tokenizer
        self.tagger = Tagger()
        self.opts = MinerOptions()
        self.vocab = Vocabulary(self.tok, self.opts)
        self.negatives = negatives

    def caption(self, text: str) -> list[tuple[str, list[str]]]:
        torch, tok, o = self.torch, self.tok, self.opts
        words = self.tagger.tag([text])[0]  # one caption at a time
        out = []
        with torch.inference_mode():
            for w in words:
                if w.pos not in o.noun_pos:
                    continue
                masked_text = text[: w.start] + tok.mask_token + text[w.end :]
                enc_m = tok(masked_text, return_tensors="pt", truncation=True, max_length=o.max_tokens)
                pos_m = int((enc_m["input_ids"][0] == tok.mask_token_id).nonzero()[0])
                logp = self.mlm.model(**enc_m).logits[0, pos_m].float().log_softmax(-1)  # pass 1 (batch 1)
                enc = tok(text, return_tensors="pt", truncation=True, max_length=o.max_tokens, return_offsets_mapping=True)
                offs = enc.pop("offset_mapping")[0].tolist()
                pieces = [i for i, (s, e) in enumerate(offs) if e > s and s < w.end and e > w.start]
                if not pieces:
                    continue
                probs = self.mlm.model(**enc).logits[0, pieces].float().softmax(-1)  # pass 2 (batch 1)
                logq = probs.mean(0).log()
                allowed = self.vocab.allowed.clone()
                allowed[self.vocab.excluded_ids(w, o)] = False
                lp, cand = logp.masked_fill(~allowed, -torch.inf).topk(o.top_k)
                score = lp - logq[cand]
                order = torch.sort(score, descending=True, stable=True).indices
                kept = cand[order][: o.keep].tolist()
                cands = [self.vocab.words[i] for i in kept]
                # features: the caption through the word encoder, batch 1 (pass 3)
                self.mlm.encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
                if self.negatives != "none":  # the 25 negative captions, one call
                    negs = [text[: w.start] + c + text[w.end :] for c in cands]
                    e2 = tok(negs, return_tensors="pt", padding=True, truncation=True, max_length=o.max_tokens + 32)
                    self.mlm.encoder(input_ids=e2["input_ids"], attention_mask=e2["attention_mask"])
                out.append((w.text, cands))
        return out


def bare_forward_seconds(captions: list[str], negatives: str, neg_table) -> tuple[float, int]:
    """Encoder-only forwards of the sequences the stage must run, length-bucketed (timed part only)."""
    import numpy as np
    import torch

    from pipeline.models.mlm import load_mlm
    from pipeline.models.spacy_tagger import Tagger

    mlm = load_mlm("random-bert-base")
    tok = mlm.tokenizer
    seqs = []
    enc = tok(captions, truncation=True, max_length=128, return_offsets_mapping=True)
    rows = neg_table.to_pylist()
    by_caption: dict[int, list[dict]] = {}
    for r in rows:
        by_caption.setdefault(r["caption_id"], []).append(r)
    for cid, text in enumerate(captions):
        ids, offs = enc["input_ids"][cid], enc["offset_mapping"][cid]
        nouns = by_caption.get(cid, [])
        seqs.append(ids)
        for r in nouns:
            pieces = [i for i, (s, e) in enumerate(offs) if e > s and s < r["end"] and e > r["start"]]
            seqs.append(ids[: pieces[0]] + [tok.mask_token_id] + ids[pieces[-1] + 1 :])
            if negatives != "none":
                negs = [text[: r["start"]] + c + text[r["end"] :] for c in r["candidates"]]
                seqs.extend(tok(negs, truncation=True, max_length=160)["input_ids"])
    del Tagger
    lens = np.array([len(s) for s in seqs])
    order = np.argsort(lens, kind="stable")
    total, i, budget = 0.0, 0, 4096
    with torch.inference_mode():
        while i < len(order):
            j = i + 1
            while j < len(order) and j - i < 128 and (j - i + 1) * lens[order[j]] <= budget:
                j += 1
            idx = order[i:j]
            L = int(lens[idx[-1]])
            ids = torch.zeros(len(idx), L, dtype=torch.long)
            att = torch.zeros(len(idx), L, dtype=torch.long)
            for r, s in enumerate(idx):
                ids[r, : lens[s]] = torch.tensor(seqs[s])
                att[r, : lens[s]] = 1
            t0 = time.perf_counter()
            mlm.encoder(input_ids=ids, attention_mask=att)
            total += time.perf_counter() - t0
            i = j
    return total, len(seqs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--naive-n", type=int, default=100)
    ap.add_argument("--negatives", choices=["none", "all"], default="none")
    ap.add_argument("--shard", type=int, default=250, help="captions per stage unit")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the in-process naive and bare runs")
    args = ap.parse_args()
    if not SUGARCREPE.is_dir():
        print(f"skipped: {SUGARCREPE} not present")
        return 0
    sys.path.insert(0, str(REPO))
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    captions = load_captions(args.n)
    print(f"{len(captions)} SugarCrepe captions, model random-bert-base (12x768), negatives={args.negatives}, "
          f"CPUs {os.cpu_count()} (shared with other jobs: timings are noisy)")

    with tempfile.TemporaryDirectory() as tmp:
        wall, art = run_stage_timed(Path(tmp) / "run", captions, args.negatives, args.shard)
        neg = art.read("negatives")
        stats = art.manifest["stats"]
    n_nouns = neg.num_rows
    print(f"stage:  {wall:8.1f} s  {len(captions) / wall:7.2f} captions/s  ({n_nouns} nouns, "
          f"{stats.get('forward_batches')} forward batches, padding {stats.get('padded_tokens', 0) / max(stats.get('real_tokens', 1), 1) - 1:.1%})")
    enc_s = stats.get("encoder_seconds", 0.0)
    print(f"        inside the actors: encoder forwards {enc_s:.1f} s of {2 * wall:.1f} actor-seconds "
          f"(wall x 2 actors): {enc_s / (2 * wall):.0%} of the stage's CPU time is the bare forward")

    torch.set_num_threads(args.threads)
    bare, n_seq = bare_forward_seconds(captions, args.negatives, neg)
    print(f"bare:   {bare:8.1f} s  encoder forwards of the {n_seq} sequences the stage runs ({args.threads} threads)")

    naive = Naive(args.negatives)
    sub = captions[: args.naive_n]
    naive.caption(sub[0])  # warm-up
    t0 = time.perf_counter()
    naive_out = [naive.caption(t) for t in sub]
    naive_wall = time.perf_counter() - t0
    # same candidates as the stage?
    stage_c = {}
    for r in neg.to_pylist():
        stage_c.setdefault(r["caption_id"], []).append((r["noun"], r["candidates"]))
    agree = sum(stage_c.get(i, []) == o for i, o in enumerate(naive_out))
    naive_rate = len(sub) / naive_wall
    print(f"naive:  {naive_wall:8.1f} s  {naive_rate:7.2f} captions/s  on the first {len(sub)} captions "
          f"(same negatives as the stage for {agree}/{len(sub)} captions)")
    print(f"speed-up stage vs naive: {len(captions) / wall / naive_rate:.1f}x   (target >= 5x)")
    print(f"stage wall / bare forward: {wall / bare:.2f}   (target <= 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
