"""The ``device`` and ``precision`` options every model stage shares.

``device: auto`` (the default) runs a model actor on CUDA exactly when Ray gave that actor a GPU,
i.e. when the stage's ``num_gpus`` is > 0 (Ray then reserves the GPU and sets
``CUDA_VISIBLE_DEVICES`` for the actor); otherwise on CPU. ``cpu``, ``cuda`` and ``cuda:N`` are
taken as given (``cuda`` without a visible GPU is a one-line error naming the option).
``precision: auto`` runs CUDA forward passes under fp16 autocast and CPU ones in fp32; ``fp32``,
``fp16`` and ``bf16`` force one (bf16/fp16 autocast on CPU only where torch supports it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal

from pydantic import Field

DEVICE_HELP = (
    "torch device of the model actors: auto (CUDA when the actor was given a GPU with num_gpus > 0, else CPU), "
    "cpu, cuda or cuda:N"
)
PRECISION_HELP = "auto: fp16 autocast on CUDA, fp32 on CPU; or fp32 / fp16 / bf16"
Precision = Literal["auto", "fp32", "fp16", "bf16"]


def device_field(default: str = "auto"):
    return Field(default, description=DEVICE_HELP)


def precision_field(default: str = "auto"):
    return Field(default, description=PRECISION_HELP)


def _actor_has_gpu() -> bool:
    try:
        import ray

        if ray.is_initialized() and ray.get_gpu_ids():
            return True
    except Exception:
        pass
    return False


def resolve_device(device: str | None) -> str:
    """``auto`` -> ``cuda`` when this process (a Ray actor) was given a GPU and CUDA is usable, else
    ``cpu``; an explicit device is checked and returned."""
    import torch

    d = (device or "auto").strip().lower()
    if d == "auto":
        return "cuda" if _actor_has_gpu() and torch.cuda.is_available() else "cpu"
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use device: auto or cpu")
    torch.device(d)  # raises on a malformed name
    return d


def autocast(device: str, precision: str = "auto"):
    """The mixed-precision context of a forward pass on ``device`` (a no-op for fp32)."""
    import torch

    kind = torch.device(device).type
    p = precision or "auto"
    if p == "auto":
        p = "fp16" if kind == "cuda" else "fp32"
    if p == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if p == "fp16" else torch.bfloat16
    return torch.autocast(device_type=kind, dtype=dtype)


def effective_precision(device: str | None, precision: str | None, num_gpus: float = 0) -> str:
    """The arithmetic the actors will use, known on the driver: ``fp32`` on CPU under ``auto``,
    fp16 on CUDA under ``auto``, else as given. Stages put it in their fingerprinted parameters only
    when it is not fp32 (so CPU results keep the fingerprints they had before the option existed)."""
    d = (device or "auto").strip().lower()
    on_gpu = d.startswith("cuda") or (d == "auto" and num_gpus > 0)
    p = precision or "auto"
    if p == "auto":
        return "fp16" if on_gpu else "fp32"
    return p


def fingerprinted(params: dict, device: str | None, precision: str | None, num_gpus: float = 0) -> dict:
    """``params`` without ``device``/``precision``, plus ``precision`` when it is not fp32."""
    out = {k: v for k, v in params.items() if k not in ("device", "precision")}
    p = effective_precision(device, precision, num_gpus)
    if p != "fp32":
        out["precision"] = p
    return out
