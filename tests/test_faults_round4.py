"""Bad input and faults, round 4 (issue 40): every byte a trainer reads is checked. The concept
encodings' .npy arrays go through the manifest's sha256 like every other artifact file; checkpoints
carry a sha256 beside them (written after them), are refused in one line saying what the file is,
and `train run --resume previous` goes back to the checkpoint before; metrics.jsonl after a kill -9
and a rerun equals an uninterrupted run's."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import ArtifactWriter, CorruptArtifact
from pipeline.io.checkpoint import (
    CheckpointError,
    load_checkpoint,
    previous_path,
    recorded_sha256,
    save_checkpoint_file,
    sum_path,
)

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def flip(path: Path, at: int | None = None) -> None:
    """Invert one byte of ``path`` (the middle one by default), keeping its size and mtime: what a
    stat-based cache cannot see is the case the first use (and `pipeline verify`) must catch."""
    st = path.stat()
    b = bytearray(path.read_bytes())
    b[len(b) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(b))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- concept encodings: the .npy arrays are checked like every other artifact file -------------------


def _concept_tokens(tmp_path: Path) -> Path:
    from pipeline.stages.encode_concepts import ConceptTokenWorker, write_membership
    from tests.test_c3_concept_tokens import _vocab_artifact

    vocab_paths = _vocab_artifact(tmp_path, ["red circle", "a small blue square", "dog", "man riding a horse"])
    aw = ArtifactWriter(tmp_path, "concept_tokens", "encode-concepts", {"max_tokens": 16, "pooled_only": False})
    ConceptTokenWorker("tiny-random", "cpu", 1, 2, 16, False, False)(
        {"vocab_paths": vocab_paths, "range": [0, 3], "min_df": 3, "artifact_dir": str(aw.dir),
         "stage": "encode-concepts", "unit": "00000", "fingerprint": "x"})
    m = aw.unit_writer("membership", "fp")
    write_membership(m, [3, 3, 6], [7, 8, 8])
    m.commit()
    aw.finalize(["00000", "membership"], extra={"pooled_only": False})
    return tmp_path / "concept_tokens"


@pytest.mark.parametrize("rel", ["tokens/tokens-00000.npy", "pooled/pooled-00000.npy", "index/index-00000.parquet"])
def test_a_flipped_byte_in_the_concept_encodings_is_refused_naming_the_file(tmp_path, rel):
    from pipeline.loaders.concept_tokens import ConceptTokens

    ct = _concept_tokens(tmp_path)
    assert len(ConceptTokens(ct)) == 3  # intact: reads (and the cache now vouches for every file)
    flip(ct / rel)  # same size, same mtime: only the sha256 tells
    (ct / "_cache.json").unlink()  # a fresh reader: the cache must not hide it either way
    with pytest.raises(CorruptArtifact) as e:
        ConceptTokens(ct)
    msg = str(e.value)
    assert msg.startswith(str(ct / rel)) and "\n" not in msg
    assert "sha256 differs" in msg or "corrupt or unreadable Parquet file" in msg  # (a footer byte: unreadable)
    assert f"pipeline verify --fix {ct}" in msg


def test_a_resized_encoding_is_refused_even_with_the_cache_vouching_for_the_old_file(tmp_path):
    from pipeline.loaders.concept_tokens import ConceptTokens

    ct = _concept_tokens(tmp_path)
    ConceptTokens(ct)
    p = ct / "pooled" / "pooled-00000.npy"
    p.write_bytes(b"\xff" * p.stat().st_size)  # 0xFF over the array: once trained to loss=nan silently
    with pytest.raises(CorruptArtifact, match=r"pooled-00000\.npy: sha256 differs"):
        ConceptTokens(ct)


# --- checkpoints: a sha256 beside each, checked on every load ------------------------------------------


def _ck(tmp_path: Path, name: str = "last.pt", w: float = 0.0343) -> Path:
    path = tmp_path / "checkpoints" / name
    save_checkpoint_file(path, {"model": {"weight": torch.full((64, 64), w)}, "step": 3, "config": {"seed": 0}})
    return path


def test_checkpoint_sum_is_written_beside_it_after_it_in_sha256sum_format(tmp_path):
    import hashlib

    path = _ck(tmp_path)
    line = sum_path(path).read_text()
    assert line == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  last.pt\n"
    assert sum_path(path).stat().st_mtime_ns >= path.stat().st_mtime_ns  # after the file it covers
    r = subprocess.run(["sha256sum", "-c", sum_path(path).name], cwd=path.parent, capture_output=True, text=True)
    assert r.returncode == 0 and "last.pt: OK" in r.stdout
    assert load_checkpoint(path)["step"] == 3


def test_checkpoint_sum_is_never_stale_while_the_new_file_is_renamed(tmp_path, monkeypatch):
    """A kill between the checkpoint's rename and its checksum leaves no checksum (checked by its zip
    CRCs then), never the previous file's checksum beside the new bytes."""
    import pipeline.io.atomic as A

    path = _ck(tmp_path, w=1.0)
    seen = []
    real = A.os.replace

    def spy(src, dst):
        if Path(dst) == path:
            seen.append(sum_path(path).exists())
        return real(src, dst)

    monkeypatch.setattr(A.os, "replace", spy)
    save_checkpoint_file(path, {"model": {"weight": torch.zeros(3)}, "step": 4})
    assert seen == [False]
    assert load_checkpoint(path)["step"] == 4


