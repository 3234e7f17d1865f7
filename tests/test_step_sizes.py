"""Multi-fragment step predictions: each call is profiled at its own sizes (one graph compiled for
dynamic sizes serves calls of many), inputs a backward reads stay counted until it runs,
parameters shared by fragments hold one gradient (autograd's sums priced), and a storage kept
through views counts once."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import memcompile
from memcompile import zoo
from memcompile.analysis.fragment_profile import FragmentProfile, ParamGrad
from memcompile.analysis.graph import GraphProfile, NodeProfile
from memcompile.analysis.step_model import CacheUse, OutputLife, cache_peak, simulate_step
from memcompile.pipeline import features
from memcompile.report import find_compiler
from memcompile.runtime.measure import measure, storage_sizes
from memcompile.runtime.store import is_host_placed

from helpers import predicted_peak


def _step(name: str, **options: object) -> tuple[int, int]:
    """(predicted, measured) absolute peak of one step of zoo ``name`` (tiny) after 3 training
    steps under memcompile with ``options``."""
    return _run(name, **options)[:2]


def _run(name: str, **options: object) -> tuple[int, int, Any]:
    """:func:`_step`, and the compiled model."""
    torch._dynamo.reset()
    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model, **options)
    wl.train(compiled, 3)
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(4)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    predicted = memcompile.report(compiled).predicted_peak
    assert predicted is not None
    return predicted, measured, compiled


@pytest.mark.parametrize("offload_params", [False, True])
def test_moe_step_prediction_is_within_two_percent_of_the_measured_peak(offload_params):
    # Four fragments, one of them (the expert) compiled for a dynamic token count and called
    # eight times per step at different sizes; each layer's router saves its input, which the
    # Python loop drops. Profiled at the example's sizes, without saved inputs, the prediction
    # was 502,596 B for a measured 574,824 B (-13 %).
    predicted, measured = _step("moe", offload_params=offload_params)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_moe_step_prediction_under_a_budget_counts_a_storage_several_calls_save_once():
    # Under a budget the experts save the layer's expert input h instead of activations, and
    # the router saves h too: counted once per call, the step was over-predicted by 6.7 %
    # (511,140 B for 479,000 B measured at 0.95x).
    _, measured = _step("moe")
    predicted, at_budget, compiled = _run("moe", budget=int(0.95 * measured))
    comp, _ = find_compiler(compiled)
    assert abs(predicted - at_budget) <= 0.03 * at_budget, (predicted, at_budget)
    profiles = {r.index: r.profile for r in comp.records() if r.profile is not None}
    assert any(p.saved_input_positions for p in profiles.values())
    assert any(p.saved_output_positions for p in profiles.values())


class _TangentUsedEarly(nn.Module):
    """Fragment 0's backward reads its incoming gradient first (the second weight's gradient
    and the hidden one), then makes the first weight's gradient: its peak."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, 4 * d) / d)
        self.w2 = nn.Parameter(torch.randn(4 * d, d) / d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.w1) @ self.w2
        torch._dynamo.graph_break()
        return (y * y).sum()


@features.patch(direct_unplanned=False)  # counts what every watched step does
def test_an_incoming_gradient_dies_at_its_last_use_in_the_backward():
    # The engine hands the gradient over and AOT's backward keeps no reference: held to the
    # call's end, fragment 0's backward was predicted 64 KiB (the gradient) over its
    # measured 4,521,992 B.
    torch._dynamo.reset()
    d = 256
    model = _TangentUsedEarly(d)
    compiled = memcompile.compile(model)
    x = torch.randn(d // 4, d)
    for _ in range(2):
        compiled(x).backward()
    model.zero_grad(set_to_none=True)
    measured = measure(lambda: compiled(x).backward(), resident=[model, x])
    comp, _ = find_compiler(compiled)
    pred, seq, _ = comp.predict_step()
    assert pred is not None
    calls = {(i, k): p for (i, k, _), p in zip(seq, pred.call_peaks, strict=True)}
    want = measured.ranges["memcompile:F0:backward"]
    assert abs(calls[(0, "backward")] - want) <= 0.005 * want, (calls, want)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w).sum()


def test_profile_at_uses_a_calls_own_sizes():
    torch._dynamo.reset()
    model = _Scaled()
    compiled = torch.compile(model, backend="memcompile", dynamic=True)
    for rows in (8, 32):
        compiled(torch.randn(rows, 16)).backward()
    comp, _ = find_compiler(compiled)
    (record,) = comp.records()
    assert record.profile_at is not None
    small, large = record.profile_at((8,)), record.profile_at((32,))
    assert small is not None and large is not None
    # tanh's output (rows x 16 floats) is what the backward reads.
    assert (small.saved_bytes, large.saved_bytes) == (8 * 16 * 4, 32 * 16 * 4)
    assert record.profile_at((32,)) is large  # cached
    # The step the report replays is the last one, at its size (the backward: its forward's).
    assert comp.step_monitor.sequence_and_sizes()[1] == ((32,), (32,))


