"""The README and docs/ say what runs: every shell block parses, every command is one the CLIs accept,
every file and link they name exists, and (slow) every command that names the demo manifest runs as
written on the demo's output."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def shell_blocks(page: Path) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang in ("bash", "sh", "shell")]


def commands(block: str) -> list[list[str]]:
    """Each command of a block as argv (continuation lines joined, comments dropped, `&&` split)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w in ("&&", "||", ";", "|"):
                while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
                    cmd.pop(0)  # environment assignments
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _click(prog: str):
    import typer

    if prog == "pipeline":
        from pipeline.cli import app
    else:
        from train.cli import app
    return typer.main.get_command(app)


def check_cli(argv: list[str]) -> None:
    """Parse argv with the CLI's own parser (click), invoking nothing."""
    prog = Path(argv[0]).name
    group = _click(prog)
    ctx = group.make_context(prog, list(argv[1:]), resilient_parsing=False)
    rest_args = list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])) + list(ctx.args)
    name, sub, rest = group.resolve_command(ctx, rest_args)
    assert sub is not None, f"{prog}: unknown command {argv[1:2]}"
    sub.make_context(name, rest, parent=ctx, resilient_parsing=False)


def all_commands():
    for page in PAGES:
        for block in shell_blocks(page):
            for argv in commands(block):
                yield page, argv


def test_docs_have_shell_blocks_and_pages_exist():
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file()
    n = sum(len(shell_blocks(p)) for p in PAGES)
    assert n >= 10, n


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_blocks_parse(page):
    for block in shell_blocks(page):
        r = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert r.returncode == 0, f"{page.name}: bash -n fails on\n{block}\n{r.stderr}"
        assert not re.search(r"<[a-z_]+>", block), f"{page.name}: placeholder in a shell block:\n{block}"


