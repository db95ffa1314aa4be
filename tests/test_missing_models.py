"""Model folders that do not exist (pipeline/models/required.py): `pipeline run`, `plan` and `status` name every
missing folder at once, the slots that name it and the complete command that makes it, before Ray starts or a
folder is made; a spec that looks like a local path never reaches a hub lookup (no "Repo id must be ..." message)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

PIXELS = "manifests/pixels-gt.yaml"


def _expected(out: Path, sets: str, ingest_first: bool = True) -> str:
    """The one line, written out here from the pixels manifest's comments (which job exports which folder)."""
    cmd = f"-m {PIXELS} --set output={out}{sets}"
    line = (f"error: 3 model folders the manifest names do not exist: "
            f"{out}/encoders/clip (models.clip, models.detector, models.sam, models.predicate_encoder): "
            f"make it with `train run clip-encoder {cmd}`; "
            f"{out}/encoders/groupvit (models.groupvit): make it with `train run groupvit-encoder {cmd}`; "
            f"{out}/encoders/mlm (models.mlm, models.word_encoder): make it with `train run mlm-encoder {cmd}`")
    if ingest_first:
        line += f"; the encoder jobs train on the samples artifact: run `pipeline run ingest {cmd}` first"
    return line


def _invoke(*args: str):
    return CliRunner(**({"mix_stderr": False} if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else {})).invoke(
        app, list(args))


@pytest.mark.parametrize("command", [["run", "all"], ["run", "extract-clip-tokens"], ["plan"]])
def test_run_and_plan_name_every_missing_encoder_and_its_command_before_ray(tmp_path, command, monkeypatch):
    import ray

    started = []  # ray.init called (an earlier test of the session may have left a Ray running in this process)
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    out = tmp_path / "px"
    r = _invoke(*command, "-m", PIXELS, "--set", f"output={out}")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    if command[1:] == ["extract-clip-tokens"]:  # that stage loads models.clip only
        cmd = f"-m {PIXELS} --set output={out}"
        assert lines == [f"error: 1 model folder the manifest names does not exist: {out}/encoders/clip (models.clip): "
                         f"make it with `train run clip-encoder {cmd}`; the encoder jobs train on the samples artifact: "
                         f"run `pipeline run ingest {cmd}` first"]
    else:
        assert lines == [_expected(out, "")]
    assert "Repo id" not in r.output and "Traceback" not in r.output
    assert not started and not out.exists()  # nothing started, no folder made


def test_status_lists_the_missing_encoders_and_complete_commands(tmp_path):
    import pyarrow as pa

    from pipeline.io.artifacts import ArtifactWriter, unit_name

    out = tmp_path / "px"
    w = ArtifactWriter(out, "samples", "ingest", {}, force=True)  # ingest has run: the jobs need nothing else first
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([1], pa.int64())}))
    u.commit()
    w.finalize([unit_name(0)])
    r = _invoke("status", "-m", PIXELS, "--set", f"output={out}", "--set", "stages.ingest.shard_size=100")
    assert r.exit_code == 1
    sets = " --set stages.ingest.shard_size=100"
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "models: " + _expected(out, sets, ingest_first=False)[len("error: "):]
    rows = {ln.split()[0]: ln for ln in lines[1:-1]}
    assert rows["clip_tokens"].endswith(f"run `pipeline run extract-clip-tokens -m {PIXELS} --set output={out}{sets}`")
    assert rows["negatives"].endswith(f"run `pipeline run negative-captions -m {PIXELS} --set output={out}{sets}`")


def test_a_control_folder_names_the_control_run(tmp_path):
    out = tmp_path / "px"
    r = _invoke("run", "extract-clip-tokens", "-m", PIXELS, "--set", f"output={out}",
                "--set", 'models.clip="{output}/encoders/clip-shuffled"')
    assert r.exit_code == 2
    assert (f"{out}/encoders/clip-shuffled (models.clip): make it with `train run clip-encoder -m {PIXELS} --set "
            f"output={out} --set 'models.clip=\"{{output}}/encoders/clip-shuffled\"' --set train.clip_encoder.control=shuffled`"
            in r.stderr), r.stderr


@pytest.mark.parametrize("spec", ["./nope/clip", "/nonexistent/clip", "runs/nowhere/encoders/clip", "~/nope-x/clip",
                                  "clip-pool:./nope/clip"])
