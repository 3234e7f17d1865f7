"""Two-stream timeline and reload prefetching: stalls, issue points, the peak bound, the wait op."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import memcompile
from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import profile_graph
from memcompile.analysis.timeline import simulate
from memcompile.planning.plan import FragmentPlan, MemoryPlan, TensorDecision
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.early_reloads import plan_prefetch, prefetch_pass
from memcompile.runtime.store import TieredStore, register_store

from helpers import predicted_peak, train_under_budget

aten = torch.ops.aten
N = 64  # 64x64 float32: 16 KiB per tensor; a matmul is 2*N^3 = 524288 FLOPs

# 1 GFLOP/s: a matmul takes 0.524 ms; host link 16 MiB/s: a 16 KiB copy takes ~0.98 ms.
PROFILE = DeviceProfile(
    name="test",
    flops={"float32": 1e9},
    memory_bandwidth=1e15,
    host_bandwidth=16 * 2**20,
    disk_bandwidth=1e9,
    launch_overhead=0.0,
)
MM = 2 * N**3 / 1e9
COPY = N * N * 4 / (16 * 2**20)


def _backward_like(key: int, chain: int, big: int = 1) -> fx.GraphModule:
    """x = reload(x_host); a chain of matmuls on ``a`` (``big``x wider ones first); y = x + c."""
    g = fx.Graph()
    x_host, a = g.placeholder("x_host"), g.placeholder("a")
    c = a
    if big > 1:
        wide = g.call_function(aten.repeat.default, (a, [big, 1]))
        c = g.call_function(
            aten.sum.dim_IntList, (g.call_function(aten.mm.default, (wide, a)), [0])
        )
        c = g.call_function(aten.add.Tensor, (a, c))
    for _ in range(chain):
        c = g.call_function(aten.mm.default, (c, a))
    x = g.call_function(torch.ops.memcompile.reload.default, (x_host, torch.device("cpu"), key, 0))
    g.call_function(torch.ops.memcompile.wait.default, (x, key))
    y = g.call_function(aten.add.Tensor, (x, c))
    g.output((y,))
    gm = fx.GraphModule({}, g)
    FakeTensorProp(gm).propagate(torch.randn(N, N), torch.randn(N, N))
    for n in gm.graph.nodes:
        if n.target is torch.ops.memcompile.wait.default:
            n.meta["val"] = None
    return gm


def _inputs(key: int) -> list[torch.Tensor]:
    x = torch.randn(N, N)
    return [torch.ops.memcompile.offload(x, key, 0), torch.randn(N, N)]


def test_timeline_stalls_for_a_reload_issued_at_its_use() -> None:
    gm = _backward_like(register_store(TieredStore()), chain=3)
    t = simulate(gm, PROFILE)
    assert t.compute == pytest.approx(3 * MM, rel=1e-3)  # the add is ~free at 1e15 B/s
    assert t.copy == pytest.approx(COPY)
    assert t.stall == pytest.approx(COPY)  # nothing to overlap with: the copy is all exposed
    assert t.total == pytest.approx(t.compute + t.stall)
    assert dict(t.exposed).keys() == {"reload_default"}


def test_prefetch_hides_the_copy_and_keeps_results_and_peak() -> None:
    key = register_store(TieredStore())
    gm = _backward_like(key, chain=3)
    prof = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
    inputs = _inputs(key)
    expected = gm(*inputs)[0]

    plan = plan_prefetch(gm, prof, PROFILE)
    # 0.98 ms of copy needs two 0.52 ms matmuls in front of the wait: issued before the 2nd mm.
    assert plan.before.stall == pytest.approx(COPY)
    assert plan.after.stall == 0.0 and plan.hidden_seconds == pytest.approx(COPY)
    assert plan.issue_before == (("reload_default", "mm_default_1"),)
    prefetch_pass(gm, PassContext("F0", "backward"), plan=plan)
    names = [n.name for n in gm.graph.nodes]
    assert names.index("reload_default") == names.index("mm_default_1") - 1
    assert simulate(gm, PROFILE).stall == 0.0
    after = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
    assert after.peak_bytes == prof.peak_bytes  # the reload moved only where memory was free
    assert torch.equal(gm(*inputs)[0], expected)


def test_prefetch_never_raises_the_peak() -> None:
    # A wide temporary (4x) in front of the chain makes the peak: the reload may move up to it,
    # not across it, however long its copy.
    slow = DeviceProfile(**{**PROFILE.__dict__, "host_bandwidth": 2**20})
    key = register_store(TieredStore())
    gm = _backward_like(key, chain=2, big=4)
    prof = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
    plan = plan_prefetch(gm, prof, slow)
    assert plan.after.stall > 0  # cannot be hidden in the memory left
    assert plan.after.stall < plan.before.stall
    prefetch_pass(gm, PassContext("F0", "backward"), plan=plan)
    after = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
    assert after.peak_bytes == prof.peak_bytes
    names = [n.name for n in gm.graph.nodes]
    assert names.index("reload_default") > names.index("mm_default")  # not above the wide matmul


def test_a_reload_of_a_block_of_rows_is_never_issued_above_its_slice() -> None:
    # A tiled op reloads a block of rows of the host copy (rewrites/tiling/build.py): the reload may
    # move up to the slice it reads, however slow the link and large the slack.
    slow = DeviceProfile(**{**PROFILE.__dict__, "host_bandwidth": 2**20})
    key = register_store(TieredStore())
    g = fx.Graph()
    x_host, a = g.placeholder("x_host"), g.placeholder("a")
    first = g.call_function(aten.mm.default, (a, a))
    part = g.call_function(aten.slice.Tensor, (x_host, 0, 0, N // 2))
    c = g.call_function(aten.mm.default, (first, a))
    x = g.call_function(torch.ops.memcompile.reload.default, (part, torch.device("cpu"), key, 0))
    g.call_function(torch.ops.memcompile.wait.default, (x, key))
    half = g.call_function(aten.slice.Tensor, (c, 0, 0, N // 2))
    g.output((g.call_function(aten.add.Tensor, (x, half)),))
    gm = fx.GraphModule({}, g)
    inputs = _inputs(key)
    FakeTensorProp(gm).propagate(*inputs)
    expected = gm(*inputs)
    prof = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
    plan = plan_prefetch(gm, prof, slow, slack=2**30)
    prefetch_pass(gm, PassContext("F0", "backward"), plan=plan)  # lints the moved graph
    names = [n.name for n in gm.graph.nodes]
    assert names.index("reload_default") == names.index("slice_tensor") + 1
    assert plan.issue_before  # it did move: above the matmul after the slice, not above both
    assert torch.equal(gm(*inputs)[0], expected[0])


def test_prefetch_uses_the_slack_the_budget_leaves_and_no_more() -> None:
    # The same wide temporary: with one tensor's bytes of slack (the budget above the plan's
    # peak) the reload may cross it, and the peak rises by exactly that; one byte less: not.
    slow = DeviceProfile(**{**PROFILE.__dict__, "host_bandwidth": 2**20})
    key = register_store(TieredStore())
    size = N * N * 4
    for slack, crosses in ((size, True), (size - 1, False)):
        gm = _backward_like(key, chain=2, big=4)
        prof = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
        plan = plan_prefetch(gm, prof, slow, slack=slack)
        prefetch_pass(gm, PassContext("F0", "backward"), plan=plan)
        after = profile_graph(gm, kind="backward", persistent_inputs=[0, 1])
        names = [n.name for n in gm.graph.nodes]
        assert (names.index("reload_default") < names.index("mm_default")) == crosses, slack
        assert prof.peak_bytes <= after.peak_bytes <= prof.peak_bytes + slack
    with pytest.raises(ValueError, match="slack must be >= 0 bytes, got -1"):
        plan_prefetch(gm, prof, slow, slack=-1)


def test_plan_prefetch_rejects_a_profile_of_another_graph() -> None:
    key = register_store(TieredStore())
    gm, other = _backward_like(key, chain=3), _backward_like(key, chain=2)
    prof = profile_graph(other, kind="backward", persistent_inputs=[0, 1])
    with pytest.raises(ValueError, match="the profile does not describe this graph"):
        plan_prefetch(gm, prof, PROFILE)


def test_wait_is_a_no_op_on_cpu_and_nothing_stays_in_flight() -> None:
    store = TieredStore()
    key = register_store(store)
    x = torch.randn(8, 8)
    y = torch.ops.memcompile.reload(torch.ops.memcompile.offload(x, key, 0), x.device, key, 0)
    torch.ops.memcompile.wait(y, key)
    assert torch.equal(x, y) and store.in_flight() == 0


@pytest.mark.usefixtures("fresh_dynamo")
def test_swap_plan_records_prefetch_and_stall_and_round_trips() -> None:
    budget = int(predicted_peak("gpt_manual") * 0.85)
    compiled, _, measured = train_under_budget(
        "gpt_manual", "sgd", budget, recompute=False, offload_to="host"
    )
    rep = memcompile.report(compiled)
    (plan,) = rep.plan.fragments
    assert plan.swapped and plan.prefetch and plan.swap_stall is not None
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured and measured <= budget * 1.02
    again = MemoryPlan.from_json(rep.plan.to_json())
    assert again == rep.plan


def test_fragment_plan_without_prefetch_fields_still_loads() -> None:
    # Plans written before prefetching existed have no "prefetch" / "swap_stall" keys.
    plan = FragmentPlan(
        fragment="F0",
        decisions=(TensorDecision("a", 16, "keep"),),
        backward_order=("a",),
        target=None,
        resident_bytes=0,
        predicted_peak=16,
        baseline_peak=16,
        recompute_time=0.0,
        feasible=True,
    )
    data = plan.to_dict()
    del data["prefetch"], data["swap_stall"]
    assert FragmentPlan.from_dict(data) == plan
