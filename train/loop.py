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

    _vlpipe_run       the marker of a run folder this project made (train/run_folder.py): a run_dir
                      of other files is refused; temporary files are removed only where it is
    _lock             held (flock, pipeline/io/lock.py) by the process training in the folder: a
                      second `train run` of it is refused naming the holder's pid and host; the
                      lock of a process that died is taken over with a note
    config.json       the resolved job config
    metrics.jsonl     {"kind": "train"|"eval", "step", "epoch", ...} one line each
    metrics.png       losses and eval metrics against steps
    checkpoints/last.pt, checkpoints/final.pt  (rewritten only when a step is trained: a rerun of a
                      finished run changes no checkpoint)
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

from pipeline.errors import describe_exception
from pipeline.io.checkpoint import load_checkpoint as _load_checkpoint
from pipeline.io.atomic import remove_stale_tmp, write_bytes_atomic
from pipeline.io.artifacts import CorruptArtifact
from pipeline.io.checkpoint import CheckpointError, save_checkpoint_file
from pipeline.io.lock import lock_folder, unlock_folder
from train import tracking
from train.job import Job, batch_record
from train.metrics_file import lines_in, truncate_metrics
from train.ranks import Ranks
from train.run_folder import (  # noqa: F401 (re-exported)
    NotARunFolder,
    RunMismatch,
    check_run_files,
    check_run_folder,
    claim_run_folder,
    fresh_hint,
    restore_previous,
)

_truncate_metrics = truncate_metrics  # the name the tests of earlier rounds use

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


def save_checkpoint(path: Path, payload: dict, keep_previous: bool = False) -> None:
    """Tensors + plain data only (pipeline.io.checkpoint.plain), so it loads with weights_only=True;
    its sha256 beside it; ``keep_previous``: the replaced file stays as previous.pt."""
    save_checkpoint_file(path, payload, keep_previous=keep_previous)


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    return _load_checkpoint(path, map_location)  # weights_only=True; pickled objects are refused


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
    if dist.writer:
        claim_run_folder(run_dir, getattr(job, "NAME", ""))  # a folder of other files: refused, nothing deleted
        check_run_files(run_dir)  # a FIFO as config.json or last.pt.sha256: refused, never opened
    taken = dist.writer and lock_folder(run_dir, doing="trained", note=lambda line: print(line, file=sys.stderr))
    try:
        # the artifacts' fingerprints: checked on resume against the checkpoint's, stored in every checkpoint written
        inputs = job.input_fingerprints() if hasattr(job, "input_fingerprints") else {}
        if resume:
            check_run_folder(run_dir, run_cfg, getattr(job, "NAME", ""), inputs)  # before anything is written
        if dist.writer:
            if n := remove_stale_tmp(run_dir):  # e.g. .last.pt.<random>.tmp of a killed run (marked folder only)
                print(f"{run_dir}: removed {n} temporary file(s) left by an interrupted run", file=sys.stderr)
            (run_dir / "config.json").write_text(json.dumps({**run_cfg.model_dump(mode="json"), **batch_record(job)},
                                                            indent=1))
        dist.barrier()  # the other ranks read the folder (last.pt) only once rank 0 has cleaned it
        return _train_with_settings(job, job.cfg, run_dir, ckpt_dir, metrics_path, resume, progress and dist.writer,
                                    stop_after, dist, run_cfg, inputs)
    finally:
        if dist.writer:
            tracking.close(run_dir)  # the final harness table added, the trackers' files complete
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


def _train(job, cfg, run_dir, ckpt_dir, metrics_path, resume, progress, stop_after, dist, run_cfg, inputs) -> dict:
    seed_everything(cfg.seed)
    run = _Run(job, cfg, run_dir, dist, run_cfg, inputs)
    if resume and run.last.exists() and run.params:
        run.resume()
    elif dist.writer:
        run.start_over(resume)
    if not run.train_steps(progress, stop_after):
        return {"interrupted_at": run.step}
    return run.finish()


class EvaluationInputCorrupt(RuntimeError):
    """The final evaluation could not score because an input artifact is corrupt (one line naming
    the file and the fix); the trained checkpoints are kept."""


