"""The six-idiom table: it covers every op of the zoo's graphs, and sums per fragment."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import memcompile
from memcompile import zoo
from memcompile.analysis.graph import target_name
from memcompile.dynamic.idioms import (
    IDIOMS,
    graph_idioms,
    is_covered,
    op_idioms,
    sum_idioms,
    table,
)
from memcompile.report import find_compiler

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _zoo_ops(name: str) -> dict[str, str]:
    """Every call_function target of the forward, backward and inference graphs AOTAutograd
    builds for one training step of zoo workload ``name`` (as memcompile's eager inner compiler
    gets them: no decompositions) -> the graph it was first seen in."""
    ops: dict[str, str] = {}

    def recorder(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            for n in gm.graph.nodes:
                if n.op == "call_function":
                    ops.setdefault(target_name(n.target), f"{name} {kind}")
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        inference_compiler=recorder("inference"),
        keep_inference_input_mutations=True,
    )
    torch._dynamo.config.allow_empty_graphs = True  # as memcompile sets it
    wl = zoo.build(name, size="tiny")
    compiled = torch.compile(wl.model, backend=backend)
    wl.loss(compiled, 0).backward()
    return ops


@pytest.mark.parametrize(
    # Under aot_eager the natural models' forward falls back and their torch.nn modules are
    # never compiled (memcompile compiles them: backends/regions.py).
    "name",
    [n for n in zoo.names() if not zoo.build(n, size="tiny").extra.get("natural")],
)
def test_every_op_of_the_zoo_graphs_has_idioms(name: str) -> None:
    ops = _zoo_ops(name)
    assert len(ops) >= 5, ops  # the capture saw real graphs
    missing = {op: where for op, where in ops.items() if not is_covered(op)}
    assert not missing, f"ops without an idiom entry: {missing}"
    # every covered aten op that moves data has at least one idiom
    for op in ops:
        if op.startswith("aten.") and op.split(".")[1] not in ("alias", "detach", "_assert_async"):
            assert any(op_idioms(op)), op


def test_op_vectors_follow_the_idiom_definitions() -> None:
    assert IDIOMS == ("layout", "elementwise", "indexing", "reduction", "stencil", "dimensionality")
    assert op_idioms("aten.addmm.default") == (0, 1, 0, 1, 0, 0)  # contraction + bias add
    assert op_idioms("aten.t.default") == (1, 0, 0, 0, 0, 0)
    assert op_idioms("aten.view.default") == (0, 0, 0, 0, 0, 1)
    assert op_idioms("aten.index_add.default") == (0, 1, 1, 0, 0, 0)
    assert op_idioms("aten.convolution.default") == (0, 0, 0, 1, 1, 0)
    assert op_idioms("aten.gelu.default") == (0, 1, 0, 0, 0, 0)
    # overloads share their packet's entry; non-aten tuple access moves nothing
    assert op_idioms("aten.sum.dim_IntList") == op_idioms("aten.sum.default") == (0, 0, 0, 1, 0, 0)
    assert op_idioms("_operator.getitem") == (0,) * 6 and is_covered("_operator.getitem")
    assert all(len(v) == 6 and set(v) <= {0, 1} for v in table().values())


def test_unknown_ops_count_as_zeros() -> None:
    assert not is_covered("aten.frobnicate.default")
    assert op_idioms("aten.frobnicate.default") == (0,) * 6
    assert sum_idioms(["aten.frobnicate.default", "aten.mm.default"]) == (0, 0, 0, 1, 0, 0)


def test_fragment_sums_count_ops_per_idiom() -> None:
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model)
    wl.loss(compiled, 0).backward()
    compiler, _ = find_compiler(compiled)
    by_code = {r.code.split(" ")[0]: r for r in compiler.records()}
    expert = by_code["forward"]  # Expert.forward: gather, two linears, gelu, index_add
    forward = expert.profile.forward
    targets = [n.target for n in forward.nodes if n.op == "call_function"]
    sums = graph_idioms(forward)
    assert sums == sum_idioms(targets)
    assert sums[IDIOMS.index("indexing")] >= 2  # h[tok] and index_add
    assert sums[IDIOMS.index("reduction")] >= 2  # fc1 and fc2
    assert sums[IDIOMS.index("stencil")] == 0
    assert graph_idioms(None) == (0,) * 6
