"""Ray: an embedded, small and quiet local instance by default; a cluster when the manifest says so.

Stages hand their units of work to :func:`map_units`, which runs them as a Ray Data pipeline
(``from_items -> map_batches -> iterate``) with a task pool for pure-CPU work or an actor pool for
model work (the model is loaded once per actor, not once per unit). On a cluster the same code
spreads units over the nodes; the artifact folder must then be on storage all nodes share: a shared
file system, or an object store (``output: s3://...``, pipeline/io/storage.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.errors import RayStartError, describe_exception

log = logging.getLogger("pipeline")

_QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "1",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "RAY_COLOR_PREFIX": "0",  # worker lines forwarded to the driver without ANSI colour codes
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # no download / loading bars from model loads
    "TRANSFORMERS_VERBOSITY": "error",
}
_STORAGE_ENV = ("VLPIPE_CACHE_DIR", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL",
                "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")
# Workers only: model-loading bars (tqdm) from inside actors do not belong in the driver's log.
_WORKER_ENV = {"TQDM_DISABLE": "1"}


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(ray, ray_cfg, runtime_env) -> None:
    if ray_cfg.address:
        if ray_cfg.address != "auto" and "://" not in ray_cfg.address:  # host:port: Ray's helpers in the workers use it too
            runtime_env = {**runtime_env, "env_vars": {"RAY_ADDRESS": ray_cfg.address, **runtime_env.get("env_vars", {})}}
        ray.init(address=ray_cfg.address, runtime_env=runtime_env, log_to_driver=True, logging_level=logging.WARNING)
        return
    # Embedded: a new instance of our own, whatever else runs on the machine. address="local" never
    # attaches to another instance (ray.init() alone joins the one `ray start` last recorded, and
    # reads RAY_ADDRESS); its GCS listens on a port chosen here, and the workers get that address as
    # RAY_ADDRESS, so Ray's own helpers inside them (state API lookups) never search the machine
    # for "the" instance ("Found multiple active Ray instances").
    from ray._private.services import get_node_ip_address

    port = _free_port()
    own = f"{get_node_ip_address()}:{port}"  # the GCS address this instance will have
    runtime_env = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), "RAY_ADDRESS": own}}
    before = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    try:
        ray.init(
            address="local",
            num_cpus=ray_cfg.num_cpus or os.cpu_count(),
            object_store_memory=ray_cfg.object_store_memory,
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=True,
            configure_logging=True,
        )
    finally:
        if before is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = before


def _log_files() -> list[logging.Handler]:
    """The run's log files (``<output>/_logs/<command>.log``, set up by the CLI)."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


class _RayWarnings:
    """``warnings.showwarning`` that sends warnings raised in Ray's code (deprecations...) to the
    ``ray`` logger (the run's log file) and every other warning to the original handler."""

    def __init__(self, original):
        self.original = original

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if f"{os.sep}ray{os.sep}" in str(filename):
            logging.getLogger("ray").warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            self.original(message, category, filename, lineno, file, line)


class _ToLogFiles(logging.Handler):
    """Hands a record to the run's log files. Ray's loggers get this one rather than the files'
    own handlers: Ray sets its format on its loggers' handlers, which must not change the files'."""

    def emit(self, record: logging.LogRecord) -> None:
        for f in _log_files():
            if record.levelno >= f.level:
                f.handle(record)


_TO_LOG_FILES = _ToLogFiles()


def _worker_lines_to_log(data: dict) -> None:
    """Ray's forwarded worker output (a batch of lines of one process) as log records."""
    if data.get("pid") == "autoscaler":  # its periodic status report: in Ray's own session logs
        return
    lg = logging.getLogger("ray.workers")
    who = data.get("actor_name") or data.get("task_name") or f"pid={data.get('pid')}"
    for text in data.get("lines") or []:
        lg.log(logging.WARNING if data.get("is_err") else logging.INFO, "(%s) %s", who, text)


def route_ray_output() -> bool:
    """Ray's own log lines, warnings and forwarded worker output go to the run's log file, not the
    terminal: the ``ray`` loggers write to the log files only (no terminal handler, no propagation
    to the root's), warnings raised in Ray's code become ``ray`` log records, and the worker lines
    Ray prints on the driver's stderr become ``ray.workers`` records. Without a log file (a library
    call, a test) nothing changes: Ray's output then stays visible. True when routed."""
    import warnings

    files = _log_files()
    if not files:
        return False
    for name in ("ray", "ray.data", "ray.train", "ray.tune"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):  # the terminal ones (Ray Data's own file in the session folder stays)
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lg.removeHandler(h)
        if _TO_LOG_FILES not in lg.handlers:
            lg.addHandler(_TO_LOG_FILES)
        lg.propagate = False
    logging.getLogger("ray.workers").setLevel(logging.INFO)
    if not isinstance(warnings.showwarning, _RayWarnings):
        warnings.showwarning = _RayWarnings(warnings.showwarning)
    try:  # Ray's printer of worker lines (log_to_driver) is a handler of this dispatcher (Ray 2.x)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return True
    if any(name == "ray_print_logs" for name, _ in dispatcher.handlers):
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("vlpipe_worker_lines", _worker_lines_to_log)
    return True