def test_a_flipped_byte_in_a_checkpoint_is_refused_in_one_line(tmp_path):
    path = _ck(tmp_path)
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    raw = path.read_bytes()
    n, m = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])  # the local header's lengths
    at = info.header_offset + 30 + n + m + 8
    before = load_checkpoint(path)["model"]["weight"].clone()
    # a byte of a weight (the stored bytes of member data/0): torch reads the changed weight back silently
    flip(path, at)
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["weight"], before)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {path}: its sha256 ")
    assert "recorded in last.pt.sha256" in msg and "CRC32 of its member" in msg and "data/0" in msg
    sum_path(path).unlink()  # without its checksum file: the zip CRCs still catch it
    with pytest.raises(CheckpointError, match=r"CRC32 of its member .*data/0 fails.*last\.pt\.sha256 is missing"):
        load_checkpoint(path)


@pytest.mark.parametrize("content, what", [
    (lambda b: b[:300], "a truncated torch file (300 bytes"),
    (lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"a" * 64 + b"\nsize 123\n",
     "a Git LFS pointer"),
    (lambda b: bytes(range(256)) * 4, "not a torch file (1024 bytes"),
    (lambda b: b"", "an empty file (0 bytes)"),
])
def test_a_checkpoint_that_is_not_one_says_what_it_is(tmp_path, content, what):
    path = _ck(tmp_path)
    path.write_bytes(content(path.read_bytes()))
    for keep_sum in (True, False):
        if not keep_sum:
            sum_path(path).unlink()
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint {path}: ") and what in msg, msg
        assert "pickled" not in msg


def test_pickled_code_with_a_valid_sum_is_still_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    import hashlib

    sum_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  evil.pt\n")
    with pytest.raises(CheckpointError, match="refused: it holds pickled Python objects"):
        load_checkpoint(path)
    assert pickle  # (the module the refusal comes from)


def test_keep_previous_keeps_the_replaced_checkpoint_with_its_sum(tmp_path):
    path = _ck(tmp_path, w=1.0)
    first = recorded_sha256(path)
    save_checkpoint_file(path, {"model": {"weight": torch.zeros(2)}, "step": 9}, keep_previous=True)
    prev = previous_path(path)
    assert prev.name == "previous.pt" and recorded_sha256(prev) == first
    assert load_checkpoint(prev)["step"] == 3 and load_checkpoint(path)["step"] == 9


