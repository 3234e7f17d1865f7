"""GraphProfile: storage accounting, liveness and the live-bytes curve, checked by hand and
against the CPU allocator on random programs."""

from __future__ import annotations

import copy
import operator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.analysis.graph import StorageIds, profile_graph
from memcompile.backends.inner import compile_inner
from memcompile.runtime.measure import measure

aten = torch.ops.aten
N = 64
TENSOR = N * N * 4  # bytes of one (N, N) fp32 tensor


def trace(fn, *args: torch.Tensor) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def test_chain_frees_each_value_after_its_last_use() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.relu()
        b = a * a
        c = b.exp()
        return c

    p = profile_graph(trace(f, torch.randn(N, N)), kind="forward", persistent_inputs=[0])
    assert p.start_bytes == 0
    assert p.peak_bytes == 2 * TENSOR  # b and c: a is gone after b, b after c
    assert p.end_bytes == TENSOR  # the output
    assert [n.new_bytes for n in p.nodes if n.op == "call_function"] == [TENSOR] * 3


def test_views_share_their_base_storage() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.relu()
        v = a.t()  # no new storage
        w = v[: N // 2]  # nor here
        return w.sum(0)

    p = profile_graph(trace(f, torch.randn(N, N)), kind="forward", persistent_inputs=[0])
    by_target = {n.target: n for n in p.nodes}
    assert by_target["aten.t.default"].new_bytes == 0
    assert by_target["aten.t.default"].bytes_moved == 0
    assert by_target["aten.slice.Tensor"].new_bytes == 0
    assert by_target["aten.relu.default"].storages == by_target["aten.slice.Tensor"].storages
    # relu's storage is alive through the sum (a view of it is summed), then freed
    assert p.peak_bytes == TENSOR + N * 4
    assert p.end_bytes == N * 4


def test_views_of_persistent_inputs_are_not_tracked() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.t().reshape(-1)[:3] + 1  # t and reshape of a non-contiguous view copy

    p = profile_graph(trace(f, torch.randn(N, N)), kind="forward", persistent_inputs=[0])
    t = next(n for n in p.nodes if n.target == "aten.t.default")
    assert t.new_bytes == 0 and t.storages[0] in p.persistent


def test_multi_output_ops_allocate_every_output() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out, _mean, _rstd = aten.native_layer_norm(x, [N], w, b, 1e-5)
        return out

    x, w, b = torch.randn(8, N), torch.randn(N), torch.randn(N)
    p = profile_graph(trace(f, x, w, b), kind="forward", persistent_inputs=[0, 1, 2])
    ln = next(n for n in p.nodes if n.target == "aten.native_layer_norm.default")
    assert ln.new_bytes == 8 * N * 4 + 2 * 8 * 4  # out + mean + rstd (8, 1) each
    assert p.end_bytes == 8 * N * 4  # mean and rstd are dropped after the getitems


def test_freeable_inputs_are_live_on_entry_and_freed_at_last_use() -> None:
    def f(saved: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return saved.mul(grad).sum()

    p = profile_graph(trace(f, torch.randn(N, N), torch.randn(N, N)), kind="backward")
    assert p.start_bytes == 2 * TENSOR
    mul = next(n for n in p.nodes if n.target == "aten.mul.Tensor")
    assert mul.live_bytes == 3 * TENSOR
    assert mul.freed_bytes == 2 * TENSOR  # both inputs die after the mul
    assert p.end_bytes == 4


def test_shared_ids_link_forward_outputs_to_backward_inputs() -> None:
    ids = StorageIds()
    x = torch.randn(N, N)

    def fw(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.relu()
        return a.sum(), a

    gm = trace(fw, x)
    pf = profile_graph(gm, kind="forward", persistent_inputs=[0], ids=ids)
    saved = gm.graph.find_nodes(op="output")[0].args[0][1].meta["val"]
    assert ids.id_of(saved) in {s.id for s in pf.storages}
    assert pf.storage_bytes([ids.id_of(saved)]) == TENSOR


def test_flops_come_from_the_flop_counter() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    p = profile_graph(
        trace(f, torch.randn(N, 32), torch.randn(32, 16)), kind="forward", persistent_inputs=[0, 1]
    )
    assert p.flops == 2 * N * 32 * 16
    mm = next(n for n in p.nodes if n.target == "aten.mm.default")
    assert mm.bytes_moved == (N * 32 + 32 * 16 + N * 16) * 4


def test_a_copied_node_keeps_its_cost_unless_it_reads_or_makes_other_values() -> None:
    # A node's cost is kept in its meta with the values it was found for: a copy sharing them
    # (the graphs a search builds) is not costed again; a node reading other values is.
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def mm_of(g: fx.GraphModule) -> fx.Node:
        return next(n for n in g.graph.nodes if n.target is aten.mm.default)

    gm = trace(f, torch.randn(N, 32), torch.randn(32, 16))
    profile_graph(gm, kind="forward", persistent_inputs=[0, 1])
    known = mm_of(gm).meta["memcompile_cost"]
    assert known[3][0] == 2 * N * 32 * 16
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    assert mm_of(copied).meta["memcompile_cost"] is known  # the copy's meta, not costed again
    assert profile_graph(copied, kind="forward", persistent_inputs=[0, 1]).flops == known[3][0]
    # The same node with twice the rows, the cost of the first in its meta: costed again.
    other = trace(f, torch.randn(2 * N, 32), torch.randn(32, 16))
    mm_of(other).meta["memcompile_cost"] = known
    p = profile_graph(other, kind="forward", persistent_inputs=[0, 1])
    assert p.flops == 2 * (2 * N) * 32 * 16


def test_peak_node_and_curve() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        b = x.relu()
        c = a + b  # a, b, c live here
        return c.sum()

    p = profile_graph(trace(f, torch.randn(N, N)), kind="forward", persistent_inputs=[0])
    assert p.peak_node == "add"
    assert max(p.live_curve) == p.peak_bytes == 3 * TENSOR


# --- random programs against the allocator --------------------------------------------------

UNARY = ("relu", "neg", "exp", "clone", "t", "narrow0", "narrow1", "sum0")
BINARY = ("add", "mul", "mm", "sub")


@st.composite
def programs(draw: st.DrawFn) -> tuple[int, list[tuple[str, tuple[int, ...]]], list[int]]:
    n_inputs = draw(st.integers(1, 3))
    steps: list[tuple[str, tuple[int, ...]]] = []
    shapes: list[tuple[int, int] | tuple[int]] = [(N, N)] * n_inputs
    for _ in range(draw(st.integers(1, 14))):
        square = [i for i, s in enumerate(shapes) if s == (N, N)]
        if draw(st.booleans()):
            op = draw(st.sampled_from(UNARY))
            i = draw(st.sampled_from(square))
            steps.append((op, (i,)))
            shapes.append(
                {"narrow0": (N // 2, N), "narrow1": (N, N // 2), "sum0": (N,)}.get(op, (N, N))
            )
        else:
            op = draw(st.sampled_from(BINARY))
            steps.append((op, (draw(st.sampled_from(square)), draw(st.sampled_from(square)))))
            shapes.append((N, N))
    outputs = draw(
        st.lists(st.integers(n_inputs, len(shapes) - 1), min_size=1, max_size=3, unique=True)
    )
    return n_inputs, steps, outputs


def build(program: tuple[int, list[tuple[str, tuple[int, ...]]], list[int]]):
    n_inputs, steps, outputs = program
    ops = {
        "relu": torch.relu,
        "neg": torch.neg,
        "exp": torch.exp,
        "clone": torch.clone,
        "t": torch.t,
        "narrow0": lambda x: x.narrow(0, 0, N // 2),
        "narrow1": lambda x: x.narrow(1, 0, N // 2),
        "sum0": lambda x: x.sum(0),
        "add": operator.add,
        "mul": operator.mul,
        "sub": operator.sub,
        "mm": torch.mm,
    }

    def fn(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = list(inputs)
        for op, args in steps:
            vals.append(ops[op](*(vals[a] for a in args)))
        return tuple(vals[o] for o in outputs)

    return fn, [torch.randn(N, N) for _ in range(n_inputs)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_predicted_peak_equals_allocator_peak_on_random_programs(program) -> None:
    fn, inputs = build(program)
    gm = trace(fn, *inputs)
    profile = profile_graph(gm, kind="forward", persistent_inputs=range(len(inputs)))
    run = compile_inner("eager", gm, inputs, role="forward")
    measured = measure(lambda: run(list(inputs)))
    assert measured.resident_bytes == len(inputs) * TENSOR
    assert measured.peak - measured.resident_bytes == profile.peak_bytes


def test_attention_without_dropout_does_not_draw_random_numbers() -> None:
    # The attention kernels carry nondeterministic_seeded for their optional dropout: with
    # dropout_p == 0 they are deterministic, so the planner may recompute them (what
    # checkpointing does); with dropout, or a real dropout op, never.
    from memcompile.analysis.graph import draws_random, has_effect

    q = torch.randn(1, 2, 8, 4)

    def attn(p: object, as_kwarg: bool) -> fx.GraphModule:  # built, not run (CPU: p must be 0)
        g = fx.Graph()
        x = g.placeholder("q")
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        args, kwargs = ((x, x, x), {"dropout_p": p}) if as_kwarg else ((x, x, x, p), {})
        g.output(g.call_function(op, args, kwargs))
        return fx.GraphModule({}, g)

    def drop(q: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.native_dropout(q, 0.1, True)[0]

    def random_nodes(gm: fx.GraphModule) -> list[str]:
        return [
            n.target._opname for n in gm.graph.nodes if n.op == "call_function" and draws_random(n)
        ]

    sdpa = ["_scaled_dot_product_flash_attention_for_cpu"]
    assert (
        random_nodes(
            make_fx(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q))(q)
        )
        == []
    )
    for as_kwarg in (False, True):
        assert random_nodes(attn(0.0, as_kwarg)) == []
        assert random_nodes(attn(0.25, as_kwarg)) == sdpa
    g = fx.Graph()  # the default (0.0) when the argument is left out
    x = g.placeholder("q")
    g.output(
        g.call_function(
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x)
        )
    )
    assert random_nodes(fx.GraphModule({}, g)) == []
    gm = make_fx(drop)(q)
    assert random_nodes(gm) == ["native_dropout"]
    assert [n.target._opname for n in gm.graph.nodes if has_effect(n)] == ["native_dropout"]


def test_gpt_plans_may_recompute_attention_and_stay_bit_identical() -> None:
    import memcompile

    from helpers import predicted_peak, train_under_budget

    base = predicted_peak("gpt", size="tiny")
    compiled, _, measured = train_under_budget(
        "gpt", "sgd", int(base * 0.8), swap=False, offload_params=False
    )
    (plan,) = memcompile.report(compiled).plan.fragments
    recomputed = [n for n in plan.backward_order if "scaled_dot_product" in n]
    assert recomputed, plan.backward_order
    assert measured == memcompile.report(compiled).predicted_peak
