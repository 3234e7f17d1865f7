"""Linear cross-entropy by blocks: a classifier head whose ``N x V`` logits are never whole.

``losshead.py`` computes a head's log-softmax and its gradient in one ``N x V`` buffer, which the
plan keeps from the forward to the backward. Under a budget that buffer is often the floor: the
bench GPT with its parameters on the host peaks at 20.05 MiB, 16 of them the head's buffer. This
pass replaces the head, forward and backward, with two ops (``runtime/linearce.py``) that make
the logits a block at a time and keep two numbers per row between them:

    joint graph before                               after
      x = addmm(b, h, wt)        # wt = t(W)           loss, tw, m, ls = mc.linear_ce_forward(
      lsm = _log_softmax(view(view(x)), 1, False)          h, wt, b, target, 1, -100, chunks)
      loss, tw = nll_loss_forward(lsm, target, ...)    ...
      ...                                              gh, gw, gb = mc.linear_ce_backward(
      g = nll_loss_backward(go, lsm, target, ...)          go, h, wt, b, target, 1, -100, tw,
      gl = _log_softmax_backward_data(g, lsm, 1, f32)      m, ls, chunks, [True, True, True])
      gh = mm(view(gl), t(wt))                         (readers of gh, gw, gb as before)
      gw = mm(t(view(gl)), h); gb = sum(view(gl), [0], True)

(``mc`` is ``torch.ops.memcompile``.)

The backward makes the logits twice more (by rows for ``gh``, by columns for ``gw`` and ``gb``):
two matmuls of the head's size, so the compiler uses this only for a plan that does not fit
without it (``pipeline/fragment.py``).

**The log-softmax on the host.** Where the host tier is allowed and three ``N x V`` copies cost
less than those two matmuls (:func:`keeps_on_host`: a CPU, not a GPU), the forward copies each
block's log-softmax to host-tier memory and the backward copies it back, by rows (for ``gh``),
then by columns (for ``gw`` and ``gb``), instead of making the logits again:

      loss, tw, saved = mc.linear_ce_forward_host(h, wt, b, target, 1, -100, chunks)
      gh, gw, gb = mc.linear_ce_backward_host(go, h, wt, target, 1, -100, tw, saved, chunks,
                                              [True, True, True])

The matmuls are the whole head's three.

**What is rewritten.** A ``_log_softmax`` over the last dim of the (viewed) result of an ``mm``
or ``addmm`` (1-D bias) whose every reader is the loss: ``nll_loss_forward`` without class
weights, reduction ``mean`` or ``sum`` and an ``ignore_index`` other than 0, and in the backward
``nll_loss_backward`` into ``_log_softmax_backward_data``, whose result (through views) is read
only by ``mm(gl, t(wt))``, ``mm(t(gl), h)`` and, with a bias, ``sum(gl, [0], True)`` (each
where its gradient is wanted: an input that needs none, data, has no ``gh``, and the backward
then skips its blocks of rows). Sizes are static; nothing else reads the logits or the
log-softmax, and none is a graph output.

**Bit-identical, measured.** The blocks' matmuls are the same dot products as the whole, but a
BLAS may take another path for fewer rows (MKL does below ~256 rows). So :func:`exact_chunks`
runs the head whole and by blocks on random values of the graph's sizes, on its device, for
``16, 8, 4, 2`` blocks, and the rewrite takes the first count whose loss and gradients are
bitwise equal (cached per sizes); a head none matches is left as it is, and logged. The probe
costs about twenty matmuls of the head's size, once per size and process, and runs only for a
fragment no plan fits without it.

Decided by :func:`find_linear_ce`, rewritten by :func:`linear_ce_pass`.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _disable_current_modes

import memcompile.runtime.linearce as kernels
from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.workspace import PROBE_META, materialize, metadata_key
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import (
    alias_nodes,
    copy_node,
    rebuilt_module,
    refresh_view,
    storage_refs,
)

log = logging.getLogger(__name__)

__all__ = [
    "CHUNKS",
    "LinearCrossEntropy",
    "exact_chunks",
    "find_linear_ce",
    "keeps_on_host",
    "linear_ce_pass",
]

aten = torch.ops.aten
_FORWARD = torch.ops.memcompile.linear_ce_forward.default
_BACKWARD = torch.ops.memcompile.linear_ce_backward.default
_FORWARD_HOST = torch.ops.memcompile.linear_ce_forward_host.default
_BACKWARD_HOST = torch.ops.memcompile.linear_ce_backward_host.default
_OPS = (_FORWARD, _BACKWARD, _FORWARD_HOST, _BACKWARD_HOST)

#: Block counts tried, most first (least scratch): the first whose results are bitwise the
#: whole head's is used.
CHUNKS = (16, 8, 4, 2)

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass(frozen=True)
class LinearCrossEntropy:
    """One head to rewrite (node names of the joint graph).

    Attributes:
        log_softmax: the head's ``_log_softmax``.
        nll_forward: its ``nll_loss_forward`` (the new forward op takes its place).
        lsm_backward: its ``_log_softmax_backward_data`` (the new backward op takes its place).
        h, wt, bias: the matmul's operands (``bias`` ``""`` for ``mm``).
        target, grad_output, total_weight: the NLL's target, incoming gradient and total
            weight (the forward's).
        reduction, ignore_index: the NLL's.
        grad_input, grad_weight, grad_bias: the readers of the logits' gradient the backward
            op's three results replace (``""``: none; at least one).
        removed: every other node the rewrite drops (the matmul, views, detaches, the NLL's
            backward, the transposes only these read).
        chunks: blocks of rows (and of columns) the ops run in.
        host: the forward keeps the log-softmax in the host tier and the backward reads it
            there (``linear_ce_forward_host``), instead of making the logits again twice.
    """

    log_softmax: str
    nll_forward: str
    lsm_backward: str
    h: str
    wt: str
    bias: str
    target: str
    grad_output: str
    total_weight: str
    reduction: int
    ignore_index: int
    grad_input: str
    grad_weight: str
    grad_bias: str
    removed: tuple[str, ...]
    chunks: int
    host: bool = False

    def describe(self) -> str:
        """``"<log_softmax>: <n> blocks"``, and where the log-softmax is kept."""
        return f"{self.log_softmax}: {self.chunks} blocks" + (
            ", log-softmax on the host" if self.host else ""
        )


def _static(val: torch.Tensor) -> bool:
    # A symbolic size would change the blocks (and the measured block count) with it.
    return all(isinstance(s, int) for s in (*val.shape, *val.stride(), val.storage_offset()))


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_transpose_of(n: object, of: fx.Node) -> bool:
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.args[0] is not of:
        return False
    if n.target is aten.t.default:
        return True
    return n.target is aten.permute.default and tuple(n.args[1]) == (1, 0)  # type: ignore[arg-type]


def _matmul(x2d: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The ``mm``/``addmm`` ``x2d`` views (through single-reader views), and those views."""
    views: list[fx.Node] = []
    n = x2d
    while n.op == "call_function" and n.target in _VIEWS:
        views.append(n)
        n = n.args[0]  # type: ignore[assignment]
        if not isinstance(n, fx.Node) or len(n.users) != 1:
            return None
    if n.op != "call_function" or n.kwargs:
        return None
    if n.target is aten.mm.default and len(n.args) == 2:
        return n, views
    if n.target is aten.addmm.default and len(n.args) == 3:
        return n, views
    return None


def _match(gm: fx.GraphModule, lsm: fx.Node) -> dict[str, Any] | None:
    """The head around ``lsm`` (see the module docstring), or ``None``."""
    x2d, dim, half = [*lsm.args, None, None, None][:3]
    if not isinstance(x2d, fx.Node) or dim not in (1, -1) or half is not False:
        return None
    found = _matmul(x2d)
    if found is None:
        return None
    mm, views = found
    bias = mm.args[0] if mm.target is aten.addmm.default else None
    h, wt = mm.args[-2], mm.args[-1]
    lsm_val, h_val, wt_val = _val(lsm), _val(h), _val(wt)
    if lsm_val is None or h_val is None or wt_val is None or lsm_val.dim() != 2:
        return None
    if not lsm_val.is_contiguous() or not lsm_val.dtype.is_floating_point:
        return None
    if h_val.dim() != 2 or wt_val.dim() != 2 or h_val.dtype != lsm_val.dtype:
        return None
    if wt_val.dtype != lsm_val.dtype or not all(map(_static, (lsm_val, h_val, wt_val))):
        return None
    if bias is not None:
        b_val = _val(bias)
        if b_val is None or b_val.dim() != 1 or b_val.dtype != lsm_val.dtype:
            return None
    # The logits: read by the log-softmax only.
    logits = set(alias_nodes(gm, mm))
    if any(u not in logits and u is not lsm for n in logits for u in n.users):
        return None
    if any(n is not mm and n not in views for n in logits):
        return None
    # The log-softmax: read by the NLL forward, its backward and the log-softmax's gradient.
    aliases = alias_nodes(gm, lsm)
    alias_set = set(aliases)
    if any(n.op != "call_function" for n in aliases):
        return None
    readers = [u for n in aliases for u in n.users if u not in alias_set]
    by_target: dict[Any, list[fx.Node]] = {}
    for u in readers:
        by_target.setdefault(u.target, []).append(u)
    expected = {
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten._log_softmax_backward_data.default,
    }
    if set(by_target) != expected or any(len(v) != 1 for v in by_target.values()):
        return None
    nlf = by_target[aten.nll_loss_forward.default][0]
    nlb = by_target[aten.nll_loss_backward.default][0]
    lsm_bw = by_target[aten._log_softmax_backward_data.default][0]
    if nlf.args[0] is not lsm or len(nlf.args) != 5 or nlf.kwargs:
        return None
    _, target, weight, reduction, ignore_index = nlf.args
    if weight is not None or reduction not in (1, 2):
        return None
    if not isinstance(ignore_index, int) or ignore_index == 0:
        return None
    t_val = _val(target)
    if t_val is None or t_val.dim() != 1 or not _static(t_val):
        return None
    if len(nlb.args) != 7 or nlb.kwargs:
        return None
    go, saved, target2, weight2, reduction2, ignore2, tw = nlb.args
    if saved not in alias_set or target2 is not target or weight2 is not None:
        return None
    if reduction2 != reduction or ignore2 != ignore_index:
        return None
    go_val = _val(go)
    if go_val is None or go_val.dim() != 0:
        return None
    if not (isinstance(tw, fx.Node) and tw.target is operator.getitem and tw.args == (nlf, 1)):
        return None
    if list(nlb.users) != [lsm_bw] or lsm_bw.args[0] is not nlb or lsm_bw.kwargs:
        return None
    if lsm_bw.args[1] not in alias_set or lsm_bw.args[2] not in (1, -1):
        return None
    if lsm_bw.args[3] != lsm_val.dtype:
        return None
    # The logits' gradient: read by the two matmuls (and the bias's sum) only.
    rows, classes = lsm_val.shape
    grads = alias_nodes(gm, lsm_bw)
    grad_set = set(grads)
    if any(n.op != "call_function" for n in grads):
        return None
    grad_readers = [u for n in grads for u in n.users if u not in grad_set]
    grad_input = grad_weight = grad_bias = None
    for u in grad_readers:
        a = u.args[0] if u.args else None
        a_val = _val(a)
        if a not in grad_set or a_val is None or u.kwargs:
            return None
        transposes_wt = isinstance(wt, fx.Node) and _is_transpose_of(u.args[1], wt)
        if u.target is aten.mm.default and grad_input is None and transposes_wt:
            if tuple(a_val.shape) != (rows, classes) or a_val.stride() != (classes, 1):
                return None
            grad_input = u
        elif u.target is aten.mm.default and grad_weight is None and u.args[1] is h:
            if tuple(a_val.shape) != (classes, rows) or a_val.stride() != (1, classes):
                return None
            grad_weight = u
        elif (
            u.target is aten.sum.dim_IntList
            and grad_bias is None
            and bias is not None
            and list(u.args[1:]) == [[0], True]
        ):
            if tuple(a_val.shape) != (rows, classes) or a_val.stride() != (classes, 1):
                return None
            grad_bias = u
        else:
            return None
    if grad_input is None and grad_weight is None and grad_bias is None:
        return None
    removed = [mm, *views, lsm, *aliases, nlb, *grads]
    transposed = None if grad_input is None else grad_input.args[1]
    if isinstance(transposed, fx.Node) and list(transposed.users) == [grad_input]:
        removed.append(transposed)
    if any(n.op == "output" for r in removed for n in r.users):
        return None
    return {
        "lsm": lsm,
        "nlf": nlf,
        "lsm_bw": lsm_bw,
        "h": h,
        "wt": wt,
        "bias": bias,
        "target": target,
        "go": go,
        "tw": tw,
        "reduction": reduction,
        "ignore_index": ignore_index,
        "grad_input": grad_input,
        "grad_weight": grad_weight,
        "grad_bias": grad_bias,
        "removed": removed,
    }


_exact_cache: dict[tuple[Any, ...], int | None] = {}


def exact_chunks(
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    output_mask: tuple[bool, bool, bool],
    *,
    candidates: tuple[int, ...] = CHUNKS,
    host: bool = False,
) -> int | None:
    """The first block count of ``candidates`` for which the ops of ``runtime/linearce.py``
    (``host``: those keeping the log-softmax on the host) give bitwise the whole head's loss
    and the gradients ``output_mask`` asks for (input, weight, bias: aten's ops, as AOT's graph
    has them), on random values of these (fake or real) tensors' metadata, run on their device;
    ``None``: none does. Cached per metadata."""
    key = (
        *map(metadata_key, (h, wt, bias, target)),
        reduction,
        ignore_index,
        output_mask,
        candidates,
        host,
    )
    if key in _exact_cache:
        return _exact_cache[key]
    device = h.device
    devices = [device] if device.type == "cuda" else []
    found: int | None = None
    with _disable_current_modes(), torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(0)
        hr, wtr, br = materialize([h, wt, bias], device, {})
        # (Sizes are static: _match takes no symbolic ones.)
        tr = torch.randint(0, int(wt.shape[1]), tuple(target.shape), device=device)
        tr = tr.to(target.dtype)
        tr[::7] = ignore_index  # some rows ignored, as padding is
        go = torch.rand((), dtype=h.dtype, device=device) + 0.5
        loss, tw, grads = kernels.run_whole(go, hr, wtr, br, tr, reduction, ignore_index)
        whole = [loss, tw, *(g for g, wanted in zip(grads, output_mask, strict=True) if wanted)]
        del grads
        for chunks in candidates:
            loss2, tw2, grads = kernels.run_blocks(
                go, hr, wtr, br, tr, reduction, ignore_index, chunks, output_mask, host=host
            )
            blocks = [
                loss2,
                tw2,
                *(g for g, wanted in zip(grads, output_mask, strict=True) if wanted),
            ]
            if all(
                a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
                for a, b in zip(whole, blocks, strict=True)
            ):
                found = chunks
                break
    _exact_cache[key] = found
    return found


def keeps_on_host(h: torch.Tensor, wt: torch.Tensor, profile: DeviceProfile) -> bool:
    """Whether a head of these sizes keeps its log-softmax on the host on ``profile``'s
    device: there its three ``N x V`` copies (the forward's out, the backward's in by rows and
    by columns) cost less than the two matmuls that make the logits again (on this CPU's
    profile: 4 ms against 25 ms for the bench GPT's head; on an H100 the matmuls cost 0.1 ms,
    the copies 1.0 ms). CPU tensors only (``runtime/linearce.py``)."""
    if h.device.type != "cpu":
        return False
    rows, features, classes = int(h.shape[0]), int(h.shape[1]), int(wt.shape[1])
    copies = profile.copy_time(3 * rows * classes * h.element_size(), "host")
    matmuls = profile.op_time(2 * 2 * rows * features * classes, 0, h.dtype)
    return copies < matmuls


def _name(n: fx.Node | None) -> str:
    return "" if n is None else n.name


def _mask(m: dict[str, Any]) -> tuple[bool, bool, bool]:
    return (m["grad_input"] is not None, m["grad_weight"] is not None, m["grad_bias"] is not None)


def find_linear_ce(
    gm: fx.GraphModule, ctx: PassContext, *, host_profile: DeviceProfile | None = None
) -> tuple[LinearCrossEntropy, ...]:
    """The heads of joint graph ``gm`` to make by blocks (see the module docstring), each with
    the block count measured bit-identical; heads where none is are logged and left out.

    ``host_profile``: the host tier may hold the log-softmax between the forward and the
    backward, and this is the device's cost model; heads where that costs less than making the
    logits again (:func:`keeps_on_host`) keep it there."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten._log_softmax.default:
            continue
        m = _match(gm, n)
        if m is None:
            continue
        h_val, wt_val = _val(m["h"]), _val(m["wt"])
        assert h_val is not None and wt_val is not None  # _match checked them
        # The log-softmax on the host where that is cheaper, else (or if its blocks are not
        # bitwise the whole head's) the logits made again.
        on_host = host_profile is not None and keeps_on_host(h_val, wt_val, host_profile)
        chunks, host = None, False
        for host in (True, False) if on_host else (False,):
            chunks = exact_chunks(
                h_val,
                wt_val,
                _val(m["bias"]),
                _val(m["target"]),  # type: ignore[arg-type]
                m["reduction"],
                m["ignore_index"],
                _mask(m),
                host=host,
            )
            if chunks is not None:
                break
            if host:
                log.info(
                    "%s: the loss head at %s is not bitwise the same by blocks with its "
                    "log-softmax on the host; trying the logits made again",
                    ctx.fragment,
                    n.name,
                )
        if chunks is None:
            log.info(
                "%s: the loss head at %s is not bitwise the same by blocks on this device; "
                "left whole",
                ctx.fragment,
                n.name,
            )
            continue
        out.append(
            LinearCrossEntropy(
                log_softmax=n.name,
                nll_forward=m["nlf"].name,
                lsm_backward=m["lsm_bw"].name,
                h=m["h"].name,
                wt=m["wt"].name,
                bias=_name(m["bias"]),
                target=m["target"].name,
                grad_output=m["go"].name,
                total_weight=m["tw"].name,
                reduction=m["reduction"],
                ignore_index=m["ignore_index"],
                grad_input=_name(m["grad_input"]),
                grad_weight=_name(m["grad_weight"]),
                grad_bias=_name(m["grad_bias"]),
                removed=tuple(dict.fromkeys(r.name for r in m["removed"])),
                chunks=chunks,
                host=host,
            )
        )
    return tuple(out)


def linear_ce_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    decided: tuple[LinearCrossEntropy, ...] | None = None,
) -> fx.GraphModule:
    """A copy of joint graph ``gm`` with the heads ``decided`` (default:
    :func:`find_linear_ce`'s) made by blocks, or ``gm`` itself when there is none. ``gm`` is not
    changed. The heads are in the result's ``meta['memcompile_linear_ce']``."""
    heads = find_linear_ce(gm, ctx) if decided is None else decided
    if not heads:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    assert fake_mode is not None, "AOT joint graphs carry fake tensors"
    by_forward = {nodes[hd.nll_forward]: hd for hd in heads}
    by_backward = {nodes[hd.lsm_backward]: hd for hd in heads}
    removed = {nodes[name] for hd in heads for name in hd.removed}
    results: dict[fx.Node, tuple[fx.Node, int]] = {}  # grad reader -> (backward op, index)
    # head -> what its forward keeps for the backward: (row_max, row_logsum) nodes, or the
    # host-tier log-softmax's
    stats: dict[str, tuple[fx.Node, ...]] = {}
    replaced: set[Any] = set()
    for hd in heads:
        for name in (hd.nll_forward, hd.grad_input, hd.grad_weight, hd.grad_bias):
            if name:
                replaced.update(storage_refs(nodes[name].meta.get("val")))

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def arg(name: str) -> fx.Node | None:
        return env[nodes[name]] if name else None

    def call(target: Any, args: tuple[Any, ...], name: str) -> fx.Node:
        node = new.create_node("call_function", target, args, name=name)
        vals = fx.node.map_arg(args, lambda a: a.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*vals)
        if target in _OPS:
            # Blocks of logits and a few row-sized temporaries: measured like aten's scratch.
            node.meta[PROBE_META] = True
        return node

    getitem = operator.getitem
    for n in gm.graph.nodes:
        if n in by_forward:
            hd = by_forward[n]
            fwd = call(
                _FORWARD_HOST if hd.host else _FORWARD,
                (
                    arg(hd.h),
                    arg(hd.wt),
                    arg(hd.bias),
                    arg(hd.target),
                    hd.reduction,
                    hd.ignore_index,
                    hd.chunks,
                ),
                f"linear_ce_{n.name}",
            )
            env[n] = fwd  # the NLL's getitems (loss, total weight) now read the new op
            # The total weight right here, before the loss: torch's rule (and the joint
            # model's) puts in the forward only what comes before its last output, and a total
            # weight after it was made again in the backward, by the whole forward op again.
            tw = nodes[hd.total_weight]
            env[tw] = call(getitem, (fwd, 1), tw.name)
            stats[hd.log_softmax] = (
                (call(getitem, (fwd, 2), f"{fwd.name}_saved"),)
                if hd.host
                else (
                    call(getitem, (fwd, 2), f"{fwd.name}_row_max"),
                    call(getitem, (fwd, 3), f"{fwd.name}_row_logsum"),
                )
            )
            continue
        if n in by_backward:
            hd = by_backward[n]
            mask = [bool(hd.grad_input), bool(hd.grad_weight), bool(hd.grad_bias)]
            common = (arg(hd.grad_output), arg(hd.h), arg(hd.wt))
            rule = (hd.reduction, hd.ignore_index, arg(hd.total_weight))
            args: tuple[Any, ...]
            if hd.host:  # the host-tier log-softmax instead of the bias and the row stats
                args = (*common, arg(hd.target), *rule, *stats[hd.log_softmax])
            else:
                args = (*common, arg(hd.bias), arg(hd.target), *rule, *stats[hd.log_softmax])
            args = (*args, hd.chunks, mask)
            bwd = call(_BACKWARD_HOST if hd.host else _BACKWARD, args, f"linear_ce_{n.name}")
            for i, name in enumerate((hd.grad_input, hd.grad_weight, hd.grad_bias)):
                if name:
                    results[nodes[name]] = (bwd, i)
            continue
        if n in results:
            bwd, i = results[n]
            env[n] = call(getitem, (bwd, i), f"{bwd.name}_{i}")
            continue
        if n in removed or n in env:  # (env: a total weight made above)
            continue
        env[n] = copy_node(new, n, lambda a: env[a])
        if n.op == "call_function" and storage_refs(n.meta.get("val")) & replaced:
            # A view of a replaced value (the loss, a gradient): a view of the new one.
            refresh_view(env[n], n, fake_mode)

    out = rebuilt_module(gm, new, "memcompile_linear_ce", heads)
    log.info(
        "%s: %d loss heads made by blocks (%s)",
        ctx.fragment,
        len(heads),
        ", ".join(hd.describe() for hd in heads),
    )
    return out
