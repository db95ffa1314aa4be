"""The two commands' help and their name errors, as a user reads them: help wrapped at word
boundaries to 100 columns when not on a terminal (nothing cut mid-word, no RST markup), a job's
options listed by `train list <job>` with their defaults, "did you mean" for a mistyped stage or
job, and `pipeline inspect`'s long lines ending with an ellipsis."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from pipeline.cli import app as pipeline_app
from pipeline.cli_help import HELP_WIDTH, did_you_mean, option_lines
from train.cli import app as train_app

APPS = {"pipeline": pipeline_app, "train": train_app}
RST = re.compile(r"``|:(func|class|mod|meth|attr):`")


def _helps():
    runner = CliRunner()
    for name, app in APPS.items():
        for sub in [None, *get_command(app).commands]:
            args = [sub, "--help"] if sub else ["--help"]
            r = runner.invoke(app, args, env={"COLUMNS": ""})
            assert r.exit_code == 0, (name, sub, r.output)
            yield f"{name} {sub or ''}".strip(), r.output


def test_help_wraps_at_words_without_markup():
    texts = dict(_helps())
    assert len(texts) >= 12, sorted(texts)
    for cmd, text in texts.items():
        for line in text.splitlines():
            assert len(line) <= HELP_WIDTH, f"{cmd}: {len(line)} columns: {line!r}"
            assert "…" not in line, f"{cmd}: a cut word: {line!r}"
            assert not RST.search(line), f"{cmd}: RST markup: {line!r}"
            assert not re.search(r"[│╭╰─]", line), f"{cmd}: a box: {line!r}"
    # an option name is printed whole (rich's panels cut it to --gpus-per-work…)
    assert "--gpus-per-worker" in texts["train run"]
    assert "train list <job>" in texts["train run"]  # where a job's own options are


def test_train_list_job_gives_every_option_with_its_default():
    from train.registry import registry

    r = CliRunner().invoke(train_app, ["list", "relation-head"])
    assert r.exit_code == 0, r.output
    cfg = registry()["relation-head"].Config
    lines = r.output.splitlines()
    options = [x for x in lines if re.match(r"  \S", x)]  # an option's first line; its description goes on below
    for name, field in cfg.model_fields.items():
        row = [x for x in options if x.split()[:1] == [name]]
        assert len(row) == 1, (name, r.output)
        if not field.is_required() and isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
            assert str(field.default) in row[0], (name, row[0])
    assert all(len(x) <= HELP_WIDTH for x in lines)
    assert re.search(r"^\s+lr\s+0\.003?\s+\S", r.output, re.M) or re.search(r"^\s+lr\s+\S+\s+\S", r.output, re.M)


@pytest.mark.parametrize("columns", ["60", "250"])
def test_train_list_prints_every_description_whole(columns):
    """`train list <job>` wraps each option's description at words under its column, never cutting
    it (it stopped at ~45 characters, at any terminal width): the words of the lines below an option
    are exactly its description's."""
    from train.registry import registry

    r = CliRunner().invoke(train_app, ["list", "concept-ot"], env={"COLUMNS": columns})
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    lines = r.output.splitlines()
    assert all(len(x) <= max(int(columns), 40) for x in lines if not re.match(r"  \S+  \S{17,}$", x)), lines
    starts = [i for i, x in enumerate(lines) if re.match(r"  \S", x)]
    cfg = registry()["concept-ot"].Config
    assert len(starts) == len(cfg.model_fields)
    from pipeline.cli_help import COMMON, _default

    for (name, field), a, b in zip(cfg.model_fields.items(), starts, [*starts[1:], len(lines)]):
        first = re.fullmatch(rf"  {name} +{re.escape(_default(field))}(?: +(.*))?", lines[a])
        assert first, (name, _default(field), lines[a])
        shown = " ".join([first[1] or "", *(x.strip() for x in lines[a + 1:b])]).split()
        assert shown == (field.description or COMMON.get(name, "")).split(), (name, lines[a:b])
    amp = next(i for i in starts if lines[i].split()[0] == "amp")
    assert lines[amp + 1].startswith(" " * 6) and "autocast" in lines[amp + 1]  # its long description goes on below


def test_option_lines_wrap_whole_words():
    from pydantic import BaseModel, Field

    class C(BaseModel):
        alpha: int = Field(3, description="word " * 40)
        beta: str = "x"
        gamma: list = Field(["a" * 10, "b" * 10], description="a long default")

    rows = option_lines(C, width=60)
    assert all(len(x) <= 60 for x in rows if "aaaa" not in x)
    assert rows[0].split()[:2] == ["alpha", "3"] and rows[0].endswith("word") and "…" not in "".join(rows)
    alpha = [rows[0]] + [x for x in rows[1:] if x.startswith(" " * 10) and "word" in x]
    assert sum(x.count("word") for x in alpha) == 40
    beta = rows.index(next(x for x in rows if x.split()[:1] == ["beta"]))
    assert rows[beta].split() == ["beta", "x"]
    assert rows[beta + 1].split()[:2] == ["gamma", '["aaaaaaaaaa",']  # a default wider than its column, whole
    assert rows[beta + 2].strip() == "a long default"


