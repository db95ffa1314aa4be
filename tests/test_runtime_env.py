"""`ray.runtime_env` reaches the workers: a module that exists only in a shipped working_dir is
importable inside a Ray task (how the package reaches cluster nodes whose image lacks it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
