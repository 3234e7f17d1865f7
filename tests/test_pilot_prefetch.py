"""The pilot's in-graph prefetch op (rewrites/pilot_prefetch.py): placed at the latest point where
the expected copy still finishes before the graph ends, never before the values the predictor
reads, the stall recorded when the two conflict; the op runs its hook with those values."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.backends.inner import compile_inner
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.pilot_prefetch import (
    PILOT_PREFETCH,
    device_observed,
    observed_outputs,
    pilot_prefetch_pass,
    plan_pilot_prefetch,
)
from memcompile.runtime.ops import register_hook

aten = torch.ops.aten
N = 64  # a 64x64 matmul is 2*N^3 = 524288 FLOPs: 0.524 ms at 1 GFLOP/s

PROFILE = DeviceProfile(
    name="test",
    flops={"float32": 1e9},
    memory_bandwidth=1e15,
    host_bandwidth=2**20,  # 1 MiB/s: 1 KiB copies in ~0.98 ms
    disk_bandwidth=1e9,
    launch_overhead=0.0,
)
MM = 2 * N**3 / 1e9
KIB = 1024 / 2**20  # seconds to copy 1 KiB


def _forward_like(chain: int, counts_after: int) -> fx.GraphModule:
    """``chain`` matmuls on ``a``; after the ``counts_after``-th, the router's counts
    (which of 8 columns is largest per row, counted: an int64 sum of a one-hot); returns
    (y, counts)."""
    g = fx.Graph()
    a = g.placeholder("a")
    c, counts = a, None
    for i in range(chain):
        c = g.call_function(aten.mm.default, (c, a))
        if i + 1 == counts_after:
            first8 = g.call_function(aten.slice.Tensor, (c, 1, 0, 8))
            idx = g.call_function(aten.argmax.default, (first8, 1))
            hot = g.call_function(aten.one_hot.default, (idx, 8))
            counts = g.call_function(aten.sum.dim_IntList, (hot, [0]))
    assert counts is not None
    g.output((c, counts))
    gm = fx.GraphModule({}, g)
    FakeTensorProp(gm).propagate(torch.randn(N, N))
    return gm


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def test_the_op_goes_to_the_latest_point_where_the_copy_still_finishes() -> None:
    gm = _forward_like(chain=6, counts_after=1)
    (counts,) = observed_outputs(gm)
    # 1.5 matmuls of copy: it must start two matmuls before the end.
    nbytes = int(1.5 * MM / KIB * 1024)
    plan = plan_pilot_prefetch(gm, PROFILE, fragment="F1", copy_bytes=nbytes, observed=[counts])
    assert plan.in_graph and plan.observed == (counts.name,)
    assert plan.graph_seconds == pytest.approx(6 * MM)
    assert plan.issue_seconds == pytest.approx(4 * MM)  # before the 5th matmul
    mms = [n.name for n in gm.graph.nodes if n.target is aten.mm.default]
    assert plan.before == mms[4]
    assert plan.stall_seconds == 0 and plan.overlap_seconds == pytest.approx(plan.copy_seconds)
    # One node later the copy would not finish: the latest point, not just any.
    assert plan.issue_seconds + MM + plan.copy_seconds > plan.graph_seconds


def test_the_router_counts_come_first_and_a_late_one_is_a_recorded_stall() -> None:
    gm = _forward_like(chain=6, counts_after=5)
    (counts,) = observed_outputs(gm)
    nbytes = int(1.5 * MM / KIB * 1024)  # would need to start before the 5th matmul
    plan = plan_pilot_prefetch(gm, PROFILE, fragment="F1", copy_bytes=nbytes, observed=[counts])
    names = _names(gm)
    assert names.index(plan.before) == names.index(counts.name) + 1  # right after the counts
    assert plan.issue_seconds == pytest.approx(5 * MM)
    assert plan.stall_seconds == pytest.approx(plan.copy_seconds - MM)
    assert plan.overlap_seconds == pytest.approx(MM)
    tail = plan.at_tail()
    assert not tail.in_graph and tail.overlap_seconds == 0
    assert tail.stall_seconds == pytest.approx(plan.copy_seconds)


def test_nothing_to_copy_goes_at_the_end() -> None:
    gm = _forward_like(chain=3, counts_after=1)
    plan = plan_pilot_prefetch(gm, PROFILE, fragment="F0", copy_bytes=0)
    assert plan.before == "output" and plan.copy_seconds == 0 and plan.stall_seconds == 0


class _Hook:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[list[int]]]] = []

    def in_graph(self, fragment: int, observed: Sequence[torch.Tensor]) -> None:
        self.calls.append((fragment, [t.tolist() for t in observed]))


def test_the_rewritten_graph_calls_its_hook_with_the_counts() -> None:
    gm = _forward_like(chain=4, counts_after=2)
    (counts,) = observed_outputs(gm)
    plan = plan_pilot_prefetch(gm, PROFILE, fragment="F2", copy_bytes=2048, observed=[counts])
    hook = _Hook()
    key = register_hook(hook)
    pilot_prefetch_pass(gm, PassContext("F2", "forward"), plan=plan, hook=key, fragment=2)
    (op,) = gm.graph.find_nodes(op="call_function", target=PILOT_PREFETCH)
    assert op.args == (key, 2, [counts]) and op.next.name == plan.before
    a = torch.randn(N, N)
    expected = gm(a)[1].tolist()
    assert hook.calls == [(2, [expected])]
    # The eager inner compiler calls the kernel directly, and the op survives dead-code
    # elimination (it has no users).
    gm.graph.eliminate_dead_code()
    assert gm.graph.find_nodes(op="call_function", target=PILOT_PREFETCH) == [op]
    fn = compile_inner("eager", gm, [a], role="forward")
    fn([a])
    assert len(hook.calls) == 2 and hook.calls[1] == (2, [expected])
    with pytest.raises(ValueError, match="F2: the graph already predicts in-graph"):
        pilot_prefetch_pass(gm, PassContext("F2", "forward"), plan=plan, hook=key, fragment=2)


def test_observed_outputs_are_the_small_integer_outputs_in_order() -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    first8 = g.call_function(aten.slice.Tensor, (a, 1, 0, 8))
    idx = g.call_function(aten.argmax.default, (first8, 1))  # 64 elements: too many to read
    hot = g.call_function(aten.one_hot.default, (idx, 8))
    small = g.call_function(aten.sum.dim_IntList, (hot, [0]))  # 8 int64: kept
    mask = g.call_function(aten.gt.Scalar, (a, 0))  # bool: a mask, not counts
    g.output((a, idx, mask, small, small))
    gm = fx.GraphModule({}, g)
    FakeTensorProp(gm).propagate(torch.randn(N, N))
    assert [n.name for n in observed_outputs(gm)] == [small.name, small.name]


@pytest.mark.parametrize(("device", "read"), [("cpu", True), ("cuda", True), ("meta", False)])
def test_device_observed_values_send_the_prediction_to_the_tail(device: str, read: bool) -> None:
    # The router's counts on a CUDA device (fake: no GPU needed) are observed, but reading them
    # in the graph would wait for the device: the compiler predicts at the tail instead.
    gm = _forward_like(3, 1)
    with FakeTensorMode() as mode:
        a = torch.empty(N, N, device=device)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(a)
    observed = observed_outputs(gm)
    assert [n.name for n in observed] == (["sum_dim_int_list"] if read else [])
    assert device_observed(observed) == (device == "cuda")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"copy_bytes": -1}, "plan_pilot_prefetch: copy_bytes must be >= 0; got -1"),
        ({"copy_bytes": 8, "copy_tensors": 0}, "copy_tensors must be >= 1; got 0"),
    ],
)
def test_bad_copy_sizes_are_refused(kwargs: dict, message: str) -> None:
    gm = _forward_like(chain=2, counts_after=1)
    with pytest.raises(ValueError, match=message):
        plan_pilot_prefetch(gm, PROFILE, fragment="F0", **kwargs)


def test_an_observed_node_of_another_graph_is_refused() -> None:
    gm, other = _forward_like(chain=2, counts_after=1), _forward_like(chain=2, counts_after=2)
    with pytest.raises(ValueError, match="observed nodes not in the graph"):
        plan_pilot_prefetch(
            gm, PROFILE, fragment="F0", copy_bytes=8, observed=observed_outputs(other)
        )
