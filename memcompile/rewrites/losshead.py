"""Loss head in place: log-softmax into the logits' memory, its gradient into the log-softmax's.

Cross-entropy in AOT's joint graph is four ops on ``N x V`` tensors (``N`` tokens, ``V``
classes); eager holds the logits and their log-softmax together in the forward, and the saved
log-softmax, the NLL gradient and the logits' gradient together in the backward:

    joint graph before                               after
      logits = view(mm(h, w_t), [N, V])                logits = view(mm(h, w_t), [N, V])
      lsm = _log_softmax(logits, 1, False)   # +NxV    lsm = memcompile.log_softmax_(logits, 1)
      loss, tw = nll_loss_forward(lsm, t, w, r, ii)    loss, tw = nll_loss_forward(lsm, ...)
      ...                                              ...
      g = nll_loss_backward(go, lsm, t, w, r, ii, tw)  # +NxV
      gl = _log_softmax_backward_data(g, lsm, 1, f32)  # +NxV
                                                       gl = memcompile.nll_log_softmax_backward_(
                                                           lsm, go, t, w, r, ii, tw, 1, 16)
      grad_h = mm(gl, w); grad_w = mm(gl.t(), h)       grad_h = mm(gl, w); ...

so one ``N x V`` buffer serves the whole head (GPT bench size: 48 MiB of eager's 196 MiB step
peak become 16 MiB plus ``1/16`` of it as scratch). The ops (``runtime/losshead.py``) run the
aten kernels in place; the values are bit-identical. The forward needs no scratch; the backward
makes the NLL gradient a block of rows at a time, ``chunks`` blocks: at most ``max_chunks``,
and each at least ``min_block_bytes``. Each block costs a few kernel calls; without a budget the
compiler asks for blocks whose calls cost at most 5 % of the block's own memory traffic
(:func:`min_block_bytes`: 4 MiB on this VM's CPU profile, 200 MB on an H100's), so the head costs
no time and still holds at least one ``N x V`` buffer less in each direction than eager. The
matmuls and the loss's reduction over rows are untouched (chunking them would change the order
of a sum).

Where the rewrite applies, each half on its own:

* forward: ``_log_softmax`` (``half_to_float=False``) over the last dim of a contiguous 2-D
  floating tensor whose storage nothing else reads (no other reader of any view of it, not a
  graph input or output);
* backward: ``_log_softmax_backward_data(nll_loss_backward(go, lsm, ...), lsm, ...)`` with a
  scalar ``go`` (reduction ``mean`` or ``sum``), the NLL gradient read by nothing else, and
  ``lsm`` read only by the NLL ops (so nothing reads it after it is overwritten).

The new nodes' fake values alias the tensor they overwrite, so the analysis sees no new
allocation; the nodes reading the result through views get fake values recomputed from the new
node, as in ``params.py``. Each new node's scratch is in ``meta['memcompile_workspace']``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

import memcompile.runtime.losshead as kernels
from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import sym_to_int
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import (
    alias_nodes,
    copy_node,
    rebuilt_module,
    refresh_view,
    storage_refs,
)

log = logging.getLogger(__name__)

__all__ = ["CHUNKS", "LossHeadRewrite", "loss_head_pass", "min_block_bytes"]

aten = torch.ops.aten
_FORWARD = torch.ops.memcompile.log_softmax_.default
_BACKWARD = torch.ops.memcompile.nll_log_softmax_backward_.default

#: Most blocks of rows a backward head runs in: its scratch is 1/CHUNKS of the head, and its
#: kernels run CHUNKS times.
CHUNKS = 16

#: Kernel calls per backward block (the NLL gradient's fill and scatter, the log-softmax
#: gradient), and the bytes each block's kernels move per byte of the block (the NLL gradient
#: written, then read with the log-softmax, the result written).
_CALLS_PER_BLOCK = 3
_TRAFFIC_PER_BYTE = 4
#: The share of a block's own time its calls' fixed cost may add without a budget.
_FREE_SHARE = 0.05


def min_block_bytes(profile: DeviceProfile) -> int:
    """The smallest backward block whose kernel calls' fixed cost (``launch_overhead`` each)
    is at most 5 % of the time its memory traffic takes on ``profile``: smaller blocks would
    cost time a plan without a budget must not spend."""
    fixed = _CALLS_PER_BLOCK * profile.launch_overhead
    return math.ceil(fixed * profile.memory_bandwidth / (_FREE_SHARE * _TRAFFIC_PER_BYTE))


@dataclass(frozen=True)
class LossHeadRewrite:
    """One rewritten loss head: the log-softmax node, and what replaced it and its gradient
    (``""`` where that half was left alone)."""

    log_softmax: str
    forward: str
    backward: str


def _rows_ok(val: object) -> bool:
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 2
        and val.dtype.is_floating_point
        and val.is_contiguous()
    )


def _last_dim(dim: object) -> bool:
    return isinstance(dim, int) and dim in (1, -1)


def _forward_ok(gm: fx.GraphModule, lsm: fx.Node) -> bool:
    x, dim, half = [*lsm.args, None, None, None][:3]
    if not isinstance(x, fx.Node) or not _last_dim(dim) or half is not False:
        return False
    if not (_rows_ok(x.meta.get("val")) and _rows_ok(lsm.meta.get("val"))):
        return False
    if x.meta["val"].dtype != lsm.meta["val"].dtype:
        return False
    aliases = alias_nodes(gm, x)
    alias_set = set(aliases)
    for n in aliases:
        if n.op != "call_function":  # a graph input: not ours to overwrite
            return False
        for user in n.users:
            if user is lsm:
                continue
            if user.op == "output" or user not in alias_set:
                return False  # another reader of the logits' memory
    return True


def _backward_match(gm: fx.GraphModule, lsm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(nll_loss_backward, _log_softmax_backward_data) reading ``lsm`` (directly or through
    the ``detach`` AOT puts between a saved value and the backward), when rewritable."""
    if not _last_dim(lsm.args[1] if len(lsm.args) > 1 else None):
        return None
    aliases = alias_nodes(gm, lsm)
    alias_set = set(aliases)
    readers = [u for n in aliases for u in n.users if u not in alias_set]
    nll_bw = [u for u in readers if u.target is aten.nll_loss_backward.default]
    lsm_bw = [u for u in readers if u.target is aten._log_softmax_backward_data.default]
    others = [
        u
        for u in readers
        if u.target is not aten.nll_loss_forward.default and u not in nll_bw and u not in lsm_bw
    ]
    if len(nll_bw) != 1 or len(lsm_bw) != 1 or others:
        return None
    if any(n.op != "call_function" for n in aliases):
        return None
    g, gl = nll_bw[0], lsm_bw[0]
    if len(g.args) != 7 or g.kwargs or len(gl.args) != 4 or gl.kwargs:
        return None
    go, _, target, _, reduction, _, _ = g.args
    if list(g.users) != [gl] or gl.args[0] is not g or gl.args[1] not in alias_set:
        return None
    if not _last_dim(gl.args[2]) or gl.args[3] != lsm.meta["val"].dtype:
        return None
    go_val = go.meta.get("val") if isinstance(go, fx.Node) else None
    target_val = target.meta.get("val") if isinstance(target, fx.Node) else None
    if not isinstance(go_val, torch.Tensor) or go_val.dim() != 0 or reduction not in (1, 2):
        return None
    if not isinstance(target_val, torch.Tensor) or target_val.dim() != 1:
        return None
    saved = gl.args[1]
    if not isinstance(saved, fx.Node) or not (
        _rows_ok(gl.meta.get("val")) and _rows_ok(saved.meta.get("val"))
    ):
        return None
    return g, gl