class _Window:
    """The train metrics summed since the last logged row (and its steps, samples and seconds):
    kept in last.pt, so the first row after a resume averages the same steps as a clean run's."""

    def __init__(self):
        self.acc: dict[str, float] = {}
        self.n_steps, self.n_samples, self.t0 = 0, 0, time.perf_counter()

    def add(self, values: dict, n_samples: int) -> None:
        for k, v in values.items():
            self.acc[k] = self.acc.get(k, 0.0) + float(v)
        self.n_steps += 1
        self.n_samples += n_samples

    def row(self, dist) -> dict:
        """The window's means (over its steps and the ranks) and rates; the window starts again."""
        dt = max(1e-9, time.perf_counter() - self.t0)
        acc, n_samples = dist.mean(self.acc), dist.sum(self.n_samples)  # the ranks' mean; samples of all ranks
        out = {**{k: v / self.n_steps for k, v in acc.items()},
               "steps_per_s": self.n_steps / dt, "samples_per_s": n_samples / dt}
        self.__init__()
        return out

    def state(self, dist) -> dict:
        """What a checkpoint keeps (called on every rank: the sums are the ranks' mean)."""
        shared = dist.mean({**{f"acc/{k}": v for k, v in self.acc.items()}, "samples": float(self.n_samples)})
        return {"acc": {k[4:]: v for k, v in shared.items() if k.startswith("acc/")}, "n_steps": self.n_steps,
                "n_samples": int(round(shared.get("samples", 0.0))), "seconds": time.perf_counter() - self.t0}

    def restore(self, st: dict | None) -> None:
        if not st:
            return
        self.acc = {k: float(v) for k, v in st["acc"].items()}
        self.n_steps, self.n_samples = int(st["n_steps"]), int(st["n_samples"])
        self.t0 = time.perf_counter() - float(st.get("seconds", 0.0))


def _optimizer(params: list, cfg, total: int):
    """AdamW (weight decay on matrices only) and its warmup + cosine schedule; (None, None) without parameters."""
    if not params:
        return None, None
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=tuple(cfg.betas),
    )
    warmup = int(round(cfg.warmup_frac * total))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup, cfg.min_lr_frac))


