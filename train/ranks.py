"""A process's place in a data-parallel run and the collectives the shared loop needs
(train/loop.py; the process group is Ray Train's, see train/distributed.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Ranks:
    """This process's place in a data-parallel run (the defaults: one process, no communication)."""

    rank: int = 0
    world_size: int = 1
    run_cfg: Any = None  # the run's configuration (full batch size): what the run folder records

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def _on(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self._on():
            torch.distributed.barrier()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's initial weights on every rank (they agree already when seeded alike; this makes sure)."""
        if self._on():
            for t in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(t.data, src=0)

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Each parameter's gradient <- its mean over the ranks, in one all-reduce (a parameter that
        no rank gave a gradient keeps none, as in one process)."""
        if not self._on() or not params:
            return
        has = [p.grad is not None for p in params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] +
                         [torch.tensor(has, dtype=torch.float32, device=grads[0].device)])
        torch.distributed.all_reduce(flat)
        flat /= self.world_size
        any_grad = flat[-len(params):] > 0
        off = 0
        for p, g, ok in zip(params, grads, any_grad.tolist()):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(g).to(g.dtype) if ok else None
            off += n

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """The ranks' mean of each value (every rank logs the same keys)."""
        if not self._on() or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist())}

    def sum(self, value: float) -> float:
        if not self._on():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item())
