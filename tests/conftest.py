"""Shared fixtures: quiet offline environment, one small embedded Ray per test session."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the sweep-state signing key (train/sweep_state.py): the tests' own, never the user's ~/.config/vlpipe
os.environ.setdefault("VLPIPE_STATE_KEY", os.path.join(tempfile.mkdtemp(prefix="vlpipe-test-key-"), "state.key"))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray sized for tests (2 CPUs, 128 MiB object store, no dashboard)."""
    from pipeline.config import RayConfig
    from pipeline.runtime import ensure_ray

    import ray

    ensure_ray(RayConfig(num_cpus=2, object_store_memory=128 * 1024**2))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def small_testbed(tmp_path_factory, ray_session) -> Path:
    """The structural tests' data, made once per session through the real stages: the testbed
    manifest (scene-oracle encoders) at 100 generated images (tests/testbed_reduced.py,
    :func:`small_oracle_testbed`: ingest, extract-clip-tokens, build-index). Returns its manifest;
    take a private copy with :func:`tests.testbed_reduced.copy_testbed` (or ``testbed_copy``)."""
    from tests.testbed_reduced import small_oracle_testbed

    return small_oracle_testbed(tmp_path_factory.mktemp("small_testbed"))


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """The learning tests' reduced testbed (tests/testbed_run.py, :class:`Testbed`): defined here, not
    imported into each test module, so that the modules share ONE instance per session (a fixture
    imported into two modules is two fixtures, and made the stages run twice)."""
    from tests.testbed_run import Testbed

    return Testbed(tmp_path_factory.mktemp("testbed"))


@pytest.fixture(scope="session")
def infoground_testbed(tmp_path_factory) -> Path:
    """The output folder of `pipeline run ingest / negative-captions / extract-regions` on the testbed
    manifest at 400 images (tests/test_testbed_infoground.py, :func:`run_stages`), made once per session
    for tests/test_testbed_infoground.py and tests/test_paper_grid_slow.py; each copies it
    (:func:`tests.test_testbed_infoground.copy_stages`) before it writes run folders."""
    from tests.test_testbed_infoground import run_stages

    out = tmp_path_factory.mktemp("infoground_testbed") / "out"
    run_stages(out)
    return out


@pytest.fixture(scope="session")
def oracle_testbed_400(tmp_path_factory, ray_session) -> Path:
    """The manifest of :func:`tests.testbed_reduced.reduced_testbed` at 400 images (every benchmark)
    with ingest, extract-clip-tokens and extract-visual-tokens run, once per session: the stages the
    visual-tokens and relation-head learning tests read (tests/test_testbed_visual_tokens.py,
    tests/test_testbed_relation_head.py); each takes a copy (:func:`tests.testbed_reduced.reduced_testbed_from`)."""
    from tests.testbed_reduced import reduced_testbed, run_stages

    man = reduced_testbed(tmp_path_factory.mktemp("oracle_testbed_400"), 400, None)
    run_stages(man, ["ingest", "extract-clip-tokens", "extract-visual-tokens"])
    return man


@pytest.fixture
def testbed_copy(small_testbed, tmp_path) -> tuple[Path, Path]:
    """(output folder, manifest) of this test's own copy of ``small_testbed``."""
    from tests.testbed_reduced import copy_testbed

    return copy_testbed(small_testbed, tmp_path)


@pytest.fixture
def shared_dir() -> Path:
    """../shared beside the checkout; tests that read it skip where it is absent (user machines)."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not present")
    return SHARED


@pytest.fixture
def sugarcrepe_dir(shared_dir) -> Path:
    d = shared_dir / "data" / "sugarcrepe"
    if not d.is_dir():
        pytest.skip("../shared/data/sugarcrepe is not present")
    return d


def make_manifest(tmp_path: Path, overrides: list[str] | None = None, path: str | None = None):
    """manifests/tiny.yaml (tiny-random models; or ``path``) with output under ``tmp_path`` and small Ray settings."""
    from pipeline.config import load_manifest

    base = [f"output={tmp_path / 'run'}", "ray.num_cpus=2", "ray.object_store_memory=134217728"]
    return load_manifest(path or REPO / "manifests" / "tiny.yaml", base + list(overrides or []))


@pytest.fixture
def one_thread():
    """Small tensor programs: one torch thread is fastest and robust to a shared, oversubscribed
    CPU (used by the OT / trainer test modules through ``pytestmark``)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: str):
    """A tmpfs of ``size`` (e.g. "64k", "1m") mounted at ``folder`` for a full-disk test (root only;
    the test is skipped where mounting is not permitted); unmounted after, lazily if a file is left open."""
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False)
