"""Helpers shared by test modules (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memcompile.zoo import Workload


def train(
    wl: Workload, model: Callable[..., torch.Tensor], optimizer: str, steps: int
) -> list[torch.Tensor]:
    """Train ``wl.model`` (through ``model``, maybe a compiled wrapper) and return the losses."""
    params = list(wl.model.parameters())
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.1)
    else:
        opt = torch.optim.Adam(params, lr=1e-3)
    torch.manual_seed(123)  # dropout draws from the global RNG: same stream in every run
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = wl.loss(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Parameters and buffers of ``a`` and ``b`` are bit-identical."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"differ: {differ}"