class _Run:
    """One call of :func:`train`: the model, its optimizer state and data position, and what it
    writes into the run folder (checkpoints, metrics.jsonl lines, evaluations; rank 0 only)."""

    def __init__(self, job, cfg, run_dir: Path, dist, run_cfg, inputs: dict):
        self.job, self.cfg, self.run_dir, self.dist, self.run_cfg = job, cfg, run_dir, dist, run_cfg
        self.inputs = inputs  # {option: artifact fingerprint}, written into every checkpoint
        self.ckpt_dir, self.metrics_path = run_dir / "checkpoints", run_dir / "metrics.jsonl"
        self.last = self.ckpt_dir / "last.pt"
        self.device = job.device
        self.model = job.build_model().to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        dist.broadcast_parameters(self.model)
        self.bpe = job.batches_per_epoch() if self.params else 0
        if self.params and self.bpe <= 0:
            raise RuntimeError("no training batches: the training split is empty or smaller than one batch")
        total = int(cfg.max_steps) if cfg.max_steps is not None else int(math.ceil(cfg.epochs * self.bpe))
        self.total = total if self.params else 0
        self.opt, self.sched = _optimizer(self.params, cfg, self.total)
        self.amp_on, self.amp_dtype, use_scaler = amp_settings(cfg.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None
        self.step, self.epoch, self.pos = 0, 0, 0
        self.resumed_at = -1  # the step last.pt held when this call resumed (-1: not resumed)
        # model selection (cfg.best_metric): the best value so far travels in last.pt, so a resumed run
        # keeps comparing against it
        self.best: dict = {"metric": getattr(cfg, "best_metric", None), "value": None, "step": None}
        self.window = _Window()

    # ---- the run folder at the start -----------------------------------------------------------
    def resume(self) -> None:
        """Continue from last.pt: model, optimizer, scheduler, scaler, RNG states, data position, the
        best value so far and the open log window; metrics.jsonl cut back to the checkpoint."""
        ck = load_checkpoint(self.last)
        try:
            self.model.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["optimizer"])
            self.sched.load_state_dict(ck["scheduler"])
            if self.scaler is not None and ck.get("scaler"):
                self.scaler.load_state_dict(ck["scaler"])
            self.step, self.epoch, self.pos = ck["step"], ck["epoch"], ck["batch_in_epoch"]
            self.resumed_at = int(self.step)
            _set_rng_state(ck["rng"])
            self.window.restore(ck.get("log_window"))
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {self.last}: does not resume this job's model ({describe_exception(e, 160)})") from None
        if (ck.get("best") or {}).get("metric") == self.best["metric"]:
            self.best.update(ck["best"])
        if not self.dist.writer:
            return
        step, total = self.step, self.total
        print(f"resumed from {self.last} at step {step} (epoch {self.epoch}, batch {self.pos})", file=sys.stderr)
        redo = frozenset({"eval", "best"}) if step >= total else frozenset()  # the final evaluation runs again
        if dropped := truncate_metrics(self.metrics_path, step, redo):
            print(f"{self.metrics_path}: {dropped}", file=sys.stderr)
        if step >= total:  # say why nothing trains, and what the rerun does instead
            print(f"{self.run_dir}: already trained {step} of {total} steps: {NOTHING_TO_TRAIN} "
                  "with the current evaluation settings (eval_every only acts during training: "
                  "--fresh retrains in this folder; more epochs or max_steps train in a folder of their own)",
                  file=sys.stderr)

    def start_over(self, resume: bool) -> None:
        """A run from step 0: what an earlier run left in metrics.jsonl and best.pt goes (a run killed
        before its first checkpoint says so)."""
        if resume and self.params and (n := lines_in(self.metrics_path)):
            print(f"{self.metrics_path}: dropped {n} line(s) of a run that stopped before its first checkpoint; "
                  "starting at step 0", file=sys.stderr)
        self.metrics_path.unlink(missing_ok=True)
        (self.ckpt_dir / "best.pt").unlink(missing_ok=True)

    # ---- what the run writes -------------------------------------------------------------------
    def checkpoint(self, path: Path, window: dict | None = None) -> None:
        if not self.dist.writer:
            return
        opt, sched, scaler = self.opt, self.sched, self.scaler
        save_checkpoint(path, {
            "model": self.model.state_dict(),
            "optimizer": opt.state_dict() if opt else None,
            "scheduler": sched.state_dict() if sched else None,
            "scaler": scaler.state_dict() if scaler else None,
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.pos,
            "rng": _rng_state(), "config": self.run_cfg.model_dump(mode="json"), "inputs": self.inputs,
            "job": getattr(self.job, "NAME", type(self.job).__name__), "best": dict(self.best),
            "log_window": window,
        }, keep_previous=path == self.last)

    def checkpoint_last(self) -> None:
        """last.pt with the open log window (every rank calls it: the window is the ranks' mean)."""
        self.checkpoint(self.last, self.window.state(self.dist))

    def log(self, row: dict) -> None:
        if not self.dist.writer:
            return
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        tracking.record(self.run_dir, row, self.run_cfg, getattr(self.job, "NAME", ""))  # TensorBoard, MLflow, W&B

    def run_eval(self, tag: str) -> dict:
        if not self.dist.writer:  # rank 0 evaluates; the others wait for it
            self.dist.barrier()
            return {}
        self.model.eval()
        with torch.no_grad():
            res = self.job.evaluate(self.model, self.run_dir / "eval" / tag)
        self.model.train()
        self.log({"kind": "eval", "step": self.step, "epoch": self.epoch, **res})
        plot_metrics(self.metrics_path, self.run_dir / "metrics.png")
        self.select_best(res)
        self.dist.barrier()
        return res

    def select_best(self, res: dict) -> None:
        """checkpoints/best.pt <- the model now, when res[cfg.best_metric] beats the best so far."""
        best, name = self.best, self.best["metric"]
        val = res.get(name) if name else None
        if not isinstance(val, (int, float)) or not math.isfinite(val) or not self.params:
            return
        better = best["value"] is None or (val > best["value"] if self.cfg.best_mode == "max" else val < best["value"])
        if better:
            best.update(value=float(val), step=self.step)
            self.checkpoint(self.ckpt_dir / "best.pt")
            self.log({"kind": "best", "step": self.step, "epoch": self.epoch, "metric": name, "value": float(val)})

    # ---- training ------------------------------------------------------------------------------
    def optimizer_step(self, batch) -> torch.Tensor:
        """One forward/backward/update on ``batch`` (autocast, loss scaling, gradients averaged over
        the ranks, clipping); the window gets its loss, gradient norm and the job's extras."""
        cfg, opt, scaler = self.cfg, self.opt, self.scaler
        ctx = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_on else contextlib.nullcontext()
        with ctx:
            loss, extras = self.job.loss(self.model, batch)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        self.dist.average_gradients(self.params)
        gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip if cfg.grad_clip else float("inf"))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        self.sched.step()
        self.step += 1
        self.pos += 1
        self.window.add({"loss": float(loss.detach()), "grad_norm": float(gn), **extras}, _batch_size(batch))
        return loss

    def after_step(self) -> None:
        """The step's metric line, evaluation and checkpoint, each when its interval comes round."""
        cfg, step, total = self.cfg, self.step, self.total
        if step % cfg.log_every == 0 or step == total:
            self.log({"kind": "train", "step": step, "epoch": self.epoch, "lr": self.sched.get_last_lr()[0],
                      **self.window.row(self.dist)})
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            self.run_eval(f"step{step:06d}")
        if step % cfg.ckpt_every == 0 and step < total:
            self.checkpoint_last()

    def train_steps(self, progress: bool, stop_after: int | None) -> bool:
        """Train to the last step; False when ``stop_after`` steps of this call ended it first (then
        last.pt holds the position)."""
        bar = _Progress(self.total, self.step, progress)
        self.model.train()
        steps_this_call, interrupted = 0, False
        while self.step < self.total and not interrupted:
            finished_epoch = True
            for batch in self.job.batches(self.epoch, self.pos):
                loss = self.optimizer_step(batch)
                steps_this_call += 1
                bar.update({"loss": f"{float(loss.detach()):.4f}"})
                self.after_step()
                if self.step >= self.total:
                    finished_epoch = self.pos >= self.bpe
                    break
                if stop_after is not None and steps_this_call >= stop_after:
                    interrupted, finished_epoch = True, False
                    break
            if finished_epoch:
                self.epoch += 1
                self.pos = 0
        bar.close()
        if interrupted:
            self.checkpoint_last()
            if self.dist.writer:
                plot_metrics(self.metrics_path, self.run_dir / "metrics.png")
        return not interrupted

    def finish(self) -> dict:
        """last.pt and final.pt, the final evaluation and benchmarks, eval/final/metrics.json last. A
        rerun that trained no step writes no checkpoint (previous.pt stays the one before), except a
        final.pt that is missing or not its recorded bytes, written again from last.pt's model."""
        if self.params:
            if self.step > self.resumed_at:
                self.checkpoint_last()
                self.checkpoint(self.ckpt_dir / "final.pt")
            elif self.dist.writer and _needs_writing(self.ckpt_dir / "final.pt"):
                self.checkpoint(self.ckpt_dir / "final.pt")
        elif self.dist.writer:
            save_checkpoint(self.ckpt_dir / "final.pt", {"model": self.model.state_dict(), "step": 0, "epoch": 0,
                                                         "batch_in_epoch": 0, "config": self.run_cfg.model_dump(mode="json")})
        final = self.run_dir / "eval" / "final"
        try:
            res = self.run_eval("final")
            if not self.dist.writer:
                return res
            final.mkdir(parents=True, exist_ok=True)
            if getattr(self.cfg, "benchmarks_at_end", False):
                final_benchmarks(self.job, self.model, final, self.ckpt_dir / "final.pt", self.step)
        except CorruptArtifact as e:  # no metrics.json: the next `train run` evaluates the kept model again
            raise EvaluationInputCorrupt(
                f"{e}; the final evaluation could not score (the trained model is kept in {self.ckpt_dir / 'final.pt'}: "
                "once the input is redone, the same `train run` evaluates it, nothing is retrained)") from None
        # written last: a run is finished once its eval/final/metrics.json exists (train sweep skips it)
        write_bytes_atomic(final / "metrics.json", json.dumps(res, indent=1).encode())
        return res


