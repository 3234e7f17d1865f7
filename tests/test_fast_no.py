"""A fast "no": a budget below every plan's lower bound raises ``MemoryBudgetError`` at once,
with the bound, before any plan is searched (``pipeline/fragment.py``, ``search.lower_bound``);
a budget under half the first plan built raises without searching the alternatives, and one
under a quarter of it as planned before the late rewrites of its graphs (a quick "no",
``fragment._quick_no``)."""

from __future__ import annotations

import pickle

import pytest
import torch

import memcompile
from memcompile import MemoryBudgetError, zoo
from memcompile.pipeline import features, plan_cache, search
from memcompile.runtime.measure import storage_sizes
from memcompile.step import checks


def _error(wl: zoo.Workload, budget: int, **options) -> MemoryBudgetError:
    torch._dynamo.reset()
    compiled = memcompile.compile(wl.model, budget=budget, **options)
    with pytest.raises(MemoryBudgetError) as info:
        wl.loss(compiled, 0).backward()
    return info.value


def test_a_budget_below_every_plans_bound_is_told_without_a_search(monkeypatch):
    # 1 KiB for the tiny GPT: parameters may go to the host, but its largest (64 KiB: the
    # embedding, the head) is read whole on the device, beside the batch.
    searched = []
    monkeypatch.setattr(search.FragmentSearch, "plan", lambda *a, **k: searched.append(1))
    wl = zoo.build("gpt", size="tiny")
    err = _error(wl, 1024)
    assert not searched and err.bound
    largest = max(storage_sizes([p]).popitem()[1] for p in wl.model.parameters())
    assert largest <= err.min_feasible < 2 * largest, err.min_feasible
    message = str(err)
    assert "every plan peaks at" in message and "(a bound: no plan was searched)" in message
    assert "64.00 KiB is F0's largest parameter, fetched whole from the host" in message
    assert "on_infeasible='best_effort' searches anyway" in message
    again = pickle.loads(pickle.dumps(err))  # through pytest-xdist and multiprocessing
    assert again.bound and again.min_feasible == err.min_feasible and again.hint == err.hint


def test_the_bound_counts_the_parameters_where_they_may_not_leave_the_device():
    wl = zoo.build("gpt", size="tiny")
    params = sum(storage_sizes(wl.model.parameters()).values())
    err = _error(wl, 1024, offload_params=False)
    assert err.bound and err.min_feasible >= params
    assert "offload_params=True (or 'auto') keeps parameters on the host" in str(err)


def test_the_bound_is_never_above_the_searched_floor_which_best_effort_still_finds():
    # best_effort searches (the bound only ever answers "no" for on_infeasible="error") and
    # runs the smallest plan found: the bound is at or under that plan's peak.
    wl = zoo.build("gpt", size="tiny")
    bound = _error(wl, 1).min_feasible
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, on_infeasible="best_effort")
    with pytest.warns(memcompile.MemoryBudgetWarning, match="running the smallest plan found"):
        wl.loss(compiled, 0).backward()
    floor = memcompile.report(compiled).predicted_peak
    assert floor is not None and bound <= floor, (bound, floor)


@pytest.mark.long
@pytest.mark.parametrize("name", ["resnet", "gru", "branchy", "moe", "early_exit", "treelstm"])
def test_the_bound_is_at_or_under_the_first_fragments_smallest_plan_on_the_zoo(name):
    # The bound of F0 (the fragment that raises) against the smallest plan best_effort finds
    # for it (pytest -m long: a search per model).
    wl = zoo.build(name, size="tiny")
    bound = _error(wl, 1).min_feasible
    torch._dynamo.reset()
    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, on_infeasible="best_effort")
    with pytest.warns(memcompile.MemoryBudgetWarning):
        wl.loss(compiled, 0).backward()
    first = memcompile.report(compiled).fragments[0].plan
    assert first is not None and bound <= first.predicted_peak, (bound, first.predicted_peak)


def _searches(monkeypatch) -> list[str]:
    """The alternatives' searches and the plan cache's stores, as they are made."""
    made: list[str] = []
    alternatives, store = search.FragmentSearch.with_alternatives, plan_cache.store

    def with_alternatives(self, hosted, first):
        made.append("alternatives")
        return alternatives(self, hosted, first)

    def stored(key, entry):
        made.append("stored")
        return store(key, entry)

    monkeypatch.setattr(search.FragmentSearch, "with_alternatives", with_alternatives)
    monkeypatch.setattr(plan_cache, "store", stored)
    return made


def _builds(monkeypatch) -> list:
    """The late rewrites of each plan built: ``None``, tried; ``()``, none."""
    builds, build = [], search.FragmentSearch.build

    def built(self, cand, *, late=None):
        builds.append(late)
        return build(self, cand, late=late)

    monkeypatch.setattr(search.FragmentSearch, "build", built)
    return builds


def test_a_budget_far_under_the_first_plan_is_told_without_the_alternatives(monkeypatch):
    # Tiny GPT at 130 kB: over the bound (its 64 KiB head read whole, the batch), over a quarter
    # of the first plan as planned (386 KiB), under half of it built (300 KiB, and so with its
    # loss heads by blocks): a quick "no" after those two builds.
    made = _searches(monkeypatch)
    wl = zoo.build("gpt", size="tiny")
    with features.patch(plan_cache=True):
        err = _error(wl, 130_000)
    assert not err.bound and err.min_feasible > 2 * 130_000, err.min_feasible
    assert made == [], made  # no alternative searched, nothing cached to be replayed
    message = str(err)
    assert "the smallest peak found is" in message
    assert "the budget is under half of it, so no other plan was searched" in message
    assert "on_infeasible='best_effort' searches them all" in message