def test_static_fragments_have_no_size_profiles():
    torch._dynamo.reset()
    model = _Scaled()
    compiled = torch.compile(model, backend="memcompile")
    compiled(torch.randn(8, 16)).backward()
    comp, _ = find_compiler(compiled)
    (record,) = comp.records()
    assert record.profile_at is None


@features.patch(direct_unplanned=False)  # counts what every watched step does
@pytest.mark.parametrize("offload_params", [False, True])
def test_treelstm_step_prediction_is_within_three_percent_of_the_measured_peak(offload_params):
    # Six fragments; the three cell graphs (0, 1, n children) share the cell's parameters and
    # every cell call reads a row of the embedding output (a view of one storage). Gradients
    # counted per cell graph predicted +22.8 %; counting the embedding output once per call,
    # +88 %; not at all, -2.5 % (offloaded: -4.4 %). Now: one gradient per parameter storage,
    # autograd's out-of-place sum of a second contribution (for host-placed parameters, a
    # device tensor until the last one), the viewed storage counted once.
    predicted, measured = _step("treelstm", offload_params=offload_params)
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


def test_only_the_steps_latest_held_output_call_takes_weak_references(monkeypatch) -> None:
    # A tree's cell graphs run hundreds of times a step, each with held outputs (h, c); the
    # step's first backward checks only the latest such call (the classifier's). After the
    # first step only that fragment's calls take weak references, and it is still measured.
    import memcompile.step.monitor as monitor_mod

    made: list[int] = []
    real = monitor_mod.StorageWeakRef

    def counting(storage: Any) -> Any:
        made.append(1)
        return real(storage)

    monkeypatch.setattr(monitor_mod, "StorageWeakRef", counting)
    torch._dynamo.reset()
    wl = zoo.build("treelstm", size="tiny")
    compiled = memcompile.compile(wl.model)
    comp = None
    per_step = []
    for step in range(3):
        made.clear()
        wl.model.zero_grad(set_to_none=True)
        wl.loss(compiled, step).backward()
        per_step.append(len(made))
        comp, _ = find_compiler(compiled)
        held = [
            (i, c.held)
            for i, c in enumerate(comp.step_monitor._step_storages)
            if c.held is not None
        ]
        assert len(held) == 1, held  # the latest held-output call, measured every step
    assert comp is not None and len(comp.step_monitor._last_forwards) == 1
    calls = len(comp.step_monitor._step)
    assert per_step[0] > calls // 2  # the first step: every forward call with held outputs
    assert per_step[1] <= 4 and per_step[2] <= 4  # then: the last one (and the loss's root)


# -- the replay itself, on profiles made by hand ---------------------------------------------


def _graph(kind: str, peak: int, end: int) -> GraphProfile:
    return GraphProfile(kind, (), (), 0, end, peak, 0, 0, 0, False)  # type: ignore[arg-type]


def _profile(
    grads: tuple[ParamGrad, ...], *, bw_peak: int, bw_end: int, param_bytes: int
) -> FragmentProfile:
    """A fragment reading one parameter (position 0), saving nothing, whose backward peaks
    at ``bw_peak`` and ends holding ``bw_end`` (its device gradients)."""
    return FragmentProfile(
        _graph("forward", 0, 0),
        _graph("backward", bw_peak, bw_end),
        input_bytes=param_bytes,
        static_input_bytes=param_bytes,
        saved_bytes=0,
        held_output_bytes=0,
        grad_bytes=sum(g.nbytes for g in grads if not g.host),
        clone_bytes=0,
        param_grads=grads,
    )


def _training(indices: list[int]) -> list[tuple[int, str, int]]:
    return [(i, "forward", 0) for i in indices] + [(i, "backward", 0) for i in indices[::-1]]


def test_fragments_sharing_a_parameter_hold_one_gradient_and_sum_the_second_out_of_place():
    # Four graphs reading one parameter (a cell's leaf, one-child, n-children graphs...).
    prof = _profile((ParamGrad(0, 400),), bw_peak=400, bw_end=400, param_bytes=400)
    profiles = dict.fromkeys(range(4), prof)
    seq = _training([0, 1, 2, 3])
    shared = simulate_step(profiles, seq, resident_bytes=400, call_storages=[{0: 0xA}] * len(seq))
    # F3.bw: the first gradient (kept); F2.bw: old + new + their sum, before the old one is
    # freed; F1.bw, F0.bw: summed in place (autograd owns the sum now): one gradient.
    assert shared.call_peaks[4:] == (800, 1600, 1200, 1200)
    # Unknown storages: one gradient per fragment, as before (an overestimate here).
    separate = simulate_step(profiles, seq, resident_bytes=400)
    assert separate.call_peaks[4:] == (800, 1200, 1600, 2000)