def _needs_writing(path: Path) -> bool:
    """``path`` is missing or not the bytes its checksum records."""
    from pipeline.io.checkpoint import integrity_problem

    return not path.is_file() or integrity_problem(path) is not None


def final_benchmarks(job: Job, model: torch.nn.Module, out_dir: Path, checkpoint: Path, step: int) -> None:
    """The harness (train/eval/harness.py) on the final model: eval/final/results.parquet, the
    table `train compare` reads. Problems are reported, never fail a finished training run, except a
    corrupt input artifact (:class:`CorruptArtifact`): nothing could be scored from it."""
    from train.eval.harness import run_harness

    has_own = type(job).job_metrics is not Job.job_metrics
    if not (job.manifest.eval.benchmarks or has_own):
        return
    try:
        table, errors = run_harness(job, model, job.manifest, out_dir, checkpoint=str(checkpoint), step=step)
    except CorruptArtifact:  # an input that is not the bytes written: the run fails (_Run.finish), the model is kept
        raise
    except Exception as e:  # noqa: BLE001 - report, keep the trained model
        print(f"benchmarks: not scored ({describe_exception(e, 200)})",
              file=sys.stderr)
        return
    for e in errors:  # (run_harness printed the one line of what was scored, and where)
        print(f"benchmarks: {e}", file=sys.stderr)


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
