"""The user's own activation checkpointing (``torch.utils.checkpoint(use_reentrant=False)``,
as Hugging Face's ``gradient_checkpointing_enable`` uses it): Dynamo traces it as tagged
regions, and every plan recomputes what eager recomputes (``JointModel.checkpointed``).
Before, memcompile's partition ignored the tags: without a budget an HF GPT-2 with checkpointing
on peaked at 35.91 MiB, against 15.38 MiB eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memcompile

from helpers import capture_module, quiet_peak


class Stack(nn.Module):
    """MLP blocks, each checkpointed (``residual``: ``x + block(x)``, else ``block(x)``: one
    region's output is the next one's input)."""

    def __init__(self, *, checkpointed: bool = True, residual: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh())
            for _ in range(4)
        )
        self.checkpointed, self.residual = checkpointed, residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            y = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
            x = x + y if self.residual else y
        return x.square().mean()


X = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))


def _step(model) -> None:
    model(X).backward()


@pytest.mark.parametrize("residual", [True, False])
def test_without_a_budget_the_users_checkpointing_is_kept(residual):
    torch._dynamo.reset()
    eager = Stack(residual=residual)
    mine = copy.deepcopy(eager)
    eager_peak = quiet_peak(lambda: _step(eager), eager)
    unchecked = Stack(checkpointed=False, residual=residual)
    unchecked_peak = quiet_peak(lambda: _step(unchecked), unchecked)
    compiled = memcompile.compile(mine)
    _step(compiled)  # compiles
    pairs = zip(eager.parameters(), mine.parameters(), strict=True)
    assert all(torch.equal(a.grad, b.grad) for a, b in pairs)  # bit-identical
    mine.zero_grad(set_to_none=True)
    measured = quiet_peak(lambda: _step(compiled), mine)
    rep = memcompile.report(compiled)
    # As eager with its checkpointing (before: as eager without it, 2x on this stack).
    assert measured <= eager_peak * 1.02 < unchecked_peak * 0.8, (measured, eager_peak)
    assert rep.exact and rep.predicted_peak == measured
    (plan,) = [f.plan for f in rep.fragments]
    assert sum(d.action == "recompute" for d in plan.decisions) >= 4 * 2  # each block's inside


def test_the_checkpointed_values_are_those_in_regions_and_the_boundaries_stay_saved():
    found = capture_module(Stack(residual=False), X)
    model = found["model"]
    checkpointed, saved = model.checkpointed(), model.eager_saved()
    assert checkpointed and not checkpointed & saved
    assert model.default_saved() - checkpointed <= saved
    # Each region's output is the next one's input: saved between them, never recomputed
    # through every region before it (torch's cleanup_recompute_tags).
    names = {model.describe(s) for s in saved - model.default_saved()}
    assert not names, names  # nothing eager would not keep: the inputs were read already
    outputs = [n for n in model.nodes if n.target is torch.ops.aten.tanh.default]
    assert len(outputs) == 4
    for n in outputs[:-1]:
        (s,) = model.storages[model.index[n]]
        assert s in saved and s not in checkpointed, n.name


def test_a_graph_without_checkpointing_keeps_eagers_saved_set():
    model = capture_module(Stack(checkpointed=False), X)["model"]
    assert not model.checkpointed()
    assert model.eager_saved() == model.default_saved()
