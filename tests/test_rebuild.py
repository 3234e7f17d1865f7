"""rewrites/rebuild.py: the graph copies the passes make are torch's copies, made faster."""

from __future__ import annotations

import copy

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.rewrites.rebuild import copy_graph, copy_node, make_node


def _traced() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(x @ w) + x * 0.5
        return h.sum(dim=-1, keepdim=True), torch.nn.functional.softmax(h, -1)

    return make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))


def test_copy_graph_makes_the_graph_deepcopy_makes_sharing_the_values() -> None:
    gm = _traced()
    theirs, ours = copy.deepcopy(gm.graph), copy_graph(gm.graph)
    assert ours.python_code("self").src == theirs.python_code("self").src
    for a, b, c in zip(gm.graph.nodes, ours.nodes, theirs.nodes, strict=True):
        assert (b.name, b.op, b.target, b.type) == (c.name, c.op, c.target, c.type)
        assert b.meta is not a.meta and b.meta.get("val") is a.meta.get("val")
        assert [u.name for u in b.users] == [u.name for u in c.users]
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for got, want in zip(fx.GraphModule(gm, ours)(x, w), gm(x, w), strict=True):
        assert torch.equal(got, want)


def test_copy_node_and_make_node_give_the_nodes_node_copy_and_create_node_give() -> None:
    gm = _traced()
    a, b = fx.Graph(), fx.Graph()
    env_a: dict[fx.Node, fx.Node] = {}
    env_b: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env_a[n] = a.node_copy(n, env_a.__getitem__)
        env_b[n] = copy_node(b, n, env_b.__getitem__)
    extra = (env_b[next(iter(gm.graph.nodes))], 2.0)
    made = make_node(b, "call_function", torch.ops.aten.mul.Tensor, extra, {}, "scaled")
    want = a.create_node(
        "call_function",
        torch.ops.aten.mul.Tensor,
        (env_a[next(iter(gm.graph.nodes))], 2.0),
        {},
        "scaled",
    )
    assert made.name == want.name and made.args[1] == 2.0 and made.all_input_nodes == [extra[0]]
    assert [(n.name, str(n.args), str(n.kwargs)) for n in a.nodes] == [
        (n.name, str(n.args), str(n.kwargs)) for n in b.nodes
    ]
