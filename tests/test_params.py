"""Parameters on the host (``offload_params``): bit-identical training with SGD and Adam, the
saving measured by the allocator, "auto" only when needed, clean failure, the rewrite itself."""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_random import _check_case, programs
from torch import nn

import memcompile
from memcompile import MemoryBudgetError, zoo
from memcompile.analysis.costmodel import device_profile
from memcompile.analysis.joint_model import JointModel
from memcompile.planning.planner import plan_fragment
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.params import param_fetch_pass
from memcompile.runtime.measure import resident_bytes
from memcompile.runtime.store import TieredStore, is_host_placed, place_on_host, register_store

from helpers import assert_same_state, capture_module, examples, train_under_budget

fetch_op = torch.ops.memcompile.reload.default
offload_op = torch.ops.memcompile.offload.default


def _host_state(model: nn.Module) -> tuple[int, int]:
    """(parameters in the host tier, gradients not there)."""
    params = list(model.parameters())
    return (
        sum(is_host_placed(p) for p in params),
        sum(p.grad is not None and not is_host_placed(p.grad) for p in params),
    )


@pytest.mark.parametrize("name", ["gpt", "branchy", "early_exit", "moe", "treelstm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_host_placed_parameters_train_bit_identically(name: str, optimizer: str) -> None:
    torch._dynamo.reset()
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    expected = eager.train(eager.model, 3, optimizer=optimizer)
    compiled = memcompile.compile(comp.model, offload_params=True)
    losses = comp.train(compiled, 3, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(expected, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    n = len(list(comp.model.parameters()))
    # Every parameter (every expert's too: one graph serves them all) and every gradient.
    assert _host_state(comp.model) == (n, 0)
    assert any(p.grad is not None for p in comp.model.parameters())
    rep = memcompile.report(compiled)
    assert rep.host_param_bytes == sum(p.nbytes for p in comp.model.parameters())
    assert any(f.plan is not None and f.plan.host_params for f in rep.fragments)


def test_host_placed_parameters_leave_the_measured_peak() -> None:
    torch._dynamo.reset()
    peaks = {}
    for off in (False, True):
        wl = zoo.build("gpt", size="tiny")
        compiled = memcompile.compile(wl.model, offload_params=off)
        for step in range(2):
            wl.loss(compiled, step).backward()
        wl.model.zero_grad(set_to_none=True)
        batch = wl.batch(1)

        def step(compiled=compiled, batch=batch) -> None:
            compiled(*batch).backward()

        m = memcompile.measure(step, resident=[wl.model, batch])
        rep = memcompile.report(compiled)
        assert rep.predicted_peak == m.peak  # one fragment, eager inner compiler: exact
        peaks[off] = m
    params = sum(p.nbytes for p in zoo.build("gpt", size="tiny").model.parameters())
    assert peaks[True].resident_bytes == peaks[False].resident_bytes - params
    assert peaks[True].peak < peaks[False].peak


def test_auto_moves_parameters_only_when_nothing_else_fits() -> None:
    # gpt tiny: the smallest plan with parameters on the device peaks at ~1.37 MB, with them on
    # the host at ~0.84 MB (CPU).
    compiled, wl, measured = train_under_budget("gpt", "adam", 1_600_000)
    assert _host_state(wl.model)[0] == 0 and memcompile.report(compiled).host_param_bytes == 0
    compiled, wl, measured = train_under_budget("gpt", "adam", 1_200_000)
    n = len(list(wl.model.parameters()))
    assert _host_state(wl.model) == (n, 0)  # train_under_budget zeroes the gradients
    assert measured <= 1_200_000
    assert memcompile.report(compiled).predicted_peak == measured


def test_offload_params_false_never_moves_them_and_the_error_says_so() -> None:
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1_200_000, offload_params=False)
    with pytest.raises(MemoryBudgetError, match=r"offload_params=True \(or 'auto'\) keeps"):
        wl.loss(compiled, 0)
    assert _host_state(wl.model)[0] == 0


def test_infeasible_even_on_the_host_leaves_parameters_untouched() -> None:
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    # The tiny GPT's smallest plan with its parameters on the host is ~395 KB (torch 2.13).
    compiled = memcompile.compile(wl.model, budget=300_000)
    with pytest.raises(MemoryBudgetError, match="with the parameters on the host") as info:
        wl.loss(compiled, 0)
    assert info.value.min_feasible > 300_000
    assert _host_state(wl.model)[0] == 0
    after = wl.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class Tied(nn.Module):
    """An embedding whose weight is also the output head's (two readers of one parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return (h @ self.emb.weight.t()).logsumexp(-1).mean()


def test_every_reader_gets_its_own_fetch_and_gradients_leave() -> None:
    found = capture_module(Tied(), torch.tensor([[1, 2, 3]]))
    joint, n = found["joint"], found["n"]
    store = register_store(TieredStore())
    primal = next(iter(joint.graph.find_nodes(op="placeholder")))
    out = param_fetch_pass(
        joint, PassContext("F0"), primals=[0], num_fwd_outputs=n, device=torch.device("cpu"),
        store=store,
    )  # fmt: skip
    assert joint.graph.find_nodes(op="call_function", target=fetch_op) == []  # not changed
    fetches = out.graph.find_nodes(op="call_function", target=fetch_op)
    readers = [u for u in primal.users]
    assert len(fetches) == len(readers) >= 2
    assert all(len(f.users) >= 1 and f.args[0].name == primal.name for f in fetches)
    new_primal = next(iter(out.graph.find_nodes(op="placeholder")))
    assert set(new_primal.users) == set(fetches)  # nothing reads the host storage directly
    (grad,) = [a for a in out.graph.find_nodes(op="output")[0].args[0][n:] if a is not None]
    assert grad.target is offload_op
    # A view of the parameter is a view of its fetched copy now (the analysis relies on it).
    for f in fetches:
        for view in f.users:
            if view.target is torch.ops.aten.t.default:
                assert (
                    view.meta["val"].untyped_storage()._cdata
                    == f.meta["val"].untyped_storage()._cdata
                )


def test_fetched_copies_are_fetched_again_for_the_backward_not_kept() -> None:
    found = capture_module(Tied(), torch.tensor([[1, 2, 3]]))
    n = found["n"]
    out = param_fetch_pass(
        found["joint"], PassContext("F0"), primals=[0], num_fwd_outputs=n,
        device=torch.device("cpu"), store=register_store(TieredStore()),
    )  # fmt: skip
    model = JointModel(
        out, num_fwd_outputs=n, static_input_indices=found["static"], profile=device_profile("h100")
    )
    copies = model.fetched_copies()
    # Eager's saved set would keep the copies the backward reads (the weight for its matmuls).
    assert copies & model.default_saved()
    plan = plan_fragment(model, target=None, resident_bytes=0)
    actions = {d.tensor: d.action for d in plan.decisions}
    fetched = [model.describe(s) for s in sorted(copies & model.default_saved())]
    assert fetched and all(actions[name] == "recompute" for name in fetched)
    # The backward graph fetches its own copies: the reload nodes appear in its order.
    fetch_names = {n.name for n in out.graph.find_nodes(op="call_function", target=fetch_op)}
    assert fetch_names & set(plan.backward_order)


@pytest.mark.parametrize("name", ["gru", "treelstm"])
def test_offloading_parameters_never_raises_the_measured_peak(name: str) -> None:
    # Recurrent cells fetch their weights once per call: kept for the backward, those copies
    # doubled the GRU's peak (373,864 B -> 736,616 B) and multiplied the TreeLSTM's by 4.7.
    peaks = {}
    for off in (False, True):
        torch._dynamo.reset()
        wl = zoo.build(name, size="tiny")
        compiled = memcompile.compile(wl.model, offload_params=off)
        wl.train(compiled, 2)
        wl.model.zero_grad(set_to_none=True)
        batch = wl.batch(4)
        peaks[off] = memcompile.measure_peak(
            lambda c=compiled, b=batch: c(*b).backward(), resident=[wl.model, batch]
        )
    assert peaks[True] < peaks[False], peaks


def test_param_fetch_pass_rejects_a_position_that_is_not_a_primal() -> None:
    found = capture_module(Tied(), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="F7: primal 9 is not an input of the joint graph"):
        param_fetch_pass(
            found["joint"], PassContext("F7"), primals=[9], num_fwd_outputs=found["n"],
            device=torch.device("cpu"), store=0,
        )  # fmt: skip


def test_place_on_host_keeps_the_object_values_and_gradient() -> None:
    lin = nn.Linear(4, 3)
    lin(torch.randn(2, 4)).sum().backward()
    w, values, grad = lin.weight, lin.weight.detach().clone(), lin.weight.grad.clone()
    before = resident_bytes(lin)
    assert place_on_host(w) == w.nbytes
    assert lin.weight is w and torch.equal(w, values) and torch.equal(w.grad, grad)
    assert is_host_placed(w) and is_host_placed(w.grad)
    assert resident_bytes(lin) == before - 2 * w.nbytes  # the measurement skips the host tier
    assert place_on_host(w) == 0  # already there


def test_place_on_host_refuses_views_and_other_devices() -> None:
    base = torch.zeros(10)
    with pytest.raises(ValueError, match="a view of a larger buffer cannot be host-placed"):
        place_on_host(nn.Parameter(base[:5]))
    with pytest.raises(ValueError, match=r"need a CPU or CUDA tensor; got meta"):
        place_on_host(nn.Parameter(torch.zeros(3, device="meta")))


def test_host_placed_parameters_with_an_inference_call_in_between() -> None:
    torch._dynamo.reset()
    eager, comp = zoo.build("gpt", size="tiny"), zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(comp.model, offload_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.MemoryBudgetWarning)
        comp.train(compiled, 2)
        with torch.no_grad():
            got = compiled(*comp.batch(5))
    eager.train(eager.model, 2)
    with torch.no_grad():
        assert torch.equal(got, eager.model(*eager.batch(5)))


@settings(max_examples=examples(30), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
@given(program=programs, fraction=st.floats(0.2, 1.0), batch=st.sampled_from([16, 64]))
def test_random_network_with_host_placed_parameters(program, fraction: float, batch: int) -> None:
    # _check_case: bit-identical gradients, predicted within 3 % of measured, within budget.
    real = memcompile.compile

    def with_params_on_host(model: nn.Module, **options: object) -> object:
        return real(model, offload_params=True, **options)

    with mock.patch.object(memcompile, "compile", with_params_on_host):
        _check_case(program, fraction, batch)


def test_block_ids_name_the_experts_when_their_parameters_move(tmp_path) -> None:
    # The trace names a block by its parameters' storages; host placement moves them.
    from memcompile.dynamic.trace import read_trace
    from memcompile.report import find_compiler

    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    path = tmp_path / "trace.jsonl"
    compiled = memcompile.compile(wl.model, offload_params=True, trace_path=str(path))
    wl.train(compiled, 2)
    for observer in find_compiler(compiled)[0].block_observers:
        observer.flush()
    blocks = {b for step in read_trace(path) for b in step.blocks()}
    assert any(b.endswith("/blocks.0.experts.1") for b in blocks), sorted(blocks)
    assert not any("/#" in b for b in blocks), sorted(blocks)


def test_trace_placeholders_while_dynamo_compiles_and_after_a_reset() -> None:
    # A CUDA model's host-placed parameter (a CPU tensor) holds a placeholder on its device while
    # Dynamo compiles (runtime/pinned.py): no bytes, no gradient. The CPU stands in for the
    # device here (CUDA: tests/test_cuda.py).
    from memcompile.runtime import pinned

    p = nn.Parameter(torch.randn(3, 4))
    p.grad = torch.ones(3, 4)
    values, grad = p.detach().clone(), p.grad
    pinned._params[p] = torch.device("cpu")
    seen = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        seen.append((p.device.type, p.untyped_storage().nbytes(), is_host_placed(p), p.grad))
        return gm.forward

    try:
        torch._dynamo.reset()  # drops Dynamo's compile callbacks: a compiler puts them back
        memcompile.compile(nn.Linear(2, 2))  # (constructing it is enough)
        torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    finally:
        del pinned._params[p]
    assert seen == [("cpu", 0, True, None)]
    assert p.device.type == "cpu" and torch.equal(p, values) and p.grad is grad
    assert not pinned._tracing and not is_host_placed(p)


def test_an_inference_graph_on_another_device_gets_copies_of_host_placed_parameters() -> None:
    # A module called under no_grad compiles to an inference graph, which no plan fetches for:
    # its host-placed parameters (here: the first input) reach it as device copies; other
    # inputs, and inputs already on the device, pass unchanged. ("meta" stands in for CUDA.)
    from memcompile.backends.call_wrapper import _fetching

    w = nn.Parameter(torch.randn(4, 4))
    place_on_host(w)
    b = torch.randn(4)  # a static input that is not host-placed
    seen: list[list[torch.Tensor]] = []
    run = _fetching(lambda args: seen.append(list(args)), 0, (0, 1), torch.device("meta"))
    run([w, b, torch.randn(2, 4)])
    fetched, kept, x = seen[0]
    assert fetched.device.type == "meta" and fetched.shape == w.shape
    assert kept is b and x.device.type == "cpu"
    assert is_host_placed(w)  # the parameter itself stays in the host tier


def test_an_inference_graph_fetches_the_host_tiers_parameters_before_each_reader(monkeypatch):
    # Evaluation under no_grad compiles an inference graph, which no plan partitions: the
    # parameters the training graph's plan put on the host are fetched before each reader there
    # too, and the output is eager's.
    from memcompile.backends import fragment_build

    seen = []
    real = fragment_build.param_fetch_pass

    def spy(gm, ctx, **kw):
        out = real(gm, ctx, **kw)
        seen.append((ctx.graph, kw["primals"], out))
        return out

    monkeypatch.setattr(fragment_build, "param_fetch_pass", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    compiled = memcompile.compile(model, offload_params=True)
    x = torch.randn(8, 16)
    compiled(x).sum().backward()  # the training graph's plan: the parameters to the host
    assert all(is_host_placed(p) for p in model.parameters())
    assert seen == []
    with torch.no_grad():
        assert torch.equal(compiled(x), ref(x))
    ((graph, primals, gm),) = seen
    assert graph == "inference" and len(primals) == 4
    fetches = gm.graph.find_nodes(op="call_function", target=torch.ops.memcompile.reload.default)
    assert len(fetches) == 4  # one per reader: each weight and bias


def test_optimizer_state_made_on_the_device_before_a_parameter_went_to_the_host_follows_it():
    # A parameter placed on the host after the optimizer's first step (an early exit's head,
    # placed when first taken) has state on the device, and torch's step refuses the mix: the
    # pre-step hook moves it where the parameter is, once per placement change. ("meta" stands
    # in for where the parameter now is, the CPU for the device the state was made on.)
    from memcompile.runtime import pinned, placement

    p = nn.Parameter(torch.empty(4, device="meta"))
    other = nn.Parameter(torch.zeros(4))  # on the device, not host-placed: left alone
    opt = torch.optim.SGD([p, other], lr=0.1, momentum=0.9)
    opt.state[p]["momentum_buffer"] = torch.ones(4)
    opt.state[other]["momentum_buffer"] = torch.ones(4)
    pinned._params[p] = torch.device("cpu")
    try:
        placement.moved()
        assert pinned.state_to_host(opt) == 16
        assert opt.state[p]["momentum_buffer"].device.type == "meta"
        assert opt.state[other]["momentum_buffer"].device.type == "cpu"
        opt.state[p]["momentum_buffer"] = torch.ones(4)  # (not walked again: nothing moved)
        assert pinned.state_to_host(opt) == 0
    finally:
        del pinned._params[p]
