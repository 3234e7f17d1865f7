"""Timed training steps, as the benchmarks that compare step times run them.

    times, losses = timed_steps(wl, compiled, opt, steps)    # seconds and loss per step

Each step is ``wl.loss(model, i)``, ``backward()``, ``opt.step()``,
``opt.zero_grad(set_to_none=True)``, timed with ``time.perf_counter`` (with ``cuda``, the device
synchronized before and after each step, so the time is the device's too).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from memcompile.zoo.base import Workload

__all__ = ["timed_steps"]


def timed_steps(
    wl: Workload,
    model: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    cuda: bool = False,
) -> tuple[list[float], list[float]]:
    """Train ``wl`` through ``model`` for ``steps`` steps; each step's seconds and loss."""
    times, losses = [], []
    for i in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = wl.loss(model, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses
