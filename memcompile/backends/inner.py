"""Inner compilers: turn a (rewritten) AOT graph into a boxed callable.

``"eager"`` runs the FX graph node by node with boxed code generation: the generated function takes
the argument list, pops every argument into a local and clears the list, so each input is freed
right after its last use:

    def forward(self, args_list):
        args_iter = iter(args_list); primals_1 = next(args_iter); ...; args_list.clear()
        mm = torch.ops.aten.mm.default(primals_1, primals_2); primals_1 = None   # freed here

Without it the caller's list would keep every saved activation alive through the whole backward.
``"inductor"`` hands the graph to ``compile_fx_inner`` (needs Inductor's decompositions, see
:func:`decompositions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import fx
from torch.fx.graph import _BoxedCodeGen

from memcompile.runtime.ops import DIRECT

log = logging.getLogger(__name__)

__all__ = ["BoxedCallable", "compile_inner", "decompositions"]

InnerName = Literal["eager", "inductor"]
GraphRole = Literal["forward", "backward", "inference"]


class BoxedCallable(Protocol):
    """Called with one list of arguments, which it may clear."""

    _boxed_call: bool

    def __call__(self, args: list[Any]) -> Any: ...


def decompositions(inner: InnerName) -> dict[Any, Callable[..., Any]] | None:
    """Decomposition table AOTAutograd must trace with for ``inner``.

    The eager inner compiler runs the ops eager PyTorch would run (none), which keeps losses and
    gradients bit-identical to eager; Inductor needs its own table (``compile_fx_inner`` fails on
    graphs with ops it has both a fallback and a decomposition for), but for dropout: traced
    whole, ``native_dropout`` is what memcompile's dropout rewrite makes recomputable
    (rewrites/dropout.py), where Inductor's decomposition leaves a random draw the plans must
    save (hand-written-attention GPT, small, at 0.3x eager's activations, recompute only, with
    Inductor's code measured: the smallest plan 21.98 MiB decomposed, 20.39 MiB whole, and
    measured at 20.39 MiB; budget 21.29 MiB). Inductor runs it as a call of the aten op (as it
    does every random op here: ``fallback_random``), which draws eager's masks.
    """
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        table = dict(select_decomp_table())
        table.pop(torch.ops.aten.native_dropout.default, None)
        return table
    return None


def _direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    # memcompile's own ops called as plain functions (no dispatcher), on a copy: the graph
    # itself keeps the ops for the analysis, the report and drawing.
    if not any(n.target in DIRECT for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.target in DIRECT:
            n.target = DIRECT[n.target]
    return fx.GraphModule(gm, graph)


def _compile_eager(gm: fx.GraphModule) -> BoxedCallable:
    gm = _direct_calls(gm)
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    forward = gm.forward

    def run(args: list[Any]) -> Any:
        return forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def compile_inner(
    inner: InnerName,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    role: GraphRole,
    static_input_indices: Sequence[int] = (),
) -> BoxedCallable:
    """Compile ``gm`` with the named inner compiler; returns a boxed callable."""
    if inner == "eager":
        return _compile_eager(gm)
    if inner == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner

        # Random ops (dropout's ``rand``, decomposed) reach Inductor's lowering as they are:
        # Inductor rewrites them into its own seeded ops in its joint-graph passes
        # (replace_random.py), which memcompile's own partition does not run. Lower them as
        # calls of the aten op instead (they draw from the global generator, as in eager).
        with inductor_config.patch(fallback_random=True):
            compiled = compile_fx_inner(
                gm,
                list(example_inputs),
                static_input_idxs=tuple(static_input_indices),
                is_backward=role == "backward",
                is_inference=role == "inference",
            )
        if not getattr(compiled, "_boxed_call", False):  # defensive: Inductor's are boxed
            raise AssertionError("compile_fx_inner returned an unboxed callable")
        return compiled  # type: ignore[return-value]
    raise ValueError(f"unknown inner compiler {inner!r}")
