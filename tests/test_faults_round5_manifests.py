"""Round 5 (a), issue 49 items 3 and 7: manifest and grid errors show a value cut to a few hundred
characters, YAML aliases that expand past a limit are refused before validation, ``--set`` values
that are not YAML are strings, and ``{output}`` expands wherever a path is given (refused in
``output`` itself)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import MAX_YAML_VALUES, ManifestError, load_manifest, load_yaml
from pipeline.errors import describe_exception, shorten


def _bomb(levels: int = 8) -> str:
    """The probe's alias bomb: 9 values, then ``levels`` lists of 9 aliases of the one before."""
    lines = ["  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "x-anchors:\n" + "\n".join(lines) + "\n"


def _expanded_count(levels: int) -> int:
    """Values the bomb's last list holds with every alias expanded, counted by hand: a list of 9
    scalars is 10 values; each level is 1 + 9 times the level below."""
    n = 10
    for _ in range(levels):
        n = 1 + 9 * n
    return n


def test_shorten_cuts_at_a_word_boundary_and_gives_the_full_length():
    assert shorten("short") == "short"
    text = ("Either the file is corrupted or it was saved by another version " * 10).strip()
    out = shorten(text, 40)
    assert out == f"Either the file is corrupted or it was... ({len(text):,} characters)"
    assert shorten("x" * 1000, 10) == "xxxxxxxxxx... (1,000 characters)"  # no blank: a character boundary
    assert describe_exception(ValueError(text), 40) == f"ValueError: {out}"


def test_an_alias_bomb_manifest_is_refused_in_one_short_line(tmp_path):
    m = tmp_path / "bomb.yaml"
    m.write_text(_bomb() + "stages:\n  ingest:\n    shard_size: *a8\n")
    with pytest.raises(ManifestError) as e:
        load_manifest(m)
    n = _expanded_count(8) + _expanded_count(7) + 1  # the anchor list, shard_size's alias of it, ... counted once per use
    assert str(e.value).startswith(f"manifest {m}: its aliases (*name) expand to ")
    assert str(e.value).endswith(f" values, more than {MAX_YAML_VALUES:,}; write the values out instead of repeating aliases")
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)
    assert n > MAX_YAML_VALUES


def test_the_alias_count_is_exact_and_a_small_alias_is_fine():
    assert load_yaml("a: &a [1, 2]\nb: *a\n") == {"a": [1, 2], "b": [1, 2]}
    # the 3-level bomb and one more use of its last list: the top mapping, its 2 keys, the anchors'
    # mapping with its 4 keys and lists, and b's list again
    text = _bomb(3) + "b: *a3\n"
    total = 1 + 2 + 1 + sum(1 + _expanded_count(k) for k in range(4)) + _expanded_count(3)
    with pytest.raises(ValueError, match=f"expand to {total:,} values, more than 100;"):
        load_yaml(text, limit=100)
    assert len(load_yaml(text, limit=total)["b"]) == 9


def test_an_alias_bomb_grid_is_refused(tmp_path):
    from train.sweep import GridError, read_grid

    g = tmp_path / "grid.yaml"
    g.write_text(_bomb() + "train.c3.lr: *a8\n")
    with pytest.raises(GridError) as e:
        read_grid(g, "c3")
    assert str(e.value).startswith(f"grid {g}: its aliases (*name) expand to ") and len(str(e.value)) < 300


def test_a_huge_wrong_value_is_shown_cut_with_its_length(tmp_path):
    m = tmp_path / "long.yaml"
    m.write_text("stages:\n  ingest:\n    shard_size: '" + "word " * 20000 + "'\n")
    with pytest.raises(ManifestError) as e:
        load_manifest(m)
    shown = repr("word " * 20000)
    assert str(e.value) == (
        f"manifest {m}: key 'stages.ingest.shard_size': Input should be a valid integer, unable to parse string "
        f"as an integer (got {shorten(shown)})")
    assert str(e.value).endswith("word word... (100,002 characters))") and len(str(e.value)) < len(str(m)) + 450


def test_a_grid_value_that_is_not_a_list_is_shown_cut(tmp_path):
    from train.sweep import GridError, read_grid

    g = tmp_path / "grid.yaml"
    g.write_text("train.c3.lr: '" + "9" * 5000 + "'\n")
    with pytest.raises(GridError) as e:
        read_grid(g, "c3")
    assert str(e.value) == f"grid {g}: train.c3.lr must be a non-empty list of values (got '{'9' * 299}... (5,002 characters))"


def test_set_value_that_is_not_yaml_is_the_string_given(tmp_path):
    """The documented `--set models.clip={output}/encoders/clip`, unquoted: YAML reads `{` as a flow
    mapping and fails; the value is taken as the text, then `{output}` expands."""
    out = tmp_path / "run"
    m = load_manifest(None, [f"output={out}", "models.clip={output}/encoders/clip", "dataset.kind=folder",
                             "dataset.captions=[unclosed"])
    assert m.models.clip == f"{out}/encoders/clip"
    assert m.dataset.captions == "[unclosed"


def test_output_template_expands_in_every_path_and_is_refused_in_output(tmp_path):
    out = tmp_path / "run"
    m = load_manifest(None, [
        f"output={out}", "dataset.kind=folder", "dataset.images={output}/imgs", "dataset.captions={output}/c.tsv",
        "storage.cache_dir={output}/cache", "train.c3.run_dir={output}/train/c3",
        'eval.benchmarks=[{name: s, format: sugarcrepe, path: "{output}/bench"}]',
    ])
    assert (m.dataset.images, m.dataset.captions, m.storage.cache_dir, m.train.c3.run_dir, m.eval.benchmarks[0].path) == (
        f"{out}/imgs", f"{out}/c.tsv", f"{out}/cache", f"{out}/train/c3", f"{out}/bench")
    with pytest.raises(ManifestError) as e:
        load_manifest(None, ["output={output}/x"])
    assert str(e.value) == ("manifest <defaults>: key 'output': {output} cannot stand inside output itself "
                            "(got '{output}/x'); give the output folder's path")
    assert not Path("{output}").exists()


def test_the_limits_docs_errors_md_states():
    """docs/errors.md, Round 5 (a): 1,000,000 alias-expanded values, 300 characters shown, 256 MiB per image file."""
    from pipeline.errors import SHOWN_CHARS
    from pipeline.readers.images import DEFAULT_MAX_IMAGE_BYTES
    from pipeline.stages.ingest import Config

    text = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    assert (MAX_YAML_VALUES, SHOWN_CHARS, DEFAULT_MAX_IMAGE_BYTES) == (1_000_000, 300, 256 * 2**20)
    assert Config().max_image_bytes == DEFAULT_MAX_IMAGE_BYTES
    assert "past 1,000,000\n  values" in text and "to 300 characters" in text and "(256 MiB," in text
