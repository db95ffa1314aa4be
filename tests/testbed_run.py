"""A reduced testbed, made through the real commands: ``manifests/testbed.yaml`` with fewer images
and its output in a temporary folder (written by :func:`tests.testbed_reduced.reduced_testbed`), its stages run by ``pipeline run <stage>`` in a subprocess,
its jobs by ``train run <job> --json`` (also in a subprocess: the commands a user types).

``testbed`` (tests/conftest.py) is a session fixture: the learning tests of several jobs (tests/test_testbed_*.py)
share one run of the stages; each test asks for the stages it needs (:meth:`Testbed.stages`,
idempotent: a stage already complete is skipped by the pipeline itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
N_IMAGES = 1000  # 50 test + 50 val images (i % 20 == 18 val, == 19 test): the benchmarks score held-out images only


class Testbed:
    def __init__(self, root: Path, n_images: int = N_IMAGES):
        from tests.testbed_reduced import reduced_testbed

        self.root = Path(root)
        # every benchmark, the manifest's shard sizes and object store: only the size and split change
        self.manifest = reduced_testbed(self.root, n_images, None, None, output="run", name="testbed.yaml",
                                        object_store_memory=None)
        self.output = self.root / "run"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self.done: set[str] = set()

    def _cli(self, tool: str, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", f"{tool}.cli", *args], cwd=REPO, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        assert p.returncode == 0, f"{tool} {' '.join(args)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    def stages(self, *names: str) -> None:
        """``pipeline run <stage> --manifest <reduced testbed>`` for each stage not run yet."""
        for s in names:
            if s not in self.done:
                self._cli("pipeline", "run", s, "--manifest", str(self.manifest))
                self.done.add(s)

    def _train_args(self, job: str, sets) -> list[str]:
        args = ["train.cli", "run", job, "--manifest", str(self.manifest), "--no-progress", "--json", "--fresh"]
        for s in sets:
            args += ["--set", s]
        return args

    @staticmethod
    def _result(stdout: str) -> tuple[dict, Path]:
        res = json.loads(stdout.strip().splitlines()[-1])
        return res, Path(res["run_dir"]) / "eval" / "final" / "results.parquet"

    def train(self, job: str, *sets: str) -> tuple[dict, Path]:
        """``train run <job> --manifest <reduced testbed> --json --set ...``: (the result line, the
        final results.parquet)."""
        p = self._cli("train", *self._train_args(job, sets)[1:])
        return self._result(p.stdout)

    def train_side_by_side(self, *runs: tuple[str, ...], timeout: int = 1500) -> list[tuple[dict, Path]]:
        """:meth:`train` of each ``(job, *sets)`` at once, one process each
        (:func:`tests.testbed_reduced.side_by_side`)."""
        from tests.testbed_reduced import side_by_side

        outs = side_by_side([[sys.executable, "-m", *self._train_args(job, sets)] for job, *sets in runs], timeout, self.env)
        return [self._result(so) for so in outs]


def rows(results: Path) -> dict:
    """{(benchmark, subset, metric): row} of a results.parquet ("" for no subset)."""
    import polars as pl

    return {(r["benchmark"], r["subset"] or "", r["metric"]): r for r in pl.read_parquet(results).to_dicts()}

