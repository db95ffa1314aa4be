"""Trainer core: schedule, streaming data order / workers / resume position, exact checkpoint
continuation, CLI; evaluation helpers against brute force."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.io.shards import ShardStream, buffer_shuffle, loader
from tests.testbed_reduced import copy_testbed
from train.data import ParquetJoin
from train.eval.retrieval import recall_at_k, retrieval_report
from train.eval.benchmarks.sugarcrepe import score as sugarcrepe_score
from train.eval.in_job import read_folders
from train.eval.interface import Item, Pair
from train.loop import lr_factor

SHARED_SC = Path(__file__).resolve().parents[2] / "shared" / "data" / "sugarcrepe"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def oracle(small_testbed, tmp_path_factory):
    """This module's copy of the small oracle testbed (tests/conftest.py: samples + clip_tokens of
    100 generated images through the real stages, 90 train / 5 val / 5 test, shards of 25)."""
    return copy_testbed(small_testbed, tmp_path_factory.mktemp("core"))[0]


def test_lr_schedule_warmup_cosine():
    total, warm = 100, 5
    vals = [lr_factor(s, total, warm, 0.0) for s in range(total)]
    assert vals[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    for s in range(warm, total):
        assert vals[s] == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    assert lr_factor(total, total, warm, 0.1) == pytest.approx(0.1)


def test_buffer_shuffle_is_a_seeded_permutation():
    a = list(buffer_shuffle(range(1000), 64, random.Random(1)))
    b = list(buffer_shuffle(range(1000), 64, random.Random(1)))
    assert a == b and sorted(a) == list(range(1000)) and a != list(range(1000))


def _toy_stream(**kw):
    shards = [list(range(s, s + 37)) for s in range(0, 370, 37)]

    def read(sh):
        for i in sh:
            yield {"sample_id": i}

    def collate(samples, rng):
        return {"ids": torch.tensor([s["sample_id"] for s in samples]), "r": torch.tensor([rng.random()])}

    return ShardStream(shards, read, collate, batch_size=16, shuffle_buffer=50, seed=7, **kw)


def test_shard_stream_epochs_resume_and_workers():
    st = _toy_stream()
    e0 = [b["ids"].tolist() for b in st.set_position(0, 0)]
    e0b = [b["ids"].tolist() for b in _toy_stream().set_position(0, 0)]
    e1 = [b["ids"].tolist() for b in _toy_stream().set_position(1, 0)]
    assert e0 == e0b and e0 != e1
    assert len(e0) == 370 // 16 == st.count_batches()
    flat = [i for b in e0 for i in b]
    assert len(set(flat)) == len(flat) == 16 * (370 // 16)  # each sample at most once per epoch
    # resume position: the same batches, including the per-batch rng draws
    full = list(_toy_stream().set_position(1, 0))
    tail = list(_toy_stream().set_position(1, 5))
    assert [b["ids"].tolist() for b in tail] == [b["ids"].tolist() for b in full[5:]]
    assert [float(b["r"]) for b in tail] == [float(b["r"]) for b in full[5:]]
    # DataLoader workers: identical sequence
    par = list(loader(_toy_stream().set_position(1, 3), num_workers=2))
    assert [b["ids"].tolist() for b in par] == [b["ids"].tolist() for b in full[3:]]
    # split filter
    odd = [i for b in _toy_stream(keep=lambda s: s["sample_id"] % 2 == 1).set_position(0, 0) for i in b["ids"].tolist()]
    assert odd and all(i % 2 == 1 for i in odd)


def test_shard_stream_ranks_partition_the_epoch():
    """rank/world_size: each rank collates a disjoint share of the epoch's batches; together they are
    exactly the single-process epoch (same batches, same per-batch rng draws), also when resumed
    and through DataLoader workers, and count_batches gives each rank's share."""
    for start in (0, 5):
        full = [(b["ids"].tolist(), float(b["r"])) for b in _toy_stream().set_position(1, start)]
        world = 3
        shares = [[(b["ids"].tolist(), float(b["r"])) for b in _toy_stream(rank=r, world_size=world).set_position(1, start)]
                  for r in range(world)]
        assert sorted(len(s) for s in shares)[-1] - sorted(len(s) for s in shares)[0] <= 1
        merged = [shares[k % world][k // world] for k in range(len(full))]  # batch start + k is rank k % world's
        assert merged == full
        ids = [i for share in shares for b, _ in share for i in b]
        assert len(ids) == len(set(ids)) == sum(len(b) for b, _ in full)  # disjoint samples, none lost
    assert [_toy_stream(rank=r, world_size=3).count_batches() for r in range(3)] == [8, 8, 7]  # 23 batches
    one = [b["ids"].tolist() for b in _toy_stream(rank=1, world_size=3).set_position(0, 0)]
    par = [b["ids"].tolist() for b in loader(_toy_stream(rank=1, world_size=3).set_position(0, 0), num_workers=2)]
    assert par == one
    with pytest.raises(ValueError, match="rank 3"):
        _toy_stream(rank=3, world_size=3)


def test_parquet_join(oracle):
    j = ParquetJoin(oracle / "samples", "samples", ["split", "source_id"])
    import pyarrow.parquet as pq

    t = pq.read_table(next((oracle / "samples" / "samples").glob("*.parquet"))).to_pydict()
    for sid, split, src in zip(t["sample_id"], t["split"], t["source_id"]):
        assert j.lookup(sid) == {"split": split, "source_id": src}
    assert j.lookup(10**9) is None


def test_recall_at_k_bruteforce():
    g = torch.Generator().manual_seed(0)
    S = torch.randn(30, 50, generator=g)
    gt = torch.zeros(30, 50, dtype=torch.bool)
    for q in range(30):
        gt[q, torch.randperm(50, generator=g)[:2]] = True
    r = recall_at_k(S, gt, (1, 5, 10))
    for k in (1, 5, 10):
        hits = 0
        for q in range(30):
            order = sorted(range(50), key=lambda c: -float(S[q, c]))
            hits += any(gt[q, c] for c in order[:k])
        assert r[k] == pytest.approx(hits / 30)


def test_two_stage_rerank_only_within_topk():
    """A local score can reorder only the global top-k candidates (G.4)."""
    I, T = 6, 12
    g = torch.linspace(0, 1, I * T).reshape(I, T)
    img_of = torch.arange(T) // 2
    # the local score favours exactly the ground truth, strongly
    def local(qi, ti):
        return (img_of[ti] == qi).float() * 10
    full = retrieval_report(g, local, 1.0, img_of, top_k=T)
    assert full["rerank/i2t_R@1"] == 100 and full["rerank/t2i_R@1"] == 100
    small = retrieval_report(g, local, 1.0, img_of, top_k=1)
    assert small["rerank/i2t_R@1"] == small["global/i2t_R@1"]


def pairwise_accuracy(pos, neg) -> float:
    """SugarCrepe accuracy of (pos, neg) score pairs as the harness scores them (one kind)."""
    items = [Item([Pair("i", "a"), Pair("i", "b")], subset="swap_att") for _ in pos]
    rows = sugarcrepe_score("sc", items, [np.array([p, n], float) for p, n in zip(pos, neg)])
    return next(r.value for r in rows if r.subset == "swap_att")


def test_pairwise_accuracy():
    assert pairwise_accuracy([1, 2, 3, 4], [0, 3, 3, 1]) == pytest.approx(100 * 2 / 4)  # the tie (3, 3) is wrong
    assert pairwise_accuracy([1.0, 1.0], [1.0, 1.0]) == 0.0  # a constant scorer


@pytest.mark.skipif(not SHARED_SC.is_dir(), reason="shared SugarCrepe data not present")
def test_read_shared_sugarcrepe_as_is():
    data, available = read_folders("sugarcrepe", [SHARED_SC])
    n = 0
    for f in SHARED_SC.glob("*.json"):
        if f.stem == "LICENSE":
            continue
        rows = json.loads(f.read_text())
        mine = [it for it in data.items if it.subset == f.stem]
        assert len(mine) == len(rows)
        first = next(iter(rows.values()))
        assert [(p.image, p.text) for p in mine[0].pairs] == [(first["filename"], first["caption"].strip()),
                                                               (first["filename"], first["negative_caption"].strip())]
        n += len(rows)
    assert available == n


def _job(out: Path, run: str, **over):
    from pipeline.config import load_manifest
    from train.jobs.concept_ot import make_job

    sets = [f"output={out}", "train.concept_ot.batch_size=16", "train.concept_ot.d_c=16", "train.concept_ot.rank=8",
            "train.concept_ot.log_every=1", "train.concept_ot.eval_splits=[test]", "train.concept_ot.heatmaps=0",
            "train.concept_ot.sugarcrepe_dirs=[]", f"train.concept_ot.run_dir={out / run}"]
    sets += [f"train.concept_ot.{k}={v}" for k, v in over.items()]
    m = load_manifest(None, sets)
    return make_job(m.train.concept_ot, m, out / run, torch.device("cpu"))


def _train_rows(path: Path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


@pytest.mark.parametrize("variant", ["conceptot", "dense-uot"])
def test_exact_resume(oracle, variant):
    from train.loop import train

    # 90 train images / 16 = 5 batches per epoch: the run crosses an epoch boundary after
    # the interruption. One thread: multithreaded BLAS is not bitwise reproducible run to run.
    steps = 7
    kw = dict(variant=variant, max_steps=steps, threads=1, eval_max_images=4)
    train(_job(oracle, f"straight-{variant}", **kw), resume=False, progress=False)
    j = _job(oracle, f"resumed-{variant}", ckpt_every=100, **kw)
    assert train(j, resume=False, progress=False, stop_after=3) == {"interrupted_at": 3}
    train(_job(oracle, f"resumed-{variant}", **kw), resume=True, progress=False)
    a = _train_rows(oracle / f"straight-{variant}" / "metrics.jsonl")
    b = _train_rows(oracle / f"resumed-{variant}" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["epoch"] == rb["epoch"] and ra["lr"] == rb["lr"]
    pa = torch.load(oracle / f"straight-{variant}" / "checkpoints" / "final.pt", weights_only=False)["model"]
    pb = torch.load(oracle / f"resumed-{variant}" / "checkpoints" / "final.pt", weights_only=False)["model"]
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert (oracle / f"resumed-{variant}" / "metrics.png").stat().st_size > 0


@pytest.mark.parametrize("variant", ["conceptot", "dense-uot", "balanced-ot", "filip", "text-attn", "global-patch"])
def test_every_variant_trains_a_step(oracle, variant):
    from train.loop import seed_everything

    seed_everything(0)
    job = _job(oracle, f"v-{variant}", variant=variant)
    model = job.build_model()
    batch = next(iter(job.batches(0, 0)))
    loss, logs = job.loss(model, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert 0 < logs["loss_i2x"] < 10


def test_mine_pairs_bruteforce():
    from train.jobs.concept_ot.losses import mine_pairs

    g = torch.randn(7, 7, generator=torch.Generator().manual_seed(0))
    bad = torch.eye(7, dtype=torch.bool)
    bad[2, 5] = bad[5, 2] = True  # captions 2 and 5 are identical (symmetric, as the job builds it)
    ii, tt, nx, ni, vx, vi = mine_pairs(g, 3, bad)
    for i in range(7):
        assert nx[i].tolist() == sorted([j for j in range(7) if not bad[i, j]], key=lambda j: -float(g[i, j]))[:3]
        assert ni[i].tolist() == sorted([j for j in range(7) if not bad[i, j]], key=lambda j: -float(g[j, i]))[:3]
    assert ii[:7].tolist() == tt[:7].tolist() == list(range(7))
    assert (ii[7:28].view(7, 3) == torch.arange(7)[:, None]).all() and (tt[7:28].view(7, 3) == nx).all()
    assert (ii[28:].view(7, 3) == ni).all() and (tt[28:].view(7, 3) == torch.arange(7)[:, None]).all()


def test_cli_run_eval_and_bad_manifest(oracle, tmp_path):
    from typer.testing import CliRunner

    from train.cli import app

    runner = CliRunner()
    sets = ["--set", f"output={oracle}", "--set", "train.concept_ot.max_steps=2", "--set", "train.concept_ot.batch_size=16",
            "--set", "train.concept_ot.variant=dense-uot", "--set", "train.concept_ot.d_c=16",
            "--set", f"train.concept_ot.run_dir={tmp_path / 'cli'}", "--set", "train.concept_ot.eval_splits=[test]",
            "--set", "train.concept_ot.sugarcrepe_dirs=[]", "--set", "train.concept_ot.heatmaps=1"]
    man = tmp_path / "m.yaml"
    man.write_text("name: t\n")
    r = runner.invoke(app, ["run", "concept-ot", "--manifest", str(man), "--no-progress", "--json", *sets])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "rerank/i2t_R@1" in res and "global/t2i_R@10" in res
    ck = tmp_path / "cli" / "checkpoints" / "final.pt"
    # `train eval`: the harness table (here the job's own grounding rows: no eval.benchmarks) and, with
    # --job-eval, the job's evaluate() again, into <run>/eval/step<N>/
    r = runner.invoke(app, ["eval", "concept-ot", "--checkpoint", str(ck), "--manifest", str(man), "--job-eval", *sets])
    assert r.exit_code == 0, r.output
    where = Path(r.stdout.strip().splitlines()[-1].split("results: ", 1)[1].split(" (", 1)[0])
    assert where.is_file() and where.parent.parent.parent == tmp_path / "cli"
    res2 = json.loads((where.parent / "metrics.json").read_text())
    assert res2["rerank/i2t_R@1"] == pytest.approx(res["rerank/i2t_R@1"], abs=1e-3)
    assert list((tmp_path / "cli" / "eval" / "final").glob("heatmap_*.png"))
    # --checkpoint <run folder>: its checkpoints/final.pt (no best.pt without best_metric), saying so
    r = runner.invoke(app, ["eval", "concept-ot", "--checkpoint", str(tmp_path / "cli"), "--manifest", str(man), *sets])
    assert r.exit_code == 0, r.output
    assert f"checkpoint: {ck} " in r.stderr
    r = runner.invoke(app, ["run", "concept-ot", "--manifest", str(man), "--set", "train.concept_ot.varient=x"])
    assert r.exit_code == 2 and "varient" in r.output


@pytest.mark.parametrize("variant", ["conceptot", "dense-uot"])
def test_amp_bf16_step(oracle, variant):
    from train.loop import train

    res = train(_job(oracle, f"amp-{variant}", variant=variant, max_steps=2, amp="bf16", eval_max_images=4),
                resume=False, progress=False)
    rows = _train_rows(oracle / f"amp-{variant}" / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert "rerank/avg_R@1" in res


def test_concept_ot_batches_identical_with_workers(oracle):
    """The job's real data path (lazy shard reads, split join, random caption pick) gives the same
    batches in-process and through 2 DataLoader workers, from any resume position."""
    a = list(_job(oracle, "w0", num_workers=0).batches(1, 1))
    b = list(_job(oracle, "w2", num_workers=2).batches(1, 1))
    assert len(a) == len(b) >= 2
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)