# --- a run killed (kill -9) and rerun writes the metrics.jsonl of an uninterrupted run ----------------

from train.config import TrainerConfig  # noqa: E402
from train.job import Job  # noqa: E402

TIMING = ("steps_per_s", "samples_per_s")


class _Steps(Job):
    """A linear regression on seeded random batches (a pure function of (seed, epoch, batch)): 5
    batches per epoch, 12 steps, a line every 4 steps, an evaluation every 5, a checkpoint every 6
    (mid-window: the window of steps 5-8 spans it). ``kill_at``: the process kills itself (SIGKILL)
    as that step begins."""

    NAME = "steps"

    def __init__(self, run_dir: Path, kill_at: int = 0, **cfg):
        base = dict(max_steps=12, batch_size=4, lr=0.05, warmup_frac=0.0, amp="off", log_every=4, ckpt_every=6,
                    eval_every=5, threads=1, benchmarks_at_end=False)
        super().__init__(TrainerConfig(**{**base, **cfg}), None, run_dir, torch.device("cpu"))
        self.kill_at, self.calls = kill_at, 0

    def build_model(self):
        return torch.nn.Linear(3, 1)

    def batches_per_epoch(self):
        return 5

    def batches(self, epoch, start):
        g = torch.Generator().manual_seed(1000 * self.cfg.seed + epoch)
        xs = [torch.randn(4, 3, generator=g) for _ in range(5)]
        return [{"x": xs[i], "y": xs[i] @ torch.tensor([[1.0], [-2.0], [0.5]])} for i in range(start, 5)]

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == self.kill_at:
            os.kill(os.getpid(), 9)
        return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {"x_mean": float(batch["x"].mean())}

    def evaluate(self, model, out_dir):
        return {"w_sum": float(model.weight.sum())}


_RUN = """
import sys
from pathlib import Path
import train.loop
from tests.test_faults_round4 import _Steps
train.loop.plot_metrics = lambda *a, **k: None
train.loop.train(_Steps(Path(sys.argv[1]), kill_at=int(sys.argv[2])), progress=False)
"""


