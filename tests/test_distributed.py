"""Data-parallel training (train/distributed.py on Ray Train): the ranks split each step's batch
exactly, 2 workers train as 1 process does (same samples, same losses within float tolerance), a
worker killed mid-epoch resumes from the last checkpoint exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ddp_toy import ToyConfig, ToyJob, make_toy  # (Ray workers import it as tests.ddp_toy)

pytestmark = pytest.mark.usefixtures("one_thread")


def _toy(tmp: Path, rank: int = 0, world: int = 1, **over) -> ToyJob:
    cfg = ToyConfig(batch_size=16 // world, run_dir=str(tmp), **over)
    job = ToyJob(cfg, None, tmp, torch.device("cpu"))
    job.rank, job.world_size = rank, world
    return job


def _ids(batches) -> list[list[int]]:
    return [sorted(int(s) for s in b["sample_id"]) for b in batches]


def _steps_split_exactly(single, ranks, start: int) -> None:
    one = _ids(single.batches(0, start))
    per_rank = [_ids(j.batches(0, start)) for j in ranks]
    assert all(j.batches_per_epoch() == single.batches_per_epoch() for j in ranks)
    assert len(one) == single.batches_per_epoch() - start and all(len(r) == len(one) for r in per_rank)
    for k, ids in enumerate(one):
        parts = [r[k] for r in per_rank]
        assert sorted(sum(parts, [])) == ids and len(set(parts[0]) & set(parts[1])) == 0


@pytest.mark.parametrize("start", [0, 2])
def test_ranks_split_each_step_of_an_in_memory_job(tmp_path, start):
    _steps_split_exactly(_toy(tmp_path), [_toy(tmp_path, r, 2) for r in (0, 1)], start)


@pytest.mark.parametrize("start", [0, 1])
def test_ranks_split_each_step_of_a_shard_stream_job(tmp_path, testbed_copy, start):
    from pipeline.config import load_manifest
    from train.jobs.concept_ot import make_job

    out, _ = testbed_copy  # the small oracle testbed (tests/conftest.py): 4 clip_tokens shards

    def job(rank, world):
        m = load_manifest(None, [f"output={out}", f"train.concept_ot.batch_size={16 // world}",
                                 "train.concept_ot.d_c=16", "train.concept_ot.rank=8", "train.concept_ot.shuffle_buffer=7"])
        j = make_job(m.train.concept_ot, m, tmp_path / "run", torch.device("cpu"))
        j.rank, j.world_size = rank, world
        return j

    _steps_split_exactly(job(0, 1), [job(r, 2) for r in (0, 1)], start)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "final.pt", weights_only=True)["model"]


BASE = dict(max_steps=8, log_every=1, ckpt_every=2, threads=1, lr=1e-2, amp="off", benchmarks_at_end=False)


def _two_workers(run: Path, **over) -> dict:
    from train.distributed import train_data_parallel

    base = {**BASE, **over, "run_dir": str(run), "workers": 2}
    return train_data_parallel(lambda o: make_toy(base, o), ToyConfig(batch_size=16, **{**base}), run, 2,
                               progress=False)


def test_two_workers_train_as_one_process(tmp_path, ray_session):
    from train.loop import train

    train(_toy(tmp_path / "one", **BASE), resume=False, progress=False)
    res = _two_workers(tmp_path / "two")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 8
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)
    wa, wb = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)
    assert res["mse"] == pytest.approx(json.loads((tmp_path / "one" / "eval" / "final" / "metrics.json").read_text())["mse"],
                                       rel=1e-4)
    stored = json.loads((tmp_path / "two" / "config.json").read_text())
    assert stored["batch_size"] == 16 and stored["workers"] == 2  # the run's (effective) batch is recorded


def test_killed_worker_resumes_from_the_last_checkpoint_exactly(tmp_path, ray_session):
    _two_workers(tmp_path / "straight")
    _two_workers(tmp_path / "killed", kill_rank_at_step=5)  # rank 1 dies in step 5; last.pt is step 4
    assert (tmp_path / "killed" / "killed-once").exists()
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")
    wa, wb = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
