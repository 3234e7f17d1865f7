"""A plan whose peak holds no saved or recomputed value: no other saved set is searched.

The alternatives of a plan over its target (recompute only, swap only, the floors) change what
is saved, recomputed and swapped; where none of that is live at the plan's peak they cannot
lower it, and searching them was most of the GRU small's first step under 14.2 MiB.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memcompile
import memcompile.pipeline.search as search
from memcompile import MemoryBudgetWarning
from memcompile.pipeline import features
from memcompile.planning.planner import search_saved_set

from helpers import capture_joint, capture_module

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class EmbedNet(nn.Module):
    """An embedding table's dense gradient (1 MiB) is the backward's peak, made after every
    saved activation was read: what is live there is the backward's own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 64)
        self.lin = nn.Linear(64, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.emb(idx))).square().mean()


def _idx() -> torch.Tensor:
    return torch.randint(0, 4096, (8, 32), generator=torch.Generator().manual_seed(1))


def test_decided_at_peak_counts_only_saved_and_recomputed_values() -> None:
    torch.manual_seed(0)
    model = capture_module(EmbedNet(), _idx())["model"]
    e = search_saved_set(model, None).final
    assert e.peak_phase == "backward"
    assert model.decided_at_peak(e) == 0
    # The GPT's backward peaks while its saved activations are still held.
    gpt = capture_joint("gpt")["model"]
    g = search_saved_set(gpt, None).final
    assert 0 < gpt.decided_at_peak(g) <= g.peak
    assert gpt.decided_at_peak(g) == sum(
        gpt.nbytes[s] for s in g.live_at_peak if s in g.saved
    ) + sum(
        gpt.nbytes[s]
        for s in g.live_at_peak - g.saved
        if any(s in gpt.storages[i] for i in g.recompute)
    )


def _planned(fraction: float, **switches: bool) -> tuple[memcompile.MemReport, int, list[str]]:
    """EmbedNet compiled under ``fraction`` of its no-budget peak, one step: its report, the
    planner calls made, and the budget warnings."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    unplanned = memcompile.compile(EmbedNet())
    unplanned(_idx()).backward()
    budget = int(fraction * memcompile.report(unplanned).predicted_peak)
    torch._dynamo.reset()
    calls = []
    planner = search.plan_fragment

    def counted(model, **kwargs):
        calls.append(kwargs.get("target"))
        return planner(model, **kwargs)

    torch.manual_seed(0)
    compiled = memcompile.compile(EmbedNet(), budget=budget, on_infeasible="best_effort")
    with (
        features.patch(**switches),
        warnings.catch_warnings(record=True) as caught,
        pytest.MonkeyPatch.context() as mp,
    ):
        warnings.simplefilter("always")
        mp.setattr(search, "plan_fragment", counted)
        compiled(_idx()).backward()
    said = [str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    return memcompile.report(compiled), len(calls), said


def test_a_plan_peaking_in_backward_values_gets_no_other_saved_set_searched() -> None:
    rep, calls, said = _planned(0.5)
    searched, calls_all, _ = _planned(0.5, fixed_peak=False)
    # Its own plan and the one with the parameters on the host; the alternatives are 4 more.
    assert calls == 2 and calls_all > calls, (calls, calls_all)
    # They would not have found a lower plan: the same one runs.
    assert rep.fragments[0].plan.decisions == searched.fragments[0].plan.decisions
    assert rep.predicted_peak == searched.predicted_peak > rep.budget
    assert any("no saved activation is live at that peak" in m for m in said), said


def test_a_plan_that_fits_is_not_called_fixed() -> None:
    rep, _, said = _planned(0.7)
    assert rep.predicted_peak <= rep.budget
    assert not said