def test_host_gradients_summed_by_autograd_are_device_memory_until_the_last_contribution():
    # A host-placed parameter (0 resident bytes): each backward fetches it (100 bytes peak)
    # and sends its gradient to the host; the sum of two host gradients is a device tensor.
    host = _profile((ParamGrad(0, 400, host=True),), bw_peak=100, bw_end=0, param_bytes=0)
    other = _profile((), bw_peak=100, bw_end=0, param_bytes=0)
    profiles = {0: other, 1: host, 2: host, 3: host}
    seq = _training([0, 1, 2, 3])
    storages = [{} if i == 0 else {0: 0xB} for i, _, _ in seq]
    pred = simulate_step(profiles, seq, resident_bytes=0, call_storages=storages)
    # F3.bw: on the host; F2.bw: the sum (400) on the device, kept; F1.bw: added in place,
    # then AccumulateGrad's hook sends it to the host: F0.bw sees no device gradient.
    assert pred.call_peaks[4:] == (100, 400, 500, 100)


def test_a_storage_kept_through_views_counts_once_until_its_last_backward():
    # Three cell calls each save a row of one 1000-byte storage (made by fragment 0).
    cell = dataclasses.replace(
        _profile((), bw_peak=10, bw_end=0, param_bytes=0), saved_view_inputs=(1,)
    )
    head = _profile((), bw_peak=10, bw_end=0, param_bytes=0)
    profiles = {0: head, 1: cell}
    seq = _training([0, 1, 1, 1])
    views = [{0x5: 1000} if (i, k) == (1, "forward") else {} for i, k, _ in seq]
    pred = simulate_step(profiles, seq, resident_bytes=0, call_views=views)
    assert pred.call_peaks[4:] == (1010, 1010, 1010, 10)  # once, then freed with the last
    # The first forward's views are the caller's (in its inputs): never counted again.
    seq1 = _training([1, 1])
    first = [{0x5: 1000}, {0x5: 1000}, {}, {}]
    assert simulate_step({1: cell}, seq1, resident_bytes=0, call_views=first).peak == 10


def test_an_input_several_calls_save_counts_once_by_address():
    # Four expert calls each save the layer's 800-byte expert input (a whole storage): with
    # the calls' storages known, it is held once, not once per call (the MoE under a budget
    # was over-predicted by 7 % when it was counted per call).
    expert = dataclasses.replace(
        _profile((), bw_peak=10, bw_end=0, param_bytes=0),
        saved_input_bytes=800,
        saved_input_positions=(1,),
    )
    head = _profile((), bw_peak=10, bw_end=0, param_bytes=0)
    seq = _training([0, 1, 1, 1, 1])
    kept = [{0xE: 800} if (i, k) == (1, "forward") else {} for i, k, _ in seq]
    by_address = simulate_step({0: head, 1: expert}, seq, resident_bytes=0, call_views=kept)
    assert by_address.call_peaks[5:] == (810, 810, 810, 810, 10)
    per_call = simulate_step({0: head, 1: expert}, seq, resident_bytes=0)
    assert per_call.call_peaks[5:] == (3210, 2410, 1610, 810, 10)


def test_a_saved_output_later_calls_save_as_their_input_counts_once():
    # A router (fragment 1) saves its 800-byte output h (also a user output) for its own
    # backward; two experts save h as their input. Held once, from the router's forward to
    # its backward, whose peak (its graph's inputs) counts it.
    router = dataclasses.replace(
        _profile((), bw_peak=900, bw_end=0, param_bytes=0),
        saved_bytes=800 + 100,
        saved_output_positions=(3,),
    )
    expert = dataclasses.replace(
        _profile((), bw_peak=10, bw_end=0, param_bytes=0),
        saved_input_bytes=800,
        saved_input_positions=(1,),
    )
    head = _profile((), bw_peak=10, bw_end=0, param_bytes=0)
    seq = _training([0, 1, 2, 2])
    kept = [{0xA: 800} if (i, k) == (2, "forward") else {} for i, k, _ in seq]
    outs = [{0xA: 800} if (i, k) == (1, "forward") else {} for i, k, _ in seq]
    pred = simulate_step(
        {0: head, 1: router, 2: expert},
        seq,
        resident_bytes=0,
        call_views=kept,
        call_saved_outputs=outs,
    )
    # experts' backwards: the router's 100 saved bytes + h once; the router's: its own peak
    assert pred.call_peaks[4:] == (910, 910, 900, 10)
    with pytest.raises(ValueError, match="call_saved_outputs has 1 entries for 8 calls"):
        simulate_step({0: head}, seq, resident_bytes=0, call_saved_outputs=[{}])


