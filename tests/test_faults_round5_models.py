"""Round 5 (a), issue 49 item 1: a model folder that would load half-right is refused in one line
naming the folder and the file: a tokenizer that does not fit the config's vocabulary, weights
missing or unexpected for the config, a Git LFS pointer in place of a file; the library's load
report goes to the log, not the terminal."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from pipeline.models.hf_folder import ModelFolderError


@pytest.fixture(autouse=True)
def _no_terminal_handler_left_by_another_test():
    """An in-process CLI test earlier in the suite may leave its terminal handler (with -v: DEBUG) on the root
    logger; these tests check what a plain load prints, so they run without it."""
    root = logging.getLogger()
    saved = [h for h in root.handlers if type(h).__name__ == "_Stderr"]
    for h in saved:
        root.removeHandler(h)
    yield
    for h in saved:
        root.addHandler(h)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    """A hub-layout CLIP folder: save_pretrained of the tiny random CLIP, its processor and tokenizer."""
    from pipeline.models.clip import build_random_clip

    d = tmp_path_factory.mktemp("clip") / "clip"
    model, processor, tok = build_random_clip("tiny-random")
    model.save_pretrained(str(d))
    processor.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def mlm_folder(tmp_path_factory) -> Path:
    from pipeline.models.mlm import _build_random_mlm

    d = tmp_path_factory.mktemp("mlm") / "mlm"
    model, tok = _build_random_mlm("tiny-random")
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / src.name
    shutil.copytree(src, d)
    return d


def test_a_whole_folder_loads_with_random_weights_false_and_no_library_report(clip_folder, capfd, caplog):
    from pipeline.models.clip import load_clip

    caplog.set_level(logging.DEBUG, logger="pipeline.models.load")
    model, _proc, tok, rec = load_clip(str(clip_folder))
    assert rec["random_weights"] is False and len(tok) == model.config.text_config.vocab_size
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "Loading weights" not in err


def test_a_folder_without_its_tokenizer_files_is_refused(clip_folder, tmp_path):
    """The probe: tokenizer.json / tokenizer_config.json deleted; AutoTokenizer built a vocabulary of a
    few words and every caption embedding came out the same."""
    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    rest = [f for f in ("vocab.json", "vocab.txt") if (d / f).is_file()]
    with pytest.raises(ModelFolderError) as e:
        load_clip(str(d))
    msg = str(e.value)
    files = f"its tokenizer files ({', '.join(rest)})" if rest else "no tokenizer.json / tokenizer_config.json / vocab file"
    assert msg.startswith(f"model folder {d}: {files} give a vocabulary of ")
    assert msg.endswith(", config.json's vocab_size is 30,522; copy in the tokenizer files saved with this model")
    assert "\n" not in msg


def test_a_config_with_one_more_layer_is_refused_not_half_random(clip_folder, tmp_path, capfd):
    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    n = cfg["text_config"]["num_hidden_layers"]
    cfg["text_config"]["num_hidden_layers"] = n + 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError) as e:
        load_clip(str(d))
    assert str(e.value) == (
        f"model folder {d}: model.safetensors lacks 16 weight(s) that config.json asks for "
        f"(text_model.encoder.layers.{n}.layer_norm1.bias, text_model.encoder.layers.{n}.layer_norm1.weight, "
        f"text_model.encoder.layers.{n}.layer_norm2.bias and 13 more): they would be random; "
        "use the config.json saved with these weights")
    assert "LOAD REPORT" not in capfd.readouterr().err  # the library's table went to the log


def test_the_load_report_stays_in_the_log_when_transformers_propagation_is_on(clip_folder, tmp_path, caplog, capfd):
    """Another library may turn transformers' propagation on (CI's full suite met it): the table
    still goes to ``pipeline.models.load`` only, never to the root logger's terminal handler."""
    from transformers.utils import logging as hf_logging

    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] += 1
    (d / "config.json").write_text(json.dumps(cfg))
    target, got = logging.getLogger("pipeline.models.load"), []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    keep, level, disabled, propagate = Keep(level=logging.DEBUG), target.level, target.disabled, target.propagate
    target.addHandler(keep)
    target.propagate = False  # an earlier in-process `-v` CLI may have left a DEBUG terminal handler on the root
    target.setLevel(logging.DEBUG)  # whatever an earlier test left on the `pipeline` loggers (a level, or a
    target.disabled = False         # library's logging.config call that disabled the loggers existing then)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.DEBUG), pytest.raises(ModelFolderError):
            load_clip(str(d))
    finally:
        hf_logging.disable_propagation()
        target.removeHandler(keep)
        target.setLevel(level)
        target.disabled = disabled
        target.propagate = propagate
    assert not [r for r in caplog.records if r.name.startswith("transformers") and "LOAD REPORT" in r.getMessage()]
    assert [r for r in got if "LOAD REPORT" in r.getMessage()]
    assert "LOAD REPORT" not in capfd.readouterr().err
    assert logging.getLogger("transformers").propagate is False  # restored as found


