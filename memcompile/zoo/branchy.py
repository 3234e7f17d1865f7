"""Branchy: ``branches`` parallel wide branches joined by a sum (``branchy``).

Branch ``k`` maps the input ``x`` of shape ``(B, T, d)`` to ``h_k = Linear_k(x)`` of width
``width`` and reduces it to ``y_k = gelu(h_k).mean(-1)``; the branches are joined as
``sum_k y_k`` and the loss is the MSE against a target from the batch.

``forward`` is written breadth-first on purpose: all branch matmuls, then all GELUs, then all
reductions. Executed in program order the ``branches`` wide GELU outputs are alive at once;
a memory-aware scheduler can linearise the branches (GELU and reduce each ``h_k`` right away),
so only one wide temporary is alive at a time. The ``h_k`` themselves are saved for backward
(GELU's backward needs them) in both orders.

Static: the whole step is a single Dynamo fragment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator

_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(branches=8, d_in=32, width=128, seq_len=16, batch=4),
    "small": dict(branches=8, d_in=128, width=1024, seq_len=128, batch=8),
    "bench": dict(branches=8, d_in=256, width=2048, seq_len=256, batch=8),
}


class Branchy(nn.Module):
    """``forward(x, target)`` returns ``mse(sum_k gelu(Linear_k(x)).mean(-1), target)``."""

    def __init__(self, branches: int, d_in: int, width: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(d_in, width) for _ in range(branches))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Breadth-first (see the module docstring): each phase runs over every branch.
        hs = [branch(x) for branch in self.branches]
        gs = [F.gelu(h) for h in hs]
        ys = [g.mean(dim=-1) for g in gs]
        return F.mse_loss(torch.stack(ys).sum(dim=0), target)


@register("branchy")
def build_branchy(size: str, seed: int) -> Workload:
    """Eight wide parallel branches joined by a sum, written breadth-first."""
    cfg = _CONFIGS[size]
    torch.manual_seed(seed)
    model = Branchy(cfg["branches"], cfg["d_in"], cfg["width"])
    b, t, d = cfg["batch"], cfg["seq_len"], cfg["d_in"]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        x = torch.randn(b, t, d, generator=g)
        # A target the model can fit: a fixed nonlinear function of x plus a little noise.
        target = x[..., : d // 2].tanh().sum(-1) * 0.1 + 0.01 * torch.randn(b, t, generator=g)
        return x, target

    return Workload(
        name="branchy",
        summary=(
            f"{cfg['branches']} parallel branches Linear({d}->{cfg['width']}) + GELU + mean, "
            f"joined by a sum, on (B {b}, T {t}) inputs, written breadth-first"
        ),
        model=model,
        batch_fn=batch,
        dynamic=False,
        single_fragment=True,
        extra=dict(cfg),
    )
