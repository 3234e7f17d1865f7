"""Recomputable dropout (rewrites/dropout.py): rebuilt outputs are bit-identical, plans under a
budget recompute them, and the memory models still match the allocator."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memcompile
from memcompile import MemoryBudgetWarning, zoo
from memcompile.pipeline import features
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.dropout import SCALED_PREFIX, dropout_pass, dropout_scale

from helpers import capture_joint, predicted_peak, train_under_budget

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_rebuilt_output_is_bit_identical_on_cpu(dtype: torch.dtype) -> None:
    # Bit patterns, not values: NaN, inf and -0.0 go through the same arithmetic.
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[:4] = torch.tensor([float("inf"), float("nan"), -0.0, -1e-40]).to(dtype)
    rng = random.Random(0)
    for p in [0.0, 0.1, 0.5, 1.0] + [rng.random() for _ in range(30)]:
        torch.manual_seed(1)
        out, mask = torch.ops.aten.native_dropout(x, p, True)
        scale = dropout_scale(p, dtype, "cpu")
        assert scale is not None
        rebuilt = torch.ops.aten.mul.Tensor(torch.ops.aten.mul.Tensor(x, mask), scale)
        assert torch.equal(_bits(rebuilt), _bits(out)), (p, scale)


def test_scale_is_unknown_where_identity_is_not_established() -> None:
    assert dropout_scale(0.1, torch.int64, "cpu") is None
    assert dropout_scale(0.1, torch.float32, "mps") is None
    assert dropout_scale(1.0, torch.float32, "cuda") is None  # CUDA returns zeros_like


def test_pass_rewrites_every_gpt_dropout_and_keeps_the_joint(caplog) -> None:
    found = capture_joint("gpt")
    joint = found["joint"]
    before = joint.graph.python_code("self").src
    with caplog.at_level("INFO", logger="memcompile.rewrites.dropout"):
        out = dropout_pass(joint, PassContext(fragment="F0", graph="joint"))
    assert "F0: 4 of 4 dropouts rewritten as x * mask * scale" in caplog.text
    assert "(recomputable; 0 masks replayed)" in caplog.text
    assert joint.graph.python_code("self").src == before  # the input graph is not changed
    dropouts = [n for n in out.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(dropouts) == 4
    for nd in dropouts:  # only the mask is read from the op now
        assert [u.args[1] for u in nd.users] == [1]
    rewrites = out.meta["memcompile_dropouts"]
    assert [r.dropout for r in rewrites] == [n.name for n in dropouts]
    scaled = {n.name: n for n in out.graph.nodes if n.name.startswith(SCALED_PREFIX)}
    assert sorted(r.output for r in rewrites) == sorted(scaled)
    for n in scaled.values():
        assert n.meta["val"].dtype == torch.float32 and n.users


def test_gpt_under_a_budget_recomputes_dropout_outputs(monkeypatch) -> None:
    # The tiny GPT with the saved-mask rewrite forced, at 0.72x its unplanned predicted peak
    # (1.90 MB with torch 2.13): the plan rebuilds dropout outputs (and may recompute the
    # residual stream after them), training stays bit-identical and the allocator agrees with
    # the prediction. ("auto" needs it only in a narrow band here now: with the scheduler's
    # lookahead the plan without it fits down to ~0.708x, with it ~0.704x; the bench GPT test
    # below covers the "auto" decision.)
    plan = _tiny_gpt_with_rewrite(monkeypatch, "always", 0.72)
    # The plan's forward computes the rebuilt dropout outputs.
    rebuilt = [n for n in plan.forward_order if n.startswith(SCALED_PREFIX)]
    assert rebuilt, plan.forward_order


def _tiny_gpt_with_rewrite(monkeypatch, mode: str, fraction: float) -> FragmentPlan:
    """Train the tiny GPT with ``dropout_rewrite=mode`` at ``fraction`` of its unplanned
    predicted peak (bit-identical over 3 Adam steps: train_under_budget); assert the plan fits,
    the allocator stays within the budget and agrees with the prediction; return the plan."""
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(dropout_rewrite=mode))
    budget = int(predicted_peak("gpt", size="tiny") * fraction)
    torch._dynamo.reset()
    compiled, _, measured = train_under_budget(
        "gpt", "adam", budget, size="tiny", swap=False, offload_params=False
    )
    rep = memcompile.report(compiled)
    (plan,) = rep.plan.fragments
    assert plan.feasible
    assert measured <= budget * 1.02, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)
    return plan


class ManyDropouts(nn.Module):
    """Dropouts of several kinds, each feeding a matmul (so its output is saved for backward):
    p of 0.1 / 0.5 / 0 (no random op), one module in eval mode, and native_dropout called
    directly with p = 1, with train=False and with train=None."""

    def __init__(self, p_odd: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.p_odd = p_odd
        self.frozen = nn.Dropout(0.3).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lins[0](x))
        h = self.lins[1](F.dropout(h, self.p_odd, self.training))
        h = self.lins[2](F.dropout(torch.tanh(h), 0.5, self.training))
        h = self.lins[3](F.dropout(torch.tanh(h), 0.0, self.training))
        h = self.lins[4](self.frozen(torch.tanh(h)))
        h = self.lins[5](torch.native_dropout(torch.tanh(h), 1.0, True)[0] + h)
        h = self.lins[6](torch.native_dropout(torch.tanh(h), 0.2, False)[0])
        h = self.lins[7](torch.native_dropout(torch.tanh(h), 0.2, None)[0])
        return h.pow(2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(7)  # the same random stream in every run
    loss = model(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("fraction", [0.6, 0.35])
def test_many_dropouts_stay_bit_identical(fraction: float) -> None:
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    eager = ManyDropouts()
    eager_loss, eager_grads = _grads(eager, x)
    eager_peak = memcompile.measure_peak(lambda: eager(x).backward())
    eager.zero_grad(set_to_none=True)
    model = ManyDropouts()
    compiled = memcompile.compile(
        model, budget=int(eager_peak * fraction), swap=False, on_infeasible="best_effort"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        loss, grads = _grads(compiled, x)
    assert torch.equal(loss, eager_loss)
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads, strict=True))
    (plan,) = memcompile.report(compiled).plan.fragments
    if fraction < 0.5:  # tight: the plan rebuilds dropout outputs in the backward
        assert any(n.startswith(SCALED_PREFIX) for n in plan.backward_order)


def test_rewrite_adds_no_difference_where_eager_dropout_differs_from_native() -> None:
    # For some p eager CPU dropout (_dropout_impl: float noise 1/(1-p)) and native_dropout
    # (double scale) differ in the last bit: any AOT-compiled model differs from eager there.
    # What memcompile owes is that the rewrite changes nothing: budget == no budget.
    p = 0.2604923103919594
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for options in ({}, {"budget": 1, "swap": False, "on_infeasible": "best_effort"}):
        torch._dynamo.reset()
        compiled = memcompile.compile(ManyDropouts(p_odd=p), **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MemoryBudgetWarning)
            results.append(_grads(compiled, x))
    (plan,) = memcompile.report(compiled).plan.fragments
    assert any(n.startswith(SCALED_PREFIX) for n in plan.backward_order)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_no_budget_does_not_rewrite() -> None:
    compiled = memcompile.compile(ManyDropouts())
    _grads(compiled, torch.randn(16, 64))
    (plan,) = memcompile.report(compiled).plan.fragments
    assert not any(n.startswith("dropout_") for n in plan.backward_order + plan.forward_order)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(512, 256),
        lambda: torch.empty(5, 7, 3).permute(2, 1, 0),  # a permuted layout
        lambda: torch.empty(64, 66)[:, ::2],  # a strided view
        lambda: torch.empty(1000, dtype=torch.float64),
    ],
)
def test_draw_then_replay_is_native_dropouts_mask_and_stream(make) -> None:
    x = make()
    for p in (0.0, 0.1, 0.5, 0.9, 1.0):
        torch.manual_seed(3)
        mask = torch.ops.aten.native_dropout(x, p, True)[1]
        after = torch.get_rng_state()
        torch.manual_seed(3)
        state = torch.ops.memcompile.dropout_draw(x, p)
        assert torch.equal(torch.get_rng_state(), after)  # the stream advanced as eager's
        replayed = torch.ops.memcompile.dropout_replay(state, mask.shape, mask.stride(), p)
        assert torch.equal(replayed, mask) and replayed.stride() == mask.stride()
        assert torch.equal(torch.get_rng_state(), after)  # the replay put the generator back


def test_replay_pass_draws_and_replays_every_cpu_dropout(caplog) -> None:
    from memcompile.rewrites.dropout import MASK_PREFIX, STATE_PREFIX

    joint = capture_joint("gpt")["joint"]
    with caplog.at_level("INFO", logger="memcompile.rewrites.dropout"):
        out = dropout_pass(joint, PassContext(fragment="F0", graph="joint"), replay=True)
    assert "F0: 4 of 4 dropouts rewritten" in caplog.text and "4 masks replayed" in caplog.text
    targets = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.native_dropout.default not in targets
    draws = [n for n in out.graph.nodes if n.name.startswith(STATE_PREFIX)]
    masks = [n for n in out.graph.nodes if n.name.startswith(MASK_PREFIX)]
    assert len(draws) == len(masks) == 4
    assert all(n.target is torch.ops.memcompile.dropout_draw.default for n in draws)
    assert {m.args[0] for m in masks} == set(draws)  # each mask is replayed from its state
    rewrites = out.meta["memcompile_dropouts"]
    assert sorted(r.mask for r in rewrites) == sorted(m.name for m in masks)
    assert sorted(r.state for r in rewrites) == sorted(d.name for d in draws)
    # The draw is random (never recomputed, its order kept); the replay is not.
    from memcompile.analysis.graph import draws_random

    assert all(draws_random(n) for n in draws) and not any(draws_random(m) for m in masks)


def test_replayed_masks_stay_bit_identical_and_are_recomputed(monkeypatch) -> None:
    from memcompile.rewrites.dropout import MASK_PREFIX

    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(dropout_rewrite="replay"))
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    eager = ManyDropouts()
    eager_loss, eager_grads = _grads(eager, x)
    eager_peak = memcompile.measure_peak(lambda: eager(x).backward())
    eager.zero_grad(set_to_none=True)
    compiled = memcompile.compile(
        ManyDropouts(), budget=int(eager_peak * 0.35), swap=False, on_infeasible="best_effort"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)
        for _ in range(2):  # the second step replays from states drawn in its own forward
            loss, grads = _grads(compiled, x)
            assert torch.equal(loss, eager_loss)
            assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads, strict=True))
    (plan,) = memcompile.report(compiled).plan.fragments
    assert any(n.startswith(MASK_PREFIX) for n in plan.backward_order), plan.backward_order


def test_gpt_with_replayed_masks_fits_and_is_predicted(monkeypatch) -> None:
    # The tiny GPT at 0.71x its unplanned peak, with masks replayed (forced): it fits,
    # bit-identical over 3 Adam steps (train_under_budget), masks are replayed in the backward,
    # and the allocator agrees with the prediction.
    from memcompile.rewrites.dropout import MASK_PREFIX

    plan = _tiny_gpt_with_rewrite(monkeypatch, "replay", 0.71)
    assert any(n.startswith(MASK_PREFIX) for n in plan.backward_order), plan.backward_order


def test_saved_after_names_a_plain_saved_set_in_the_rewritten_graph() -> None:
    from memcompile.rewrites.dropout import saved_after

    joint = capture_joint("gpt")["joint"]
    ctx = PassContext(fragment="F0", graph="joint")
    for replay in (False, True):
        out = dropout_pass(joint, ctx, replay=replay)
        rewrites = out.meta["memcompile_dropouts"]
        plain = {r.replaced_output for r in rewrites} | {r.replaced_mask for r in rewrites}
        mapped = saved_after(plain | {"other"}, rewrites)
        names = {n.name for n in out.graph.nodes} | {"other"}
        assert mapped <= names and "other" in mapped  # names it does not know are kept as is
        assert {r.output for r in rewrites} <= mapped  # outputs: the rebuilt products
        masks = {r.state for r in rewrites} if replay else {r.replaced_mask for r in rewrites}
        assert masks <= mapped  # masks: kept as they are, or as the states they replay from


def _smallest_recompute_only_budget(mode: str, monkeypatch) -> int:
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(dropout_rewrite=mode))
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="bench")
    compiled = memcompile.compile(wl.model, budget=1, swap=False, offload_params=False)
    with pytest.raises(memcompile.MemoryBudgetError) as info:
        wl.loss(compiled, 1)
    return info.value.min_feasible


def test_replayed_masks_lower_the_bench_gpts_smallest_budget(monkeypatch) -> None:
    # The bench GPT (4 layers, d 256, T 256, B 8, dropout 0.1): the smallest plain plan keeps
    # its eight 0.5 MiB masks; "auto" replays them (the search starting from the plain plan's
    # choices) and needs about their bytes less (69.6 MB -> 65.4 MB with torch 2.13).
    plain = _smallest_recompute_only_budget("never", monkeypatch)
    auto = _smallest_recompute_only_budget("auto", monkeypatch)
    assert plain - auto >= 3 * 2**20, (plain, auto)


@pytest.mark.parametrize("budget", [None, 4096])
def test_a_graph_that_ends_in_dropout_saves_its_mask(budget: int | None) -> None:
    # The mask comes after the last forward output in the joint graph (the dropout's output is
    # the graph's output): it was classified as neither forward nor backward, so every plan
    # "recomputed" the random op and none was feasible, even without a budget.
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3))
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3))
    model.load_state_dict(eager.state_dict())
    compiled = memcompile.compile(model, budget=budget, on_infeasible="best_effort")
    x = torch.randn(8, 16)
    for step in range(2):
        for m in (eager, compiled):
            torch.manual_seed(step)
            m(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    (fragment,) = memcompile.report(compiled).fragments
    assert fragment.plan is None or fragment.plan.feasible or budget is not None
