"""Training on Ray as users run it (issue 39): the paths a user gives reach Ray Train workers and
Tune trials absolute; impossible worker counts, batches that do not split and splits smaller than
the workers are refused before a worker starts (one line, exit 2, nothing retried); a small split
trains on N workers by the one-process rule; a worker's error is one line naming the worker, and
only a lost worker is retried; a sweep's Tune state is read only after its checksums pass; grids
are UTF-8. The end-to-end runs (a second Ray instance on the machine, relative paths from two
folders, a sweep resumed and tampered with) are ``slow``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ddp_toy import ToyConfig, ToyJob, make_toy

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]


# --- the batch: split exactly, or refused; a small split by the one-process rule ----------------
def test_the_global_batch_splits_exactly_or_is_refused_in_one_line():
    from train.distributed import PreflightError, worker_batch_size

    assert worker_batch_size(64, 2) == 32 and worker_batch_size(64, 1) == 64 and worker_batch_size(None, 4) is None
    with pytest.raises(PreflightError) as e:
        worker_batch_size(64, 3)
    msg = str(e.value)
    assert "\n" not in msg and "64" in msg and "3 workers" in msg and "63" in msg and "66" in msg


def _toy(tmp: Path, n: int, batch: int, rank: int = 0, world: int = 1) -> ToyJob:
    from train import job as job_module

    job_module.PLACE = (rank, world)  # as train.distributed._worker sets it before the job is built
    try:
        return ToyJob(ToyConfig(n=n, batch_size=batch, run_dir=str(tmp)), None, tmp, torch.device("cpu"))
    finally:
        job_module.PLACE = (0, 1)


@pytest.mark.parametrize("n, batch, world, per_rank, steps", [
    (35, 64, 1, 35, 1),   # one process: the whole short split is one batch
    (35, 32, 2, 17, 1),   # 2 workers (batch 64 -> 32 each): one global batch of 34, 17 each
    (35, 16, 4, 8, 1),    # 4 workers: 32 of the 35
    (96, 8, 2, 8, 6),     # a split larger than the batch: the configured batch
])
def test_a_small_split_trains_on_n_workers_by_the_one_process_rule(tmp_path, n, batch, world, per_rank, steps):
    from train.job import batch_record

    ranks = [_toy(tmp_path, n, batch, r, world) for r in range(world)]
    assert all(j.batches_per_epoch() == steps for j in ranks)
    ids = [[sorted(int(s) for s in b["sample_id"]) for b in j.batches(0, 0)] for j in ranks]
    for k in range(steps):
        parts = [ids[r][k] for r in range(world)]
        assert all(len(p) == per_rank for p in parts)
        flat = sum(parts, [])
        assert len(set(flat)) == len(flat) == per_rank * world  # disjoint, exactly split
    assert batch_record(ranks[0]) == {"batch_per_step": {"global": per_rank * world, "per_worker": per_rank,
                                                          "workers": world}}


# --- preflight: the cluster, the data, the configuration ------------------------------------
def test_preflight_refuses_more_workers_than_the_cluster_places_and_fewer_samples_than_workers(tmp_path, ray_session):
    from train.distributed import PreflightError, preflight

    cpus = int(ray_session.cluster_resources()["CPU"])
    for workers in (cpus + 1, 1000):
        with pytest.raises(PreflightError) as e:
            preflight(ToyConfig(batch_size=6000), workers)
        assert f"can place {cpus} workers" in str(e.value) and f"--workers {cpus}" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(PreflightError) as e:
        preflight(ToyConfig(batch_size=4), 2, job=_toy(tmp_path, n=1, batch=4))
    assert "1 samples, fewer than the 2 workers" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PreflightError, match="gpus-per-worker"):
        preflight(ToyConfig(batch_size=4, device="cuda"), 2)
    assert preflight(ToyConfig(batch_size=4), 2, job=_toy(tmp_path, n=3, batch=4)) == 2


def test_refused_worker_counts_exit_2_in_one_line_before_a_worker_starts(tmp_path, testbed_copy, ray_session):
    from typer.testing import CliRunner

    from train.cli import app

    out, man = testbed_copy
    common = ["run", "concept-ot", "--manifest", str(man), "--no-progress", "--max-steps", "1",
              "--set", "train.concept_ot.d_c=16", "--set", "train.concept_ot.rank=8"]
    t0 = time.perf_counter()
    for extra, words in ((["--workers", "3", "--set", "train.concept_ot.batch_size=64"], "does not split exactly"),
                         (["--workers", "4", "--set", "train.concept_ot.batch_size=64"], "can place 2 workers"),
                         (["--workers", "1000", "--set", "train.concept_ot.batch_size=2000"], "can place 2 workers")):
        r = CliRunner().invoke(app, common + extra)
        errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
        assert r.exit_code == 2 and len(errors) == 1 and words in errors[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    assert time.perf_counter() - t0 < 60  # refused, not waited for
    assert not list(out.glob("train/concept-ot/*/checkpoints"))  # nothing trained


# --- a worker's error: one line naming the worker; retried only when a worker is lost ---------
@pytest.mark.slow
def test_a_workers_error_is_one_line_naming_it_and_is_not_retried(tmp_path, ray_session):
    import logging

    from train.distributed import WorkerFailed, run_log, train_data_parallel

    run = tmp_path / "run"
    base = dict(max_steps=6, log_every=1, ckpt_every=2, threads=1, lr=1e-2, amp="off", benchmarks_at_end=False,
                run_dir=str(run), workers=2, raise_rank_at_step=3)
    with run_log(run) as log, pytest.raises(WorkerFailed) as e:
        train_data_parallel(lambda o: make_toy(base, o), ToyConfig(batch_size=16, **base), run, 2, progress=False)
    assert not [h for h in logging.getLogger().handlers if getattr(h, "baseFilename", "") == str(log.resolve())]
    msg = str(e.value)
    assert msg.startswith("worker 1 failed (ValueError: toy: bad sample at step 3)") and "\n" not in msg, msg
    assert (run / "raised").read_text().count("x") == 1  # bad input is not retried (a lost worker is: test_distributed)
    assert "Traceback" in log.read_text() and "toy: bad sample" in log.read_text()  # the full story in the run's log


# --- sweep state and grids ------------------------------------------------------------------
def test_grid_that_is_not_utf8_is_one_line_naming_the_file_and_byte(tmp_path):
    from train.sweep import GridError, read_grid

    grid = tmp_path / "g.yaml"
    grid.write_bytes("train.concept_ot.lr: [0.1]  # café\n".encode("latin-1"))
    with pytest.raises(GridError) as e:
        read_grid(grid, "concept-ot")
    msg = str(e.value)
    assert str(grid) in msg and "0xe9" in msg and f"offset {grid.read_bytes().index(0xe9)}" in msg and "\n" not in msg


class _Planted:
    """Unpickling this creates the file ``path``: the proof that a pickle was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_sweep_state_is_read_only_when_its_checksums_pass(tmp_path):
    import pickle

    from train.sweep_state import SUMS, StateError, check, seal

    exp = tmp_path / "sweep-x"
    check(exp)  # nothing to resume: passes
    (exp / "trial_0").mkdir(parents=True)
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    (exp / "trial_0" / "params.pkl").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(StateError, match=f"no {SUMS}.*--fresh"):
        check(exp)  # written by something that did not seal it
    seal(exp)
    check(exp)
    marker = tmp_path / "unpickled"
    (exp / "tuner.pkl").write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(StateError) as e:
        check(exp)
    assert "tuner.pkl changed" in str(e.value) and "--fresh" in str(e.value) and "\n" not in str(e.value)
    seal(exp)
    (exp / "trial_0" / "params.pkl").write_bytes(b"\x80\x04")  # truncated
    with pytest.raises(StateError, match="params.pkl changed"):
        check(exp)
    seal(exp)
    (exp / "extra.pkl").write_bytes(b"")
    with pytest.raises(StateError, match="extra.pkl was not written by this sweep"):
        check(exp)
    (exp / "extra.pkl").unlink()
    (exp / "trial_0" / "params.pkl").unlink()
    with pytest.raises(StateError, match="params.pkl is missing"):
        check(exp)
    assert not marker.exists()


