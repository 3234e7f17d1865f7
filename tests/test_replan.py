"""Steps predicted over budget are re-planned with the whole step known (planning/replan.py):
fragments planned one at a time are planned again with what the rest of the step holds."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import memcompile
from memcompile import MemoryBudgetWarning, zoo
from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.analysis.graph import GraphProfile
from memcompile.analysis.step_model import StepPrediction, simulate_step
from memcompile.planning.replan import MAX_REPLANS, decide_replan
from memcompile.report import find_compiler
from memcompile.runtime.measure import storage_sizes
from memcompile.step.resident import ResidentSet

from helpers import assert_same_state, measure_settled


def _unplanned_peak(name: str) -> int:
    """Measured peak of one step of zoo ``name`` (tiny) under memcompile without a budget."""
    torch._dynamo.reset()
    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model)
    wl.train(compiled, 1)
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(4)
    return memcompile.measure_peak(lambda: compiled(*batch).backward(), resident=[wl.model, batch])


def _train_under(
    name: str, budget: int, steps: int, **options: Any
) -> tuple[Any, zoo.Workload, list[warnings.WarningMessage]]:
    """Train zoo ``name`` under ``budget`` (and ``options``) next to eager (bit-identical losses
    and parameters); returns the compiled model, its workload and the warnings."""
    torch._dynamo.reset()
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, steps)
    compiled = memcompile.compile(comp.model, budget=budget, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = comp.train(compiled, steps)
    for step, (a, b) in enumerate(zip(eager_losses, losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    assert_same_state(eager.model, comp.model)
    return compiled, comp, caught


def _budget_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)]


@pytest.mark.parametrize("fraction", [0.92, 0.85])
def test_moe_over_budget_fits_once_the_experts_saved_sets_are_capped(fraction: float) -> None:
    # MoE's four fragments, planned one at a time, together peak over what the step needs
    # unplanned (the router and the first fragment know nothing of the experts' saved sets).
    # The step's peak is where eight expert calls' saved sets are held while the head runs:
    # an expert's own graph peak does not show them, so a tighter target alone never made it
    # give any up (0.92 and 0.85 warned "did not fit"). Re-planned with a cap on what each
    # fragment holds for its backward, it fits, measured.
    budget = int(_unplanned_peak("moe") * fraction)
    compiled, wl, caught = _train_under("moe", budget, 4)
    assert not _budget_warnings(caught), _budget_warnings(caught)
    rep = memcompile.report(compiled)
    first = rep.replans[0]
    assert first.round == 1 and first.predicted_peak > budget and rep.replans[-1].fits
    assert not rep.over_budget and rep.predicted_peak <= budget
    # The expert (F2, eight calls a step) was capped below what its first plan held, and its
    # new plan holds at most that.
    caps = dict(zip(first.fragments, first.saved_cap, strict=True))
    expert = rep.fragments[2].plan
    assert expert is not None and expert.saved_cap is not None and caps["F2"] is not None
    assert expert.held_bytes <= expert.saved_cap <= caps["F2"]
    assert expert.recomputed or expert.swapped
    assert "F2 (saved <= " in str(rep)
    assert tuple(rep.to_dict()["replans"][0]["saved_cap"]) == first.saved_cap
    # The re-planned fragments replace their records (same index, calls counted on).
    assert [f.name for f in rep.fragments] == ["F0", "F1", "F2", "F3"]
    assert rep.fragments[0].forward_calls == 4
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(4)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    assert measured <= budget, (measured, budget)


def test_step_that_replanning_cannot_fit_is_warned_and_reported() -> None:
    # At 70 % the router's backward alone (its attention's peak, nothing of which another
    # fragment holds) and the parameters leave no room: two rounds lower the predicted peak,
    # then nothing can be tightened. Parameters kept on the device: on the host ("auto",
    # test_auto_moves_parameters_to_the_host_with_less_reserve_for_the_pilot) the step fits.
    budget = int(_unplanned_peak("moe") * 0.70)
    compiled, _, caught = _train_under("moe", budget, 4, offload_params=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    assert len(messages) == 1, messages  # once per step composition, not once per step
    assert "re-planning its fragments with the whole step known did not fit it" in messages[0]
    # It names what is left to try: recompute and swap are allowed already.
    assert (
        "(set offload_params=True (" in messages[0] and " on the device), or raise" in messages[0]
    )
    assert "allow" not in messages[0]
    rep = memcompile.report(compiled)
    assert rep.over_budget and rep.replans and rep.replans[-1].fits is False
    assert rep.replans[-1].peak_after < rep.replans[0].predicted_peak  # it did lower it
    # Told to keep them on the device, no round puts the parameters on the host.
    assert rep.host_param_bytes == 0 and not any(r.host_params for r in rep.replans)
    assert "still over budget" in str(rep) and "EXCEEDED" in str(rep)


@pytest.mark.parametrize("name", ["early_exit", "moe"])
def test_auto_moves_parameters_to_the_host_with_less_reserve_for_the_pilot(name: str) -> None:
    # With the pilot's full prefetch reserve (2 blocks' host parameters) the plans with the
    # parameters on the host did not fit either, so "auto" kept them on the device and the
    # step ran over: early exit at 431,570 B measured 572,584 B, the MoE at 0.7x 440,136 B
    # (both warned). Planned with what is left for the cache, the host tier fits.
    # (The pilot asked for: "auto" no longer runs on the CPU device, nor reserves anything.)
    budget = 431_570 if name == "early_exit" else int(_unplanned_peak("moe") * 0.70)
    compiled, wl, caught = _train_under(name, budget, 4, pilot="lightgbm")
    assert not _budget_warnings(caught), _budget_warnings(caught)
    measured = measure_settled(compiled, wl, wl.batch(4))
    rep = memcompile.report(compiled)
    assert rep.host_param_bytes > 0 and not rep.over_budget
    assert measured <= budget, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)


def test_auto_puts_the_whole_steps_parameters_on_the_host_when_saved_sets_cannot_fit_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The MoE at 0.6x: each fragment's first plan fits alone, so "auto" kept the parameters on
    # the device; the step did not fit, and each re-plan tried the host tier for its own
    # parameters only, which the others' still on the device made useless ("keeping the
    # parameters on the host does not help"): two rounds, warned, 438,048 B measured in a
    # 348,756 B budget. Once the saved sets are spent, one round puts every fragment's
    # parameters on the host, and the step fits.
    budget = int(_unplanned_peak("moe") * 0.60)
    # Each fragment that round plans with its parameters on the host counts the others' as
    # moved too (they move when their fragments compile next), not as resident.
    # (fragment, bytes of the others' parameters not counted, those still on the device)
    moving: list[tuple[int, int, int]] = []
    resident_bytes = ResidentSet.resident_bytes

    def spy(self: ResidentSet, build: Any, *, host: Any = ()) -> int:
        out = resident_bytes(self, build, host=host)
        if build.host_replan and host:
            self.host_step = False  # the same plan, counting the others' parameters
            try:
                counted = resident_bytes(self, build, host=host)
            finally:
                self.host_step = True
            own = storage_sizes(build.example_inputs)
            device = {
                a: n
                for r in self._records()
                if r.index != build.index
                for a, n in self.static_storages(r)
                if a in r.hostable and a not in own
            }
            moving.append((build.index, counted - out, sum(device.values())))
        return out

    monkeypatch.setattr(ResidentSet, "resident_bytes", spy)
    compiled, wl, caught = _train_under("moe", budget, 4, pilot="lightgbm")  # with its reserve
    assert not _budget_warnings(caught), _budget_warnings(caught)
    measured = measure_settled(compiled, wl, wl.batch(4))  # (a step that checks the last round)
    rep = memcompile.report(compiled)
    hosting = [r for r in rep.replans if r.host_params]
    assert len(hosting) == 1 and hosting[0].predicted_peak > budget, rep.replans
    assert set(hosting[0].fragments) == {"F0", "F1", "F2", "F3"}
    assert all(r is None for r in hosting[0].resident)
    assert rep.host_param_bytes > 0 and not rep.over_budget and rep.replans[-1].fits
    assert "parameters to the host" in str(rep)
    assert measured <= budget, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)
    # The first fragment of the round found all the others' parameters still on the device.
    assert moving and moving[0][0] == 0 and moving[0][1] > 0, moving
    assert all(gone == device for _, gone, device in moving), moving


def test_a_warning_for_a_step_with_its_parameters_on_the_host_does_not_ask_to_move_them() -> None:
    # TreeLSTM at 0.4x: every parameter is on the host ("auto") and a 128-call step is still
    # over. The warning said "set offload_params=True" (done already) and "allow recompute
    # and swap" (allowed): it now says the parameters are on the host and what is left.
    # (Since the backward makes views again instead of taking them as inputs, 0.6x fits.)
    budget = int(_unplanned_peak("treelstm") * 0.40)
    torch._dynamo.reset()
    wl = zoo.build("treelstm", size="tiny")
    compiled = memcompile.compile(wl.model, budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wl.train(compiled, 5)
    messages = [str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    assert len(messages) == 1, messages
    host = memcompile.report(compiled).host_param_bytes
    assert host == sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert "With its parameters on the host (" in messages[0]
    assert "(raise the budget; see memcompile.report())" in messages[0]
    assert "offload_params" not in messages[0] and "allow" not in messages[0]


def test_a_fragment_that_does_not_fit_runs_its_smallest_plan_without_the_pilots_reserve() -> None:
    # The GRU's longer buckets are fragments of their own that find the parameters on the host
    # (the first bucket's fragment moved them) and were planned with the pilot's whole reserve,
    # 196 KiB in a 144 KiB budget: their smallest plans peaked at 360 KiB, twice the first
    # bucket's, and 164 KiB without it. The reserve gives way where the plan does not fit, as
    # it does for the first fragment; the warnings say what is resident and name no reserve.
    budget = int(_unplanned_peak("gru") * 0.4)
    compiled, _, caught = _train_under(
        "gru", budget, 3, on_infeasible="best_effort", pilot="lightgbm"
    )
    plans = memcompile.report(compiled).plan.fragments
    # (No larger than the first bucket's, which was planned without the reserve.)
    first, *longer = (p.predicted_peak for p in plans)
    assert len(longer) == 2 and max(longer) <= first, (first, longer)
    said = [str(w.message) for w in caught if w.category is MemoryBudgetWarning]
    assert not any("prefetch cache" in m for m in said), said
    # One per fragment, and the optimizer step's: its parameters and gradients alone are over.
    assert len([m for m in said if "does not fit budget" in m]) == 3, said
    assert len([m for m in said if "the optimizer step is predicted" in m]) == 1, said


def test_a_step_is_replanned_though_a_fragments_own_plan_did_not_fit(monkeypatch) -> None:
    # The MoE at 0.35x (0.4x before the backward made views again instead of taking them as
    # inputs: that fits now): the router and two expert graphs, planned one at a time while the
    # other experts' parameters were still on the device, did not fit (warned). The step was
    # then left as it was, 366,472 B measured; re-planned with the whole step known (what moved
    # to the host since), it fits. Plans now count the parameters later fragments will move to
    # the host as moved, and these fit: counted on the device as they were, the fragments'
    # plans miss again, which is the case this test is about.
    untaken = ResidentSet._untaken_resident
    monkeypatch.setattr(
        ResidentSet, "_untaken_resident", lambda self, hosted, _: untaken(self, hosted, False)
    )
    budget = int(_unplanned_peak("moe") * 0.35)
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, budget=budget, on_infeasible="best_effort")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wl.train(compiled, 4)
    messages = [str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    assert any("does not fit budget" in m for m in messages), messages  # said when planned
    measured = measure_settled(compiled, wl, wl.batch(4))
    rep = memcompile.report(compiled)
    assert rep.replans and rep.replans[0].predicted_peak > budget
    assert measured <= budget, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)


def _graph(kind: str, peak: int) -> GraphProfile:
    return GraphProfile(kind, (), (), 0, 0, peak, 0, 0, 0, False)  # type: ignore[arg-type]


def _profile(forward_peak: int, saved: int, backward_peak: int) -> FragmentProfile:
    return FragmentProfile(
        _graph("forward", forward_peak),
        _graph("backward", backward_peak),
        input_bytes=0,
        static_input_bytes=0,
        saved_bytes=saved,
        held_output_bytes=0,
        grad_bytes=0,
        clone_bytes=0,
    )


def test_decide_replan_caps_saved_sets_held_while_another_fragment_peaks() -> None:
    # F1 (an expert) runs four times, each saving 100 B; then F0 (a head) peaks at 300 B with
    # all four held: 700 B for a 560 B budget. The 140 B excess is split in proportion to
    # bytes: F0's own peak 300 B -> 60 B, the held 400 B -> 80 B, a fifth of each.
    expert, head = _profile(100, 100, 150), _profile(300, 0, 300)
    seq = [(1, "forward", b) for b in range(4)] + [(0, "forward", 0), (0, "backward", 0)]
    seq += [(1, "backward", b) for b in reversed(range(4))]
    calls = [head if i == 0 else expert for i, _, _ in seq]
    prediction = simulate_step({0: head, 1: expert}, seq, resident_bytes=0)
    assert prediction.peak == 700
    kwargs: dict[str, Any] = dict(budget=560, assumed={0: 0, 1: 0}, replans={})
    decision = decide_replan(prediction, seq, calls, held={0: 0, 1: 100}, **kwargs)
    # The expert's plan may hold 80 of its 100 B; the head plans for the 320 B the rest holds
    # once the experts gave up theirs (target 240 B: its peak less its 60 B share).
    assert decision.saved_cap == {1: 80}
    assert decision.resident == {0: 320, 1: 410} and decision.others == {0: 400, 1: 300}
    # Without the plans' held bytes: no caps, and the head alone is asked for all 140 B.
    uncapped = decide_replan(prediction, seq, calls, **kwargs)
    assert uncapped.saved_cap == {} and uncapped.resident[0] == 400
    # Re-planned twice already: no cap, and it is among those that cannot be tightened.
    spent = decide_replan(
        prediction, seq, calls, held={0: 0, 1: 100}, **{**kwargs, "replans": {1: MAX_REPLANS}}
    )
    assert spent.saved_cap == {} and spent.stuck == (1,)


def test_decide_replan_rejects_mismatched_calls() -> None:
    prediction = StepPrediction(peak=10, call_peaks=(10,), peak_call=0, exact=False)
    with pytest.raises(ValueError, match="2 calls, 1 call profiles and 1 call peaks"):
        decide_replan(
            prediction,
            [(0, "forward", 0), (0, "backward", 0)],
            [None],
            budget=5,
            assumed={},
            replans={},
        )


def test_a_fragment_asked_to_replan_twice_before_it_recompiles_is_replanned_once() -> None:
    # Two re-plan requests for one fragment before its code compiled again (a round asked at
    # the end of one step, another at the next, a fragment of the first not yet called) queued
    # its record twice: the first recompile replaced the record, and the next compile of that
    # graph looked for the replaced one ("ValueError: ... is not in list", seen on
    # Hugging Face's Qwen2-MoE with eager experts at 0.75x its eager peak). The later request
    # now replaces the earlier, and a recompile replaces the record of its index.
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="1GiB")
    wl.loss(compiled, 0).backward()
    comp, _ = find_compiler(compiled)
    (record,) = comp.records()
    for resident in (1000, 2000):
        comp.budget.request_replan({record.index: resident}, {record.index: record}, {})
    assert [entry[1] for entry in comp.budget._awaiting[record.identity.id]] == [2000]
    for step in (1, 2):
        wl.loss(compiled, step).backward()
        comp.budget.request_replan({record.index: 3000}, {record.index: comp.records()[0]}, {})
    wl.loss(compiled, 3).backward()
    records = comp.records()
    assert [r.index for r in records] == [record.index] and records[0] is not record
