"""The one training loop shared by every job.

Job interface (subclass :class:`Job`; see train/jobs/concept_ot/__init__.py for a complete example)::

    class MyJob(Job):
        def build_model(self) -> torch.nn.Module          # trainable parts (may have no parameters)
        def batches_per_epoch(self) -> int                # optimizer steps in one epoch
        def batches(self, epoch: int, start: int) -> Iterable[batch]
            # the epoch's batches from index ``start`` on; MUST be a pure function of
            # (cfg.seed, epoch): this is what makes resume exact (train.data.ShardStream does it)
        def loss(self, model, batch) -> tuple[torch.Tensor, dict[str, float]]
            # scalar loss to minimise + extra scalars to log (called under autocast when AMP is on)
        def evaluate(self, model, out_dir: Path) -> dict[str, float]
            # optional; may write files (plots, heatmaps) into out_dir

    ``self.cfg`` (the job's Config, a :class:`train.config.TrainerConfig`), ``self.manifest``,
    ``self.run_dir`` and ``self.device`` are set by the constructor.

:func:`train` runs it: AdamW (weight decay on matrices only), linear warmup then cosine decay
(per step), global-norm gradient clipping, autocast (``amp=auto``: fp16 + GradScaler on CUDA,
bf16 on CPUs with native bf16, off elsewhere), periodic checkpoints written atomically, resume with exact
continuation (model, optimizer, scheduler, scaler, RNG states and the data position, i.e. epoch
and batch index, are restored; ``metrics.jsonl`` lines past the checkpoint, out of step order or
unreadable are dropped, saying so; temporary files a killed run left are removed; the loss
curve is bit-identical when the CPU thread count is fixed, e.g. ``threads: 1``: multithreaded
BLAS reductions are not bitwise reproducible from run to run, resumed or not), metric
lines as JSON (``metrics.jsonl``) and a plot (``metrics.png``), periodic evaluation and a
progress bar with steps/s and samples/s.

Data-parallel (``train run --workers N``, :mod:`train.distributed`): ``train(job, dist=...)`` runs
on every rank with the rank's share of the data (train/job.py); gradients are averaged over the
ranks after each backward pass, logged metrics are the ranks' mean, and rank 0 alone takes the lock
and writes the run folder (checkpoints, metrics, evaluations) while the other ranks wait for it.

Run folder (``cfg.run_dir`` or ``<output>/train/<job>/<variant>[-<hash>]``, see
:meth:`train.config.TrainerConfig.run_tag`; one configuration per folder: resuming a checkpoint
of another training configuration raises :class:`RunMismatch` before anything is written)::

    _lock             held (flock, pipeline/io/lock.py) by the process training in the folder: a
                      second `train run` of it is refused naming the holder's pid and host; the
                      lock of a process that died is taken over with a note
    config.json       the resolved job config
    metrics.jsonl     {"kind": "train"|"eval", "step", "epoch", ...} one line each
    metrics.png       losses and eval metrics against steps
    checkpoints/last.pt, checkpoints/final.pt
    checkpoints/best.pt  with ``best_metric``: the model at the evaluation with the best value of
                      that evaluate() key so far (``best_mode`` max|min); a {"kind": "best"} metric
                      line records each new best
    eval/             whatever the job's evaluate() writes (final evaluation: eval/final/)
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.io.checkpoint import load_checkpoint as _load_checkpoint
from pipeline.io.atomic import remove_stale_tmp, write_bytes_atomic
from pipeline.io.checkpoint import CheckpointError, save_checkpoint_file
from pipeline.io.lock import lock_folder, unlock_folder
from train.job import Job
from train.ranks import Ranks

# what a resumed run that has no step left says (benchmarks/testbed.py reads it to tell a re-evaluation from a run)
NOTHING_TO_TRAIN = "nothing to train; the final model is evaluated again"


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run 3-5x faster than float32 there (BENCHMARKS.md, OT solvers);
    elsewhere torch emulates bf16 on the CPU, slower than float32."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        f = getattr(cpu, probe, None)
        try:
            if f is not None and f():
                return True
        except Exception:  # a probe missing from this torch build
            pass
    return False


def amp_settings(amp: str, device: torch.device) -> tuple[bool, torch.dtype | None, bool]:
    """(enabled, dtype, use_grad_scaler). ``auto``: fp16 + loss scaling on CUDA, bf16 on a CPU with
    native bf16, off on other CPUs (the paper trains in mixed precision; DESIGN.md: "mixed
    precision where available")."""
    if amp == "auto" and device.type == "cpu" and cpu_has_native_bf16():
        amp = "bf16"
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return False, None, False
    if amp == "bf16":
        return True, torch.bfloat16, False
    # fp16 (explicit, or auto on CUDA)
    return True, torch.float16, device.type == "cuda"


def lr_factor(step: int, total: int, warmup: int, min_frac: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_frac`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    prog = min(1.0, (step - warmup) / span)
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * prog))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    ns = st["numpy"]  # saved through plain(): the key array as a tensor
    np.random.set_state((ns[0], np.asarray(ns[1], dtype=np.uint32), *ns[2:]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(path: Path, payload: dict) -> None:
    """Tensors + plain data only (pipeline.io.checkpoint.plain), so it loads with weights_only=True."""
    save_checkpoint_file(path, payload)


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    return _load_checkpoint(path, map_location)  # weights_only=True; pickled objects are refused


def _truncate_metrics(path: Path, step: int) -> str:
    """Keep the lines of ``metrics.jsonl`` that a resume from ``step`` continues: readable, at or
    before ``step``, in step order and each (kind, step) once. A line whose step goes back, or
    repeats, is a remnant of another run that wrote into the same file. Returns what was dropped
    (one phrase; '' when nothing was)."""
    if not path.exists():
        return ""
    keep, past, back, bad = [], [], [], 0
    seen: set[tuple] = set()
    last = None
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        s = row.get("step") if isinstance(row, dict) else None
        if not isinstance(s, (int, float)) or isinstance(s, bool):
            bad += 1
        elif s > step:
            past.append(s)
        elif (last is not None and s < last) or (row.get("kind"), s) in seen:
            back.append(s)
        else:
            keep.append(line)
            seen.add((row.get("kind"), s))
            last = s
    if not (past or back or bad):
        return ""
    write_bytes_atomic(path, "".join(k + "\n" for k in keep).encode())

    def steps(xs: list) -> str:
        shown = ", ".join(str(x) for x in xs[:6])
        return f"step {shown}" if len(xs) == 1 else f"steps {shown}{', ...' if len(xs) > 6 else ''}"

    parts = ([f"{len(past)} past the checkpoint's step {step} ({steps(past)})"] if past else []) + \
            ([f"{len(back)} out of step order or repeated ({steps(back)}; another run wrote into this file)"]
             if back else []) + ([f"{bad} unreadable"] if bad else [])
    return f"dropped {len(past) + len(back) + bad} line(s): " + "; ".join(parts)


def plot_metrics(metrics_path: Path, out_png: Path) -> None:
    """Per-family panels of train and eval metrics against steps (see :mod:`pipeline.report.curves`)."""
    from pipeline.report.curves import plot_metrics as _plot

    _plot(metrics_path, out_png)


class _Progress:
    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled and total > 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                            mininterval=0.5, smoothing=0.1)

    def update(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict):
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return int(v.shape[0])
    return 0


class RunMismatch(RuntimeError):
    """A run folder whose checkpoint was trained with another configuration (one line: both configs
    and the way out)."""


def check_run_folder(run_dir: Path, cfg, job_name: str = "") -> None:
    """Refuse to resume ``run_dir`` when its checkpoint (else its config.json) holds another training
    configuration (train.config.config_differences: evaluation-only options may differ)."""
    from train.config import config_differences

    last = Path(run_dir) / "checkpoints" / "last.pt"
    stored, src = None, None
    if last.is_file():
        stored, src = (load_checkpoint(last).get("config") or None), last
    elif (Path(run_dir) / "config.json").is_file() and (Path(run_dir) / "checkpoints").is_dir():
        try:
            stored, src = json.loads((Path(run_dir) / "config.json").read_text()), Path(run_dir) / "config.json"
        except ValueError:
            stored = None
    if not stored:
        return
    diff = config_differences(stored, cfg)
    if diff:
        shown = list(diff.items())[:4]
        more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
        raise RunMismatch(
            f"{run_dir} holds a run of another configuration ({src.name}: "
            f"{', '.join(f'{k}={a}' for k, (a, _) in shown)}; now: {', '.join(f'{k}={b}' for k, (_, b) in shown)}{more}): "
            f"{fresh_hint(job_name)}")


def fresh_hint(job_name: str = "") -> str:
    """The ways out of a run folder that cannot be resumed."""
    key = f"train.{job_name.replace('-', '_')}" if job_name else "train.<job>"
    return f"pass --fresh to start over in it, or set {key}.run_dir to another folder"


def train(job: Job, *, resume: bool = True, progress: bool = True, stop_after: int | None = None,
          dist=None) -> dict:
    """Train ``job`` to ``cfg.max_steps`` (or ``cfg.epochs``); returns the final eval metrics.

    ``resume``: continue from ``checkpoints/last.pt`` when present. ``stop_after``: return after
    this many optimizer steps in this call (a checkpoint is written), as an interruption would.
    ``dist``: this process's :class:`train.ranks.Ranks` when data-parallel (then ``job.cfg``
    has the per-worker batch size and ``dist.run_cfg`` is the run's configuration, which the run
    folder and checkpoints record); ranks other than 0 return {}.
    """
    if dist is None:
        dist = Ranks()
    run_cfg = dist.run_cfg or job.cfg
    run_dir = job.run_dir
    ckpt_dir = run_dir / "checkpoints"
    metrics_path = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    taken = dist.writer and lock_folder(run_dir, doing="trained", note=lambda line: print(line, file=sys.stderr))
    try:
        if resume:
            check_run_folder(run_dir, run_cfg, getattr(job, "NAME", ""))  # before anything in the folder is written
        if dist.writer:
            if n := remove_stale_tmp(run_dir):  # e.g. .last.pt.<random>.tmp of a killed run
                print(f"{run_dir}: removed {n} temporary file(s) left by an interrupted run", file=sys.stderr)
            (run_dir / "config.json").write_text(json.dumps(run_cfg.model_dump(mode="json"), indent=1))
        dist.barrier()  # the other ranks read the folder (last.pt) only once rank 0 has cleaned it
        return _train_with_settings(job, job.cfg, run_dir, ckpt_dir, metrics_path, resume, progress and dist.writer,
                                    stop_after, dist, run_cfg)
    finally:
        if taken:
            unlock_folder(run_dir)


def _train_with_settings(job, cfg, *args) -> dict:
    """_train with the run's torch thread count and denormal mode, restored after."""
    prev_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # torch has no getter for the denormal mode: set it for the run, back to the default (off) after
    flush = bool(cfg.flush_denormal) and torch.set_flush_denormal(True)
    try:
        return _train(job, cfg, *args)
    finally:
        torch.set_num_threads(prev_threads)
        if flush:
            torch.set_flush_denormal(False)


def _train(job, cfg, run_dir, ckpt_dir, metrics_path, resume, progress, stop_after, dist, run_cfg) -> dict:
    seed_everything(cfg.seed)
    device = job.device
    model = job.build_model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    dist.broadcast_parameters(model)
    bpe = job.batches_per_epoch() if params else 0
    if params and bpe <= 0:
        raise RuntimeError("no training batches: the training split is empty or smaller than one batch")
    total = int(cfg.max_steps) if cfg.max_steps is not None else int(math.ceil(cfg.epochs * bpe))
    if not params:
        total = 0
    warmup = int(round(cfg.warmup_frac * total))

    opt = sched = scaler = None
    if params:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.betas),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup, cfg.min_lr_frac))
    amp_on, amp_dtype, use_scaler = amp_settings(cfg.amp, device)
    if use_scaler:
        scaler = torch.amp.GradScaler(device.type)

    step, epoch, pos = 0, 0, 0
    last = ckpt_dir / "last.pt"
    # model selection (cfg.best_metric): the best value so far travels in last.pt, so a resumed run
    # keeps comparing against it
    best: dict = {"metric": getattr(cfg, "best_metric", None), "value": None, "step": None}
    if resume and last.exists() and params:
        ck = load_checkpoint(last)
        try:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            sched.load_state_dict(ck["scheduler"])
            if scaler is not None and ck.get("scaler"):
                scaler.load_state_dict(ck["scaler"])
            step, epoch, pos = ck["step"], ck["epoch"], ck["batch_in_epoch"]
            _set_rng_state(ck["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            raise CheckpointError(f"checkpoint {last}: does not resume this job's model ({type(e).__name__}: {why})") from None
        if (ck.get("best") or {}).get("metric") == best["metric"]:
            best.update(ck["best"])
        if dist.writer:
            print(f"resumed from {last} at step {step} (epoch {epoch}, batch {pos})", file=sys.stderr)
            if dropped := _truncate_metrics(metrics_path, step):
                print(f"{metrics_path}: {dropped}", file=sys.stderr)
            if step >= total:  # say why nothing trains, and what the rerun does instead
                print(f"{run_dir}: already trained {step} of {total} steps: {NOTHING_TO_TRAIN} "
                      "with the current evaluation settings (eval_every only acts during training: "
                      "--fresh retrains in this folder; more epochs or max_steps train in a folder of their own)",
                      file=sys.stderr)
    elif (not resume or not params) and dist.writer:
        metrics_path.unlink(missing_ok=True)
        (ckpt_dir / "best.pt").unlink(missing_ok=True)

    def checkpoint(path: Path) -> None:
        if not dist.writer:
            return
        save_checkpoint(path, {
            "model": model.state_dict(),
            "optimizer": opt.state_dict() if opt else None,
            "scheduler": sched.state_dict() if sched else None,
            "scaler": scaler.state_dict() if scaler else None,
            "step": step, "epoch": epoch, "batch_in_epoch": pos,
            "rng": _rng_state(), "config": run_cfg.model_dump(mode="json"),
            "job": getattr(job, "NAME", type(job).__name__), "best": dict(best),
        })

    def log(row: dict) -> None:
        if not dist.writer:
            return
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def run_eval(tag: str) -> dict:
        if not dist.writer:  # rank 0 evaluates; the others wait for it
            dist.barrier()
            return {}
        model.eval()
        with torch.no_grad():
            res = job.evaluate(model, run_dir / "eval" / tag)
        model.train()
        log({"kind": "eval", "step": step, "epoch": epoch, **res})
        plot_metrics(metrics_path, run_dir / "metrics.png")
        select_best(res)
        dist.barrier()
        return res

    def select_best(res: dict) -> None:
        """checkpoints/best.pt <- the model now, when res[cfg.best_metric] beats the best so far."""
        name = best["metric"]
        val = res.get(name) if name else None
        if not isinstance(val, (int, float)) or not math.isfinite(val) or not params:
            return
        better = best["value"] is None or (val > best["value"] if cfg.best_mode == "max" else val < best["value"])
        if better:
            best.update(value=float(val), step=step)
            checkpoint(ckpt_dir / "best.pt")
            log({"kind": "best", "step": step, "epoch": epoch, "metric": name, "value": float(val)})

    bar = _Progress(total, step, progress)
    model.train()
    t_last, n_samples, n_steps = time.perf_counter(), 0, 0
    steps_this_call = 0
    acc: dict[str, float] = {}
    interrupted = False
    while step < total and not interrupted:
        it = job.batches(epoch, pos)
        finished_epoch = True
        for batch in it:
            ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_on else contextlib.nullcontext()
            with ctx:
                loss, extras = job.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            dist.average_gradients(params)
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip else float("inf"))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sched.step()
            step += 1
            pos += 1
            steps_this_call += 1
            n_steps += 1
            n_samples += _batch_size(batch)
            for k, v in {"loss": float(loss.detach()), "grad_norm": float(gn), **extras}.items():
                acc[k] = acc.get(k, 0.0) + float(v)
            bar.update({"loss": f"{float(loss.detach()):.4f}"})
            if step % cfg.log_every == 0 or step == total:
                dt = max(1e-9, time.perf_counter() - t_last)
                acc, n_samples = dist.mean(acc), dist.sum(n_samples)  # the ranks' mean; samples of all ranks
                row = {"kind": "train", "step": step, "epoch": epoch, "lr": sched.get_last_lr()[0],
                       **{k: v / n_steps for k, v in acc.items()},
                       "steps_per_s": n_steps / dt, "samples_per_s": n_samples / dt}
                log(row)
                acc, n_steps, n_samples, t_last = {}, 0, 0, time.perf_counter()
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                run_eval(f"step{step:06d}")
            if step % cfg.ckpt_every == 0 and step < total:
                checkpoint(last)
            if step >= total:
                finished_epoch = pos >= bpe
                break
            if stop_after is not None and steps_this_call >= stop_after:
                interrupted = True
                finished_epoch = False
                break
        if finished_epoch:
            epoch += 1
            pos = 0
    bar.close()
    if interrupted:
        checkpoint(last)
        if dist.writer:
            plot_metrics(metrics_path, run_dir / "metrics.png")
        return {"interrupted_at": step}
    if params:
        checkpoint(last)
        checkpoint(ckpt_dir / "final.pt")
    elif dist.writer:
        save_checkpoint(ckpt_dir / "final.pt", {"model": model.state_dict(), "step": 0, "epoch": 0, "batch_in_epoch": 0,
                                                 "config": run_cfg.model_dump(mode="json")})
    res = run_eval("final")
    if not dist.writer:
        return res
    (run_dir / "eval" / "final").mkdir(parents=True, exist_ok=True)
    if getattr(cfg, "benchmarks_at_end", False):
        final_benchmarks(job, model, run_dir / "eval" / "final", ckpt_dir / "final.pt", step)
    # written last: a run is finished once its eval/final/metrics.json exists (train sweep skips it)
    write_bytes_atomic(run_dir / "eval" / "final" / "metrics.json", json.dumps(res, indent=1).encode())
    return res


def final_benchmarks(job: Job, model: torch.nn.Module, out_dir: Path, checkpoint: Path, step: int) -> None:
    """The harness (train/eval/harness.py) on the final model: eval/final/results.parquet, the
    table `train compare` reads. Problems are reported, never fail a finished training run."""
    from train.eval.harness import run_harness

    has_own = type(job).job_metrics is not Job.job_metrics
    if not (job.manifest.eval.benchmarks or has_own):
        return
    try:
        table, errors = run_harness(job, model, job.manifest, out_dir, checkpoint=str(checkpoint), step=step)
    except Exception as e:  # noqa: BLE001 - report, keep the trained model
        print(f"benchmarks: not scored ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
              file=sys.stderr)
        return
    for e in errors:
        print(f"benchmarks: {e}", file=sys.stderr)
    print(f"benchmarks: {len(table)} result rows in {out_dir / 'results.parquet'}", file=sys.stderr)


def load_model_for_eval(job: Job, checkpoint: str | Path):
    """(model in eval mode with the checkpoint's weights, the checkpoint's step)."""
    model = job.build_model().to(job.device)
    ck = load_checkpoint(checkpoint, map_location=job.device)
    model.load_state_dict(ck["model"])
    model.eval()
    return model, int(ck.get("step", 0) or 0)


def evaluate_checkpoint(job: Job, checkpoint: str | Path, out_dir: Path | None = None) -> dict:
    model = job.build_model().to(job.device)
    ck = load_checkpoint(checkpoint, map_location=job.device)
    model.load_state_dict(ck["model"])
    model.eval()
    out = Path(out_dir) if out_dir else job.run_dir / "eval" / f"checkpoint-step{ck.get('step', 0):06d}"
    with torch.no_grad():
        res = job.evaluate(model, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(res, indent=1))
    return res