def test_a_finished_trial_is_reused_only_when_its_stored_configuration_is_its_own(tmp_path):
    from pipeline.config import load_manifest
    from train.sweep import reusable, stored_differences

    man = tmp_path / "m.yaml"
    man.write_text("name: t\n")
    sets = ["train.concept_ot.lr=0.001", "train.concept_ot.seed=1"]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "eval" / "final").mkdir(parents=True)
    stored = load_manifest(man, sets).train.concept_ot.model_dump(mode="json")
    (run / "config.json").write_text(json.dumps({**stored, "batch_per_step": {"global": 8}, "threads": 3}))
    assert not reusable("concept-ot", man, sets, run)  # not finished yet
    (run / "checkpoints" / "final.pt").write_bytes(b"x")
    (run / "eval" / "final" / "metrics.json").write_text("{}")
    assert reusable("concept-ot", man, sets, run)  # the record and evaluation-only options do not count
    (run / "config.json").write_text(json.dumps({**stored, "lr": 0.002}))
    assert stored_differences("concept-ot", man, sets, run) == {"lr": (0.002, 0.001)}
    assert not reusable("concept-ot", man, sets, run)
    (run / "config.json").write_text("{")
    assert not reusable("concept-ot", man, sets, run)


# --- paths ----------------------------------------------------------------------------------
def test_every_user_path_is_made_absolute_against_the_working_directory(tmp_path, monkeypatch):
    from pipeline.config import load_manifest
    from train.paths import absolute_inputs

    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "m.yaml").write_text(
        "name: t\noutput: runs/x\neval:\n  benchmarks:\n"
        "    - {name: a, format: sugarcrepe, path: data/sc}\n"
        "    - {name: b, format: sugarcrepe, path: '{output}/source/sc'}\n")
    expect = (tmp_path / "proj" / "runs" / "x").resolve()
    for cwd, man, sets in ((tmp_path / "proj", "m.yaml", []),
                           (tmp_path / "proj" / "sub", "../m.yaml", ["output=../runs/x"]),
                           (tmp_path, "proj/m.yaml", ["output=proj/runs/x", "train.concept_ot.sugarcrepe_dirs=[proj/sc]"]),
                           (tmp_path, str(tmp_path / "proj" / "m.yaml"), [f"output={expect}"])):
        monkeypatch.chdir(cwd)
        path, over = absolute_inputs(Path(man), sets, "concept-ot")
        assert path.is_absolute() and path == (tmp_path / "proj" / "m.yaml").resolve()
        monkeypatch.chdir("/")  # what a worker sees: another folder
        m = load_manifest(path, over)
        assert Path(m.output) == expect
        assert m.eval.benchmarks[0].path == str((cwd / "data" / "sc").resolve())  # the manifest's relative path: the user's folder
        assert m.eval.benchmarks[1].path == str(expect / "source" / "sc")  # {output} expands in every path (issue 49)
        if "sugarcrepe" in " ".join(sets):
            assert m.train.concept_ot.sugarcrepe_dirs == [str((tmp_path / "proj" / "sc").resolve())]


