"""Every zoo workload under the memcompile backend: bit-identical training, no eager fallback,
and (single-fragment workloads) a predicted step peak within 3 % of the measured one."""

from __future__ import annotations

import warnings

import pytest
import torch

import memcompile
from memcompile import EagerFallbackWarning, zoo

from helpers import assert_same_state, measure_settled, predicted_peak

# The natural models fall back by design: tests/test_regions.py covers them.
NAMES = [n for n in zoo.names() if not zoo.build(n, size="tiny").extra.get("natural")]
SINGLE = [n for n in NAMES if zoo.build(n, size="tiny").single_fragment]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", NAMES)
def test_bit_identical_to_eager_under_memcompile(name: str, optimizer: str) -> None:
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, 3, optimizer=optimizer)
    compiled = torch.compile(comp.model, backend="memcompile")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)  # no frame may run eagerly
        compiled_losses = comp.train(compiled, 3, optimizer=optimizer)
    for step, (a, b) in enumerate(zip(eager_losses, compiled_losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    assert_same_state(eager.model, comp.model)  # parameters and buffers (BatchNorm stats)
    rep = memcompile.report(compiled)
    assert rep.fallbacks == ()
    assert sum(f.forward_calls for f in rep.fragments) >= 3


@pytest.mark.parametrize("name", SINGLE)
def test_predicted_step_peak_within_3_percent(name: str) -> None:
    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for step in range(2):
        wl.loss(compiled, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    batch = wl.batch(1)  # already compiled for: nothing compiles inside the measurement
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    opt.zero_grad(set_to_none=True)
    rep = memcompile.report(compiled)
    assert rep.exact, rep
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)
    (fragment,) = {call.split(".")[0] for call in rep.step}  # gru: one fragment per length
    assert rep.step == (f"{fragment}.fw", f"{fragment}.bw")


@pytest.mark.parametrize("name", NAMES)
def test_no_budget_never_raises_the_measured_peak(name: str) -> None:
    # Without a budget memcompile only reorders (it costs no time), so its step may not peak
    # above the same graphs under PyTorch's own partitioner (aot_eager). Caught: parameters
    # split per read (rewrites/input_uses.py) made the GRU's backward return one recurrent-weight
    # gradient per time step, 2.2x aot_eager's peak. Allowed: 1 %, as the activation split costs
    # TreeLSTM 192 B (0.11 %). Eager itself can be lower: TreeLSTM's graphs peak 7.9 % above it
    # under aot_eager and memcompile alike.
    peaks = []
    for backend in ("memcompile", "aot_eager"):
        torch._dynamo.reset()
        wl = zoo.build(name, size="tiny")
        compiled = torch.compile(wl.model, backend=backend)
        wl.train(compiled, 2)
        batch = wl.batch(1)
        wl.model.zero_grad(set_to_none=True)
        peaks.append(
            memcompile.measure_peak(
                lambda c=compiled, b=batch: c(*b).backward(), resident=[wl.model, batch]
            )
        )
    assert peaks[0] <= 1.01 * peaks[1], peaks


def test_multi_fragment_predictions_are_labelled_estimates() -> None:
    wl = zoo.build("early_exit", size="tiny")
    compiled = memcompile.compile(wl.model)
    wl.loss(compiled, 0).backward()
    rep = memcompile.report(compiled)
    assert len(rep.step) > 2 and not rep.exact
    assert "(estimate)" in str(rep)


@pytest.mark.parametrize("fraction", [0.7, 0.4])
@pytest.mark.parametrize("name", NAMES)
def test_bit_identical_to_eager_under_a_budget(name: str, fraction: float) -> None:
    """Every zoo model under budgets that force recomputation and swaps: the same losses and
    parameters as eager after Adam steps, whether or not the plan fits (best_effort), and a
    predicted step peak within 3 % of the measured one (seen: within 1.5 %, TreeLSTM's
    multi-fragment estimate the farthest)."""
    budget = int(predicted_peak(name) * fraction)
    torch._dynamo.reset()

    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, 3, optimizer="adam")
    compiled = memcompile.compile(comp.model, budget=budget, on_infeasible="best_effort")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = comp.train(compiled, 3, optimizer="adam")
    for step, (a, b) in enumerate(zip(eager_losses, losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    assert_same_state(eager.model, comp.model)
    assert not [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    rep = memcompile.report(compiled)
    plans = rep.plan.fragments
    assert plans and all(p.target is not None for p in plans)
    # Either the predicted step fits, or the user was told it does not (never a quiet overrun).
    # Multi-fragment steps are planned a fragment at a time and may exceed (see the README).
    warned = any(issubclass(w.category, memcompile.MemoryBudgetWarning) for w in caught)
    # ... or it is being re-planned with the whole step known (warned if that cannot fit).
    replanning = bool(rep.replans) and rep.replans[-1].fits is None
    assert rep.predicted_peak <= budget or (rep.over_budget and (warned or replanning)), rep
    if comp.single_fragment and fraction < 0.5:
        assert any(p.recomputed or p.swapped for p in plans), rep
    # A re-plan the last step decided compiles in the next: measure a step that compiles nothing.
    measured = measure_settled(compiled, comp, comp.batch(1))
    predicted = memcompile.report(compiled).predicted_peak
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