def test_cli_commands_parse():
    seen = 0
    for page, argv in all_commands():
        prog = Path(argv[0]).name
        if argv[0].startswith(".venv/bin/") and prog in ("pipeline", "train"):
            try:
                check_cli(argv)
            except Exception as e:  # click raises UsageError / BadParameter / NoSuchOption
                pytest.fail(f"{page.relative_to(REPO)}: `{shlex.join(argv)}` is refused by the CLI: {e}")
            seen += 1
        elif argv[0] in (".venv/bin/python", "python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
            assert (REPO / argv[1]).is_file(), f"{page.name}: {argv[1]} does not exist"
        for w in argv:
            if re.fullmatch(r"manifests/[\w.-]+\.yaml", w):
                assert (REPO / w).is_file(), f"{page.name}: {w} does not exist"
    assert seen >= 20, seen


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: link {target} leads nowhere"


def test_readme_has_exactly_two_setup_commands():
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = [b for lang, b in FENCE.findall(setup)]
    assert len(blocks) == 2
    assert "pipeline run all --manifest manifests/demo.yaml" in blocks[0]
    assert "pytest" in blocks[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci, ".ci/run must run the README's test command verbatim"


# --------------------------------------------------------------------------- the demo's commands run
DEMO = "manifests/demo.yaml"
DEMO_IMAGES = 200  # the test's copy of the demo: 140 train, 30 val, 30 test (every benchmark keeps items)
DEMO_STEPS = 4  # optimizer steps per training run in the test's copy


def demo_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every command of README.md and docs/ that names the demo manifest, README
    command 1 first, then page by page; the commands that redo the demo's data (`--set dataset...
    --force`) last, so that the others read what command 1 made."""
    found = [(str(page.relative_to(REPO)), argv) for page in PAGES for block in shell_blocks(page)
             for argv in commands(block) if DEMO in argv]
    redo = [c for c in found if any(w.startswith("dataset.") for w in c[1])]
    return [c for c in found if c not in redo] + redo


def _skip_reason(argv: list[str]) -> str | None:
    """Why a demo command cannot run on this test's machine (none: it runs)."""
    if "--gpus-per-worker" in argv and float(argv[argv.index("--gpus-per-worker") + 1]) > 0:
        return "needs GPUs"
    if argv[1:2] == ["sweep"]:
        return "a grid of Ray Tune trials (15 here); `train sweep` runs end to end in tests/test_sweep.py"
    return None


def test_demo_commands_are_found():
    """The slow test below has something to run: README command 1 and the tour, and the docs' own."""
    cmds = demo_commands()
    assert [a[:3] for p, a in cmds[:2]] == [[".venv/bin/pipeline", "run", "all"], [".venv/bin/train", "run", "all"]], cmds[:2]
    pages = {p for p, _ in cmds}
    assert {"README.md", "docs/evaluation.md", "docs/training.md", "docs/stages.md"} <= pages, pages
    assert len(cmds) >= 30 and sum(_skip_reason(a) is None for _, a in cmds) >= len(cmds) - 3


def _run_tour(tour: str, cwd: Path, env: dict, failed: list[str]) -> None:
    """The README's tour as one block: its commands on the demo's output that name no manifest too
    (`pipeline inspect runs/demo/concepts`, `train compare runs/demo/train/concept-ot/*`, ...)."""
    r = subprocess.run(["bash", "-e", "-c", tour], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        failed.append(f"README.md: the tour block exited {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(2400)
def test_demo_commands_run_as_written(tmp_path):
    """Every shell command of README.md and docs/ that names manifests/demo.yaml, as written, in a
    folder of its own (so `runs/demo` is the test's): README command 1 (the stages, then every job),
    the tour and every page's demo commands (`train eval` on the demo's benchmarks included). The
    folder's manifests/demo.yaml is the demo's with DEMO_IMAGES images and DEMO_STEPS steps per run
    (its sections, models, benchmarks and options otherwise the demo's), to keep the test to minutes;
    the commands that need GPUs or a whole Tune grid are listed as not run, with the reason."""
    import yaml

    shutil.copytree(REPO / "manifests", tmp_path / "manifests")
    (tmp_path / "grids").symlink_to(REPO / "grids")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    demo = yaml.safe_load((REPO / DEMO).read_text())
    demo["dataset"]["synthetic"]["n_images"] = DEMO_IMAGES
    demo["ray"]["num_cpus"] = 2
    for opts in demo["train"].values():
        opts["max_steps"] = DEMO_STEPS
    (tmp_path / DEMO).write_text(yaml.safe_dump(demo, sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "OMP_NUM_THREADS": "1"}
    failed, skipped, ran = [], [], 0
    text = (REPO / "README.md").read_text()
    tour = [body for lang, body in FENCE.findall(text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0])
            if lang == "bash"][0]
    cmds = demo_commands()
    first_redo = next((i for i, (_, a) in enumerate(cmds) if any(w.startswith("dataset.") for w in a)), len(cmds))
    for k, (page, argv) in enumerate(cmds):
        if k == first_redo:
            _run_tour(tour, tmp_path, env, failed)  # on command 1's data, before the commands that redo it
        why = _skip_reason(argv)
        if why:
            skipped.append(f"{page}: {shlex.join(argv)} ({why})")
            continue
        line = " ".join(w if re.fullmatch(r"[\w@%+=:,./*-]+", w) else shlex.quote(w) for w in argv)  # globs expand
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        ran += 1
        if r.returncode != 0:
            failed.append(f"{page}: `{shlex.join(argv)}` exited {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}")
        if argv[1:3] == ["run", "all"] and argv[0].endswith("train"):  # command 1 done: every job trained
            trained = {p.parents[2].name for p in (tmp_path / "runs" / "demo" / "train").glob("*/*/checkpoints/final.pt")}
            assert {"c3", "concept-ot", "infoground", "relation-head", "text-groups", "visual-tokens"} <= trained, \
                (trained, r.stdout[-3000:], r.stderr[-3000:])
            assert "features: scene-oracle" in r.stdout, r.stdout[-2000:]  # the closing table says where they came from
    if first_redo == len(cmds):
        _run_tour(tour, tmp_path, env, failed)
    print(f"{ran} demo commands ran; not run: {skipped}")
    assert not failed, "\n\n".join(failed)
    assert ran >= 30 and len(skipped) <= 3, (ran, skipped)
    assert (tmp_path / "runs" / "demo" / "report" / "index.html").is_file()


# --------------------------------------------------------------------------- every path a page names exists
CODE_SPAN = re.compile(r"`([^`\s]+)`")
TOP_DIRS = ("pipeline/", "train/", "tests/", "benchmarks/", "manifests/", "grids/", "docker/", "docs/", ".ci/")
FILE_LIKE = re.compile(r".*(\.(py|yaml|yml|md|j2|toml|json|txt|sh|csv|png)|/)")
SOURCE_FILES = {p.name for d in ("pipeline", "train", "benchmarks", "tests") for p in (REPO / d).rglob("*.py")}


def _named_paths(text: str):
    """Repository paths in code spans (`train/jobs/c3/model.py`, `pipeline/loaders/`), without
    placeholders, globs or run folders (`train/<job>/...` under an output has no extension)."""
    for tok in CODE_SPAN.findall(text):
        tok = tok.rstrip(".,:;")
        if tok.startswith(TOP_DIRS) and FILE_LIKE.fullmatch(tok) and not re.search(r"[<>*{}$]", tok):
            yield tok


def _job_files(text: str):
    """(package, file) for the bare file names (`model.py`, `ot/`) of a paragraph or table row that
    names exactly one job package (`train/jobs/concept_ot/`)."""
    units = [x for x in text.splitlines() if x.startswith("|")]
    units += [p for p in re.split(r"\n\s*\n", text) if not p.lstrip().startswith("|")]
    for unit in units:
        pkgs = re.findall(r"`(train/jobs/\w+/)`", unit)
        if len(pkgs) == 1:
            for tok in CODE_SPAN.findall(unit):
                if re.fullmatch(r"\w+\.py|\w+/", tok):
                    yield pkgs[0], tok


@pytest.mark.parametrize("page", [*PAGES, REPO / "BENCHMARKS.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_and_job_files_exist(page):
    """Every repository path a page names exists, and every file it names beside a job package is in
    that package (or, for a module of another folder it names in passing, somewhere in the source):
    docs/jobs/concept-ot.md naming `ot.py` after it became the package `ot/` fails here."""
    text = page.read_text()
    for path in _named_paths(text):
        assert (REPO / path).exists(), f"{page.relative_to(REPO)}: `{path}` does not exist"
    for pkg, name in _job_files(text):
        inside = (REPO / pkg / name).exists() or any((REPO / pkg).rglob(name.rstrip("/")))
        assert inside or name in SOURCE_FILES, f"{page.relative_to(REPO)}: `{name}` is not in {pkg} (nor anywhere in the source)"


def test_every_job_package_has_its_two_files():
    """docs/ARCHITECTURE.md, A job package: every job has __init__.py and job.py."""
    for pkg in sorted(p for p in (REPO / "train" / "jobs").iterdir() if p.is_dir() and not p.name.startswith("_")):
        assert (pkg / "__init__.py").is_file() and (pkg / "job.py").is_file(), pkg


def _demo_docs():
    """benchmarks/demo_docs.py as a module (the script that writes the docs' demo table and figure)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_docs", REPO / "benchmarks" / "demo_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_figure_comes_from_a_demo_run():
    """docs/report.png is the screenshot benchmarks/demo_docs.py took of a demo run's report: its sidecar
    names the demo manifest and the command, the runs the page held, the figure's sha256 (a figure
    replaced without its sidecar, or taken from another run, fails here) and that run's closing table,
    which is docs/performance.md's demo table (the figure and the table come from one run)."""
    import hashlib
    import json

    import yaml

    png = REPO / "docs" / "report.png"
    side = json.loads((REPO / "docs" / "report.png.json").read_text())
    assert side["sha256"] == hashlib.sha256(png.read_bytes()).hexdigest(), "docs/report.png changed without its sidecar"
    assert side["manifest"] == DEMO and f"--manifest {DEMO}" in side["command"], side
    syn = yaml.safe_load((REPO / DEMO).read_text())["dataset"]["synthetic"]
    assert side["images"] == syn["n_images"] - syn.get("corrupt_images", 0), side  # the demo's data, not a test's
    assert {"c3", "concept-ot", "infoground", "relation-head", "text-groups", "visual-tokens"} <= set(side["runs"])
    assert "demo" in side["page"]["title"] and side["page"]["size"][1] > 1000, side["page"]
    for page in ("README.md", "docs/report.md"):
        assert "report.png" in (REPO / page).read_text(), page
    table = _demo_docs().docs_table()
    assert side["table"] == table.splitlines(), "docs/report.png.json and docs/performance.md: two runs' tables"
    assert [x.split()[0] for x in side["table"][1:]] == sorted(side["runs"]), side["table"]
    # the run folders the figure's run trained in are the ones `train run` uses with the demo manifest
    runs = {j: str(Path("runs/demo") / r) for j, r in side["runs"].items()}
    assert set(runs.values()) <= _demo_run_folders(), runs


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_demo_docs_match_a_demo_run(tmp_path):
    """docs/performance.md's demo table is what benchmarks/demo_docs.py makes of a demo run (to the digit on the
    CPU that made it, else within a quarter of each row's interval width: benchmarks/demo_docs.py --check), and (headless Chromium where there is one, the report browser test's driver) the figure it takes of
    that run's report has the docs figure's provenance: the same table, the demo manifest, the demo's
    images. The run: $VLPIPE_DEMO_OUTPUT (README command 1's output, made by this checkout), else README
    command 1's two commands here (the full demo: its numbers are seeded, a smaller one's are not these)."""
    import json

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    out = Path(os.environ["VLPIPE_DEMO_OUTPUT"]) if os.environ.get("VLPIPE_DEMO_OUTPUT") else tmp_path / "demo"
    if not os.environ.get("VLPIPE_DEMO_OUTPUT"):
        for tool in ("pipeline", "train"):
            r = subprocess.run([str(Path(sys.prefix) / "bin" / tool), "run", "all", "--manifest", DEMO, "--set",
                                f"output={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
            assert r.returncode == 0, (tool, r.stdout[-2000:], r.stderr[-3000:])
    script = [sys.executable, str(REPO / "benchmarks" / "demo_docs.py"), "--output", str(out)]
    r = subprocess.run([*script, "--check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    from tests.test_report import _driver

    _driver().quit()  # skips here without headless Chromium
    png = tmp_path / "report.png"
    r = subprocess.run([*script, "--png", "--png-out", str(png)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    side, docs = json.loads(Path(f"{png}.json").read_text()), json.loads((REPO / "docs" / "report.png.json").read_text())
    for k in ("manifest", "images", "runs", "job_table"):
        assert side[k] == docs[k], (k, side[k], docs[k])
    sys.path.insert(0, str(REPO / "benchmarks"))
    import demo_docs

    as_text = lambda t: "\n".join(t) + "\n" if isinstance(t, list) else t  # noqa: E731
    assert side["table"] == docs["table"] or not demo_docs.close_lines(as_text(side["table"]), 0.25, as_text(docs["table"])), \
        (side["table"], docs["table"])  # the same table, or within another CPU's digits (demo_docs --check)
    assert side["page"]["title"] == docs["page"]["title"] and png.stat().st_size > 50_000


def test_demo_table_check_tolerates_another_cpus_digits_only(monkeypatch):
    """benchmarks/demo_docs.py --check, where the tables differ: numbers within a quarter of their row's interval
    width pass (another CPU's arithmetic); a verdict, an item count, a label or a number moved further fails."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import demo_docs

    docs = ("job            headline           value  95% interval    no-learning b…      n  verdict  diff vs bar [95%]\n"
            "relation-head  rela…out/recall@1   37.1  [31.3, 42.6]    42.5 (recall…)    138  below    -5.43 [-9.72, -1.4]\n"
            "text-groups    retrieva…/i2t/R@1     20  [14.8, 26.4]    0.556 (chance)    180  above    —\n")
    monkeypatch.setattr(demo_docs, "docs_table", lambda text=None: docs)
    run = docs.replace("no-learning b…", "no-learning …").replace("37.1  [31.3, 42.6]", "35.6  [30.4, 41.1]") \
        .replace("(recall…)", "(recal…)").replace("-5.43 [-9.72, -1.4]", "-6.88 [-11.4, -2.6]")  # 2026-11-29's
    assert demo_docs.check_table(run) and demo_docs.close_lines(run, 0.25) == []
    # docs/performance.md quotes this case (a 2-core AMD EPYC's demo run against the table it shows)
    perf = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert "relation-head 35.6 [30.4, 41.1] against the 37.1 below" in perf and "37.1  [31.3, 42.6]" in docs
    assert "relation-head  rela…out/recall@1   37.1  [31.3, 42.6]" in (REPO / "docs" / "performance.md").read_text()
    assert len(demo_docs.close_lines(run, 0.1)) == 1  # 1.5 points is more than a tenth of the 11.3-wide interval
    for bad in (run.replace("below", "above", 1), run.replace(" 138 ", " 139 "), run.replace("(chance)", "(frozen)"),
                run.replace("35.6", "40.6"), run.replace("0.556 ", "5.556 ")):
        assert bad != run and len(demo_docs.close_lines(bad, 0.25)) == 1, bad


# --------------------------------------------------------------------------- every run folder a page names
RUN_FOLDER = re.compile(r"\bruns/([\w.-]+)/train/([\w-]+)/([\w.+-]+)")


def _named_run_folders():
    """(page, output, job, folder name) of every run folder a page names in full (not `grouped-...`,
    globs or `sweeps`)."""
    for page in [*PAGES, REPO / "BENCHMARKS.md"]:
        for out, job, tag in RUN_FOLDER.findall(page.read_text()):
            if not tag.endswith(("-", ".")) and tag != "sweeps" and job not in ("sweeps",):
                yield str(page.relative_to(REPO)), out, job, tag.rstrip(".")


def _demo_run_folders() -> set[str]:
    """The run folders the pages' `train run <job> -m manifests/demo.yaml [--set ...]` commands train in,
    as `train run` names them (train.cli.run_folder): `train run all` trains every job's."""
    from pipeline.config import load_manifest
    from train.cli import run_folder
    from train.registry import feature_jobs

    made = set()
    for _, argv in demo_commands():
        if Path(argv[0]).name != "train" or argv[1:2] != ["run"]:
            continue
        sets = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--set"]
        jobs = feature_jobs() if argv[2] == "all" else [argv[2]]
        for job in jobs:
            m = load_manifest(REPO / DEMO, sets)
            made.add(str(run_folder(job, m, getattr(m.train, job.replace("-", "_")))))
    return made


def test_named_demo_run_folders_are_made_by_a_documented_command():
    """A demo run folder a page names (`runs/demo/train/concept-ot/conceptot-...-d382ab`) is the folder a
    documented command trains in: docs/training.md named `conceptot-lr3e-5-1a2b3c` and
    `conceptot-hard_negatives_index-34a1d0`, which no command made."""
    made = _demo_run_folders()
    assert "runs/demo/train/concept-ot/conceptot-batch_size32-d_c32-lr0.01-max_steps300-rank16-d382ab" in made, made
    named = [(p, f"runs/{o}/train/{j}/{t}") for p, o, j, t in _named_run_folders() if o == "demo"]
    assert len(named) >= 6, named
    for page, folder in named:
        assert folder in made, f"{page}: {folder} is made by no documented demo command ({sorted(made)})"


def test_named_run_folders_keep_whole_option_words():
    """Every run folder a page names (the testbed's too) is `<variant>-<whole option words>-<hash>`: no
    word cut as the old 48-character rule cut them (`max_s`, `epochs-`, `epoch_unit_conce`)."""
    from train.registry import registry

    reg = registry()
    seen = 0
    for page, _, job, tag in _named_run_folders():
        if job not in reg or not re.search(r"-[0-9a-f]{6}$", tag):
            continue
        fields = reg[job].Config.model_fields
        import typing

        named = sorted((str(v) for v in typing.get_args(fields["variant"].annotation)) if "variant" in fields
                       else ["default"], key=len, reverse=True)  # a variant may hold a '-': dense-uot
        head = next((v for v in named if tag.startswith(v + "-")), tag.split("-", 1)[0])
        words = tag[len(head) + 1:-7].split("-")
        for i, w in enumerate(words):
            if w.isdigit() and i and words[i - 1][-1:] == "e":  # lr3e-5
                continue
            ok = [k for k in fields if w.startswith(k) and (len(w) > len(k) or fields[k].annotation is bool)]
            ok += [k for k in fields if w == f"no_{k}"]
            assert ok, f"{page}: {tag}: {w!r} is not a whole option word of {job}"
        seen += 1
    assert seen >= 8, seen


# --------------------------------------------------------------------------- papers cited, not pathed
def test_pages_cite_papers_by_title_and_id_not_by_a_path_outside_the_repository():
    """A reader of the repository has no `../shared`: the five papers are cited by title with their arXiv
    id (or OpenReview id where the paper has no arXiv version), never by a file of the shared folder."""
    shared_files = ("c3_song2024", "conceptot_kumar", "infoground_gupta2020", "visual-tokens_kalibhat",
                    "text-groups_behjati")
    for page in [*PAGES, REPO / "BENCHMARKS.md"]:
        text = page.read_text()
        assert "../shared" not in text and "shared papers folder" not in text, f"{page.relative_to(REPO)}: ../shared"
        for f in shared_files:
            assert f not in text, f"{page.relative_to(REPO)}: cites {f}..., a file outside the repository"
    ids = {"concept-ot": "OpenReview EU0tuTbrKn", "c3": "OpenReview vM1xZ9kDUj", "infoground": "arXiv:2006.09920",
           "visual-tokens": "arXiv:2405.16401", "text-groups": "arXiv:2511.11262"}
    arch = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for paper, ident in ids.items():
        source = next(x for x in (REPO / "docs" / "papers" / f"{paper}.md").read_text().splitlines()
                      if x.startswith("Source: "))
        assert re.search(r'"[A-Z][^"]{20,}"', source) and ident in source, (paper, source)  # the title, the id
        assert ident in arch, (paper, ident)


def test_readme_says_what_train_compare_prints():
    """The tour's `train compare` comment names the columns the command prints (it said "value,
    chance, n, skipped": compare has no skipped column)."""
    import pyarrow  # noqa: F401

    from train.eval import compare as C
    from train.eval.harness import write_results

    line = next(x for x in (REPO / "README.md").read_text().splitlines()
                if x.startswith(".venv/bin/train compare runs/demo/train/concept-ot/*  "))
    assert line.split("# ", 1)[1] == "its table: chance, value [95% interval] (n=N; verdict)", line
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_results([{"job": "j", "variant": "v", "checkpoint": "c", "step": 9, "benchmark": "b", "subset": "all",
                        "metric": "acc", "value": 70.0, "n": 200, "chance": 50.0, "ci_low": 63.3, "ci_high": 75.9,
                        "skipped": 4, "skip_reasons": "{}", "unit": "%", "note": ""}], Path(d) / "eval" / "final")
        txt = C.compare([Path(d)])
    head, _, row = txt.splitlines()[:3]
    assert head.startswith("| benchmark | subset | metric | chance | ") and "skipped" not in head
    assert row == "| b | all | acc | 50.0 % | 70.0 [63.3, 75.9] % (n=200; above) |", row