# --- end to end, as a user runs it ----------------------------------------------------------
def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return {**env, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO)}


def _other_ray(tmp: Path) -> subprocess.Popen:
    """An unrelated Ray instance on the machine (`ray start --head`, as another user would; it records
    itself as the machine's latest cluster), in its own session so that it is stopped by its own
    process group, never `ray stop`. ``tmp``: a short folder (Ray's socket paths must stay short)."""
    p = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus=1",
                          "--include-dashboard=false", "--object-store-memory=80000000", "--port=0",
                          f"--temp-dir={tmp}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env=_env())
    for _ in range(120):  # up once `ray start` recorded the cluster's address
        if (Path(tmp) / "ray_current_cluster").is_file() or p.poll() is not None:
            break
        time.sleep(1)
    time.sleep(3)
    assert p.poll() is None, "the unrelated Ray instance did not start"
    return p


def _stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    except ProcessLookupError:
        pass


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "train"), *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=540)


@pytest.mark.slow
@pytest.mark.heavy
def test_workers_with_relative_paths_from_two_folders_beside_another_ray_instance(tmp_path, testbed_copy):
    """`train run --workers 2` as the README writes it (relative manifest and output) from the
    manifest's folder, and from another folder (relative paths to it), while an unrelated Ray runs;
    a small split (80-odd training images < batch 256) trains by the one-process rule. ~100 s."""
    import yaml

    out, man = testbed_copy
    m = yaml.safe_load(man.read_text())
    m["output"] = "testbed"  # relative: the folder beside the manifest
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(m))
    (tmp_path / "elsewhere").mkdir()
    sets = ["--set", "train.concept_ot.d_c=16", "--set", "train.concept_ot.rank=8", "--set", "train.concept_ot.heatmaps=0",
            "--set", "train.concept_ot.sugarcrepe_dirs=[]", "--set", "train.concept_ot.benchmarks_at_end=false",
            "--set", "train.concept_ot.batch_size=256", "--set", "train.concept_ot.threads=1", "--set", "ray.num_cpus=2",
            "--set", "ray.object_store_memory=100000000", "--no-progress", "--max-steps", "2", "--workers", "2"]
    import shutil
    import tempfile

    other_tmp = Path(tempfile.mkdtemp(prefix="ray-other-", dir="/tmp"))
    other = _other_ray(other_tmp)
    try:
        runs = []
        for cwd, args in ((tmp_path, ["--manifest", "m.yaml"]),
                          (tmp_path / "elsewhere", ["--manifest", "../m.yaml", "--set", "output=../testbed",
                                                    "--set", "train.concept_ot.lr=0.0002"])):
            r = _train(["run", "concept-ot", *args, *sets], cwd)
            assert r.returncode == 0, r.stderr[-3000:]
            assert "Traceback" not in r.stderr and "multiple active Ray instances" not in r.stderr, r.stderr[-3000:]
            run = Path(next(x for x in r.stderr.splitlines() if x.startswith("run folder: ")).split(": ", 1)[1])
            runs.append((cwd / run).resolve())
        assert other.poll() is None  # the other instance was left alone
    finally:
        _stop(other)
        shutil.rmtree(other_tmp, ignore_errors=True)
    for run in runs:
        assert run.parent.parent == out.resolve() / "train"  # under the manifest's relative output, both times
        rec = json.loads((run / "config.json").read_text())
        g = rec["batch_per_step"]
        assert rec["batch_size"] == 256 and rec["workers"] == 2 and g["workers"] == 2
        assert g["global"] == 2 * g["per_worker"] and 2 <= g["global"] < 256  # the whole small split, split exactly
        assert len([x for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]) >= 1
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
        assert (run / "train.log").is_file()