def _run_steps(run: Path, kill_at: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, str(run), str(kill_at)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def clean_metrics(tmp_path_factory) -> list[dict]:
    run = tmp_path_factory.mktemp("clean") / "run"
    r = _run_steps(run)
    assert r.returncode == 0, r.stderr[-2000:]
    return _metrics(run)


KILLS = pytest.mark.parametrize("kill_at, resumed", [(5, None), (11, 6)], ids=["before-first-checkpoint", "after-it"])


def _check_rerun(run: Path, stderr: str, clean: list[dict], kill_at: int, resumed: int | None) -> None:
    if resumed is None:
        assert "dropped 1 line(s) of a run that stopped before its first checkpoint; starting at step 0" in stderr
    else:
        assert f"resumed from {run / 'checkpoints' / 'last.pt'} at step {resumed}" in stderr
        assert "dropped 2 line(s): 2 past the checkpoint's step 6 (steps 8, 10)" in stderr  # train 8, eval 10
    got = _metrics(run)
    assert [(x["kind"], x["step"]) for x in got] == [(x["kind"], x["step"]) for x in clean]  # each step once
    assert got == clean  # the same values: step 8's loss averages steps 5-8 across the resume


@pytest.mark.slow
@KILLS
def test_metrics_after_a_kill9_and_a_rerun_equal_an_uninterrupted_runs(tmp_path, clean_metrics, kill_at, resumed):
    """The real thing: the training process SIGKILLs itself as step ``kill_at`` begins (~5 s a process)."""
    run = tmp_path / "run"
    r = _run_steps(run, kill_at)
    assert r.returncode == -9
    assert [x["step"] for x in _metrics(run) if x["kind"] == "train"] == [4, 8][: (kill_at - 1) // 4]
    r = _run_steps(run)
    assert r.returncode == 0, r.stderr[-2000:]
    _check_rerun(run, r.stderr, clean_metrics, kill_at, resumed)


class _Died(BaseException):
    """What a kill leaves, in this process: nothing after the raise runs (the lock is released, as
    the kernel releases a dead process's)."""


@KILLS
def test_metrics_after_a_death_and_a_rerun_equal_an_uninterrupted_runs(tmp_path, monkeypatch, capsys, kill_at, resumed):
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    train.loop.train(_Steps(tmp_path / "clean"), progress=False)
    clean = _metrics(tmp_path / "clean")
    run = tmp_path / "run"
    job = _Steps(run, kill_at=kill_at)
    monkeypatch.setattr(os, "kill", lambda pid, sig: (_ for _ in ()).throw(_Died()))
    with pytest.raises(_Died):
        train.loop.train(job, progress=False)
    monkeypatch.undo()
    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    capsys.readouterr()
    train.loop.train(_Steps(run), progress=False)
    _check_rerun(run, capsys.readouterr().err, clean, kill_at, resumed)


# --- train run --resume previous -----------------------------------------------------------------------


def _cli(monkeypatch, job: Job, *args: str):
    from typer.testing import CliRunner

    import train.cli

    monkeypatch.setattr(train.cli, "build_job", lambda *a, **k: (None, job.cfg, None, job))
    return CliRunner().invoke(train.cli.app, ["run", "steps", "--manifest", "unused.yaml", "--no-progress", *args])


def test_a_corrupt_last_checkpoint_is_refused_and_resume_previous_goes_back_one(tmp_path, monkeypatch):
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    run = tmp_path / "run"
    train.loop.train(_Steps(run, ckpt_every=3), progress=False, stop_after=7)  # checkpoints at 3, 6, and 7 (stop)
    last, prev = run / "checkpoints" / "last.pt", run / "checkpoints" / "previous.pt"
    assert load_checkpoint(last)["step"] == 7 and load_checkpoint(prev)["step"] == 6
    flip(last, last.stat().st_size - 2000)  # a byte inside the weights / optimizer state
    r = _cli(monkeypatch, _Steps(run, ckpt_every=3))
    assert r.exit_code == 2, r.output
    err = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and f"checkpoint {last}: its sha256" in err[0] and "--resume previous" in err[0], r.output
    r = _cli(monkeypatch, _Steps(run, ckpt_every=3), "--resume", "previous")
    assert r.exit_code == 0, r.output
    assert f"resuming from {prev} (step 6); {last} set aside as last.pt.rejected (its sha256" in r.output
    assert "resumed from" in r.output and "at step 6" in r.output
    assert (run / "checkpoints" / "last.pt.rejected").is_file() and load_checkpoint(last)["step"] == 12
    steps = [x["step"] for x in _metrics(run) if x["kind"] == "train"]
    assert steps == [4, 8, 12]
    # previous.pt refused as well: one line, nothing changed
    flip(prev)
    r = _cli(monkeypatch, _Steps(run, ckpt_every=3), "--resume", "previous")
    assert r.exit_code == 2 and f"checkpoint {prev}: its sha256" in r.output
    r = _cli(monkeypatch, _Steps(run), "--resume", "previous", "--fresh")
    assert r.exit_code == 2 and "not with --fresh" in r.output


# --- an evaluation that cannot score a corrupt input fails the run; tables across runs skip a corrupt one ----


class _CorruptEval(_Steps):
    """Its final evaluation reads an input that is not the bytes written (what a truncated samples
    Parquet raises from the harness)."""

    broken = True

    def evaluate(self, model, out_dir):
        if self.broken and out_dir.name == "final":
            raise CorruptArtifact("runs/x/samples/samples/samples-00000.parquet: 100 bytes, recorded 2000 since "
                                  "`ingest` wrote it; artifact samples is not read until it is redone: run "
                                  "`pipeline verify --fix runs/x/samples`, then `pipeline run ingest`")
        return super().evaluate(model, out_dir)


def test_a_final_evaluation_on_a_corrupt_input_exits_2_keeping_the_trained_model(tmp_path, monkeypatch):
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    run = tmp_path / "run"
    r = _cli(monkeypatch, _CorruptEval(run))
    assert r.exit_code == 2, r.output
    err = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "samples-00000.parquet: 100 bytes, recorded 2000" in err[0]
    assert "pipeline verify --fix" in err[0] and f"the trained model is kept in {run / 'checkpoints' / 'final.pt'}" in err[0]
    assert "Traceback" not in r.output
    assert load_checkpoint(run / "checkpoints" / "final.pt")["step"] == 12
    assert not (run / "eval" / "final" / "metrics.json").exists()  # not a finished run: a sweep reruns it
    fixed = _CorruptEval(run)
    fixed.broken = False
    r = _cli(monkeypatch, fixed)  # the input redone: the same command evaluates the kept model
    assert r.exit_code == 0, r.output
    assert "already trained 12 of 12 steps" in r.output and (run / "eval" / "final" / "metrics.json").is_file()


def _results_run(root: Path, name: str, value: float, seed: int = 0) -> Path:
    from train.eval.harness import write_results

    run = root / name
    (run / "eval" / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"variant": "conceptot", "epochs": 3.0, "max_steps": 5, "lr": 1e-5,
                                                 "device": "cpu", "seed": seed}))
    write_results([{"job": "concept-ot", "variant": "conceptot", "checkpoint": "c", "step": 5, "benchmark": "sugarcrepe",
                    "subset": "all", "metric": "accuracy", "value": value, "n": 300, "chance": 50.0, "skipped": 0,
                    "skip_reasons": "{}", "unit": "%", "note": "", "ci_low": value - 3, "ci_high": value + 3}],
                  run / "eval" / "final")
    (run / "eval" / "final" / "metrics.json").write_text(json.dumps({"loss": 0.5}))
    return run


