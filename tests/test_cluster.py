"""A real multi-node Ray cluster on this machine: a head and a second node joined to it (each
`ray start --block` on loopback with its own resources, started and stopped by this test through
their own process ids), the demo's stages run with `ray.address` pointing at it, and the artifacts
compared byte for byte with an embedded single-node run. The second node's worker processes are
killed mid-stage: Ray retries the lost units and the output is still byte-identical (nothing
duplicated, nothing missing)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
# `ray start` clusters use token authentication (Ray's default): every process of this test (the two
# nodes and the pipeline drivers) gets the same fresh token through the environment.
_TOKEN = secrets.token_hex(32)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ("ingest", "mine-concepts", "extract-clip-tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "RAY_DEDUP_LOGS": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": _TOKEN,
                # Ray's OOM killer watches the whole machine's memory, which other processes share
                # here: the only workers this test kills are the ones it kills itself
                "RAY_memory_monitor_refresh_ms": "0"})
    return env


class Node:
    """One `ray start --block` process and everything it spawned; stopped by its own pid."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
                                      "--disable-usage-stats", *args], stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, env=_env(), start_new_session=True)

    def descendants(self):
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def workers(self):
        out = []
        for p in self.descendants():
            try:
                cmd = " ".join(p.cmdline())
            except Exception:
                continue
            if "default_worker.py" in cmd or p.name().startswith("ray::"):
                out.append(p)
        return out


def stop_nodes(nodes: list[Node]) -> None:
    """SIGTERM to every node's `ray start --block` at once (each stops its own processes gracefully:
    about 30 s when they are left to finish), a few seconds' grace, then SIGKILL by pid to each node and
    everything it spawned (the test is over: nothing of the cluster is read after this)."""
    import psutil

    procs = [n.descendants() for n in nodes]
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)  # --block: stops the node's processes
    for n, left in zip(nodes, procs):
        try:
            n.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            n.proc.kill()
        for p in left:  # anything the node left behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _wait_nodes(address: str, n: int, timeout: float = 240) -> None:
    code = ("import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(1 for x in ray.nodes() if x['Alive']))")
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, env=_env(),
                           timeout=120)
        if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(3)
    raise AssertionError(f"cluster at {address} did not reach {n} nodes")


def _run(stage: str, out: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [str(BIN / "pipeline"), "run", stage, "--manifest", str(REPO / "manifests" / "tiny.yaml"),
           "--set", f"output={out}", *sum((["--set", e] for e in extra), [])]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)


def _shards(out: Path, artifact: str) -> dict:
    man = json.loads((out / artifact / "_manifest.json").read_text())
    return {(s.get("table"), Path(s["path"]).name): (s["rows"], s["sha256"]) for s in man["shards"]}


def _samples_rows(out: Path) -> list:
    import pyarrow.parquet as pq

    from pipeline.io.artifacts import Artifact

    rows = []
    for f in Artifact(out / "samples").files("samples"):
        for r in pq.read_table(f).to_pylist():
            if isinstance(r.get("image"), str) and r["image"].startswith(str(out)):
                r["image"] = os.path.relpath(r["image"], out)  # absolute refs (outputs written before relative paths)
            rows.append(r)
    return rows


@contextlib.contextmanager
def two_node_cluster(tmp_path: Path):
    """(address, second node): a head with 1 CPU and a second node with 1 CPU joined to it, both
    stopped by their own pids at exit."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    tmp_ray = Path(f"/tmp/rt{port}")  # unix socket paths must stay short
    head = Node(["--head", f"--port={port}", "--num-cpus=1", "--object-store-memory=120000000",
                 "--include-dashboard=false", f"--temp-dir={tmp_ray}"], tmp_path / "head.log")
    node2 = None
    try:
        _wait_nodes(address, 1)
        node2 = Node([f"--address={address}", "--num-cpus=1", "--object-store-memory=120000000",
                      '--resources={"second_node": 1}'], tmp_path / "node2.log")
        _wait_nodes(address, 2)
        yield address, node2
    finally:
        stop_nodes([n for n in (node2, head) if n is not None])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, second node) of one two-node cluster that this module's tests share (starting and
    stopping one takes tens of seconds); stopped after the module's last test. The test that kills
    the second node's workers leaves the node itself running (Ray starts new workers on it)."""
    pytest.importorskip("psutil")
    with two_node_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_train_two_workers_on_two_nodes(tmp_path, testbed_copy, cluster):
    """`train run concept-ot --workers 2` on the two-node cluster: one worker per node (each node has
    1 CPU and a worker takes 1), rank 0 writes the run folder, the run trains to its last step and
    evaluates. Data: a copy of the small oracle testbed (tests/conftest.py)."""
    data, _ = testbed_copy
    man = tmp_path / "m.yaml"
    man.write_text("name: t\n")
    run = tmp_path / "run"
    sets = [f"output={data}", "train.concept_ot.max_steps=4", "train.concept_ot.batch_size=16",
            "train.concept_ot.d_c=16", "train.concept_ot.rank=8", "train.concept_ot.log_every=1",
            "train.concept_ot.eval_splits=[test]", "train.concept_ot.sugarcrepe_dirs=[]", "train.concept_ot.heatmaps=0",
            "train.concept_ot.threads=1", f"train.concept_ot.run_dir={run}"]
    address, _ = cluster
    cmd = [str(BIN / "train"), "run", "concept-ot", "--manifest", str(man), "--workers", "2", "--no-progress",
           "--set", f"ray.address={address}", *sum((["--set", s] for s in sets), [])]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=1500)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert json.loads((run / "config.json").read_text())["workers"] == 2
    assert (run / "checkpoints" / "final.pt").is_file()
    assert "global/avg_R@1" in json.loads((run / "eval" / "final" / "metrics.json").read_text())


@pytest.mark.heavy
def test_multinode_cluster_matches_single_node_with_a_killed_node(tmp_path, cluster):
    single, multi = tmp_path / "single", tmp_path / "multi"
    for st in STAGES:
        p = _run(st, single, ["ray.num_cpus=2", "ray.object_store_memory=134217728"])
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]

    address, node2 = cluster
    killed = 0
    for st in STAGES:
        p = _run(st, multi, [f"ray.address={address}"])
        if st == "extract-clip-tokens":
            # kill the second node's workers once the stage has started work
            t0 = time.time()
            while p.poll() is None and time.time() - t0 < 600 and not killed:
                ws = node2.workers()
                busy = [w for w in ws if w.name().startswith("ray::") and "IDLE" not in w.name()]
                if busy:
                    time.sleep(1.0)
                    for w in node2.workers():
                        try:
                            w.kill()
                            killed += 1
                        except Exception:
                            pass
                time.sleep(0.5)
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"{st} on the cluster failed:\n{out[-4000:]}"
    assert killed >= 1, "no worker of the second node was seen running the stage"

    for art in ("concepts", "clip_tokens"):
        a, b = _shards(single, art), _shards(multi, art)
        assert a == b, f"{art}: shards differ between the single-node and the cluster run"
    assert _samples_rows(single) == _samples_rows(multi)
