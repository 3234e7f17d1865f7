"""``module:function`` targets for tests/test_cli.py and tests/test_viz.py (tests/ is on sys.path).

memcompile inspect cli_targets:mlp --budget 80%
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Calls of :func:`mse_loss` (the test of a target's own loss reads it).
LOSS_CALLS = [0]


def _data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    )
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(512, 32, generator=g), torch.randint(0, 10, (512,), generator=g)


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """(model, (inputs, targets)): the CLI's default loss, cross-entropy."""
    model, x, y = _data()
    return model, (x, y)


def mse_loss(model: Any, batch: tuple[Any, ...]) -> torch.Tensor:
    LOSS_CALLS[0] += 1
    (x,) = batch
    return model(x).pow(2).mean()


def mlp_with_loss() -> tuple[nn.Module, tuple[torch.Tensor], Any]:
    """(model, batch, loss): a target with its own loss."""
    model, x, _ = _data()
    return model, (x,), mse_loss


def raises() -> Any:
    raise RuntimeError("no data here")


def wrong_shape() -> int:
    return 3