CORRUPT_FILES = {
    "results.parquet": ("eval/final/results.parquet", lambda p: p.write_bytes(p.read_bytes()[:40]), "Parquet"),
    "metrics.json": ("eval/final/metrics.json", lambda p: p.write_text('{"loss": 0.'), "JSON"),
    "config.json": ("config.json", lambda p: p.write_bytes(b'{"seed": "\xff\xfe"}'), "JSON"),
}


@pytest.mark.parametrize("kind", list(CORRUPT_FILES))
def test_tables_across_runs_skip_a_run_folder_with_a_corrupt_file_naming_it(tmp_path, kind):
    from typer.testing import CliRunner

    import train.cli

    good = [_results_run(tmp_path, f"s{s}", 60.0 + s, s) for s in range(2)]
    bad = _results_run(tmp_path, "bad", 99.0, 2)
    rel, corrupt, what = CORRUPT_FILES[kind]
    corrupt(bad / rel)
    for extra in ([], ["--over-seeds"], ["--paper", "concept-ot"]):
        if kind == "config.json" and not extra:
            continue  # plain compare reads config.json only for the seed in a column's label
        if kind == "metrics.json" and not extra:
            continue  # plain compare reads results.parquet only
        r = CliRunner().invoke(train.cli.app, ["compare", *map(str, good + [bad]), *extra])
        assert r.exit_code == 0, (extra, r.output)
        note = next(x for x in r.output.splitlines() if x.startswith("skipped 1 run folder(s) with a corrupt file"))
        assert f"{bad / rel}: corrupt or unreadable {what}" in note, (extra, r.output)
        assert "Traceback" not in r.output and "99.0" not in r.output.replace(str(bad), "")
        assert "60" in r.output  # the good runs are still counted
        r = CliRunner().invoke(train.cli.app, ["compare", str(bad), *extra])  # nothing left: one line, exit 2
        if extra[:1] == ["--paper"]:  # the paper's table with no run counted, as for runs matching no row
            assert r.exit_code == 0 and "skipped 1 run folder(s)" in r.output and str(bad / rel) in r.output
        else:
            assert r.exit_code == 2 and str(bad / rel) in r.output, (extra, r.output)