def test_a_missing_local_path_is_named_as_one_never_as_a_repo_id(tmp_path, spec):
    r = _invoke("run", "extract-regions" if spec.startswith("clip-pool") else "extract-clip-tokens",
                "-m", "manifests/tiny.yaml", "--set", f"output={tmp_path / 'o'}",
                "--set", f"models.{'detector' if spec.startswith('clip-pool') else 'clip'}={spec}")
    assert r.exit_code == 2
    path = spec.split(":", 1)[-1]
    slot = "models.detector" if spec.startswith("clip-pool") else "models.clip"
    assert r.stderr.strip() == (f"error: 1 model folder the manifest names does not exist: {path} ({slot}): no such file "
                                f"or folder; point {slot} at an existing one, a Hugging Face id or a preset (tiny-random)")


def test_the_loaders_name_a_missing_local_path_too(tmp_path):
    """Past the CLI (a stage run in-process, the trainers' text encoders): the same path, no hub message."""
    from pipeline.errors import StageError, model_key
    from pipeline.models.clip import load_clip

    with pytest.raises(FileNotFoundError) as e:
        load_clip(str(tmp_path / "gone"))
    assert str(e.value) == f"models.clip: {tmp_path / 'gone'} does not exist (a local path, not a Hugging Face id)"
    with pytest.raises(StageError) as e:
        with model_key("models.groupvit", "./runs/none/groupvit"):
            raise AssertionError("not reached: the path is checked first")
    assert str(e.value) == "models.groupvit: ./runs/none/groupvit does not exist (a local path, not a Hugging Face id)"


def test_what_counts_as_a_local_path():
    from pipeline.models.required import local_path

    for spec in ("openai/clip-vit-base-patch16", "bert-base-uncased", "tiny-random", "scene-oracle", "clip-pool:tiny-random",
                 "vit_b:sam_vit_b_01ec64.pth", "torchvision:fasterrcnn_resnet50_fpn_v2", "s3://bucket/x/y/z", None, ""):
        assert local_path(spec) is None, spec
    for spec in ("/a", "./a", "../a/b", "~/m", "a/b/c", "clip-pool:runs/x/encoders/clip", "vit_h:/ckpt/sam.pth"):
        assert local_path(spec) == spec.split(":", 1)[-1], spec
    assert local_path("out/clip", output="out") == "out/clip"  # under the output ({output}/clip), one slash or not
    assert local_path("org/clip", output="out") is None


def test_regions_from_the_segmenter_name_the_missing_sam_folder(tmp_path):
    """extract-regions with ``backend: sam`` loads models.sam as well as models.detector: both are named."""
    out = tmp_path / "ng"
    r = _invoke("run", "extract-regions", "-m", "manifests/pixels.yaml", "--set", f"output={out}")
    assert r.exit_code == 2
    cmd = f"-m manifests/pixels.yaml --set output={out}"
    assert r.stderr.strip().splitlines() == [
        f"error: 2 model folders the manifest names do not exist: {out}/encoders/clip (models.detector): make it with "
        f"`train run clip-encoder {cmd}`; {out}/encoders/sam (models.sam): make it with `train run sam-segmenter {cmd}`; "
        f"the encoder jobs train on the samples artifact: run `pipeline run ingest {cmd}` first"]
    assert not out.exists()


def test_clip_pool_tokens_name_the_clip_and_no_sam_when_the_masks_are_given(tmp_path):
    """extract-visual-tokens with ``embedding: clip_pool`` loads models.clip besides models.sam (SAM's masks, the
    CLIP's features); with ``segmenter: annotations`` as well it loads no SAM, so no SAM folder is asked for."""
    out = tmp_path / "ng"
    base = ["run", "extract-visual-tokens", "-m", "manifests/pixels.yaml", "--set", f"output={out}",
            "--set", "stages.extract_visual_tokens.embedding=clip_pool", "--set", "stages.extract_visual_tokens.relations=geometric"]
    r = _invoke(*base)
    assert r.exit_code == 2
    line = r.stderr.strip().splitlines()[0]
    assert f"{out}/encoders/clip (models.predicate_encoder, models.clip)" in line and f"{out}/encoders/sam (models.sam)" in line
    r = _invoke(*base, "--set", "stages.extract_visual_tokens.segmenter=annotations")
    assert r.exit_code == 2
    line = r.stderr.strip().splitlines()[0]
    assert "error: 1 model folder" in line and f"{out}/encoders/clip (models.predicate_encoder, models.clip)" in line
    assert "encoders/sam" not in line