def ensure_ray(ray_cfg) -> dict:
    """Start (or join) Ray once per process; returns a description for logs and provenance."""
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    route_ray_output()  # before the import: its deprecation warnings go to the log file too
    import ray

    for name in ("ray", "ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # We show our own progress (shards, rows, rate, ETA); Ray's notice that its bars are off is noise.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # A unit whose worker died on every try is dropped by Ray Data with a traceback at ERROR level;
    # pipeline.crashes reports it (one line naming the unit or the sample) instead.
    logging.getLogger("ray.data._internal.execution.streaming_executor_state").setLevel(logging.CRITICAL)
    if ray.is_initialized():
        return {"address": ray_cfg.address or "local", "cpus": ray.cluster_resources().get("CPU", 0)}
    # Workers must import this package; an editable install makes that true locally, and on a
    # cluster the image installs it. Keep the driver's sys.path for a source checkout too.
    # Object storage (pipeline/io/storage.py): the cache folder and the endpoint/region of the store
    # reach the workers; credentials do not travel (each node's environment or role provides them).
    env_vars = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", *_STORAGE_ENV) if k in os.environ}
    env_vars.update(_QUIET_ENV)
    env_vars.update(_WORKER_ENV)
    runtime_env = dict(getattr(ray_cfg, "runtime_env", None) or {})
    runtime_env["env_vars"] = {**env_vars, **dict(runtime_env.get("env_vars") or {})}
    from pipeline import ray_reaper

    before = set() if ray_cfg.address else ray_reaper.children()
    try:
        _init(ray, ray_cfg, runtime_env)
        if not ray_cfg.address:  # embedded: its processes end with this one, even on a kill -9
            ray_reaper.start(before)
    except Exception as e:  # a cluster that is not there, a node that cannot start on an overloaded machine
        where = ray_cfg.address or "embedded local"
        raise RayStartError(f"ray ({where}) could not start: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    from ray.data import DataContext

    route_ray_output()  # ray.init and ray.data's import configured terminal handlers and the worker-line printer
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.verbose_stats_logs = False
    cpus = ray.cluster_resources().get("CPU", 0)
    log.info("ray: %s, %s CPUs", ray_cfg.address or "embedded local", cpus)
    return {"address": ray_cfg.address or "local", "cpus": cpus}


def default_pool_size(ray_cfg, per_worker_cpus: float = 1.0) -> int:
    import ray

    if ray_cfg.actors:
        return ray_cfg.actors
    cpus = ray.cluster_resources().get("CPU", 1)
    return max(1, int(cpus // per_worker_cpus))


def _decode(batch) -> dict:
    return json.loads(batch["payload"].iloc[0])


def _encode(result: dict, batch=None):
    """The result row; it carries the unit's position (``index``) so that units that never come
    back (their worker died) are known (:mod:`pipeline.crashes`)."""
    import pandas as pd

    index = int(batch["index"].iloc[0]) if batch is not None and "index" in batch else -1
    return pd.DataFrame({"index": [index], "result": [json.dumps(result, default=str)]})


def _quiet_worker() -> None:
    """Inside a worker: the driver already logs warnings (random weights, ...) once; a worker's
    copies would reach the log once per actor with a process prefix. Errors still come through."""
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # its env settings cover a later import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def _contained(fn, payload: dict) -> dict:
    """Run one unit; an exception becomes ``{"unit", "failed": one line}`` for the driver to report
    (naming the unit) instead of a worker traceback through Ray. Full traceback at debug level."""
    try:
        return fn(payload)
    except Exception as e:
        log.debug("unit %s failed", payload.get("unit"), exc_info=True)
        return {"unit": payload.get("unit"), "failed": describe_exception(e)}


def _task_entry(batch, fn):
    _quiet_worker()
    return _encode(_contained(fn, _decode(batch)), batch)


def _built_and_called(payload: dict, cls: type, kwargs: dict) -> dict:
    return cls(**kwargs)(payload)


class _ActorEntry:
    """Constructs the stage's worker once per actor (model load), then calls it per unit. A worker
    that cannot be constructed reports the reason for each unit it is given."""

    def __init__(self, cls: type, kwargs: dict):
        self.impl, self.broken = None, None
        _quiet_worker()
        try:
            self.impl = cls(**kwargs)
        except Exception as e:
            self.broken = f"the worker could not start: {describe_exception(e)}"

    def __call__(self, batch):
        payload = _decode(batch)
        if self.broken:
            return _encode({"unit": payload.get("unit"), "failed": self.broken}, batch)
        return _encode(_contained(self.impl, payload), batch)


def map_units(
    units: list[dict],
    fn: Callable | type,
    *,
    ray_cfg,
    actor: bool = False,
    num_cpus: float = 1.0,
    pool_size: int | None = None,
    constructor_kwargs: dict | None = None,
    num_gpus: float = 0,
    split=None,
) -> Iterator[dict]:
    """Run ``fn`` once per unit on Ray and yield each unit's result dict as it finishes.

    ``units`` are JSON-able dicts. ``fn`` is a function ``fn(unit) -> dict`` (run in a task pool)
    or, with ``actor=True``, a class constructed once per actor with ``constructor_kwargs`` whose
    instances are called as ``obj(unit) -> dict`` (an actor pool: model loaded once per actor).
    Every unit yields a result: a unit whose worker process dies on every try is isolated by
    :func:`pipeline.crashes.isolate_crashes` (``split``, a :class:`pipeline.crashes.SampleSplit`,
    lets it find the sample that kills the worker) or reported ``failed``.
    """
    if not units:
        return iter(())
    from pipeline.crashes import isolate_crashes

    ensure_ray(ray_cfg)

    def run(batch: list[dict], alone: bool) -> Iterator[tuple[int, dict]]:
        return _map_once(batch, fn, ray_cfg=ray_cfg, actor=actor, num_cpus=num_cpus, pool_size=pool_size,
                         constructor_kwargs=constructor_kwargs, num_gpus=num_gpus, alone=alone)

    return isolate_crashes(units, run, actor=actor, split=split)


# Ray's retries of a unit whose worker died (Ray Data's default is forever: a sample that segfaults
# its worker restarted it 38 times in 150 s and the stage never ended). On a cluster, nodes come
# and go (tests/test_cluster.py kills a node's workers mid-stage), so more tries there.
RETRIES_LOCAL, RETRIES_CLUSTER = 1, 3


def _map_once(units: list[dict], fn, *, ray_cfg, actor: bool, num_cpus: float, pool_size: int | None,
              constructor_kwargs: dict | None, num_gpus: float, alone: bool) -> Iterator[tuple[int, dict]]:
    """One Ray Data pass over ``units``: ``(position, result)`` of each unit that came back. A unit
    whose retries ran out is dropped (``max_errored_blocks``), never the whole pass."""
    import ray.data
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    size = max(1, min(pool_size or default_pool_size(ray_cfg, num_cpus), len(units)))
    if num_gpus:
        import ray

        # More GPU actors than GPUs would wait forever for a device.
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus < num_gpus:
            raise RuntimeError(f"num_gpus={num_gpus} per actor, but the Ray cluster has {gpus} GPUs")
        size = min(size, int(gpus // num_gpus))
    items = [{"index": i, "payload": json.dumps(u, default=str)} for i, u in enumerate(units)]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds.context.max_errored_blocks = -1  # pipeline.crashes deals with the units that did not come back
    retries = RETRIES_CLUSTER if ray_cfg.address else RETRIES_LOCAL
    kwargs: dict[str, Any] = dict(batch_size=1, batch_format="pandas", num_cpus=num_cpus)
    if num_gpus:
        kwargs["num_gpus"] = num_gpus
    if actor and alone:
        # One unit per task, the worker built in it: a dying actor of a pool can take units queued
        # for the pool with it, a task only its own (pipeline.crashes runs lost units this way).
        fn = functools.partial(_built_and_called, cls=fn, kwargs=constructor_kwargs or {})
        actor = False
    if actor:
        # Embedded local Ray: max_restarts=0. Ray's restartable actors keep their constructor
        # arguments in the object store and log an error line about it for every actor; a unit that
        # fails is reported by the driver (naming the unit) and a rerun resumes. On a cluster
        # (ray.address set) nodes and their workers can die: actors restart and their lost units are
        # retried (tests/test_cluster.py kills a node's workers mid-stage), at the price of that line.
        if ray_cfg.address:
            kwargs["max_restarts"] = -1
            kwargs["max_task_retries"] = retries
        else:
            kwargs["max_restarts"] = 0
        compute = ActorPoolStrategy(size=size)
        step = dict(fn=_ActorEntry, fn_constructor_kwargs={"cls": fn, "kwargs": constructor_kwargs or {}})
    else:
        kwargs["max_retries"] = retries
        compute, step = TaskPoolStrategy(size=size), dict(fn=_task_entry, fn_kwargs={"fn": fn})
    with warnings.catch_warnings():  # Ray 2.60 names no parameter for retries and restarts but warns on these
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        out = ds.map_batches(compute=compute, **step, **kwargs)
    return ((int(row["index"]), json.loads(row["result"])) for row in out.iter_rows())
