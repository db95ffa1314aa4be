"""Safe encoder exports (train/cli.py, export_placement): only a run of the manifest's own configuration of an
encoder job (or ``--export``) replaces ``<output>/encoders/<name>/``, the folder the stages' ``models.*`` load; a
smoke test (``--max-steps``, any ``--set`` of a training option) exports beside its run folder and says where."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from typer.testing import CliRunner

from tests.test_encoders import TINY_CLIP, _train, with_options


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _train_cli(*args: str):
    from train.cli import app

    kw = {"mix_stderr": False} if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else {}
    return CliRunner(**kw).invoke(app, ["run", "clip-encoder", "--no-progress", *args])


def test_a_smoke_run_leaves_the_default_export_and_says_where_it_exported(testbed_copy, tmp_path):
    out, mp = testbed_copy
    job, _ = _train(mp, "clip-encoder", TINY_CLIP, tmp_path / "default-run")  # the manifest's configuration
    default = out / "encoders" / "clip"
    assert job.export_path == default and job.export_note is None
    before = _digest(default)
    assert json.loads((default / "training.json").read_text())["run_dir"] == str(tmp_path / "default-run")

    man = with_options(mp, "clip-encoder", TINY_CLIP)
    r = _train_cli("-m", str(man), "--max-steps", "2")
    assert r.exit_code == 0, r.output
    run = next(p for p in (out / "train" / "clip-encoder").iterdir() if p.is_dir())
    moved = run / "export"
    note = (f"export: {moved}, not {default} (the folder models.* load): this run's training options differ from the "
            f"manifest's (max_steps=2 (manifest 3)); pass --export to replace {default} with it")
    assert r.stderr.count(note) == 2  # at the start and again at the end
    assert f"clip-encoder: exported {moved} " in r.stdout + r.stderr
    assert _digest(default) == before  # the stages' encoder: not one byte changed
    assert json.loads((moved / "training.json").read_text())["config"]["max_steps"] == 2

    # any --set of a training option is such a run too; an evaluation-only option is not
    from train.cli import build_job

    j = build_job("clip-encoder", man, ["train.clip_encoder.lr=0.01"])[3]
    assert j.export_path != default and "lr=0.01 (manifest 0.0005)" in j.export_note
    j = build_job("clip-encoder", man, ["train.clip_encoder.threads=2", f"output={out}"])[3]
    assert j.export_path == default and j.export_note is None

    # --export: the smoke run replaces the default folder, as asked
    r = _train_cli("-m", str(man), "--max-steps", "1", "--export")
    assert r.exit_code == 0, r.output
    assert "export:" not in r.stderr
    assert _digest(default)["model.safetensors"] != before["model.safetensors"]
    assert json.loads((default / "training.json").read_text())["config"]["max_steps"] == 1


def test_a_job_without_a_control_option_gets_the_same_placement(tmp_path):
    """sam-segmenter's Config has no ``control`` (a segmenter has no shuffled run): a ``--set`` of its steps exported
    beside its run folder and said so, where it used to stop with "'Config' object has no attribute 'control'"."""
    from pipeline.config import load_manifest
    from train.cli import export_placement
    from train.jobs.sam_segmenter import Config

    sets = ["train.sam_segmenter.max_steps=5"]
    m = load_manifest(Path("manifests/pixels.yaml"), sets)
    cfg = Config(**m.train.sam_segmenter.training_config())
    assert not hasattr(cfg, "control") and cfg.max_steps == 5
    note = export_placement("sam_segmenter", cfg, m, Path("manifests/pixels.yaml"), sets, tmp_path, False)
    assert cfg.export_dir == str(tmp_path / "export")
    assert note.startswith(f"export: {tmp_path / 'export'}, not ") and "max_steps=5 (manifest 3000)" in note
    assert note.split(", not ")[1].startswith(str(Path("runs/pixels/encoders/sam")))
