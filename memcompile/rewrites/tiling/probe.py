"""Row tiling's probe: the op as it was and its blocks, run on random values, must agree bit for
bit.

A block of rows of ``addmm`` is the same dot products as the whole, and an elementwise kernel
computes each element alike, but that is the kernels' business, not a promise: a BLAS may take
another path for fewer rows. A tiled step must train bit-identically to the untiled one, so
:func:`tiles_exactly` runs both graphs once, on the graph's device, on random values of the
leaves' metadata (the same values for both), and compares each result's shape, strides and
bits. Cached per graph code and leaf metadata: each distinct chain runs once per process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.workspace import materialize, metadata_key

__all__ = ["code_key", "tiles_exactly"]

#: Probe results by (graph code, leaf metadata, device).
_exact_cache: dict[tuple[object, ...], bool] = {}


def code_key(graph: fx.Graph) -> tuple[tuple[str, str, str], ...]:
    """What ``graph`` computes, node by node (op, target, arguments with each node read as its
    position): equal for graphs that run the same code, whatever their nodes are named. (Its
    Python code, the key before, took ~4 ms a graph to generate, two graphs a tiling.)"""
    index: dict[fx.Node, int] = {}
    key = []
    for i, n in enumerate(graph.nodes):
        index[n] = i
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", index[a]))
        key.append((n.op, str(n.target), repr(args)))
    return tuple(key)


def tiles_exactly(whole: fx.Graph, tiled: fx.Graph, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether ``tiled`` gives bitwise the result of ``whole`` on random values of ``leaves``'
    metadata (fake tensors), run on their device. Cached per code and metadata."""
    key = (code_key(whole), code_key(tiled), *map(metadata_key, leaves))
    if key in _exact_cache:
        return _exact_cache[key]
    device = leaves[0].device if leaves else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    with _disable_current_modes(), torch.random.fork_rng(devices=devices), torch.no_grad():
        results = []
        for graph in (whole, tiled):
            torch.manual_seed(0)  # the same leaf values for both (the op may write into one)
            inputs = materialize(list(leaves), device, {})
            module = fx.GraphModule(torch.nn.Module(), graph)
            out = module(*inputs)
            results.append((out,) if isinstance(out, torch.Tensor) else tuple(out))
        same = len(results[0]) == len(results[1]) and all(
            a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
            for a, b in zip(results[0], results[1], strict=True)
        )
    _exact_cache[key] = same
    return same
