"""The compatibility matrix (benchmarks/compat_matrix.py, docs/compatibility.md): every published
configuration the adapters claim, built with random weights from its config and run through its
stage's adapter on 2 images / captions. Fast: one configuration per family at its published widths
with 1-4 blocks, the doc table's dims against the published ones, and ``pipeline plan``'s sizing of
every spec without a local folder. Slow: the full-size configurations."""

from __future__ import annotations

import pytest

from benchmarks import compat_matrix as CM

ROWS = {r.name: r for r in CM.ROWS}

pytestmark = pytest.mark.usefixtures("one_thread")


def _check(result, row):
    assert result["shapes"] == row.expect, (row.name, result["shapes"])
    assert result["dtype"] == "float32"
    assert result["s_per_image"] > 0 and result["peak_mb_per_image"] >= 0


@pytest.mark.parametrize("name", CM.REDUCED)
def test_reduced_depth_published_width_runs_through_the_adapter(name):
    _check(CM.measure(ROWS[name], reduced=True), ROWS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if not r.slow])
def test_full_size_configuration_runs_through_the_adapter(name):
    """The full-size configurations that fit the CI budget on 2 cores; the ``slow`` rows (CLIP ViT-L/14, SAM
    ViT-H) are run by ``benchmarks/compat_matrix.py --write`` and their dims checked in the doc's table."""
    _check(CM.measure(ROWS[name]), ROWS[name])


def test_doc_table_has_every_configuration_with_the_published_dims():
    text = CM.DOC.read_text()
    doc, skipped = CM.parse_table(text), CM.not_run(text)
    assert set(doc) | set(skipped) == set(ROWS) and not set(doc) & set(skipped), \
        "docs/compatibility.md: rerun benchmarks/compat_matrix.py --write"
    assert all(ROWS[n].slow for n in skipped)  # only a slow one may be left to the slow test, with its reason
    for name in doc:
        assert doc[name] == ROWS[name].expect, name


def test_plan_sizes_every_configuration_without_a_local_folder():
    """pipeline/sizing/shapes.py from published configs alone (these machines hold none of the folders):
    the same dims the adapters produce, and the doc's column."""
    doc_lines = {line.split("|")[1].strip(): line.split("|")[8].strip() for line in CM.DOC.read_text().splitlines()
                 if line.startswith("| ") and not line.startswith("| configuration")}
    for name, row in ROWS.items():
        got = CM.plan_dims(row)
        e = row.expect
        want = {"extract-clip-tokens": lambda: f"{e['patch_tokens'][0]}x{e['patch_tokens'][1]}, text {e['text_tokens'][1]}, "
                                               f"joint {e['image_embed'][0]}",
                "extract-image-groups": lambda: f"{e['groups'][0]}x{e['groups'][1]}, joint {e['image_embed'][0]}",
                "extract-visual-tokens": lambda: f"features {e['image_features'][0]}",
                "negative-captions": lambda: f"hidden {e['hidden'][1]}"}[row.stage]()
        assert got == want == doc_lines[name], name


def test_open_clip_flops_equal_the_hugging_face_configs():
    """An independent check of the open_clip sizing: open_clip's ViT-B-16 / ViT-L-14 configs and the
    openai checkpoints' config.json give the same architecture, so the same counted FLOPs."""
    from pipeline.sizing import shapes as S

    for oc, hf in (("open_clip:ViT-B-16", "openai/clip-vit-base-patch16"), ("open_clip:ViT-L-14", "openai/clip-vit-large-patch14")):
        a, b = S.clip(oc), S.clip(hf)
        assert a["flops_image"] == b["flops_image"] and a["flops_text"] == b["flops_text"], oc
        assert a["source"].startswith("open_clip config") and b["source"].startswith("published config")


def test_sam_vit_h_skip_reason_states_the_plans_flops_ratio():
    """The doc's reason for not running SAM ViT-H here quotes plan's count: 6x ViT-B's FLOPs per image."""
    from pipeline.sizing import shapes as S

    reason = CM.not_run(CM.DOC.read_text()).get("SAM ViT-H")
    if reason is None:
        pytest.skip("the doc's table ran SAM ViT-H")
    ratio = S.sam("vit_h:random")["flops_image"] / S.sam("vit_b:random")["flops_image"]
    assert f"{round(ratio)}x SAM ViT-B's FLOPs" in reason