def test_a_gradient_several_backwards_add_to_is_held_until_a_backward_not_reading_it():
    # Three experts read the router's output h and each backward makes a 500-byte gradient
    # for it: autograd's engine sums them into the first and keeps the sum for the router's
    # backward (which counts it as its incoming gradient). The MoE's expert backwards were
    # under-predicted by that gradient (8 KiB of 457,232 B).
    router = _profile((), bw_peak=10, bw_end=0, param_bytes=0)
    expert = dataclasses.replace(
        _profile((), bw_peak=600, bw_end=500, param_bytes=0), activation_grads=((1, 500),)
    )
    seq = _training([1, 2, 2, 2])
    reads = [{1: 0xA} if (i, k) == (2, "forward") else {} for i, k, _ in seq]
    pred = simulate_step({1: router, 2: expert}, seq, resident_bytes=0, call_input_grads=reads)
    assert pred.call_peaks[4:] == (600, 1100, 1100, 10)
    unseen = simulate_step({1: router, 2: expert}, seq, resident_bytes=0)
    assert unseen.call_peaks[4:] == (600, 600, 600, 10)
    # a backward reading another storage ends the holding (the gradient was handed on)
    other = [{1: 0xA + j} if (i, k) == (2, "forward") else {} for j, (i, k, _) in enumerate(seq)]
    assert simulate_step(
        {1: router, 2: expert}, seq, resident_bytes=0, call_input_grads=other
    ).call_peaks[4:] == (600, 600, 600, 10)


def _cell(forward_peak: int) -> FragmentProfile:
    """A fragment saving nothing whose forward peaks at ``forward_peak`` (its held output)."""
    return dataclasses.replace(
        _profile((), bw_peak=10, bw_end=0, param_bytes=0),
        forward=_graph("forward", forward_peak, forward_peak),
        held_output_bytes=forward_peak,
    )


def test_outputs_the_caller_holds_count_at_every_call_until_their_storage_died() -> None:
    # Three cell calls, each returning a 100-byte output Python keeps in a list (a tree's
    # states): the first two die before the backward (the list is dropped); the third is the
    # last forward's, the backward's ``held``.
    cell = _cell(100)
    seq = _training([1, 1, 1])
    lives: list[tuple[OutputLife, ...]] = [
        (OutputLife(0xA, 100, 3),),
        (OutputLife(0xB, 100, 3),),
        (OutputLife(0xC, 100, None),),
        (),
        (),
        (),
    ]
    pred = simulate_step({1: cell}, seq, resident_bytes=0, call_lives=lives)
    # F.fw: its own 100, plus the earlier calls' outputs still alive (0, 100, 200).
    assert pred.call_peaks[:3] == (100, 200, 300)
    assert pred.call_peaks[3:] == (110, 110, 110)  # held (the last's) + the backward's 10
    # Unmeasured: as before, only the last forward's outputs are counted.
    assert simulate_step({1: cell}, seq, resident_bytes=0).call_peaks[:3] == (100, 100, 100)
    # One alive through the backward too (the user kept it): counted until its death.
    through = [*lives[:1], (OutputLife(0xB, 100, 5),), *lives[2:]]
    pred = simulate_step({1: cell}, seq, resident_bytes=0, call_lives=through)
    assert pred.call_peaks[3:] == (210, 210, 110)


def test_an_output_storage_reused_after_an_earlier_one_died_is_counted() -> None:
    # Call 0's output dies during call 1, whose own output gets the same address: the new
    # storage lives on; the old one's death does not end it.
    seq = _training([1, 1, 1])
    lives = [(OutputLife(0xA, 100, 2),), (OutputLife(0xA, 100, None),), (), (), (), ()]
    pred = simulate_step({1: _cell(100)}, seq, resident_bytes=0, call_lives=lives)
    assert pred.call_peaks[:3] == (100, 200, 200)


def test_a_held_output_a_later_call_reads_or_saves_is_counted_there_once() -> None:
    # F0's 100-byte output lives on; F1 reads it as its activation input (the profile counts
    # it in its inputs); F2 saves it for its backward (counted with the saved storages).
    head = _cell(100)
    reader = dataclasses.replace(_cell(50), input_bytes=100)
    saver = dataclasses.replace(
        _cell(50), input_bytes=100, saved_input_bytes=100, saved_input_positions=(0,)
    )
    seq = _training([0, 1, 2, 3])
    profiles = {0: head, 1: reader, 2: saver, 3: _cell(50)}
    lives: list[tuple[OutputLife, ...]] = [(OutputLife(0xA, 100, None),)] + [()] * 7
    inputs: list[dict[int, int] | None] = [None, {0xA: 100}, {0xA: 100}, {}] + [None] * 4
    views = [{0xA: 100} if (i, k) == (2, "forward") else {} for i, k, _ in seq]
    pred = simulate_step(
        profiles, seq, resident_bytes=0, call_lives=lives, call_inputs=inputs, call_views=views
    )
    # F1: 100 as its input + 50; F2: the same (its input, saved from here on); F3: the saved
    # storage + 50, not the output again.
    assert pred.call_peaks[:4] == (100, 150, 150, 150)
    # Unknown inputs: F1 counts it twice (its input, and alive).
    twice = simulate_step(profiles, seq, resident_bytes=0, call_lives=lives, call_views=views)
    assert twice.call_peaks[1] == 250


