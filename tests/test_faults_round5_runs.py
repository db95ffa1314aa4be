"""Bad input and faults, round 5 (issue 49, part B): run folders and sweeps.

A ``run_dir`` naming a folder of other files is refused and nothing in it is deleted; cleanup in a
run folder removes only the temporary names the project writes; a rerun of a finished run changes no
checkpoint; a FIFO as a checksum or run file is refused, never opened; a forged Tune state pickle
with a recomputed sha256 line is refused before it is unpickled. Each error is one line."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.io.checkpoint import CheckpointError
from pipeline.io.run_files import CorruptRunFile
from tests.test_faults_train import _cli_run, _errors, _Toy
from train.loop import NotARunFolder, train
from train.run_folder import RUN_MARKER

pytestmark = pytest.mark.usefixtures("one_thread")

REPO_TINY = Path(__file__).resolve().parents[1] / "manifests" / "tiny.yaml"


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)


def _foreign(folder: Path) -> dict[str, bytes]:
    """A folder of someone's files, temporary-looking names included (one in the project's own form)."""
    files = {"notes.txt": b"mine", ".draft.tmp": b"draft", "sub/.cache.1a2b3c4d.tmp": b"x" * 10,
             "sub/deeper/.build.tmp": b"y"}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    (folder / ".scratch.tmp").mkdir()
    (folder / ".scratch.tmp" / "keep").write_bytes(b"k")
    return {**files, ".scratch.tmp/keep": b"k"}


def _intact(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (folder / rel).read_bytes() == data, rel


def test_a_run_dir_of_other_files_is_refused_and_nothing_in_it_is_deleted(tmp_path, monkeypatch):
    folder = tmp_path / "home"
    folder.mkdir()
    files = _foreign(folder)
    before = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    with pytest.raises(NotARunFolder) as e:
        train(_Toy(folder), progress=False)
    assert str(e.value) == (f"run folder {folder} is not empty (.draft.tmp, .scratch.tmp, notes.txt (+1 more)) and was "
                            f"not made by `train run` (no {RUN_MARKER}): nothing is written or deleted in it; set "
                            "train.toy.run_dir to a new or empty folder")
    _intact(folder, files)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == before  # no _lock, no config.json
    r = _cli_run(monkeypatch, _Toy(folder))  # `train run` says it in one line, exit 2
    assert r.exit_code == 2 and _errors(r) == [f"error: {e.value}"], r.output
    _intact(folder, files)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == before


def test_a_new_or_empty_run_dir_gets_the_marker_and_cleanup_removes_only_the_projects_names(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()  # empty: taken
    train(_Toy(run), progress=False, stop_after=2)
    assert (run / RUN_MARKER).is_file()
    ours = [run / "checkpoints" / ".last.pt.0badc0de.tmp", run / "eval" / ".metrics.json.a1b2c3d4.tmp"]
    for p in ours:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half")
    theirs = {".notes.tmp": b"n", "checkpoints/.my-backup.tmp": b"b"}  # not a name the project writes
    for rel, data in theirs.items():
        (run / rel).write_bytes(data)
    train(_Toy(run), progress=False)
    assert "removed 2 temporary file(s) left by an interrupted run" in capsys.readouterr().err
    assert not any(p.exists() for p in ours)
    _intact(run, theirs)


def test_a_run_folder_from_before_the_marker_is_resumed_and_marked(tmp_path):
    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)
    (run / RUN_MARKER).unlink()  # a folder an older version trained in: config.json and checkpoints/
    train(_Toy(run), progress=False)
    assert (run / RUN_MARKER).is_file()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "train"] == list(range(1, 9))


def _ckpt_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "checkpoints").iterdir())}


def test_a_rerun_of_a_finished_run_changes_no_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    train(_Toy(run, ckpt_every=3), progress=False)  # checkpoints at 3, 6, then last/final at 8
    before = _ckpt_bytes(run)
    assert {"last.pt", "last.pt.sha256", "previous.pt", "previous.pt.sha256", "final.pt", "final.pt.sha256"} <= set(before)
    train(_Toy(run, ckpt_every=3), progress=False)
    assert "already trained 8 of 8 steps" in capsys.readouterr().err
    assert _ckpt_bytes(run) == before  # previous.pt is still the step-6 checkpoint, nothing rewritten
    (run / "checkpoints" / "last.pt.sha256").unlink()  # a missing checksum file: nothing rotated, nothing rewritten
    del before["last.pt.sha256"]
    train(_Toy(run, ckpt_every=3), progress=False)
    assert _ckpt_bytes(run) == before


def test_a_rerun_writes_a_missing_or_damaged_final_checkpoint_from_last_and_nothing_else(tmp_path):
    from train.loop import load_checkpoint

    run = tmp_path / "run"
    train(_Toy(run, ckpt_every=3), progress=False)
    final = run / "checkpoints" / "final.pt"
    data = bytearray(final.read_bytes())
    data[len(data) // 2] ^= 0xFF
    final.write_bytes(bytes(data))
    others = {k: v for k, v in _ckpt_bytes(run).items() if not k.startswith("final")}
    train(_Toy(run, ckpt_every=3), progress=False)
    assert load_checkpoint(final)["step"] == 8
    assert {k: v for k, v in _ckpt_bytes(run).items() if not k.startswith("final")} == others


@pytest.mark.parametrize("rel", ["checkpoints/last.pt.sha256", "config.json", "metrics.jsonl"])
def test_a_fifo_as_a_checksum_or_run_file_is_refused_in_one_line_never_opened(tmp_path, monkeypatch, rel):
    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)
    (run / rel).unlink()
    os.mkfifo(run / rel)  # opening it would block forever
    with pytest.raises(CorruptRunFile) as e:
        train(_Toy(run), progress=False)
    assert str(e.value) == (f"{run / rel}: is a FIFO (named pipe), not a regular file: it is not read; remove it "
                            "(the run writes it again)")
    r = _cli_run(monkeypatch, _Toy(run))
    assert r.exit_code == 2 and _errors(r) == [f"error: {e.value}"], r.output


def test_a_fifo_beside_a_checkpoint_is_refused_by_the_loader(tmp_path):
    from pipeline.io.checkpoint import load_checkpoint, sum_path

    run = tmp_path / "run"
    train(_Toy(run), progress=False, stop_after=3)
    last = run / "checkpoints" / "last.pt"
    sum_path(last).unlink()
    os.mkfifo(sum_path(last))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(last)
    assert str(e.value) == (f"checkpoint {last}: its checksum file {sum_path(last)} is a FIFO (named pipe), not a "
                            "regular file: it is not read; remove it (the checkpoint is then checked by its zip CRCs)")


# --- Tune state: signed with a key outside the output ----------------------------------------------------


class _Planted:
    """Unpickling this creates the file ``path``: the proof that a pickle was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _sealed(tmp_path: Path) -> Path:
    from train.sweep_state import seal

    exp = tmp_path / "out" / "sweeps" / "sweep-x"
    (exp / "trial_0").mkdir(parents=True)
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    (exp / "trial_0" / "params.pkl").write_bytes(pickle.dumps([1, 2]))
    seal(exp)
    return exp


def test_a_forged_tuner_pkl_with_a_recomputed_sha256_line_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    import hashlib

    from train.sweep_state import FIX, SUMS, StateError, check, key_path

    key = tmp_path / "config" / "vlpipe" / "state.key"
    monkeypatch.setenv("VLPIPE_STATE_KEY", str(key))
    exp = _sealed(tmp_path)
    assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600  # made on first use, for this user only
    check(exp)  # the sweep's own state: read
    marker = tmp_path / "unpickled"
    forged = pickle.dumps(_Planted(str(marker)))
    (exp / "tuner.pkl").write_bytes(forged)
    sums = exp / SUMS
    lines = sums.read_text().splitlines()
    lines = [f"{hashlib.sha256(forged).hexdigest()}  tuner.pkl" if x.endswith("  tuner.pkl") else x for x in lines]
    for signature in (lines[-1], None):  # the old signature kept, or dropped
        sums.write_text("\n".join(lines[:-1] + ([signature] if signature else [])) + "\n")
        with pytest.raises(StateError) as e:
            check(exp)
        assert str(e.value) == (f"sweep state {exp}: {SUMS} is not signed with this user's key ({key_path()}): another "
                                f"user or program wrote or changed it, so nothing there is unpickled; {FIX}")
        assert not marker.exists()


def test_a_checksum_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """An I/O or permission error on the sweep's checksum file is refused in one line, never a traceback
    (as root a chmod 000 file stays readable, so the read itself is made to fail)."""
    from train.sweep_state import FIX, SUMS, StateError, check

    monkeypatch.setenv("VLPIPE_STATE_KEY", str(tmp_path / "state.key"))
    exp = _sealed(tmp_path)
    real = Path.read_bytes

    def failing(self):
        if self.name == SUMS:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", failing)
    with pytest.raises(StateError) as e:
        check(exp)
    assert str(e.value) == f"sweep state {exp}: {SUMS} cannot be read (Permission denied): it is not read; {FIX}"


