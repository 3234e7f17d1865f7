"""``budget="60%"``: a share of the peak an iteration without a plan measures, resolved once the
loop runs (``step/fraction.py``)."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.config import MemConfig

from helpers import assert_same_state, quiet_peak, training_loop


def test_a_percentage_budget_is_measured_on_an_unplanned_iteration_then_held(caplog):
    # AdamW, 2 micro-batches: the first iteration compiles, the second is measured without a
    # plan, the model is compiled again at 60 % of that peak; from then on the iteration holds
    # that budget, and training stays bit-identical to eager throughout.
    torch._dynamo.reset()
    eager, comp = zoo.build("gpt", size="tiny"), zoo.build("gpt", size="tiny")
    eager_opt = torch.optim.AdamW(eager.model.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(comp.model.parameters(), lr=1e-3)
    eager_run = training_loop(eager, eager.model, eager_opt, micro=2)
    torch.manual_seed(7)
    eager_losses = [eager_run(k) for k in range(5)]
    eager_peak = quiet_peak(lambda: eager_run(5), eager.model, eager_opt)
    compiled = memcompile.compile(comp.model, budget="60%", on_infeasible="best_effort")
    run = training_loop(comp, compiled, opt, micro=2)
    torch.manual_seed(7)
    with caplog.at_level(logging.WARNING, logger="memcompile"), warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.MemoryBudgetWarning)
        losses = [run(0), run(1)]
        rep = memcompile.report(compiled)
        assert rep.budget is None and rep.measured_budget is not None  # applies at next call
        losses += [run(k) for k in range(2, 5)]
        measured = quiet_peak(lambda: run(5), comp.model, opt)
    said = [r.getMessage() for r in caplog.records]
    assert any("the first iterations run without a plan" in m for m in said), said
    assert any("compiled again under it" in m for m in said), said
    assert all(
        torch.equal(a, b)
        for xs, ys in zip(eager_losses, losses, strict=True)
        for a, b in zip(xs, ys, strict=True)
    )
    assert_same_state(eager.model, comp.model)
    for sa, sb in zip(eager_opt.state.values(), opt.state.values(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(sa.values(), sb.values(), strict=True))
    rep = memcompile.report(compiled)
    mb = rep.measured_budget
    assert mb is not None and mb.fraction == 0.6 and mb.micro_batches == 2
    assert rep.budget == mb.budget == math.floor(0.6 * mb.unplanned_peak)
    # Unplanned, memcompile's iteration is eager's, give or take what its graphs hold.
    assert abs(mb.unplanned_peak - eager_peak) <= 0.1 * eager_peak, (mb.unplanned_peak, eager_peak)
    assert measured <= rep.budget * 1.02, (measured, rep.budget)
    assert "60% of the" in str(rep) and rep.to_dict()["measured_budget"]["fraction"] == 0.6


def test_a_percentage_budget_resolves_in_a_loop_without_an_optimizer():
    # No optimizer (a loop that only zeroes the gradients): the measured iteration is one
    # forward and backward, ended when the next call begins with no gradients.
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="50%", on_infeasible="best_effort")
    run = training_loop(wl, compiled, None, micro=1)
    for k in range(2):
        run(k)
    before = memcompile.report(compiled)
    assert before.budget is None and "measured first" in str(before)
    run(2)  # its call starts over under the measured budget
    rep = memcompile.report(compiled)
    assert rep.measured_budget is not None and rep.measured_budget.micro_batches == 1
    assert rep.budget == rep.measured_budget.budget
    assert rep.fragments and all(f.plan is not None for f in rep.fragments if f.training)
    measured = quiet_peak(lambda: run(3), wl.model)
    assert measured <= rep.budget * 1.02, (measured, rep.budget)


def test_a_loop_that_measures_every_iteration_still_gets_its_budget_and_its_checks(monkeypatch):
    # The user wraps each iteration in memcompile.measure_peak (as the README shows): the
    # iteration to measure, and later the samples against the budget, run inside that
    # profiler session. Before, none began while it ran, and the budget never resolved.
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)  # (conftest: 0 outside test_iteration)
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3)
    compiled = memcompile.compile(wl.model, budget="60%", on_infeasible="best_effort")
    run = training_loop(wl, compiled, opt, micro=2)
    peaks = [quiet_peak(lambda k=k: run(k), wl.model, opt) for k in range(5)]
    rep = memcompile.report(compiled)
    mb = rep.measured_budget
    assert mb is not None and rep.budget == mb.budget == math.floor(0.6 * mb.unplanned_peak)
    # The iteration measured is the user's second, whose own figure it is.
    assert abs(mb.unplanned_peak - peaks[1]) <= 0.02 * peaks[1], (mb.unplanned_peak, peaks)
    assert rep.measured_peak is not None, peaks  # a sample of the plan's iteration was read
    assert peaks[4] <= rep.budget * 1.02, (peaks, rep.budget)


def test_a_loop_always_under_the_users_profiler_is_told_it_has_no_budget():
    from memcompile.step import fraction

    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3)
    compiled = memcompile.compile(wl.model, budget="60%")
    run = training_loop(wl, compiled, opt, micro=1)
    with pytest.warns(memcompile.MemoryBudgetWarning, match="began under one"):
        for k in range(fraction.PROFILED_ITERATIONS + 1):
            with torch.profiler.profile():
                run(k)
    assert memcompile.report(compiled).budget is None


def test_a_loop_that_never_ends_an_iteration_is_told_and_left_unprofiled(monkeypatch):
    # No optimizer and gradients never zeroed: no iteration ends, so the budget cannot be
    # measured; after MAX_MEASURED_STEPS steps the user is told and the profiler stops.
    from memcompile.step import fraction

    monkeypatch.setattr(fraction, "MAX_MEASURED_STEPS", 3)
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="60%")
    wl.loss(compiled, 0).backward()  # compiles
    with pytest.warns(memcompile.MemoryBudgetWarning, match="runs without a budget"):
        for k in range(1, 6):
            wl.loss(compiled, k).backward()
    assert not torch._C._autograd._profiler_enabled()
    assert memcompile.report(compiled).budget is None


def test_a_percentage_is_read_as_a_fraction_of_the_unplanned_peak():
    config = MemConfig.from_options({"budget": " 60% "})
    assert config.budget is None and config.budget_fraction == 0.6
    assert MemConfig.from_options({"budget": "100%"}).budget_fraction == 1.0


@pytest.mark.parametrize("bad", ["0%", "150%", "-5%", "lots%", "nan%", "%"])
def test_a_percentage_outside_zero_to_a_hundred_is_refused(bad):
    with pytest.raises(ValueError, match=r"not a percentage in \(0, 100\]"):
        memcompile.compile(torch.nn.Linear(2, 2), budget=bad)


def test_the_fraction_is_not_an_option_of_its_own():
    with pytest.raises(ValueError, match="unknown memcompile option 'budget_fraction'"):
        MemConfig.from_options({"budget_fraction": 0.5})


def test_a_percentage_works_through_torch_compiles_options():
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = torch.compile(wl.model, backend="memcompile", options={"budget": "60%"})
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1, momentum=0.9)
    for k in range(4):
        wl.loss(compiled, k).backward()
        opt.step()
        opt.zero_grad()
    rep = memcompile.report(compiled)
    assert rep.measured_budget is not None and rep.budget == rep.measured_budget.budget
