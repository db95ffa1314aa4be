"""`pipeline report`, the run-all summary, the progress ETA and the training-curve panels.

Fast tests run stages in-process (a serial stand-in for the Ray mapper, same payload round trip
through JSON) on a few generated images. The browser test (slow) renders the whole demo's report
in headless Chromium: no console errors, every image loads, every section present, the summary on
top and the navigation (links that open their section, sections that open on a click); it saves a
screenshot (``.ci-reports/report.png`` when that folder exists, as under ``.ci/run``, or CI is set; else
the test's tmp folder).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, make_manifest


# --------------------------------------------------------------------------- in-process stage runner
def _serial_map_units(units, fn, *, ray_cfg=None, actor=False, constructor_kwargs=None, **_):
    obj = fn(**(constructor_kwargs or {})) if actor else fn
    for u in units:
        yield obj(json.loads(json.dumps(u, default=str)))


@pytest.fixture
def no_ray(monkeypatch):
    """Run stages serially in this process (the unit functions and actors are the real ones)."""
    import pipeline.runtime
    import pipeline.stage

    monkeypatch.setattr(pipeline.stage, "map_units", _serial_map_units)
    monkeypatch.setattr(pipeline.runtime, "map_units", _serial_map_units)
    monkeypatch.setattr(pipeline.stage, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(pipeline.runtime, "ensure_ray", lambda *a, **k: None)


def _run(stages, m):
    from pipeline.report.build import record_stage
    from pipeline.stage import RunContext, run_stage

    ctx = RunContext(m)
    for s in stages:
        record_stage(m.output, s, run_stage(s, ctx), "manifests/demo.yaml")
    return ctx


# --------------------------------------------------------------------------- numbers, ETA
def test_numbers_are_rounded_for_people():
    from pipeline.report.formatting import fmt_bytes, fmt_num, fmt_value

    assert fmt_num(40.00000059604645) == "40"
    assert fmt_num(0.123456) == "0.123"
    assert fmt_num(3.14159) == "3.14"
    assert fmt_num(12345.6) == "12,346"
    assert fmt_num(1234567) == "1,234,567"
    assert fmt_num(None) == "—" and fmt_num(float("nan")) == "—"
    assert fmt_value(40.00000059604645, "%") == "40.0%"
    assert fmt_value(0.71234, "fraction") == "0.712"
    assert fmt_bytes(2048) == "2.0 KB"


def test_eta_never_negative(caplog):
    from pipeline.stage import _Progress, format_seconds

    assert format_seconds(-5) == "0.0s" and format_seconds(125) == "2m 05s" and format_seconds(7300) == "2h 01m"
    p = _Progress("x", total_units=4, total_rows=10)  # the row estimate is exceeded after the first shard
    p.tty = False
    with caplog.at_level("INFO", logger="pipeline"):
        for _ in range(4):
            p._last = -1e9  # log every update
            p.update(50)
    etas = [r.getMessage().split("ETA ")[1] for r in caplog.records if "ETA" in r.getMessage()]
    assert len(etas) == 4 and not any(e.startswith("-") for e in etas), etas
    assert etas[-1] == "0.0s"


# --------------------------------------------------------------------------- training curves
def test_metric_panels_split_families(tmp_path):
    from pipeline.report.curves import metric_panels, plot_metrics

    rows = [{"kind": "train", "step": s, "epoch": 0, "loss": 10.0 / s ** 2, "lr": 1e-4, "grad_norm": 2.0,
             "steps_per_s": 5.0, "samples_per_s": 320.0, "hn_index_hit": 0.5} for s in (1, 2, 3, 4, 5, 6, 7, 8)]
    rows.append({"kind": "eval", "step": 8, "epoch": 0, "global/i2t_R@1": 40.00000059604645, "global/t2i_R@1": 12.5,
                 "chance/i2t_R@1": 3.1, "chance/t2i_R@1": 1.6, "eval_images": 64, "eval_captions": 320,
                 "grounding/acc@IoU0.5": 0.0, "chance/grounding_acc@IoU0.5": 0.0, "grounding/mean_IoU": 0.07,
                 "sugarcrepe/swap_att": 41.3, "sugarcrepe/overall": 47.4, "chance/sugarcrepe": 50.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn li')
    panels = {p["title"]: p for p in metric_panels(rows)}
    assert panels["train loss"]["keys"] == ["loss"] and panels["train loss"]["log"]  # spans > 1 decade
    assert not panels["learning rate"]["log"]
    ev = panels["eval: global (%)"]
    assert ev["ylim"] == (0, 100) and set(ev["keys"]) == {"global/i2t_R@1", "global/t2i_R@1"}
    assert ev["chance"] == {"global/i2t_R@1": "chance/i2t_R@1", "global/t2i_R@1": "chance/t2i_R@1"}
    # an accuracy of 0 % is a percentage (not a fraction on an axis of its own); IoU on a 0-1 axis
    assert panels["eval: grounding (%)"]["keys"] == ["grounding/acc@IoU0.5"] and panels["eval: grounding (%)"]["ylim"] == (0, 100)
    assert panels["eval: grounding (0-1)"]["keys"] == ["grounding/mean_IoU"]
    # SugarCrepe's pairwise accuracies: percent, with the family's chance (50) as their dashed line
    sc = panels["eval: sugarcrepe (%)"]
    assert sc["ylim"] == (0, 100) and sc["chance"] == {"sugarcrepe/overall": "chance/sugarcrepe",
                                                       "sugarcrepe/swap_att": "chance/sugarcrepe"}
    # counts never become a curve on a metric axis
    assert not any("eval_images" in k for p in panels.values() for k in p["keys"])
    out = plot_metrics(path, tmp_path / "metrics.png")  # one eval point still draws (markers), torn line skipped
    assert out and out.stat().st_size > 5000


def test_counts_named_by_their_leaf_stay_off_percentage_axes():
    from pipeline.report.curves import is_count, metric_panels

    rows = [{"kind": "eval", "step": 4, "sugarcrepe/overall": 47.4, "sugarcrepe/skipped_no_image": 3.0,
             "chance/sugarcrepe": 50.0, "grounding/acc_items": 12.5, "grounding/phrases_total": 16.0}]
    panels = {p["title"]: p for p in metric_panels(rows)}
    sc = panels["eval: sugarcrepe (%)"]
    assert sc["keys"] == ["sugarcrepe/overall"] and sc["counts"] == {"skipped_no_image": 3.0}
    assert panels["eval: grounding (%)"]["keys"] == ["grounding/acc_items"]  # a metric word wins
    assert panels["eval: grounding (%)"]["counts"] == {"phrases_total": 16.0}
    assert is_count("data/train_rows", [5]) and not is_count("similarity/mean_cos_diag", [0.2])


def test_no_metrics_no_figure(tmp_path):
    from pipeline.report.curves import plot_metrics

    assert plot_metrics(tmp_path / "absent.jsonl", tmp_path / "m.png") is None


# --------------------------------------------------------------------------- report: errors and missing artifacts
def test_report_shows_errors_and_missing_artifacts(tmp_path, no_ray):
    from pipeline.report import build_report

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=6", "stages.ingest.shard_size=4"])
    _run(["ingest"], m)
    out = Path(m.output)
    (out / "regions").mkdir()  # a stage that started and never finished
    html_path = build_report(out, "manifests/demo.yaml", m)
    html = html_path.read_text()
    # the demo's broken image and blank caption are shown by reason, with the sample they name
    assert "unreadable_image" in html and "empty_caption" in html
    assert "Errors by reason" in html and "sample_id" in html
    # every missing artifact says so and names the command that makes it
    for stage, artifact in [("mine-concepts", "concepts"), ("negative-captions", "negatives"),
                            ("extract-visual-tokens", "visual_tokens"), ("build-index", "index")]:
        assert f"pipeline run {stage} --manifest manifests/demo.yaml" in html, stage
    assert "the folder exists but has no _manifest.json" in html
    assert "no training run under" in html and "train run concept-ot --manifest manifests/demo.yaml" in html
    assert "Training runs: none yet" in html.split('id="overview"')[1].split("</section>")[0]  # said at the top too
    # thumbnails of the samples exist beside the page
    assert len(list((out / "report" / "img" / "thumbs").glob("*.jpg"))) >= 4
    assert "RANDOM WEIGHTS" not in html.split("<main>")[1].split('id="overview"')[0]  # ingest alone has no model


def test_report_command_and_run_summary(tmp_path, no_ray):
    from typer.testing import CliRunner

    from pipeline.cli import app

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    _run(["ingest"], m)
    res = CliRunner().invoke(app, ["report", str(m.output)])
    assert res.exit_code == 0, res.output
    assert (Path(m.output) / "report" / "index.html").is_file() and "report:" in res.output
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "is not a folder" in res.output


def test_inspect_on_a_run_folder_points_to_the_report(tmp_path, no_ray):
    from typer.testing import CliRunner

    from pipeline.cli import app

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    _run(["ingest"], m)
    res = CliRunner().invoke(app, ["inspect", str(m.output)])
    assert res.exit_code == 2 and "is a run folder" in res.output and f"pipeline report {m.output}" in res.output


def test_run_all_summary_lines(tmp_path, no_ray, capsys):
    from pipeline.cli import _run_summary

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    ctx = _run(["ingest"], m)
    _run_summary(ctx, ["ingest"], Path(m.output), Path("manifests/demo.yaml"), report=True)
    text = capsys.readouterr().out
    assert "ingest" in text and "samples" in text
    assert "_logs/run-all.log" in text
    assert f"report: {Path(m.output) / 'report' / 'index.html'}" in text


def test_noop_rerun_keeps_the_times_of_the_run_that_did_the_work(tmp_path, no_ray):
    from pipeline.report.build import read_runlog

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    ctx = _run(["ingest"], m)
    first = read_runlog(m.output)["stages"]["ingest"]
    assert ctx.summaries["ingest"]["units_run"] > 0 and first["seconds"] is not None
    ctx = _run(["ingest"], m)  # every shard complete: nothing computed
    assert ctx.summaries["ingest"]["units_run"] == 0
    again = read_runlog(m.output)["stages"]["ingest"]
    assert again["seconds"] == first["seconds"] and again["finished"] == first["finished"]
    assert again["checked_seconds"] == ctx.summaries["ingest"]["seconds"] and "checked" in again


# --------------------------------------------------------------------------- the demo in a real browser
def _chromium():
    for b in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(b):
            return shutil.which(b)
    return None


def _driver():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    browser, driver = _chromium(), shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no headless Chromium here: `apt-get install chromium chromium-driver` (.ci/run installs them)")
    o = webdriver.ChromeOptions()
    o.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
              "--allow-file-access-from-files"):
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=o, service=Service(driver))


def _demo_output(tmp_path) -> tuple[Path, object]:
    """The demo manifest, all stages, plus a brief concept-ot run (or VLPIPE_REPORT_DEMO: an existing one)."""
    existing = os.environ.get("VLPIPE_REPORT_DEMO")
    if existing:
        return Path(existing), None
    from pipeline.stage import dependency_order, registry

    sets = ["dataset.synthetic.n_images=24", "train.concept_ot.max_steps=4",
            "train.concept_ot.batch_size=4", "train.concept_ot.threads=1"]
    m = make_manifest(tmp_path, sets)
    reg = registry()
    _run(dependency_order([s for s in reg if getattr(m.stages, reg[s].key).enabled]), m)
    from typer.testing import CliRunner

    from train.cli import app as train_app  # concept-ot, briefly: curves, an eval table, its heatmaps

    args = ["run", "concept-ot", "--manifest", str(REPO / "manifests" / "tiny.yaml"), "--no-progress", "--fresh"]
    for o in [f"output={m.output}", *sets]:
        args += ["--set", o]
    res = CliRunner().invoke(train_app, args)
    assert res.exit_code == 0, res.output
    return Path(m.output), m


@pytest.mark.slow
def test_demo_report_in_headless_browser(tmp_path, no_ray, one_thread):
    from pipeline.report import SECTION_IDS, build_report

    driver = _driver()
    try:
        out, m = _demo_output(tmp_path)
        page = build_report(out, "manifests/demo.yaml", m)
        driver.get(page.resolve().as_uri())
        logs = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
        assert not logs, logs
        bad = driver.execute_script(
            "return Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
        n_img = driver.execute_script("return document.images.length")
        assert not bad, bad
        assert n_img >= 20, n_img
        for sid in SECTION_IDS:
            assert driver.execute_script(f"return !!document.getElementById('{sid}')"), sid
        missing = driver.execute_script("return Array.from(document.querySelectorAll('.missing-box')).map(e => e.textContent)")
        assert not missing, missing  # the demo has every artifact and a training run with an evaluation
        text = driver.execute_script("return document.body.innerText")
        assert "RANDOM WEIGHTS" in text and "concept-ot" in text
        overview = driver.execute_script("return document.getElementById('overview').innerText")
        assert "Training runs: concept-ot/" in overview, overview  # the runs are named at the top, linked
        # the summary on top: each run's headline metrics with interval and a verdict against chance
        verdicts = driver.execute_script(
            "return Array.from(document.querySelectorAll('#jobs-summary td.verdict')).map(e => e.textContent.trim())")
        assert verdicts and all(v in {"above", "below", "not resolved", "too few items", "baseline", "—"}
                                for v in verdicts), verdicts
        # navigation: every stage, artifact and run is a fold, closed at first, so the page is short
        from selenium.webdriver.common.by import By

        folds = driver.find_elements(By.CSS_SELECTOR, "details.fold")
        assert len(folds) >= len(SECTION_IDS), len(folds)
        height = driver.execute_script("return document.body.scrollHeight")
        assert height < 6000, height  # a demo with every artifact and one run: 17,500 px before the folds

        def fold_of(target_id):
            return driver.execute_script(f"return document.getElementById('{target_id}').closest('details.fold').open")

        run_link = driver.find_element(By.CSS_SELECTOR, "#jobs-summary a[href^='#train-']")
        target = run_link.get_attribute("href").split("#", 1)[1]
        assert not fold_of(target)
        run_link.click()  # a link from the summary opens the run's fold and shows its evaluation table
        assert fold_of(target) and driver.find_element(By.ID, target).find_elements(By.CSS_SELECTOR, "table")
        driver.execute_script("window.scrollTo(0, 0)")  # back to the summary (the sticky nav covered the link)
        stage_link = driver.find_element(By.CSS_SELECTOR, "#overview a[href='#stage-ingest']")
        assert not fold_of("stage-ingest")
        stage_link.click()
        assert fold_of("stage-ingest") and "Errors by reason" in driver.find_element(By.ID, "stage-ingest").text
        summary = driver.find_element(By.CSS_SELECTOR, "#visual_tokens details.fold > summary")
        summary.click()  # a section opens on a click of its title
        assert driver.execute_script("return document.querySelector('#visual_tokens details.fold').open")
        assert driver.execute_script("return document.body.scrollHeight") > height
        driver.execute_script("window.scrollTo(0, 0)")
        # .ci/run makes .ci-reports/ (its CI artifacts folder) before the slow suite
        shots = REPO / ".ci-reports" if os.environ.get("CI") or (REPO / ".ci-reports").is_dir() else tmp_path
        shots.mkdir(parents=True, exist_ok=True)
        from selenium.common.exceptions import TimeoutException

        h = driver.execute_script("return document.body.scrollHeight")
        try:  # the top of the page (a full 20,000 px page can time out on a loaded machine)
            driver.set_window_size(1400, min(h + 50, 6000))
            driver.save_screenshot(str(shots / "report.png"))
        except TimeoutException:
            driver.set_window_size(1400, 1000)
            driver.save_screenshot(str(shots / "report.png"))
        for sid in ("visual_tokens", "training"):  # and two opened sections further down, one screen each
            driver.set_window_size(1400, 1300)
            driver.execute_script(f"document.getElementById('{sid}').scrollIntoView()")
            driver.save_screenshot(str(shots / f"report-{sid}.png"))
        assert (shots / "report.png").stat().st_size > 50_000
    finally:
        driver.quit()


def test_eval_table_puts_overall_rows_first_and_folds_subsets(tmp_path):
    from pipeline.report.training import eval_tables
    from train.eval.harness import write_results

    def row(bench, subset, metric, value, unit="%"):
        return {"job": "j", "variant": "v", "checkpoint": "c", "step": 3, "benchmark": bench, "subset": subset,
                "metric": metric, "value": value, "n": 10, "chance": 50.0, "skipped": 0, "skip_reasons": "{}",
                "unit": unit, "note": ""}

    write_results([row("vg-relation", "above", "accuracy", 40.0), row("vg-relation", "all", "macro_accuracy", 48.7),
                   row("retrieval", "global", "i2t_R@1", 30.0), row("grounding", "all", "mean_IoU", 0.07, "fraction"),
                   row("vg-attribution", "black_blue", "accuracy", 0.0), row("vg-attribution", "all", "accuracy", 49.6)],
                  tmp_path / "run" / "eval" / "final")
    (t,) = eval_tables(tmp_path / "run")
    main = {(r["benchmark"], r["subset"]) for r in t["rows"] if r["main"]}
    assert main == {("vg-relation", "all"), ("retrieval", "global"), ("grounding", "all"), ("vg-attribution", "all")}
    assert t["n_sub"] == 2
    v = {(r["benchmark"], r["subset"]): r for r in t["rows"]}
    assert v[("vg-relation", "all")]["value"] == "48.7%" and v[("grounding", "all")]["value"] == "0.070"


def test_report_shows_benchmarks_train_eval_could_not_score(tmp_path, no_ray):
    from pipeline.report import build_report
    from train.eval.harness import write_results

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    _run(["ingest"], m)
    run = Path(m.output) / "train" / "concept-ot" / "conceptot"
    row = {"job": "concept-ot", "variant": "conceptot", "checkpoint": "c", "step": 3, "benchmark": "sugarcrepe",
           "subset": "all", "metric": "accuracy", "value": 47.4, "n": 274, "chance": 50.0, "skipped": 5,
           "skip_reasons": "{}", "unit": "%", "note": ""}
    err = "winoground: 0 of 52 items are scorable: 0 of 104 benchmark images are in runs/demo/samples"
    write_results([row], run / "eval" / "step000003", errors=[err])
    (run / "config.json").write_text(json.dumps({"variant": "conceptot", "seed": 0}))
    assert json.loads((run / "eval" / "step000003" / "errors.json").read_text()) == [err]
    html = build_report(Path(m.output), "manifests/demo.yaml", m).read_text()
    assert "Not scored (1)" in html and "winoground: 0 of 52 items are scorable" in html
    write_results([row], run / "eval" / "step000003")  # scored again without errors: the old list goes
    assert not (run / "eval" / "step000003" / "errors.json").exists()
    assert "Not scored" not in build_report(Path(m.output), "manifests/demo.yaml", m).read_text()


def test_significance_comes_from_the_95_interval_not_value_above_chance():
    from pipeline.report.significance import interval, verdict

    # AUC 0.515 on 45 items: a fraction without an interval column gets no verdict (was green "above chance")
    assert verdict({"value": 0.515, "n": 45, "chance": 0.5, "unit": "fraction"}) is None
    # a percentage without an interval: none either (no Wilson that ignores how items share images)
    assert verdict({"value": 60.0, "n": 1000, "chance": 50.0, "unit": "%"}) is None
    assert verdict({"value": 52.0, "n": 274, "chance": 50.0, "unit": "%", "ci_low": 46.1, "ci_high": 57.8}) == \
        "not resolved"
    assert verdict({"value": 0.0, "n": 52, "chance": 25.0, "unit": "%", "ci_low": 0.0, "ci_high": 6.9}) == "below"
    row = {"value": 0.6, "n": 45, "chance": 0.5, "unit": "fraction", "ci_low": 0.52, "ci_high": 0.68}
    assert interval(row) == (0.52, 0.68) and verdict(row) == "above"
    assert verdict({**row, "chance": None}) is None


def test_report_summary_on_top_and_a_folded_section_per_stage_and_job(tmp_path, no_ray):
    from pipeline.report import build_report
    from train.eval.harness import write_results

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=4"])
    _run(["ingest"], m)
    run = Path(m.output) / "train" / "concept-ot" / "conceptot"
    base = {"job": "concept-ot", "variant": "conceptot", "checkpoint": "c", "step": 3, "subset": "all", "skipped": 0,
            "skip_reasons": "{}", "unit": "%", "note": ""}
    from train.eval.intervals import wilson_n

    def ci(pct, n):
        return dict(zip(("ci_low", "ci_high"), wilson_n(pct / 100, n)))

    write_results([{**base, "benchmark": "sugarcrepe", "metric": "accuracy", "value": 51.5, "n": 274, "chance": 50.0,
                    **ci(51.5, 274)},
                   {**base, "benchmark": "winoground", "metric": "text_score", "value": 0.0, "n": 52, "chance": 25.0,
                    **ci(0.0, 52)},
                   {**base, "benchmark": "synthetic", "metric": "accuracy", "value": 90.0, "n": 200, "chance": 50.0,
                    **ci(90.0, 200),
                    "diff_vs": "accuracy[frozen]", "diff": 4.0, "diff_low": 1.5, "diff_high": 6.5},
                   {**base, "benchmark": "synthetic", "metric": "accuracy[frozen]", "value": 86.0, "n": 200,
                    "chance": 50.0, "baseline_for": "all/accuracy"}],
                  run / "eval" / "step000003")
    (run / "config.json").write_text(json.dumps({"variant": "conceptot", "seed": 0}))
    html = build_report(Path(m.output), "manifests/demo.yaml", m).read_text()
    top = html.split('id="overview"')[1].split("</section>")[0]
    jobs = top.split('id="jobs-summary"')[1].split("</table>")[0]
    # the headline metrics with interval and verdict, at the top
    assert 'href="#train-concept-ot-conceptot"' in jobs
    for metric, sig in [("sugarcrepe / accuracy", "not resolved"), ("winoground / text_score", "below"),
                        ("synthetic / accuracy", "above")]:
        cells = jobs.split(metric)[1].split("</tr>")[0]
        assert f">{sig}<" in cells, (metric, cells)
    # the paired difference from the baseline beside its verdict
    assert ">+4.0% [+1.5%, +6.5%] vs accuracy[frozen]<" in jobs.split("synthetic / accuracy")[1].split("</tr>")[0]
    assert "51.5%" in jobs and "45.6% – 57.4%" in jobs  # Wilson of 51.5 % over 274 items
    # far below chance: the table says why
    training = html.split('id="training"')[1]
    assert "ties count as wrong" in training.split("winoground")[1].split("</tr>")[0]
    assert "ties count as wrong" not in training.split("sugarcrepe")[1].split("</tr>")[0]
    # navigation: every stage, artifact and run is a collapsible section (static HTML, no script)
    for target in ("stage-ingest", "train-concept-ot-conceptot"):  # the link target sits inside its fold
        fold = [f for f in html.split('<details class="fold"')[1:] if f'id="{target}"' in f.split("</details>")[0]]
        assert len(fold) == 1, target
    assert html.count('<details class="fold"') >= 1 + 8 + 1 and "<script" not in html


def test_a_run_whose_metrics_hold_text_is_drawn(tmp_path):
    """A job's own metrics.json may hold a message (c3: no held-out triplet on a tiny split): the
    report shows it as text, beside the numeric rows, instead of failing to render."""
    from pipeline.report.training import eval_tables

    ev = tmp_path / "run" / "eval" / "final"
    ev.mkdir(parents=True)
    (ev / "metrics.json").write_text(json.dumps({"c3_mcp/error": "no held-out triplet", "loss": 1.5}))
    tables = eval_tables(tmp_path / "run")
    rows = {r["metric"]: r for t in tables for r in t["rows"]}
    assert rows["c3_mcp/error"]["value"] == "no held-out triplet" and rows["c3_mcp/error"]["verdict"] == ""
    assert all({"above", "below", "verdict", "ci"} <= set(r) for r in rows.values())