def test_an_input_an_earlier_backward_keeps_counts_once_where_a_call_reads_it() -> None:
    # A router (F1) saves its 800-byte output for its backward; an expert (F2) reads it (its
    # inputs: the profile counts it) without saving it (an out-of-place index_add's base).
    router = dataclasses.replace(_cell(0), saved_bytes=800, saved_output_positions=(0,))
    expert = dataclasses.replace(_cell(50), input_bytes=800)
    seq = _training([0, 1, 2])
    outs = [{0xA: 800} if i == 1 and k == "forward" else {} for i, k, _ in seq]
    inputs: list[dict[int, int] | None] = [None, None, {0xA: 800}] + [None] * 3
    profiles = {0: _cell(0), 1: router, 2: expert}
    pred = simulate_step(
        profiles, seq, resident_bytes=0, call_saved_outputs=outs, call_inputs=inputs
    )
    assert pred.call_peaks[2] == 800 + 50  # once: saved by the router, read by the expert
    unknown = simulate_step(profiles, seq, resident_bytes=0, call_saved_outputs=outs)
    assert unknown.call_peaks[2] == 800 + 800 + 50  # as before the inputs were measured


class _Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x) + h)
        return h, h * 2


class _Unrolled(nn.Module):
    """A Python loop over a compiled cell that keeps every call's second output in a list until
    the loop ends (as a tree encoder keeps its nodes' states)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = _Cell()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._loop(x)).sum()

    @torch.compiler.disable(recursive=False)
    def _loop(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(16)
        kept: list[torch.Tensor] = []
        for row in x.unbind(0):
            h, extra = self.cell(row, h)
            kept.append(extra)
        return h + torch.stack(kept).sum(0)


def test_the_compiler_measures_when_each_held_output_dies() -> None:
    torch._dynamo.reset()
    model = _Unrolled()
    compiled = memcompile.compile(model, budget="1GiB")  # measured under a budget only
    x = torch.randn(4, 16)
    for _ in range(3):
        compiled(x).backward()
    comp, _ = find_compiler(compiled)
    seq, storages = comp.last_step, comp.last_step_storages
    *cells, head = [k for k, (_, kind, _) in enumerate(seq) if kind == "forward"]
    assert len(cells) == 4, seq  # a graph for the first (h is zeros), one for the others
    for k in cells:
        (life,) = [life for life in storages[k].lives if life.nbytes == 64]
        # ``extra`` (h * 2) dies when the loop's list does: after the last cell call, before
        # the head's forward; each call read the previous call's h.
        assert life.died == head, (k, storages[k].lives, head)
    assert all(storages[k].inputs for k in cells[1:])
    # Without a budget nothing is planned on them: not measured (it costs ~6 us a call).
    torch._dynamo.reset()
    plain = memcompile.compile(_Unrolled())
    for _ in range(2):
        plain(x).backward()
    comp, _ = find_compiler(plain)
    assert comp.last_step and not any(c.lives or c.inputs for c in comp.last_step_storages)


def test_per_call_lists_must_match_the_sequence():
    prof = _profile((), bw_peak=1, bw_end=0, param_bytes=0)
    with pytest.raises(ValueError, match="call_storages has 1 entries for 2 calls"):
        simulate_step({0: prof}, _training([0]), resident_bytes=0, call_storages=[{}])


def test_step_prediction_counts_the_prefetch_cache_a_forward_leaves() -> None:
    # Early exit with its parameters moved to the host by the budget, and the pilot on: the
    # cache fills at the first fragment's tail with the next blocks' parameters (68,896 B),
    # outside every graph. Without it the step was predicted at 75,780 B for 83,361 B measured
    # (-9.1 %; benchmarks/results/peaks_tiny.md, early exit at 0.4x).
    torch._dynamo.reset()
    torch.manual_seed(0)
    wl = zoo.build("early_exit", size="tiny", seed=0)
    compiled = memcompile.compile(
        wl.model, budget=201_998, on_infeasible="best_effort", pilot="lightgbm"
    )
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.01)
    for step in range(3):
        wl.loss(compiled, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    batch = wl.batch(2)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    comp, _ = find_compiler(compiled)
    _, _, recorded = comp.step_monitor.current_step_views()
    assert any(call.cache for call in recorded)  # the scenario: the pilot prefetched
    predicted = memcompile.report(compiled).predicted_peak
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


def test_the_pilots_copies_made_inside_a_graph_count_from_there() -> None:
    # Early exit with its parameters on the host and the pilot on (the model is dynamic): a
    # fragment's graph predicts and copies the next block's parameters (68,896 B) halfway
    # through, before its own peak. Counted at the graph's end only, the step was predicted at
    # 149,153 B for 182,304 B measured (-18 %).
    torch._dynamo.reset()
    wl = zoo.build("early_exit", size="tiny")
    budget = 431_570
    compiled = memcompile.compile(
        wl.model, budget=budget, offload_params=True, on_infeasible="best_effort", pilot="lightgbm"
    )
    for _ in range(5):
        wl.model.zero_grad(set_to_none=True)
        wl.loss(compiled, 0).backward()
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(0)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    comp, _ = find_compiler(compiled)
    _, _, recorded = comp.step_monitor.current_step_views()
    # the scenario: copies made inside a graph
    assert any(c.cache_use is not None and c.cache_use.at_op for c in recorded)
    predicted = memcompile.report(compiled).predicted_peak
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert measured <= budget


def test_treelstm_with_host_parameters_under_a_budget_is_predicted_within_3_percent() -> None:
    # The encoder keeps every node's h and c in lists until the root is done: held outputs
    # of earlier cell calls, alive through the later ones (simulate_step's OutputLife). Not
    # counting them was 7.7 % under the measured peak here (the pilot's cache copies put the
    # peak in the forward). The pilot runs every step ("auto" would alternate in its trial,
    # and the report predicts the latest step's phase).
    budget = int(predicted_peak("treelstm") * 0.7)
    torch._dynamo.reset()
    wl = zoo.build("treelstm", size="tiny")
    compiled = memcompile.compile(
        wl.model, budget=budget, offload_params=True, on_infeasible="best_effort", pilot="markov"
    )
    wl.train(compiled, 3, optimizer="adam")
    batch = wl.batch(1)
    wl.model.zero_grad(set_to_none=True)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    predicted = memcompile.report(compiled).predicted_peak
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)


def test_parameters_moved_to_the_host_are_not_resident_in_records_made_before() -> None:
    # TreeLSTM at 0.65x with "auto": a re-plan moves the embedding to the host; the record of
    # the embedding's first (static) graph, compiled before, still lists its device storage.
    # It was counted: 8,384 B of a freed storage in every call's prediction. (At 0.7x while
    # the "auto" pilot reserved a prefetch cache, which it no longer does on the CPU.)
    budget = int(predicted_peak("treelstm") * 0.65)
    torch._dynamo.reset()
    wl = zoo.build("treelstm", size="tiny")
    compiled = memcompile.compile(wl.model, budget=budget, on_infeasible="best_effort")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wl.train(compiled, 5, optimizer="adam")
    embed = wl.model.embed.weight
    assert is_host_placed(embed)
    comp, model = find_compiler(compiled)
    stale = [r for r in comp.records() if any(n == 8384 for _, n in r.static_storages)]
    assert stale  # the scenario: a record made while the embedding was on the device
    _, _, resident = comp.predict_step()
    tensors = [*model.parameters(), *model.buffers()]
    assert resident == sum(storage_sizes(tensors).values()) + (comp.device_other_bytes or 0)


def _cache_graph() -> GraphProfile:
    # fetch (4 B new), op, an allocation (10 B), a fetch (2 B), the end.
    def node(name: str, target: str, new: int, live: int) -> Any:
        return NodeProfile(name, "call_function", target, (), new, 0, 0, live, 0, 0, ())

    nodes = (
        node("fetch", "memcompile.reload.default", 4, 4),
        node("op", "memcompile.pilot_prefetch.default", 0, 4),
        node("big", "aten.mm.default", 10, 14),
        node("fetch_1", "memcompile.reload.default", 2, 6),
    )
    return GraphProfile("forward", nodes, (), 0, 6, 14, 2, 0, 0, False)


def test_cache_peak_counts_taken_copies_until_their_fetch_and_the_ops_copies_after_it() -> None:
    graph = _cache_graph()
    # Nothing cached: the graph's own peak.
    assert cache_peak(graph, CacheUse(0, 0, None, 0)) == 14
    # 6 B cached, all taken (4 B at the first fetch, 2 B at the second): until then they are
    # cache bytes. At "big": 14 live + 2 not yet fetched.
    assert cache_peak(graph, CacheUse(6, 6, None, 0)) == 16
    # 9 B cached, 6 taken: 3 B for later blocks stay through the graph.
    assert cache_peak(graph, CacheUse(9, 6, None, 0)) == 19
    # The op left 20 B cached with 2 B of this call's copies still to take (4 taken before):
    # 18 B of copies for later blocks from the op on.
    assert cache_peak(graph, CacheUse(6, 6, 20, 4)) == 14 + 2 + 18


class _LossAndLogits(nn.Module):
    """Returns the loss and the logits, as a Hugging Face causal LM does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.head = nn.Linear(64, 512)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.inp(x)))
        return nn.functional.cross_entropy(logits, target), logits.detach() * 2