@pytest.mark.parametrize("kind", list(CORRUPT_FILES))
def test_the_reports_training_section_skips_a_run_folder_with_a_corrupt_file(tmp_path, kind, caplog):
    from types import SimpleNamespace

    from pipeline.report.training import training_section

    import logging

    caplog.set_level(logging.WARNING, logger="pipeline")  # an earlier test's in-process Ray worker may have quieted it
    root = tmp_path / "out" / "train" / "concept-ot"
    good, bad = _results_run(root, "good", 61.0), _results_run(root, "bad", 99.0)
    rel, corrupt, what = CORRUPT_FILES[kind]
    corrupt(bad / rel)
    if kind == "metrics.json":  # the report reads it for an evaluation without a harness table
        (bad / "eval" / "final" / "results.parquet").unlink()
    img = tmp_path / "out" / "report" / "img"
    out = SimpleNamespace(img=img, rel=lambda p: str(p))
    sec = training_section(tmp_path / "out", out, "m.yaml")
    assert [r["dir"] for r in sec["runs"]] == [str(good)]
    assert len(sec["skipped"]) == 1 and sec["skipped"][0].startswith(f"{bad / rel}: corrupt or unreadable {what}")
    assert any(str(bad / rel) in m for m in caplog.messages)


# --- pipeline status: every shard present at its recorded size, by default --------------------------------


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_status_without_verify_sees_a_deleted_or_truncated_shard(tmp_path, damage):
    from pipeline.io.artifacts import Artifact
    from pipeline.status import artifact_state
    from tests.test_status import _chain

    _chain(tmp_path)
    rel = Artifact(tmp_path / "clip_tokens").manifest["shards"][0]["path"]
    f = tmp_path / "clip_tokens" / rel
    if damage == "deleted":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:100])
    st = artifact_state(tmp_path, "clip_tokens")  # a stat per file, no hashing
    assert st.state == "corrupt", st
    assert st.detail.startswith(f"{rel}: {'missing' if damage == 'deleted' else '100 bytes, recorded'}")
    assert f"pipeline verify --fix {tmp_path / 'clip_tokens'}" in st.detail
    ix = artifact_state(tmp_path, "index")
    assert ix.state == "stale" and "its input clip_tokens is corrupt" in ix.detail
    assert artifact_state(tmp_path, "samples").state == "complete"


# --- the scene-oracle guard reads the kind the samples artifact was ingested from --------------------------