def test_typos_get_a_suggestion(tmp_path):
    assert did_you_mean("job", "concep-ot", ["c3", "concept-ot"]).startswith("unknown job 'concep-ot'; did you mean 'concept-ot'?")
    assert "did you mean" not in did_you_mean("job", "zzz", ["c3", "concept-ot"])
    r = CliRunner().invoke(pipeline_app, ["run", "extract-clip-token", "-m", "manifests/tiny.yaml", "--set",
                                          f"output={tmp_path / 'out'}"])
    assert r.exit_code == 2 and "did you mean 'extract-clip-tokens'?" in r.output, r.output
    assert not (tmp_path / "out").exists()  # refused before any folder is made
    for args in (["list", "infogrund"], ["run", "infogrund", "-m", "manifests/tiny.yaml"]):
        r = CliRunner().invoke(train_app, args)
        assert r.exit_code == 2 and "did you mean 'infoground'?" in r.output, (args, r.output)


def test_inspect_long_parameters_end_with_an_ellipsis(tmp_path):
    from pipeline.io.artifacts import ArtifactWriter, unit_name

    w = ArtifactWriter(tmp_path / "out", "samples", "ingest", {"long": "p" * 900, "short": 1})
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("samples", pa.table({"sample_id": pa.array([1, 2], pa.int64())}))
    u.commit()
    w.finalize([unit_name(0)])
    r = CliRunner().invoke(pipeline_app, ["inspect", str(tmp_path / "out" / "samples")])
    assert r.exit_code == 0, r.output
    params = [x for x in r.output.splitlines() if x.startswith("parameters")]
    assert len(params) == 1 and params[0].endswith("…") and len(params[0]) <= 11 + 400, params
    assert "count      2 images" in r.output  # the artifact's one count (pipeline/counts.py)


@pytest.mark.parametrize("stage,tables,expect", [
    ("ingest", {"samples": 63, "captions": 315, "instances": 400, "phrases": 500, "relations": 115}, (63, "images")),
    ("mine-concepts", {"concepts": 889, "vocab": 40, "embeddings": 40}, (889, "concept rows")),
    ("encode-concepts", {"index": 514, "membership": 889, "pooled": 514, "tokens": 514}, (514, "concepts")),
    ("negative-captions", {"negatives": 2564, "shards": 63, "words": 4000}, (2564, "nouns")),
    ("some-new-stage", {"things": 7, "more": 9}, (7, "rows")),
])
def test_one_count_per_artifact(stage, tables, expect):
    from pipeline.counts import artifact_count, unit_rows
    from pipeline.report.build import main_rows

    m = {"stage": stage, "tables": {t: {"rows": n, "files": 1} for t, n in tables.items()}}
    assert artifact_count(m) == expect and main_rows(m) == expect[0]
    # a progress line sums the counted table over the units' files: the same number at the end
    files = [{"table": t, "rows": n} for t, n in tables.items()]
    if stage != "some-new-stage":
        assert unit_rows(stage, {"files": files, "stats": {"rows": 1}}) == expect


def test_every_stage_has_its_count():
    from pipeline.counts import COUNTED
    from pipeline.stage import registry

    assert set(registry()) <= set(COUNTED), set(registry()) - set(COUNTED)


def test_a_phase_without_the_counted_table_names_its_own():
    from pipeline.counts import unit_rows

    assert unit_rows("encode-concepts", {"files": [{"table": "membership", "rows": 889}]}) == (889, "membership rows")
    assert unit_rows("ingest", {"stats": {"rows": 5}}) == (5, "rows")
    assert unit_rows("ingest", {"failed": "boom"}) == (0, "images")


def test_a_committed_unit_reports_its_rows_per_table(tmp_path):
    """What a stage's unit returns (``{"unit", "stats"}``, no files) still gives its progress line the
    counted table's rows: the unit's commit records them in its stats."""
    from pipeline.counts import unit_rows
    from pipeline.io.artifacts import ArtifactWriter, unit_name

    w = ArtifactWriter(tmp_path / "out", "concept_tokens", "encode-concepts", {})
    u = w.unit_writer(unit_name(0), "fp")
    u.write_table("index", pa.table({"concept_id": pa.array(range(7), pa.int64())}))
    u.write_table("membership", pa.table({"concept_id": pa.array(range(19), pa.int64())}))
    res = u.commit({"concepts": 7})
    assert unit_rows("encode-concepts", {"unit": res.unit, "stats": res.stats}) == (7, "concepts")
    w.finalize([unit_name(0)])
    assert w  # the artifact finalises with the dict in its units' stats (only numbers are summed)