def test_the_terminal_handler_writes_to_the_stderr_of_the_moment(monkeypatch):
    """A handler set up under one stderr (a test's capture, since closed) writes to today's."""
    import io
    import sys

    from pipeline.cli import _Stderr

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    h = _Stderr()
    first.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    h.emit(logging.LogRecord("pipeline", logging.WARNING, __file__, 1, "a line", (), None))
    assert now.getvalue() == "a line\n"


def test_a_config_with_one_layer_fewer_is_refused_naming_the_dropped_weights(clip_folder, tmp_path):
    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    n = cfg["text_config"]["num_hidden_layers"] - 1
    cfg["text_config"]["num_hidden_layers"] = n
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError) as e:
        load_clip(str(d))
    assert str(e.value).startswith(f"model folder {d}: model.safetensors holds 16 weight(s) the model of config.json "
                                   f"has no place for (text_model.encoder.layers.{n}.")
    assert str(e.value).endswith("and 13 more): they would be dropped; use the config.json saved with these weights")


def test_a_git_lfs_pointer_is_named_as_one(clip_folder, tmp_path):
    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    (d / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    with pytest.raises(ModelFolderError) as e:
        load_clip(str(d))
    assert str(e.value) == (f"model folder {d}: model.safetensors is a Git LFS pointer, not the file; "
                            "run `git lfs pull` in the clone")


def test_mlm_and_word_encoder_folders(mlm_folder, tmp_path):
    """A masked LM folder loads as the masked LM and as a word encoder (the body: its missing pooler is
    never run); its tokenizer replaced by a two-word one is refused for both."""
    from pipeline.models.mlm import load_mlm, load_word_encoder

    assert load_mlm(str(mlm_folder)).record["random_weights"] is False
    assert load_word_encoder(str(mlm_folder)).record["random_weights"] is False
    d = _copy(mlm_folder, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink(missing_ok=True)
    (d / "vocab.txt").write_text("[UNK]\n[MASK]\n")
    for load in (load_mlm, load_word_encoder):
        with pytest.raises(ModelFolderError) as e:
            load(str(d))
        # the two words and the [CLS] [SEP] [PAD] the tokenizer adds
        assert str(e.value) == (f"model folder {d}: its tokenizer files (vocab.txt) give a vocabulary of 5 tokens, "
                                "config.json's vocab_size is 30,522; copy in the tokenizer files saved with this model")


def test_the_stage_error_is_one_line_naming_the_manifest_key(clip_folder, tmp_path):
    """Through the stages' provenance path the refusal keeps its own line (a StageError passes model_key)."""
    from pipeline.errors import StageError, model_key
    from pipeline.models.clip import load_clip

    d = _copy(clip_folder, tmp_path)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(StageError) as e, model_key("models.clip", str(d)):
        load_clip(str(d))
    assert str(e.value).startswith(f"model folder {d}: ")
