"""Training runs under faults (issue 30): one `train run` per run folder (a lock naming the other
run's pid and host; a dead holder's lock taken over), a garbled metrics.jsonl on resume, temporary
checkpoint files of a killed run, a full disk, a corrupt last.pt, and `train eval --checkpoint`
given a run folder. Each error is one line and exit code 2."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeline.io.checkpoint import save_checkpoint_file
from pipeline.io.lock import FolderBusy
from train.config import TrainerConfig
from train.job import Job
from train.loop import load_checkpoint, train

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):  # the figure is not what is tested here
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)


class _Toy(Job):
    """A linear map of ``width`` inputs; 4 batches per epoch, 8 steps."""

    NAME = "toy"

    def __init__(self, run_dir: Path, width: int = 1, **cfg):
        base = dict(max_steps=8, batch_size=2, lr=0.1, warmup_frac=0.0, amp="off", log_every=1, ckpt_every=100,
                    threads=1, benchmarks_at_end=False)
        super().__init__(TrainerConfig(**{**base, **cfg}), None, run_dir, torch.device("cpu"))
        self.width = width

    def build_model(self):
        return torch.nn.Linear(self.width, 1, bias=False)

    def batches_per_epoch(self):
        return 4

    def batches(self, epoch, start):
        return [{"x": torch.ones(2, self.width)} for _ in range(start, 4)]

    def loss(self, model, batch):
        return ((model(batch["x"]) - 1.0) ** 2).mean(), {}


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _cli_run(monkeypatch, job: _Toy, *args: str):
    """`train run toy` on ``job`` (the manifest and registry are not what these tests are about)."""
    import train.cli

    monkeypatch.setattr(train.cli, "build_job", lambda *a, **k: (None, job.cfg, None, job))
    return CliRunner().invoke(train.cli.app, ["run", "toy", "--manifest", "unused.yaml", "--no-progress", *args])


def _errors(r) -> list[str]:
    return [x for x in r.output.splitlines() if x.startswith("error:")]


# --- the run folder's lock ------------------------------------------------------------------------

_HOLD = """
import os, sys, time
from pipeline.io.lock import lock_folder
lock_folder(sys.argv[1], doing="trained")
child = 0
if sys.argv[2] == "fork":  # the holder dies, a child it forked keeps the descriptor (a DataLoader worker)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
print("locked", child, flush=True)
if sys.argv[2] == "fork":
    os._exit(0)
time.sleep(60)
"""


def _holder(run: Path, mode: str) -> tuple[subprocess.Popen, int]:
    """(the process holding ``run``'s lock, the pid of the child it forked or 0)."""
    run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run), mode], stdout=subprocess.PIPE, text=True, cwd=REPO)
    word, child = proc.stdout.readline().split()
    assert word == "locked"
    return proc, int(child)


def test_a_second_train_run_of_the_folder_is_refused_then_a_killed_holders_lock_is_taken(tmp_path, monkeypatch, capsys):
    import socket

    run = tmp_path / "run"
    proc, _ = _holder(run, "hold")
    try:
        with pytest.raises(FolderBusy) as e:
            train(_Toy(run), progress=False)
        msg = str(e.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in msg and "is being trained" in msg and "\n" not in msg
        assert not (run / "metrics.jsonl").exists() and not (run / "config.json").exists()  # nothing touched
        r = _cli_run(monkeypatch, _Toy(run))
        assert r.exit_code == 2 and len(_errors(r)) == 1 and f"pid {proc.pid}" in _errors(r)[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        capsys.readouterr()
        train(_Toy(run), progress=False)
        err = capsys.readouterr().err
        assert f"took over the lock of pid {proc.pid} on {socket.gethostname()}" in err
        assert _steps(run) == list(range(1, 9))
        assert (run / "_lock").read_text() == ""  # released, cleared: the next run has nothing to report
        capsys.readouterr()
        train(_Toy(run), progress=False)
        assert "took over" not in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait(10)


def test_the_lock_a_dead_runs_forked_child_still_holds_is_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    proc, child = _holder(run, "fork")
    proc.wait(10)  # reaped: its pid is gone; the child still holds the flock
    try:
        train(_Toy(run), progress=False)
        err = capsys.readouterr().err
        assert f"took over the lock of pid {proc.pid}" in err and "no longer running" in err
        assert _steps(run) == list(range(1, 9))
    finally:
        os.kill(child, signal.SIGKILL)


# --- resume ---------------------------------------------------------------------------------------


def test_resume_drops_garbled_metrics_lines_and_says_which(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(_Toy(run), resume=False, progress=False, stop_after=4) == {"interrupted_at": 4}
    with (run / "metrics.jsonl").open("a") as fh:  # a second run wrote into the same file, then died
        for step in (1, 2, 6):
            fh.write(json.dumps({"kind": "train", "step": step, "epoch": 0, "loss": 9.0}) + "\n")
        fh.write('{"kind": "train", "st\n')
    capsys.readouterr()
    train(_Toy(run), progress=False)
    err = capsys.readouterr().err
    assert _steps(run) == list(range(1, 9))
    line = next(x for x in err.splitlines() if "dropped" in x)
    assert "dropped 4 line(s)" in line and "1 past the checkpoint's step 4 (step 6)" in line
    assert "2 out of step order or repeated (steps 1, 2;" in line and "1 unreadable" in line


def test_temporary_checkpoint_files_of_a_killed_run_are_removed(tmp_path, capsys):
    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=2)  # the run folder (with its marker) of a run that stopped
    left = run / "checkpoints" / f".last.pt.{2**22 + 7}.tmp"
    left.write_bytes(b"x" * 1000)
    train(_Toy(run), progress=False)
    assert not left.exists() and not list(run.rglob("*.tmp"))
    assert "removed 1 temporary file(s) left by an interrupted run" in capsys.readouterr().err


def test_corrupt_last_checkpoint_on_train_run_is_one_line_with_the_way_out(tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)
    last = run / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:200])  # truncated, as a full disk or a copy would leave it
    r = _cli_run(monkeypatch, _Toy(run))
    assert r.exit_code == 2, r.output
    err = _errors(r)
    assert len(err) == 1 and str(last) in err[0] and "--fresh" in err[0] and "run_dir" in err[0]
    assert "Traceback" not in r.output
    r = _cli_run(monkeypatch, _Toy(run), "--fresh")
    assert r.exit_code == 0, r.output
    assert load_checkpoint(last)["step"] == 8


