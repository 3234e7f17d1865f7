"""The one interface every zoo workload follows.

A :class:`Workload` bundles a model whose ``forward(*batch)`` returns the scalar training loss,
and a deterministic batch factory. Keeping the loss inside ``forward`` puts the whole step in the
compiled region, so memcompile sees (and budgets) everything the step allocates.

    wl = memcompile.zoo.build("gpt", size="tiny", seed=0)
    loss = wl.model(*wl.batch(step))
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

#: Sizes every workload accepts: ``tiny`` for tests (an eager step well under 0.1 s on one CPU
#: thread), ``small`` for the demo and notebooks, ``bench`` for benchmarks/.
SIZES: tuple[str, ...] = ("tiny", "small", "bench")


@dataclass(frozen=True)
class Workload:
    """A model plus the batches it trains on.

    Attributes:
        name: registry name (``memcompile.zoo.names()``).
        summary: one line for ``memcompile demo`` and the docs.
        model: ``forward(*batch)`` returns a 0-dim loss tensor.
        batch_fn: ``batch_fn(step)`` returns the batch of that step; deterministic in
            (seed, step) and independent of torch's global RNG.
        dynamic: the fragment sequence or shapes change from step to step.
        single_fragment: under ``torch.compile`` the whole step is one Dynamo fragment.
        extra: workload-specific facts (sizes, expected fragment counts) for tests and docs.
    """

    name: str
    summary: str
    model: nn.Module
    batch_fn: Callable[[int], tuple[Any, ...]]
    dynamic: bool
    single_fragment: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def batch(self, step: int) -> tuple[Any, ...]:
        """The batch for training step ``step`` (same value every call)."""
        return self.batch_fn(step)

    def to(self, device: str | torch.device) -> Workload:
        """This workload with its model moved to ``device`` (in place, as ``nn.Module.to``) and
        batches made on the CPU as before, then copied to ``device``."""
        target = torch.device(device)
        fn = self.batch_fn

        def batch_fn(step: int) -> tuple[Any, ...]:
            return tuple(b.to(target) if isinstance(b, torch.Tensor) else b for b in fn(step))

        return replace(self, model=self.model.to(target), batch_fn=batch_fn)

    def loss(self, model: Callable[..., torch.Tensor], step: int) -> torch.Tensor:
        """Loss of ``model`` (this workload's model, or a compiled copy of it) on batch ``step``."""
        return model(*self.batch(step))

    def train(
        self,
        model: Callable[..., torch.Tensor],
        steps: int,
        *,
        optimizer: str = "sgd",
        seed: int = 123,
    ) -> list[torch.Tensor]:
        """Train this workload's parameters for ``steps`` steps through ``model`` (its model, or
        a compiled copy of it) and return each step's loss (detached).

        SGD at lr 0.1 or Adam at lr 1e-3; torch's global RNG is seeded with ``seed`` first, so
        dropout draws the same masks in every run: two runs from the same weights (eager, and
        compiled) must produce bit-identical losses.

        Raises:
            ValueError: ``optimizer`` is not "sgd" or "adam", or ``steps`` is negative.
        """
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam'; got {optimizer!r}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0; got {steps}")
        params = list(self.model.parameters())
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(params, lr=0.1)
            if optimizer == "sgd"
            else torch.optim.Adam(params, lr=1e-3)
        )
        torch.manual_seed(seed)
        losses = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = self.loss(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        return losses


def generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator seeded from (seed, step), so batches never touch the global RNG."""
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + step)
    return g


def check_size(size: str) -> None:
    """Raise ``ValueError`` naming the valid sizes."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