def test_train_sweep_checks_the_signature_before_tune_reads_the_state(tmp_path, monkeypatch):
    """`sweep()` up to the restore, with Tune's ``Tuner.can_restore`` replaced by what restoring does
    to tuner.pkl (pickle.loads): the forged state is refused first, so the pickle is never loaded."""
    import hashlib

    from ray import tune

    import train.sweep
    from train.sweep_state import SUMS, StateError, seal

    monkeypatch.setenv("VLPIPE_STATE_KEY", str(tmp_path / "key" / "state.key"))
    monkeypatch.setattr(train.sweep, "stored_differences", lambda *a: {})
    grid = tmp_path / "grid.yaml"
    grid.write_text("train.toy.lr: [0.1]\n")
    args = ("toy", tmp_path / "m.yaml", [], grid, 1, [str(tmp_path / "run")], tmp_path / "sweeps", None)
    seen = []

    class _Stop(Exception):
        pass

    def where(path):  # the first call: learn the experiment's folder (its name is a hash of the trials)
        seen.append(Path(path))
        raise _Stop

    monkeypatch.setattr(tune.Tuner, "can_restore", staticmethod(where))
    with pytest.raises(_Stop):
        train.sweep.sweep(*args)
    exp = seen[0]
    exp.mkdir(parents=True)
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    seal(exp)
    marker = tmp_path / "unpickled"
    forged = pickle.dumps(_Planted(str(marker)))
    (exp / "tuner.pkl").write_bytes(forged)
    sums = exp / SUMS
    sums.write_text("".join(f"{hashlib.sha256(forged).hexdigest()}  tuner.pkl\n" if x.endswith("  tuner.pkl") else
                            x + "\n" for x in sums.read_text().splitlines()))
    monkeypatch.setattr(tune.Tuner, "can_restore", staticmethod(lambda path: bool(pickle.loads(
        (Path(path) / "tuner.pkl").read_bytes()))))
    with pytest.raises(StateError, match="is not signed with this user's key"):
        train.sweep.sweep(*args)
    assert not marker.exists()


# --- relation-head on Ray Train workers --------------------------------------------------------------------


@pytest.mark.slow
def test_relation_head_trains_on_two_ray_train_workers(tmp_path, ray_session):
    """`train run relation-head --workers 2` (a TypeError in the preflight before: the job kept its
    training graphs under Job.train_items, the split's size)."""
    from typer.testing import CliRunner

    import train.cli
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    sets = ["dataset.synthetic.n_images=40", "dataset.synthetic.corrupt_images=0", "stages.ingest.shard_size=40",
            "stages.extract_visual_tokens.shard_size=40"]
    m = make_manifest(tmp_path, sets)
    run_stage("ingest", RunContext(m))
    run_stage("extract-visual-tokens", RunContext(m))
    (tmp_path / "m.yaml").write_text(REPO_TINY.read_text())
    run = tmp_path / "rh2"
    args = ["run", "relation-head", "--manifest", str(tmp_path / "m.yaml"), "--workers", "2", "--no-progress"]
    for s in [f"output={tmp_path / 'run'}", "ray.num_cpus=2", *sets, f"train.relation_head.run_dir={run}",
              "train.relation_head.max_steps=4", "train.relation_head.batch_size=8", "train.relation_head.width=16",
              "train.relation_head.heads=2", "train.relation_head.cls_dim=8", "train.relation_head.recall_k=[5]",
              "train.relation_head.log_every=1", "train.relation_head.threads=1"]:
        args += ["--set", s]
    r = CliRunner().invoke(train.cli.app, args)
    assert r.exit_code == 0, r.output[-3000:]
    assert "TypeError" not in r.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2, 3, 4]
    stored = json.loads((run / "config.json").read_text())
    assert stored["workers"] == 2 and stored["batch_size"] == 8
    assert (run / "relation_head.pt").is_file() and (run / "checkpoints" / "final.pt").is_file()


# --- read-only run and output folders ------------------------------------------------------------------------

@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only for this process: permission bits for a user, a read-only bind mount for
    root (whom permission bits do not stop; skipped where mounting is not permitted)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        try:
            yield folder
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False, capture_output=True)


_DENIED = r"\((?:Read-only file system|Permission denied)(?: at [^)]+)?\)"


def test_train_run_in_a_read_only_run_folder_is_one_line_naming_it(tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_Toy(run), progress=False)
    before = _ckpt_bytes(run)
    with read_only(run):
        r = _cli_run(monkeypatch, _Toy(run))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (err,) = _errors(r)
    assert re.fullmatch(rf"error: {re.escape(str(run))}: cannot write there {_DENIED}: make it writable, or set "
                        r"train\.toy\.run_dir to a writable folder", err), err
    assert _ckpt_bytes(run) == before


def test_train_eval_into_a_read_only_run_folder_is_one_line_naming_it(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from train import cli as train_cli

    run = tmp_path / "run"
    job = _Toy(run)
    train(job, progress=False)
    monkeypatch.setattr(train_cli, "build_job", lambda *a, **k: (None, job.cfg, None, job))
    with read_only(run):
        r = CliRunner().invoke(train_cli.app, ["eval", "toy", "--manifest", "unused.yaml", "--checkpoint", str(run)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (err,) = _errors(r)
    out = run / "eval" / "step000008"
    assert re.fullmatch(rf"error: {re.escape(str(out))}: cannot write there {_DENIED}: make it writable, or pass --out "
                        r"with a writable folder", err), err


def test_pipeline_report_of_a_read_only_output_is_one_line_naming_it(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    out = tmp_path / "out"
    run = out / "train" / "toy" / "default"
    train(_Toy(run), progress=False)
    with read_only(out):
        r = CliRunner().invoke(app, ["report", str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (err,) = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert re.fullmatch(rf"error: {re.escape(str(out / 'report'))}: cannot write there {_DENIED}: make it writable, or "
                        rf"copy {re.escape(str(out))} somewhere writable and report that copy", err), err