def test_best_effort_and_a_budget_within_reach_search_the_alternatives(monkeypatch):
    # The same budget with best_effort (it runs the smallest plan: it must find it), and with
    # the error at 0.6x the first plan's peak (the alternatives may get there).
    made = _searches(monkeypatch)
    wl = zoo.build("gpt", size="tiny")
    torch._dynamo.reset()
    compiled = memcompile.compile(wl.model, budget=130_000, on_infeasible="best_effort")
    with pytest.warns(memcompile.MemoryBudgetWarning, match="running the smallest plan found"):
        wl.loss(compiled, 0).backward()
    assert "alternatives" in made
    first = memcompile.report(compiled).fragments[0].plan
    assert first is not None
    made.clear()
    wl = zoo.build("gpt", size="tiny")
    err = _error(wl, int(0.6 * first.predicted_peak))
    assert "alternatives" in made and "no other plan was searched" not in str(err)


def test_a_budget_far_under_the_first_plan_as_planned_is_told_before_its_late_rewrites(
    monkeypatch,
):
    # An MLP of 512 KiB activations and 64 KiB weights, no loss head to make by blocks, at
    # 150 kB: over its bound (the batch, a weight read whole), under a quarter of the first plan
    # as planned: its graphs are built only without the late rewrites (in place, row tiling,
    # rematerialization), and no other plan is searched.
    made = _searches(monkeypatch)
    builds = _builds(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 128)]
    for _ in range(6):
        layers += [torch.nn.ReLU(), torch.nn.Linear(128, 128)]
    compiled = memcompile.compile(torch.nn.Sequential(*layers), budget=150_000)
    with features.patch(plan_cache=True), pytest.raises(MemoryBudgetError) as info:
        compiled(torch.randn(1024, 8)).pow(2).mean().backward()
    err = info.value
    assert builds == [()] and made == [], (builds, made)
    assert not err.bound and err.min_feasible > 4 * 150_000, err.min_feasible
    message = str(err)
    assert "that is the first plan's peak as planned: the budget is under 25% of it" in message
    assert "the rewrites of a plan's built graphs have taken off 50% at most" in message
    assert "on_infeasible='best_effort' tries them all" in message


def test_the_quick_no_before_the_late_rewrites_weighs_the_loss_heads_by_blocks_too(monkeypatch):
    # Tiny GPT at 80 kB: under a quarter of the first plan as planned (386 KiB) and of the plan
    # with its loss heads by blocks (412 KiB): planned, not built with the late rewrites.
    made = _searches(monkeypatch)
    builds = _builds(monkeypatch)
    err = _error(zoo.build("gpt", size="tiny"), 80_000)
    assert builds == [()] and made == [], (builds, made)
    assert "that is the first plan's peak as planned" in str(err)


class _Block(torch.nn.Module):
    """A mixture of experts as a user writes it: the expert chosen in Python from the
    router's output."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.router = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )
            for _ in range(experts)
        )
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = int(self.router(x).softmax(-1).mean((0, 1)).argmax())
        return x + self.experts[e](self.ln(x))


class _NaturalMoE(torch.nn.Module):
    """MoE blocks and an early exit from a ``.item()``: Dynamo runs this frame eagerly, so
    each block, the embedding, the exit and the head are fragments of their own, compiled in
    the step one after another."""

    def __init__(self, d: int = 64, experts: int = 4, layers: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d, experts) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)
        self.exit = torch.nn.Linear(d, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1 and torch.sigmoid(self.exit(x).mean()).item() > 0.9:
                break
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _moe_losses(model: torch.nn.Module, fn, iterations: int) -> list[torch.Tensor]:
    """AdamW, two micro-batches an iteration: the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(iterations):
        for _ in range(2):
            loss = fn(torch.randint(0, 256, (4, 32), generator=g)) / 2
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def test_a_fragment_that_misses_only_by_what_the_rest_of_the_step_holds_is_left_to_the_step(
    caplog, monkeypatch
):
    # Half the unplanned iteration's peak: the head, compiled last in the first planned step,
    # counts every other fragment's saved set (at its most), parameters and the optimizer's
    # state as they are then, and its bound was over the budget (4.04 MiB against 3.23 MiB):
    # a "no" from on_infeasible="error". The step planned as a whole fits.
    torch.manual_seed(0)
    ref = _NaturalMoE()
    torch.manual_seed(0)
    model = _NaturalMoE()
    expected = _moe_losses(ref, ref, 6)
    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)  # the iterations' measured peaks
    compiled = memcompile.compile(model, budget="50%")
    with caplog.at_level("INFO", logger="memcompile"):
        losses = _moe_losses(model, compiled, 6)  # no MemoryBudgetError
    assert "the rest of the step may give way" in caplog.text
    assert losses == expected
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    rep = memcompile.report(compiled)
    assert rep.budget is not None and rep.measured_peak is not None
    assert rep.measured_peak <= rep.budget, rep


def test_a_fragment_that_cannot_fit_even_alone_is_still_a_no():
    # The same model at 1 KiB: the rest of the step giving way leaves the fragment over it.
    torch.manual_seed(0)
    model = _NaturalMoE()
    compiled = memcompile.compile(model, budget=1024)
    with pytest.raises(MemoryBudgetError, match="a bound: no plan was searched"):
        _moe_losses(model, compiled, 1)