def _samples(out: Path, kind: str) -> None:
    import pyarrow as pa

    w = ArtifactWriter(out, "samples", "ingest", {"kind": kind}, force=True)
    u = w.unit_writer("00000", "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([1], pa.int64())}))
    u.commit()
    w.finalize(["00000"], extra={"dataset_kind": kind})


def test_the_oracle_guard_reads_the_samples_artifacts_own_dataset_kind(tmp_path):
    from pipeline.config import load_manifest
    from pipeline.errors import StageError
    from pipeline.models.scene_oracle import require_generated

    m = load_manifest(None, [f"output={tmp_path}", "dataset.kind=synthetic"])
    require_generated(m, "clip")  # nothing ingested yet: the manifest's kind decides
    _samples(tmp_path, "coco")  # a COCO-ingested samples artifact, the manifest overridden to synthetic
    with pytest.raises(StageError) as e:
        require_generated(m, "clip")
    msg = str(e.value)
    assert "\n" not in msg and f"the samples artifact ({tmp_path / 'samples' / '_manifest.json'}) was ingested " \
        "from dataset.kind 'coco'" in msg and msg.startswith("models.clip: scene-oracle")
    _samples(tmp_path, "synthetic")
    require_generated(m, "clip")


# --- every message about a file names the file -------------------------------------------------------------


@pytest.mark.parametrize("name", ["map.csv", "map.json"])
def test_an_image_map_that_is_not_utf8_is_one_line_naming_it(tmp_path, name):
    from train.eval.images import read_image_map

    p = tmp_path / name
    p.write_bytes(b"key,value\ncaf\xe9.jpg,1\n")
    with pytest.raises(ValueError) as e:
        read_image_map(p)
    assert str(e.value) == f"image_map {p}: not UTF-8 text (byte 0xe9 at offset 13); save it as UTF-8"


def test_a_blank_output_is_refused_naming_the_key(tmp_path):
    from pipeline.config import ManifestError, load_manifest

    for blank in ("output=  ", "output=\t"):
        with pytest.raises(ManifestError) as e:
            load_manifest(REPO / "manifests" / "demo.yaml", [blank])
        msg = str(e.value)
        assert "key 'output'" in msg and "must name the run's output folder" in msg and "None" not in msg
    m = load_manifest(None, ["stages.ingest.shard_size=64", "train.c3.max_steps=null"])  # YAML scalars as before
    assert m.stages.ingest.shard_size == 64 and m.train.c3.max_steps is None


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (tests.conftest.mounted_tmpfs)."""
    from tests.conftest import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "full", "64k") as d:
        yield d


def test_a_full_disk_names_the_file_it_stopped(full_disk):
    import errno

    import pyarrow as pa

    from pipeline.io.atomic import write_bytes_atomic, write_parquet_atomic

    big = pa.table({"x": np.random.default_rng(0).random(100_000)})
    target = full_disk / "samples" / "samples" / "samples-00000.parquet"
    with pytest.raises(OSError) as e:  # pyarrow's own error names no file
        write_parquet_atomic(big, target)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert str(e.value).startswith("[Errno 28] No space left on device") and str(target) in str(e.value)
    with pytest.raises(OSError) as e:
        write_bytes_atomic(full_disk / "x.bin", b"x" * 200_000)
    assert e.value.filename == str(full_disk / "x.bin") and "No space left on device" in str(e.value)
    assert list(full_disk.rglob("*.tmp")) == []  # no temporary file left


# --- docs/errors.md names a test beside each case, and the tests exist ---------------------------------------


def test_every_case_in_docs_errors_names_tests_that_exist():
    import re

    text = (REPO / "docs" / "errors.md").read_text()
    bullets = re.split(r"\n- ", text.split("\n- ", 1)[1])
    assert len(bullets) >= 15
    for b in bullets:
        assert "Tests: `tests/" in b, b[:120]
    refs = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", text)
    assert len(refs) >= 60
    for path, name in refs:
        src = (REPO / path).read_text()
        assert re.search(rf"^def {name}\(", src, re.M), f"{path}::{name} is not a test"


def test_train_eval_refuses_a_changed_checkpoint_naming_the_one_before(tmp_path, monkeypatch, capsys):
    import typer

    import train.loop
    from train.cli import _config_of_checkpoint

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)
    run = tmp_path / "run"
    job = _Steps(run, ckpt_every=3)
    train.loop.train(job, progress=False, stop_after=7)
    last, prev = run / "checkpoints" / "last.pt", run / "checkpoints" / "previous.pt"
    flip(last, last.stat().st_size - 2000)
    capsys.readouterr()
    with pytest.raises(typer.Exit) as e:
        _config_of_checkpoint("steps", job.cfg, last, [])
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {last}: its sha256")
    assert err[0].endswith(f"; the checkpoint before it: -c {prev}")
    cfg, run_dir = _config_of_checkpoint("steps", job.cfg, prev, [])  # the way out works
    assert run_dir == run and load_checkpoint(prev)["step"] == 6