@pytest.mark.parametrize("keep", [False, True])
def test_step_prediction_counts_the_outputs_the_caller_still_holds(keep: bool) -> None:
    # A loop that keeps only the loss drops the other outputs before the backward (HF's
    # Trainer: its compute_loss returns the loss); the prediction once assumed every output
    # held (a 128 KiB over-prediction on benchmarks/clients.py's Llama, 4 KiB on a toy).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LossAndLogits()
    compiled = memcompile.compile(model)
    x, target = torch.randn(256, 64), torch.randint(0, 512, (256,))
    kept: list[torch.Tensor] = []

    def step() -> None:
        loss, logits = compiled(x, target)
        if keep:
            kept.append(logits)
        del logits
        loss.backward()
        kept.clear()

    for _ in range(2):
        step()
        model.zero_grad(set_to_none=True)
    measured = memcompile.measure_peak(step, resident=[model, x, target])
    comp, _ = find_compiler(compiled)
    _, _, recorded = comp.step_monitor.current_step_views()
    logits = 256 * 512 * 4  # the logits' copy: no gradient flows through it
    assert recorded[0].held == 4 + (logits if keep else 0)  # the loss, held by its backward
    rep = memcompile.report(compiled)
    assert rep.exact and rep.predicted_peak == measured


def test_the_budget_error_names_the_outputs_counted_as_held() -> None:
    # The budget the re-plan below fits once the first step shows the logits dropped: at the
    # first compile no plan fits, and the error says what to try.
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = memcompile.compile(_LossAndLogits(), budget=1_299_034)
    x, target = torch.randn(256, 64), torch.randint(0, 512, (256,))
    with pytest.raises(memcompile.MemoryBudgetError) as err:
        compiled(x, target)
    message = str(err.value)
    assert "counts F0's outputs (512.00 KiB) as held by the caller" in message, message
    assert "on_infeasible='best_effort'" in message


