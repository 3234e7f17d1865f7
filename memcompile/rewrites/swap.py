"""Apply a plan's swaps: offload saved tensors after their last forward use, reload them right
before their first backward use.

    forward                                     backward
      x = op(...)                                 x_host                       (placeholder)
      ... last use of x ...                       ...
      x_host = memcompile.offload(x, store, t)    x = memcompile.reload(x_host, device, store, t)
      return (..., x_host, ...)   # saved         memcompile.wait(x, store)
                                                  first use of x

The reload sits right before its ``wait`` here; ``prefetch.py`` later moves it earlier where the
copy can overlap compute without raising the peak (the ``wait`` stays before the first use).

The saved slot keeps its position, so AOTAutograd's bookkeeping is unchanged; the backward's
placeholder now receives the tier's tensor. ``reload`` keeps the original value's metadata, so the
analysis sees the backward re-create the same storage. Offload outputs live outside the device
(``analysis.profile_graph`` does not count them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import fx
from torch._guards import detect_fake_mode

from memcompile.rewrites.context import PassContext
from memcompile.runtime.ops import TIERS

log = logging.getLogger(__name__)

__all__ = ["swap_pass"]


def swap_pass(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    ctx: PassContext,
    *,
    swaps: Mapping[str, str],
    store: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Insert offload/reload pairs for ``swaps`` (saved tensor name -> tier) into both graphs.

    (It rewrites the forward and the backward together, so it returns both.)

    Raises:
        ValueError: a name is not a saved tensor of both graphs.
    """
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    bw_nodes = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    out = fw.graph.find_nodes(op="output")[0]
    outputs = list(out.args[0])
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    bw_order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for name, tier in swaps.items():
        node, placeholder = fw_nodes.get(name), bw_nodes.get(name)
        if node is None or placeholder is None or node not in outputs:
            raise ValueError(f"{ctx.fragment}: {name!r} is not a saved tensor of both graphs")
        val = node.meta["val"]
        fake_mode = detect_fake_mode([val])
        assert fake_mode is not None, "AOT graphs carry fake tensors"
        # Forward: copy out after the last use, so the device copy dies right there.
        users = [u for u in node.users if u.op != "output"]
        point = max(users, key=order.__getitem__) if users else node
        with fw.graph.inserting_after(point):
            off = fw.graph.call_function(
                torch.ops.memcompile.offload.default, (node, store, TIERS.index(tier))
            )
        with fake_mode:
            off.meta["val"] = torch.ops.memcompile.offload.default(val, store, TIERS.index(tier))
        outputs[outputs.index(node)] = off
        # Backward: copy back right before the first use.
        first = min(placeholder.users, key=bw_order.__getitem__)
        with bw.graph.inserting_before(first):
            rel = bw.graph.call_function(
                torch.ops.memcompile.reload.default,
                (placeholder, val.device, store, TIERS.index(tier)),
            )
        placeholder.replace_all_uses_with(rel, delete_user_cb=lambda u, rel=rel: u is not rel)
        rel.meta["val"] = val  # the same storage the forward had: the backward re-creates it
        with bw.graph.inserting_before(first):
            done = bw.graph.call_function(torch.ops.memcompile.wait.default, (rel, store))
        done.meta["val"] = None
        placeholder.meta["val"] = off.meta["val"]
    out.args = (tuple(outputs), *out.args[1:])
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    log.debug("%s: swapped %d saved tensors", ctx.fragment, len(swaps))
    return fw, bw
