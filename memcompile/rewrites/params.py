"""Parameters on the host: fetch each one right before each use, send its gradient to the host.

A host-placed parameter's storage lives in the host tier (``runtime/store.py``: outside the
device allocator), so the joint graph's primal costs no device memory. This pass gives every
reader of that primal its own device copy, and copies the parameter's gradient out as soon as it
is produced:

    joint graph before                         after
      w = placeholder        # a parameter       w = placeholder        # in the host tier
      t = permute(w)                             w_dev = memcompile.reload(w, device, store, host)
      y = mm(x, t)                               t = permute(w_dev)
      ...                                        ...
      e = embedding(w, ids)  # a second reader   w_dev_1 = memcompile.reload(w, ...)
                                                 e = embedding(w_dev_1, ids)
      g = mm(grad_y, x)      # w's gradient      g = mm(grad_y, x)
                                                 g_host = memcompile.offload(g, store, host)
      return (..., g, ...)                       return (..., g_host, ...)

Nothing else changes: each fetched copy is an ordinary activation to the planner, except that
its baseline never keeps one for the backward but fetches it again there (as it would recompute
a cheap value; ZeRO-Offload's schedule): a recurrent cell called once per time step would
otherwise keep one copy of its weights per step, more than the parameters on the device cost.
The schedule pass places each fetch next to its reader. One fetch per reader, not one per
parameter: a tied weight read by the embedding and by the output head would otherwise stay on
the device for the whole forward. The gradient's host copy is what autograd accumulates into
``w.grad``, so the optimizer steps the host-placed parameter with host-placed gradients
(ZeRO-Offload's split: parameters, gradients and the optimizer step on the host).

No fetch needs a ``wait``. On the CPU device (the DESIGN's CPU row, an emulation of the GPU
split) the host tier is memory outside torch's allocator and the copies are synchronous. On CUDA
the parameter is a pinned CPU tensor (``runtime/pinned.py``): a fetch copies on the compute
stream (ordered before its readers, without blocking the host), and a gradient's copy runs on
the store's side stream, finished before the backward returns it to autograd.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import fx
from torch._functorch import partitioners as P
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import copy_node
from memcompile.runtime.ops import TIERS
from memcompile.runtime.store import is_host_placed

log = logging.getLogger(__name__)

__all__ = ["FETCH_PREFIX", "find_inference_fetches", "param_fetch_pass"]

#: Names of the fetch nodes this pass inserts.
FETCH_PREFIX = "fetch_param"

_HOST = TIERS.index("host")


def _aliases(val: object, storages: Collection[StorageWeakRef]) -> bool:
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(
        isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) in storages
        for v in vals
    )


def find_inference_fetches(inputs: Sequence[Any], static: Sequence[int]) -> tuple[int, ...]:
    """The positions among ``static`` (an inference graph's parameters and buffers) whose real
    input ``inputs[i]`` is in the host tier now: the graph fetches those before each reader.

    An inference graph (a module called under ``no_grad``: an evaluation loop, an early exit's
    confidence test) is not partitioned, so no plan decides its fetches; the parameters the
    training graphs' plans put on the host are fetched per reader here as they are there. A
    parameter placed after the graph was compiled is fetched whole for each call on CUDA
    (``backends/call_wrapper.py``); on the CPU device the graph reads it in the host tier."""
    return tuple(
        i
        for i in static
        if i < len(inputs) and isinstance(inputs[i], torch.Tensor) and is_host_placed(inputs[i])
    )


def param_fetch_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    primals: Collection[int],
    num_fwd_outputs: int,
    device: torch.device,
    store: int,
) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` that fetches the primals at positions ``primals`` (host
    placed parameters) before each reader and offloads their gradients (see the module
    docstring). ``gm`` is not changed; the copy shares the fake values of the nodes it keeps.

    Raises:
        ValueError: a position is not a primal of ``gm``.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primal_nodes = [p for p in placeholders if not P._is_tangent(p)]
    for i in sorted(primals):
        if not 0 <= i < len(primal_nodes):
            raise ValueError(f"{ctx.fragment}: primal {i} is not an input of the joint graph")
    hosted = {primal_nodes[i] for i in primals}
    hosted_storages = [StorageWeakRef(p.meta["val"].untyped_storage()) for p in hosted]
    fake_mode = detect_fake_mode([p.meta.get("val") for p in placeholders])
    assert fake_mode is not None, "AOT joint graphs carry fake tensors"
    fetches = 0

    def fetch(p: fx.Node) -> fx.Node:
        nonlocal fetches
        node = new.create_node(
            "call_function",
            torch.ops.memcompile.reload.default,
            (env[p], device, store, _HOST),
            name=FETCH_PREFIX,
        )
        with fake_mode:
            node.meta["val"] = torch.ops.memcompile.reload.default(
                p.meta["val"], device, store, _HOST
            )
        fetches += 1
        return node

    out = gm.graph.find_nodes(op="output")[0]
    # The joint graph's outputs: the forward's, then one gradient per primal (None: no grad).
    grad_positions = {
        num_fwd_outputs + k
        for k, p in enumerate(primal_nodes)
        if p in hosted and num_fwd_outputs + k < len(out.args[0])
    }
    grads = {out.args[0][pos] for pos in grad_positions} - {None}
    offloaded: dict[fx.Node, fx.Node] = {}
    local: dict[fx.Node, fx.Node] = {}  # the node being copied: its fetches

    def lookup(a: fx.Node) -> fx.Node:
        return local[a] if a in local else env[a]

    for n in gm.graph.nodes:
        if n.op == "output":
            outputs = [
                (offloaded[a] if pos in grad_positions else env[a]) if isinstance(a, fx.Node) else a
                for pos, a in enumerate(n.args[0])
            ]
            new.output(tuple(outputs))
            continue
        # This reader's own copy of each host-placed parameter it reads.
        local.clear()
        local.update((p, fetch(p)) for p in dict.fromkeys(n.all_input_nodes) if p in hosted)
        env[n] = copy_node(new, n, lookup)
        if n.op == "call_function" and _aliases(n.meta.get("val"), hosted_storages):
            # A view of the parameter is now a view of its fetched copy: new fake values, so
            # the analysis sees the view keep the copy (not the host storage) alive.
            args, kwargs = fx.node.map_arg((env[n].args, env[n].kwargs), lambda a: a.meta["val"])
            with fake_mode:
                env[n].meta["val"] = n.target(*args, **kwargs)
        if n in grads:
            off = new.call_function(torch.ops.memcompile.offload.default, (env[n], store, _HOST))
            with fake_mode:
                off.meta["val"] = torch.ops.memcompile.offload.default(n.meta["val"], store, _HOST)
            offloaded[n] = off
    result = _LazyGraphModule(gm, new)  # (its code generated when first run or read)
    result.meta = dict(getattr(gm, "meta", {}))
    result.graph.lint()
    log.info(
        "%s: %d host-placed parameters, %d fetches, %d gradients sent to the host",
        ctx.fragment,
        len(hosted),
        fetches,
        len(offloaded),
    )
    return result
