"""Fragment inputs read several times get their gradients added in eager's order
(rewrites/input_uses.py): bit-identical gradients across graph breaks."""

from __future__ import annotations

import copy
import operator
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn

import memcompile
from memcompile import MemoryBudgetWarning
from memcompile.report import find_compiler
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.input_uses import InputSplit, split_inputs_pass
from memcompile.runtime.store import is_host_placed

from helpers import examples

# 1 + 2**-24 rounds to 1 (a tie, to even); 1 + 2**-23 is exact: which two add first shows.
TINY = 2.0**-24


def _x_grad(fn: Any, *args: torch.Tensor) -> torch.Tensor:
    x = args[0].detach().clone().requires_grad_()
    fn(x, *args[1:]).sum().backward()
    assert x.grad is not None
    return x.grad


def _matches_eager(fn: Any, *args: torch.Tensor) -> torch.Tensor:
    """``x``'s gradient through ``fn`` under memcompile equals eager's bit for bit; eager's."""
    eager = _x_grad(fn, *args)
    torch._dynamo.reset()
    compiled = _x_grad(memcompile.compile(fn), *args)
    assert torch.equal(compiled, eager)
    return eager


def _across_break(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
    y = x * a + x * b  # x read twice: eager adds b's contribution, then a's
    torch._dynamo.graph_break()
    return y + x * c  # ... after this one's (backward runs it first)


def test_contributions_from_two_fragments_add_in_eager_order() -> None:
    x, c = torch.ones(8), torch.ones(8)
    a, b = torch.full((8,), TINY), torch.full((8,), TINY)
    eager = _matches_eager(_across_break, x, a, b, c)
    assert torch.equal(eager, torch.ones(8))  # (1 + tiny) + tiny
    torch._dynamo.reset()
    # AOTAutograd alone adds the fragment's two first: 1 + (tiny + tiny), one ulp above.
    aot = _x_grad(torch.compile(_across_break, backend="aot_eager"), x, a, b, c)
    assert torch.equal(aot, torch.full((8,), 1 + 2 * TINY))


def _one_op_twice(x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    y = torch.addcmul(x, x, t)  # x as self (grad 1), then as tensor1 (grad t)
    torch._dynamo.graph_break()
    return y + x * c


def test_one_ops_contributions_keep_argument_order() -> None:
    # eager: (c + 1) + tiny; the two slots the other way round: (c + tiny) + 1.
    x, t, c = torch.ones(8), torch.full((8,), TINY), torch.full((8,), TINY)
    assert torch.equal(_matches_eager(_one_op_twice, x, t, c), torch.ones(8))


def _mutates_between_breaks(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    h = x * 1
    z = h * c  # an older reader of h: its contribution is added last
    torch._dynamo.graph_break()
    y = h * a + h * b  # read twice before the mutation: summed in the backward graph
    h.mul_(1)  # the newest op on h: eager adds its contribution (1) first
    y = y + h
    torch._dynamo.graph_break()
    return y + z


def test_a_mutated_inputs_summed_reads_add_in_eager_order() -> None:
    # eager: ((1 + tiny) + tiny) + tiny = 1; the fragment's two reads summed first would give
    # 1 + 2 tiny. A mutated input is not split: nothing newer than the fragment reads the
    # value before the mutation, so no contribution comes before the fragment's own.
    x = torch.ones(8)
    a, b, c = (torch.full((8,), TINY) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.GradientOrderWarning)
        assert torch.equal(_matches_eager(_mutates_between_breaks, x, a, b, c), torch.ones(8))


def _norm_and_residual(x: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    torch._dynamo.graph_break()
    # torch.rms_norm is x * rsqrt(x.pow(2).mean()) on the CPU: two edges into h from one op.
    return torch.rms_norm(h, (h.shape[-1],)) * 3 + h


def test_an_op_with_two_edges_into_one_input_leaves_it_whole() -> None:
    # Eager adds the residual's contribution, then rms_norm's two; AOTAutograd's graph for the
    # second fragment adds them in that order too. A placeholder for rms_norm's read would add
    # its two first (caught by this test on the first version of the split).
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    _matches_eager(_norm_and_residual, x)


def _norm_read_by_two(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    torch._dynamo.graph_break()
    y = torch.rms_norm(h, (h.shape[-1],)) * 3 + h
    torch._dynamo.graph_break()
    return y + h * c  # this fragment's backward adds to h's gradient first


def test_several_edges_summed_after_another_contribution_are_warned_about() -> None:
    # The middle fragment sums rms_norm's two edges and the residual's into h in its graph;
    # the last fragment's backward added to h before it: not eager's order, and no split
    # can fix it. Without that earlier contribution (the test above) nothing is said.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    c = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = memcompile.compile(_norm_read_by_two)
    with pytest.warns(memcompile.GradientOrderWarning, match="an op reads through several"):
        for _ in range(2):
            _x_grad(compiled, x, c)
    (name,) = memcompile.report(compiled).summed_grads
    assert name.startswith("F1: ")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.GradientOrderWarning)
        compiled = memcompile.compile(_norm_and_residual)
        for _ in range(2):
            _x_grad(compiled, x)


def _hand_norm_between_breaks(x: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    torch._dynamo.graph_break()
    t = h.to(torch.float32)  # h itself (HF's RMSNorm): its readers read h
    y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch._dynamo.graph_break()
    return y + h * 3


def test_reads_through_an_op_returning_its_input_add_in_eager_order() -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    _matches_eager(_hand_norm_between_breaks, x)


N = 1024


class _SharedWeight(nn.Module):
    """A parameter each fragment reads twice (tied weights, a weight and its transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, a, b, c, d):
        y = self.w * a + self.w * b
        torch._dynamo.graph_break()
        return y + self.w * c + self.w * d


def _shared_weight_grads(**options: object) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
    """``w``'s gradient in eager and under memcompile with ``options`` (first step), the
    compiled model, and the measured peak of a second step. Eager adds the second fragment's
    two contributions (``d``'s first: the newest op), then the first one's."""
    a, b, c = (torch.full((N,), TINY) for _ in range(3))
    d = torch.ones(N)
    model = _SharedWeight()
    model(a, b, c, d).sum().backward()
    eager = model.w.grad
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = memcompile.compile(model, **options)
    compiled(a, b, c, d).sum().backward()
    assert model.w.grad is not None
    got = model.w.grad
    model.zero_grad(set_to_none=True)
    peak = memcompile.measure_peak(
        lambda: compiled(a, b, c, d).sum().backward(), resident=[model, a, b, c, d]
    )
    return eager, got, compiled, peak


def test_a_parameter_summed_after_another_calls_contribution_is_warned_about() -> None:
    # By default a parameter is not split (the memory cost of one gradient per read): the first
    # fragment sums its two reads in its graph, after the second fragment's backward added to
    # w: (1 + tiny) + (tiny + tiny), as aot_eager. Said once, naming the fragment and w.
    with pytest.warns(memcompile.GradientOrderWarning, match=r"F0 reads parameter w ") as seen:
        eager, got, compiled, _ = _shared_weight_grads()
    assert torch.equal(eager, torch.ones(N))  # ((1 + tiny) + tiny) + tiny: each rounds to 1
    assert torch.equal(got, torch.full((N,), 1 + 2 * TINY))
    assert len([w for w in seen if w.category is memcompile.GradientOrderWarning]) == 1
    rep = memcompile.report(compiled)
    # F1's backward runs first: its in-graph sum is eager's first addition, so F1 is exact.
    assert len(rep.summed_grads) == 1 and rep.summed_grads[0].startswith("F0: ")
    assert "gradient summed out of eager's order: F0: w" in str(rep)
    assert rep.to_dict()["summed_grads"] == list(rep.summed_grads)
    torch._dynamo.reset()
    model = _SharedWeight()
    a, b, c = (torch.full((N,), TINY) for _ in range(3))
    torch.compile(model, backend="aot_eager")(a, b, c, torch.ones(N)).sum().backward()
    assert torch.equal(model.w.grad, got)


def test_split_param_reads_adds_a_parameters_reads_up_in_eager_order() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.GradientOrderWarning)
        eager, got, compiled, _ = _shared_weight_grads(split_param_reads=True)
    assert torch.equal(got, eager)
    assert memcompile.report(compiled).summed_grads == ()


class _TwiceRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, a, b):
        return self.w * a + self.w * b


def test_a_fragment_called_twice_a_step_is_warned_about_or_split() -> None:
    # One fragment, two calls: the second call's backward adds to w first, then the first
    # call's in-graph sum arrives. Eager: ((1 + tiny) + tiny) + tiny = 1.
    a, b, c = (torch.full((N,), TINY) for _ in range(3))
    d = torch.ones(N)

    def step(block: Any) -> torch.Tensor:
        # Two steps: a step's check runs when the next one starts.
        module = block._orig_mod if hasattr(block, "_orig_mod") else block
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            (block(a, b) + block(c, d)).sum().backward()
        return module.w.grad

    eager = step(_TwiceRead())
    assert torch.equal(eager, torch.ones(N))
    torch._dynamo.reset()
    with pytest.warns(memcompile.GradientOrderWarning, match=r"F0 reads parameter w "):
        summed = step(memcompile.compile(_TwiceRead()))
    assert torch.equal(summed, torch.full((N,), 1 + 2 * TINY))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.GradientOrderWarning)
        assert torch.equal(step(memcompile.compile(_TwiceRead(), split_param_reads=True)), eager)


def test_a_host_placed_parameter_is_fetched_through_its_aliases() -> None:
    # Each read's alias is fetched from the host tier like the parameter itself; only the
    # parameter moves there. The prediction equals the measured peak: an example alias made
    # before the move kept the device copy alive, and the step's resident bytes counted it.
    eager, got, compiled, peak = _shared_weight_grads(offload_params=True, split_param_reads=True)
    assert torch.equal(got, eager)
    assert memcompile.report(compiled).predicted_peak == peak
    comp, _ = find_compiler(compiled)
    for record in comp.records():
        assert record.plan is not None
        assert len(record.plan.host_params) == 3  # w and the alias of each read
    assert is_host_placed(compiled._orig_mod.w)


def test_a_recurrence_summing_its_weight_in_one_call_is_exact_and_not_warned() -> None:
    # The zoo GRU reads its recurrent weights once per time step in one fragment called once
    # a step: nothing adds to those gradients before its backward, so the in-graph sum is
    # eager's order (and no split is needed).
    from memcompile import zoo

    wl = zoo.build("gru", size="tiny")
    ref = zoo.build("gru", size="tiny")
    batch = wl.batch(0)
    ref.model(*batch).backward()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.GradientOrderWarning)
        compiled = memcompile.compile(wl.model)
        for _ in range(2):
            wl.model.zero_grad(set_to_none=True)
            compiled(*batch).backward()
    comp, _ = find_compiler(compiled)
    assert any(r.summed_inputs for r in comp.records())  # there are summed weights
    for (name, p), q in zip(wl.model.named_parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 32, 32) / 6)

    def forward(self, hs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor):
        out = torch.zeros_like(hs)
        for e in idx.unique():  # data-dependent: Dynamo runs this loop eagerly
            rows, k = torch.where(idx == e)
            y = torch.nn.functional.silu(hs[rows] @ self.w[e]) * weights[rows, k, None]
            out.index_add_(0, rows, y)
        return out


class _MoEBlock(nn.Module):
    """The shape of HF Qwen2-MoE's sparse block: ``hs = h.view(-1, d)`` read by a shared
    expert and the router in the block's first fragment, by the experts (eager) and a gate
    after it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate, self.sg = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.router = nn.Linear(32, 4)
        self.experts = _Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        hs = h.view(-1, d)
        shared = torch.nn.functional.silu(self.gate(hs)) * self.up(hs)
        weights, idx = torch.topk(self.router(hs.reshape(-1, d)).softmax(-1), 2)
        out = self.experts(hs, idx, weights) + torch.sigmoid(self.sg(hs)) * shared
        return out.reshape(b, t, d)


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.block = _MoEBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The block's frame starts at the call (Dynamo breaks the graph in it): h is an input.
        return self.block(torch.tanh(self.inp(x))).pow(2).mean()


def test_a_returned_view_read_by_eager_experts_adds_up_in_eager_order() -> None:
    # What the experts and the gate add through hs must come first, then the router's, the
    # up projection's and the gate projection's. Found on HF Qwen2-MoE (eager experts).
    torch.manual_seed(0)
    eager = _MoE()
    model = copy.deepcopy(eager)
    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = _grads(eager, eager, x)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memcompile.EagerFallbackWarning)  # the experts' loop
        got = _grads(model, memcompile.compile(model), x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, h, k, m, s):
        out = h @ self.w + h.sin() * h + self.w.cos()  # h: 3 reads; w (a parameter): 2
        out = out + k * k.size(0)  # k: one read that gets a gradient
        out = out + s.tanh() * s  # s: needs no gradient
        m.add_(1)  # m: mutated
        return out + m * m


def _dynamo_graph(module: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, list[Any]]:
    seen: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    ((gm, example),) = seen
    return gm, example


def _reader(node: fx.Node) -> object:
    ((user,),) = [list(node.users)]
    return user.target


def test_split_gives_each_read_its_own_placeholder_in_eager_order() -> None:
    h, k = (torch.randn(4, 4, requires_grad=True) for _ in range(2))
    m = torch.randn(4, 4, requires_grad=True) * 1  # not a leaf: add_ is allowed
    gm, example = _dynamo_graph(_Reads(), h, k, m, torch.randn(4, 4))
    names = [p.name for p in gm.graph.find_nodes(op="placeholder")]
    before = gm.code
    out = split_inputs_pass(gm, PassContext(graph="dynamo"), example_inputs=example)
    assert gm.code == before  # Dynamo's own graph is left as it is
    pos = next(i for i, n in enumerate(names) if n.startswith("l_h"))
    w = next(i for i, n in enumerate(names) if "parameters_w" in n)
    # h only (k has one read, s needs no gradient, m is mutated); w, a parameter, stays whole.
    assert out.meta["memcompile_input_split"] == InputSplit((pos, pos, pos), summed=(w,))
    phs = list(out.graph.find_nodes(op="placeholder"))
    assert [p.name for p in phs[: len(names)]] == names  # the others keep their positions
    # h is read by matmul, sin, mul (graph order); eager adds mul's contribution first (newest
    # op), then sin's, then matmul's. Autograd runs the newest alias node first: the aliases
    # are made in the reverse order, and h itself is read by none.
    assert not phs[pos].users
    assert [_reader(p) for p in phs[len(names) :]] == [operator.matmul, "sin", operator.mul]
    x = torch.randn(4, 4)
    assert InputSplit((0, 0)).expand([x])[2].data_ptr() == x.data_ptr()  # aliases


def test_split_param_reads_gives_a_parameter_one_placeholder_per_read() -> None:
    h, k = (torch.randn(4, 4, requires_grad=True) for _ in range(2))
    m = torch.randn(4, 4, requires_grad=True) * 1
    gm, example = _dynamo_graph(_Reads(), h, k, m, torch.randn(4, 4))
    names = [p.name for p in gm.graph.find_nodes(op="placeholder")]
    out = split_inputs_pass(gm, PassContext(graph="dynamo"), example_inputs=example, params=True)
    pos = next(i for i, n in enumerate(names) if n.startswith("l_h"))
    w = next(i for i, n in enumerate(names) if "parameters_w" in n)
    assert w < pos  # Dynamo lists the parameter first
    assert out.meta["memcompile_input_split"] == InputSplit((w, w, pos, pos, pos))
    assert InputSplit((w, w, pos, pos, pos)).aliases(len(names)) == {
        len(names): w,
        len(names) + 1: w,
        len(names) + 2: pos,
        len(names) + 3: pos,
        len(names) + 4: pos,
    }
    phs = list(out.graph.find_nodes(op="placeholder"))
    # w is read by matmul, then cos: eager adds cos's first, so its alias is made last.
    assert not phs[w].users and not phs[pos].users
    readers = [_reader(p) for p in phs[len(names) :]]
    assert readers == [operator.matmul, "cos", operator.matmul, "sin", operator.mul]


def test_nothing_to_split_returns_the_graph() -> None:
    h = torch.randn(4, 4, requires_grad=True)
    gm, example = _dynamo_graph(nn.Linear(4, 4), h)
    assert split_inputs_pass(gm, PassContext(graph="dynamo"), example_inputs=example) is gm


# -- random networks with graph breaks, x budgets ------------------------------------------------
WIDTH = 32
OPS = ("linear", "tanh", "mul", "add")


class _BrokenNet(nn.Module):
    """A random DAG (as tests/test_planner_random.py) in two or three fragments: values made
    before a graph break are read, often several times, after it. With ``shared`` linear
    layers the fragments take turns with two of them: parameters read several times in one
    fragment and in others."""

    def __init__(self, segments: list[list[tuple[str, int, int]]], shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.segments = segments
        count = 2 if shared else sum(len(s) for s in segments)
        self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(count))
        self.inp = nn.Linear(WIDTH, WIDTH)

    def _segment(self, k: int, vals: list[torch.Tensor]) -> None:
        first = sum(len(s) for s in self.segments[:k])
        for i, (op, a, b) in enumerate(self.segments[k], start=first):
            u, v = vals[a % len(vals)], vals[b % len(vals)]
            if op == "linear":
                vals.append(self.linears[i % len(self.linears)](u))
            elif op == "tanh":
                vals.append(u.tanh())
            else:
                vals.append(u * v if op == "mul" else u + v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No loop around the breaks (Dynamo would run the whole frame eagerly).
        vals = [self.inp(x)]
        self._segment(0, vals)
        torch._dynamo.graph_break()
        self._segment(1, vals)
        if len(self.segments) > 2:
            torch._dynamo.graph_break()
            self._segment(2, vals)
        return sum(v.pow(2).mean() for v in vals)


segment = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4
)


def _grads(model: nn.Module, fn: Any, x: torch.Tensor) -> list[torch.Tensor]:
    fn(x).backward()
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    segments=st.lists(segment, min_size=2, max_size=3),
    fraction=st.sampled_from([None, 0.4]),
    on_host=st.booleans(),
    shared=st.booleans(),
)
def test_random_network_with_graph_breaks_is_bit_identical(
    segments, fraction, on_host, shared
) -> None:
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1))
    eager = _BrokenNet(segments, shared)
    expected = _grads(eager, eager, x)
    # Shared layers: parameters read several times in fragments that others read them in too.
    options: dict[str, Any] = {"offload_params": True} if on_host else {}
    if shared:
        options["split_param_reads"] = True
    if fraction is not None:
        peak = memcompile.measure_peak(lambda: eager(x).backward())
        eager.zero_grad(set_to_none=True)
        options |= {"budget": max(1, int(peak * fraction)), "on_infeasible": "best_effort"}
    torch._dynamo.reset()
    model = copy.deepcopy(eager)
    compiled = memcompile.compile(model, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryBudgetWarning)  # infeasible budgets are expected
        got = _grads(model, compiled, x)
        again = _grads(model, compiled, x)  # the second call runs the recorded plan
    rep = memcompile.report(compiled)
    assert rep.fallbacks == () and len(rep.fragments) >= len(segments)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(expected, again, strict=True))