def test_a_checkpoint_that_does_not_fit_the_model_is_a_checkpoint_error(tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)
    last = run / "checkpoints" / "last.pt"
    ck = load_checkpoint(last)
    ck["model"] = {"weight": torch.zeros(3, 3)}
    save_checkpoint_file(last, ck)
    r = _cli_run(monkeypatch, _Toy(run))
    assert r.exit_code == 2 and len(_errors(r)) == 1
    assert "does not resume this job's model" in _errors(r)[0] and "--fresh" in _errors(r)[0]


# --- full disks -----------------------------------------------------------------------------------


class _FullDisk:
    """A file whose writes fail as a full disk's do."""

    def __init__(self, path, mode):
        self.f = open(path, mode)

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_checkpoint_write_on_a_full_disk_names_enospc_and_the_path(tmp_path, monkeypatch):
    import pipeline.io.checkpoint as C

    path = tmp_path / "checkpoints" / "last.pt"
    save_checkpoint_file(path, {"w": torch.ones(3)})
    monkeypatch.setattr(C, "open", _FullDisk, raising=False)  # torch.save writes through it
    with pytest.raises(OSError) as e:
        save_checkpoint_file(path, {"w": torch.zeros(1000)})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert "No space left on device" in str(e.value)
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(3))  # the previous checkpoint is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt", "last.pt.sha256"]  # no temporary file left


def test_train_run_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    import pipeline.io.checkpoint as C

    monkeypatch.setattr(C, "open", _FullDisk, raising=False)
    run = tmp_path / "run"
    r = _cli_run(monkeypatch, _Toy(run))
    assert r.exit_code == 2, r.output
    err = _errors(r)
    assert len(err) == 1 and "No space left on device" in err[0] and str(run / "checkpoints" / "last.pt") in err[0]
    assert "Traceback" not in r.output and not list(run.rglob("*.tmp"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (tests.conftest.mounted_tmpfs)."""
    from tests.conftest import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "tiny", "1m") as d:
        yield d


def test_train_run_on_a_real_full_tmpfs(tiny_disk, monkeypatch):
    run = tiny_disk / "run"
    r = _cli_run(monkeypatch, _Toy(run, width=100_000))  # model + Adam moments: 1.2 MB > 1 MiB
    assert r.exit_code == 2, r.output
    err = _errors(r)
    assert len(err) == 1 and "No space left on device" in err[0] and str(run / "checkpoints" / "last.pt") in err[0]
    assert "Traceback" not in r.output and not list(run.rglob("*.tmp"))


# --- train eval --checkpoint <run folder> ------------------------------------------------------------


def test_eval_checkpoint_may_be_a_run_folder(tmp_path, capsys):
    import typer

    from train.cli import _checkpoint_file

    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)  # last.pt only
    capsys.readouterr()
    assert _checkpoint_file(run) == run / "checkpoints" / "last.pt"
    assert "checkpoint: " + str(run / "checkpoints" / "last.pt") in capsys.readouterr().err
    train(_Toy(run, best_metric="loss"), progress=False)  # final.pt; best.pt needs an evaluate() metric
    assert _checkpoint_file(run) == run / "checkpoints" / "final.pt"
    save_checkpoint_file(run / "checkpoints" / "best.pt", load_checkpoint(run / "checkpoints" / "final.pt"))
    assert _checkpoint_file(run) == _checkpoint_file(run / "checkpoints") == run / "checkpoints" / "best.pt"
    assert _checkpoint_file(run / "checkpoints" / "last.pt") == run / "checkpoints" / "last.pt"
    (tmp_path / "empty").mkdir()
    capsys.readouterr()
    with pytest.raises(typer.Exit) as e:
        _checkpoint_file(tmp_path / "empty")
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "folder without checkpoints" in err[0] and str(tmp_path / "empty") in err[0]