@pytest.mark.slow
@pytest.mark.heavy
def test_sweep_from_another_folder_resumes_only_checked_state(tmp_path, testbed_copy):
    """`train sweep` with relative manifest, output and grid from another folder; a rerun reuses the
    finished trial (its stored configuration is its own); a tampered or truncated tuner.pkl is refused
    in one line before it is unpickled; --fresh starts the Tune experiment over. ~120 s."""
    import pickle

    import yaml

    out, man = testbed_copy
    m = yaml.safe_load(man.read_text())
    m["output"] = "testbed"
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(m))
    (tmp_path / "grid.yaml").write_text("train.concept_ot.lr: [0.001]\n")
    (tmp_path / "w").mkdir()
    args = ["sweep", "concept-ot", "--manifest", "../m.yaml", "--grid", "../grid.yaml", "--set", "output=../testbed",
            "--set", "train.concept_ot.max_steps=2", "--set", "train.concept_ot.batch_size=8",
            "--set", "train.concept_ot.d_c=16", "--set", "train.concept_ot.rank=8",
            "--set", "train.concept_ot.sugarcrepe_dirs=[]", "--set", "train.concept_ot.heatmaps=0",
            "--set", "train.concept_ot.threads=1", "--set", "train.concept_ot.benchmarks_at_end=false",
            "--set", "ray.num_cpus=2", "--set", "ray.object_store_memory=100000000"]
    r = _train(args, tmp_path / "w")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained 1, reused 0, failed 0" in r.stderr, r.stderr[-2000:]
    r = _train(args, tmp_path / "w")
    assert r.returncode == 0 and "trained 0, reused 1, failed 0" in r.stderr, r.stderr[-2000:]
    (run,) = [p for p in (out / "train" / "concept-ot").iterdir() if p.name != "sweeps"]
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "lr": 0.5}))  # a finished folder of another configuration
    stamp = (run / "checkpoints" / "final.pt").stat().st_mtime_ns
    r = _train(args, tmp_path / "w")
    assert r.returncode == 0 and "trained 1, reused 0, failed 0" in r.stderr, r.stderr[-2000:]
    assert (run / "checkpoints" / "final.pt").stat().st_mtime_ns != stamp
    assert json.loads((run / "config.json").read_text())["lr"] == 0.001
    exp = next((out / "train" / "concept-ot" / "sweeps").glob("sweep-*"))
    pkl = exp / "tuner.pkl"
    assert pkl.is_file() and (exp / "vlpipe-state.sha256").is_file()
    marker = tmp_path / "unpickled"
    for bad in (pickle.dumps(_Planted(str(marker))), pkl.read_bytes()[:10]):
        pkl.write_bytes(bad)
        r = _train(args, tmp_path / "w")
        errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
        assert r.returncode == 2 and len(errors) == 1 and "tuner.pkl changed" in errors[0] and "--fresh" in errors[0]
        assert not marker.exists() and "Traceback" not in r.stderr
    r = _train([*args, "--fresh"], tmp_path / "w")
    assert r.returncode == 0 and "trained 0, reused 1, failed 0" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()
