"""`ray.runtime_env` reaches the workers: a module that exists only in a shipped working_dir is
importable inside a Ray task (how the package reaches cluster nodes whose image lacks it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_working_dir_reaches_workers(tmp_path):
    ship = tmp_path / "ship"
    ship.mkdir()
    (ship / "shipped_probe.py").write_text("VALUE = 'from the working_dir'\n")
    code = textwrap.dedent(f"""
        import ray
        from pipeline.config import RayConfig
        from pipeline.runtime import ensure_ray
        ensure_ray(RayConfig(num_cpus=1, object_store_memory=80 * 1024**2,
                             runtime_env={{"working_dir": {str(ship)!r}, "env_vars": {{"PROBE_ENV": "yes"}}}}))

        @ray.remote
        def probe():
            import os, shipped_probe
            return shipped_probe.VALUE, os.environ.get("PROBE_ENV"), os.environ.get("RAY_DEDUP_LOGS")

        print(ray.get(probe.remote()))
        ray.shutdown()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={"RAY_USAGE_STATS_ENABLED": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    # the shipped module, the manifest's env var and the pipeline's own quiet env all reach the worker
    assert "('from the working_dir', 'yes', '1')" in r.stdout


def test_ray_output_goes_to_the_run_log_not_the_terminal(tmp_path):
    """With the CLI's log file set up (pipeline.cli.setup_logging), Ray's logger records, warnings
    raised in Ray's code and the worker lines Ray forwards to the driver land in the log file; the
    terminal (stdout, stderr) shows none of them."""
    log_file = tmp_path / "_logs" / "run-x.log"
    code = textwrap.dedent(f"""
        import logging, time, warnings
        from pathlib import Path
        from pipeline.cli import setup_logging
        setup_logging(Path({str(tmp_path)!r}), "run-x")
        import ray
        from pipeline.config import RayConfig
        from pipeline.runtime import ensure_ray
        ensure_ray(RayConfig(num_cpus=1, object_store_memory=80 * 1024**2))

        @ray.remote
        def chatty():
            import sys
            print("probe worker stdout line")
            print("probe worker stderr line", file=sys.stderr)
            return 1

        assert ray.get(chatty.remote()) == 1
        logging.getLogger("ray.data").warning("probe ray logger warning")
        warnings.warn_explicit("probe ray deprecation", FutureWarning, "/x/site-packages/ray/util/y.py", 3)
        logging.getLogger("pipeline").warning("probe pipeline warning")
        time.sleep(3)  # Ray forwards worker lines asynchronously
        ray.shutdown()
        print("done")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={"RAY_USAGE_STATS_ENABLED": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                            "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    terminal = r.stdout + r.stderr
    text = log_file.read_text()
    for probe in ("probe worker stdout line", "probe worker stderr line", "probe ray logger warning", "probe ray deprecation"):
        assert probe in text, (probe, text[-2000:])
        assert probe not in terminal, (probe, terminal[-2000:])
    # the pipeline's own messages still reach both, in the pipeline's format (Ray's setup leaves it alone)
    assert "WARNING pipeline: probe pipeline warning" in text and "probe pipeline warning" in r.stderr
    assert "WARNING ray.data: probe ray logger warning" in text