def _blocks(val: torch.Tensor, max_chunks: int, min_block: int) -> tuple[int, int]:
    """Blocks for a backward head of ``val``'s size (at most ``max_chunks`` and one per row,
    each at least ``min_block`` bytes: one block for a smaller head) and their scratch."""
    rows, _ = sym_to_int(val.shape[0])
    cols, _ = sym_to_int(val.shape[1])
    row_bytes = cols * val.element_size()
    by_size = rows * row_bytes // min_block if min_block > 0 else max_chunks
    chunks = max(1, min(max_chunks, rows, by_size))
    return chunks, kernels.workspace_bytes(rows, row_bytes, chunks, backward=True)


def loss_head_pass(
    gm: fx.GraphModule, ctx: PassContext, *, max_chunks: int = CHUNKS, min_block_bytes: int = 0
) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` with its cross-entropy heads computed in place (see the
    module docstring), or ``gm`` itself when there is none. ``gm`` is not changed; the copy
    shares the fake values of every node it keeps. The rewrites are in the result's
    ``meta['memcompile_loss_heads']`` (a tuple of :class:`LossHeadRewrite`). ``max_chunks``:
    the most blocks of rows a backward head runs in; ``min_block_bytes``: the fewest bytes in
    one (fewer blocks where they would be smaller; 0: ``max_chunks`` blocks)."""
    if max_chunks < 1:
        raise ValueError(f"loss_head_pass: max_chunks must be >= 1; got {max_chunks}")
    if min_block_bytes < 0:
        raise ValueError(f"loss_head_pass: min_block_bytes must be >= 0; got {min_block_bytes}")
    forward: set[fx.Node] = set()
    backward: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # lsm_bw -> (lsm, nll_bw)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten._log_softmax.default:
            continue
        if _forward_ok(gm, n):
            forward.add(n)
        found = _backward_match(gm, n)
        if found is not None:
            backward[found[1]] = (n, found[0])
    if not forward and not backward:
        return gm
    skipped = {g for _, g in backward.values()}
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    assert fake_mode is not None, "AOT joint graphs carry fake tensors"

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    replaced: set[StorageWeakRef] = set()  # storages whose readers need new fake values
    rewrites: dict[fx.Node, list[str]] = {}

    def make(
        n: fx.Node, target: torch._ops.OpOverload, args: tuple[Any, ...], val: object, ws: int
    ) -> None:
        node = new.create_node("call_function", target, args, name=f"loss_head_{n.name}")
        node.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
        node.meta["val"] = val
        node.meta["memcompile_workspace"] = ws
        replaced.update(storage_refs(n.meta.get("val")))
        env[n] = node

    for n in gm.graph.nodes:
        if n in skipped:
            continue
        if n in forward:
            x = n.args[0]
            assert isinstance(x, fx.Node)
            val = env[x].meta["val"]
            make(n, _FORWARD, (env[x], n.args[1]), val, 0)
            rewrites.setdefault(n, ["", ""])[0] = env[n].name
            continue
        if n in backward:
            lsm, g = backward[n]
            go, _, target, weight, reduction, ignore_index, total_weight = g.args
            saved = n.args[1]  # the log-softmax as the backward reads it (a detach of it)
            assert isinstance(saved, fx.Node)
            args = fx.node.map_arg(
                (saved, go, target, weight, reduction, ignore_index, total_weight),
                lambda a: env[a],
            )
            val = env[saved].meta["val"]
            chunks, ws = _blocks(val, max_chunks, min_block_bytes)
            make(n, _BACKWARD, (*args, n.args[2], chunks), val, ws)
            rewrites.setdefault(lsm, ["", ""])[1] = env[n].name
            continue
        env[n] = copy_node(new, n, lambda a: env[a])
        if n.op == "call_function" and storage_refs(n.meta.get("val")) & replaced:
            # A view of a replaced value: a view of the new one (its storage), for the analysis.
            refresh_view(env[n], n, fake_mode)

    out = rebuilt_module(
        gm,
        new,
        "memcompile_loss_heads",
        [
            LossHeadRewrite(log_softmax=n.name, forward=f, backward=b)
            for n, (f, b) in rewrites.items()
        ],
    )
    log.info(
        "%s: %d loss heads in place (%d forward, %d backward halves)",
        ctx.fragment,
        len(rewrites),
        len(forward),
        len(backward),
    )
    return out