def test_a_plan_is_made_again_without_the_outputs_the_caller_drops() -> None:
    # Under a budget the first plan counts the logits as held through the backward and does
    # not fit; the first step shows the loop drops them, so the fragment is planned again
    # without them (and fits). A later step holding them again gets them planned back.
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, target = torch.randn(256, 64), torch.randint(0, 512, (256,))
    model, ref = _LossAndLogits(), _LossAndLogits()
    ref.load_state_dict(model.state_dict())
    compiled = memcompile.compile(model, budget=1_299_034, on_infeasible="best_effort")
    comp, _ = find_compiler(compiled)

    def step(fn: Any, hold: bool) -> None:
        loss, logits = fn(x, target)
        kept = [logits] if hold else []
        del logits
        loss.backward()
        kept.clear()

    with pytest.warns(memcompile.MemoryBudgetWarning, match="F0 does not fit"):
        step(compiled, False)
    assert comp.records()[0].profile.held_output_bytes == 4 + 256 * 512 * 4
    step(ref, False)
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", memcompile.MemoryBudgetWarning)
            step(compiled, False)
    (record,) = comp.records()
    assert record.plan.feasible and record.profile.held_output_bytes == 4  # the loss only
    model.zero_grad(set_to_none=True)
    measured = memcompile.measure_peak(lambda: step(compiled, False), resident=[model, x, target])
    rep = memcompile.report(compiled)
    assert rep.predicted_peak == measured <= 1_299_034
    assert rep.dropped_outputs == ("F0: outputs [1]",)  # the logits (the loss is output 0)
    assert "planned as dropped before the backward: F0: outputs [1]" in str(rep)
    for _ in range(2):  # held again: planned with them once more
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", memcompile.MemoryBudgetWarning)
            step(compiled, True)
    assert comp.records()[0].profile.held_output_bytes == 4 + 256 * 512 * 4


class _LossAndLiveLogits(nn.Module):
    """Returns the loss and the logits it was computed from (they require grad), after a wide
    MLP whose activation a budget makes the backward recompute (after the logits' gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.up = nn.Linear(64, 64), nn.Linear(64, 2048)
        self.down, self.head = nn.Linear(2048, 64), nn.Linear(64, 512)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.down(torch.relu(self.up(torch.tanh(self.inp(x)))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits, target), logits


def test_zeros_for_an_output_without_a_gradient_die_at_their_last_reader() -> None:
    # loss.backward() alone: AOTAutograd passes zeros as the logits' incoming gradient. No one
    # but the graph holds them, so they die at their last reader, unlike the loss's, which the
    # engine's root holds. Held to the end, the replay put them next to the MLP activation the
    # backward recomputes later: 5,376,008 B predicted for 4,851,720 B measured (the zeros'
    # 512 KiB; 128 KiB on benchmarks/clients.py's GPT-2 under a budget).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LossAndLiveLogits()
    compiled = memcompile.compile(model, budget=5_000_000, on_infeasible="best_effort")
    x, target = torch.randn(256, 64), torch.randint(0, 512, (256,))

    def step() -> None:
        loss, logits = compiled(x, target)
        del logits
        loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memcompile.MemoryBudgetWarning)
        for _ in range(2):
            step()
            model.zero_grad(set_to_none=True)
        measured = memcompile.measure_peak(step, resident=[model, x, target])
    comp, _ = find_compiler(compiled)
    (record,) = comp.records()
    assert record.plan is not None and record.plan.recomputed  # the scenario: a recompute
    assert len(record.profile.tangent_storages) == 2  # the loss's and the logits'
    calls, _, recorded = comp.step_monitor.current_step_views()
    first_backward = next(
        c for c, (_, kind, _) in zip(recorded, calls, strict=True) if kind == "backward"
    )
    held = first_backward.tangents
    assert held is not None and len(held) == 1  # the loss's
    rep = memcompile.report(compiled)
    assert rep.predicted_peak == measured
    # The plan (it recomputes: the budget constrains it) was made again with the zeros freed
    # early, and the logits dropped: both seen in the first step.
    (released,) = rep.released_tangents
    assert released.startswith("F0: ['tangents_") and released.count("tangents_") == 1
    assert record.profile.released and "incoming gradients planned as freed early" in str(rep)
    # Profiled with the zeros freed early: holding only the loss's is that profile; holding
    # them all again (a later step) adds their bytes on top, an upper bound.
    prof = record.profile
    assert prof.backward is not None
    assert prof.backward_peak_holding(held) == prof.backward.peak_bytes
    everything = {pos for pos, _ in prof.tangent_storages}
    assert prof.backward_peak_holding(everything) == prof.backward.peak_bytes + 256 * 512 * 4
    assert rep.dropped_outputs == ("F0: outputs [1]",)


def test_a_kept_input_only_its_backward_holds_is_freed_at_its_last_reader() -> None:
    # F1 reads F0's output (0xA, 100 B) and its backward keeps it; the caller dropped it, so
    # autograd frees it after the backward's first node, before the 250 B peak. Counted
    # through the whole call, the backward was predicted at 350 B.
    def node(name: str, live: int, reads: tuple[str, ...]) -> NodeProfile:
        return NodeProfile(name, "call_function", "aten.mm.default", (), 0, 0, 0, live, 0, 0, reads)

    bw = GraphProfile(
        "backward",
        (node("saved", 0, ()), node("mm", 50, ("saved",)), node("big", 250, ("mm",))),
        (),
        0,
        0,
        250,
        2,
        0,
        0,
        False,
    )
    reader = dataclasses.replace(
        _profile((), bw_peak=250, bw_end=0, param_bytes=0),
        backward=bw,
        input_bytes=100,
        saved_input_bytes=100,
        saved_input_positions=(0,),
        saved_input_reads=((0, 100, 1),),
    )
    seq = _training([0, 1])  # F0.fw F1.fw F1.bw F0.bw
    views: list[dict[int, int]] = [{}, {0xA: 100}, {}, {}]
    kept_at: list[dict[int, int]] = [{}, {0xA: 0}, {}, {}]

    def f1_backward(died: int | None, **kw: Any) -> int:
        lives = [(OutputLife(0xA, 100, died),), (), (), ()]
        pred = simulate_step(
            {0: _cell(100), 1: reader},
            seq,
            resident_bytes=0,
            call_views=views,
            call_lives=lives,
            **kw,
        )
        return pred.call_peaks[2]

    assert f1_backward(3, call_kept_at=kept_at) == 250  # died during F1.bw: at its reader
    assert f1_backward(3) == 350  # positions unknown: through the call, as before
    assert f1_backward(None, call_kept_at=kept_at) == 350  # the caller kept it to the end


class _ThreeFragments(nn.Module):
    """An MLP broken into three fragments, each reading the last one's output (as DDP's graph
    splitter makes them, or graph breaks)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 5)]
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gelu, layers = nn.functional.gelu, self.layers
        x = gelu(layers[0](x))
        torch._dynamo.graph_break()
        x = gelu(layers[1](x))
        torch._dynamo.graph_break()
        x = layers[3](gelu(layers[2](x)))
        return nn.functional.cross_entropy(x, y)


def test_a_fragment_input_only_the_backward_keeps_is_predicted_freed_in_it() -> None:
    # Each fragment saves its input, the last one's output, which the caller drops: the
    # backwards free it at its last reader. Counted to the end of each backward, the step
    # was predicted 10.8 % over (659,976 B for 595,456 B measured).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ThreeFragments()
    compiled = memcompile.compile(
        model, budget=2_000_000, offload_params=True, on_infeasible="best_effort"
    )
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            compiled(x, y).backward()
    model.zero_grad(set_to_none=True)
    measured = memcompile.measure_peak(lambda: compiled(x, y).backward(), resident=[model, x, y])
    report = memcompile.report(compiled)
    assert len(report.fragments) == 3 and report.host_param_bytes > 0
    assert report.predicted_peak is not None
    assert abs(report.predicted_peak - measured) <= 0.005 * measured, (
        report.predicted_peak,
        measured,
    )


def test_offload_params_plans_a_first_fragment_with_the_later_ones_parameters_on_the_host() -> None:
    # F0 compiles first, while F1's and F2's parameters (519 KiB) are still on the device:
    # counted resident, F0's smallest plan was 797,716 B and it raised, though the whole step
    # fits once every fragment has moved its parameters, as offload_params=True makes them.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ThreeFragments()
    budget = 700_000
    compiled = memcompile.compile(model, budget=budget, offload_params=True)
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.MemoryBudgetWarning)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            compiled(x, y).backward()
        model.zero_grad(set_to_none=True)
        measured = memcompile.measure_peak(
            lambda: compiled(x, y).backward(), resident=[model, x, y]
        )
    assert all(is_host_placed(p) for p in model.parameters())
    assert measured <= budget
