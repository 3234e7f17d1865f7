"""Kernels for a linear layer and cross-entropy made by blocks: the logits never whole.

A language model's head, ``loss = cross_entropy(h @ W.t() + b, target)`` for ``N`` tokens,
``d`` features and ``V`` classes, makes ``N x V`` logits (GPT bench size: 16 MiB, when a whole
layer's activations are 2 MiB). ``runtime/losshead.py`` keeps one such buffer from the forward
to the backward; these ops keep none: the forward makes the logits a block of rows at a time and
keeps two numbers per row, and the backward makes them again, twice (by rows for the input's
gradient, by columns for the weight's):

    loss, total_weight, row_max, row_logsum = torch.ops.memcompile.linear_ce_forward(
        h, wt, bias, target, reduction, ignore_index, chunks)
    grad_h, grad_wt, grad_bias = torch.ops.memcompile.linear_ce_backward(
        grad_output, h, wt, bias, target, reduction, ignore_index, total_weight,
        row_max, row_logsum, chunks, output_mask)

where ``wt`` is the matmul's right operand (``W.t()``, ``[d, V]``), ``grad_wt`` is
``mm(gl.t(), h)`` (``[V, d]``, what AOT's graph makes for it) and ``grad_bias`` is
``sum(gl, [0], True)`` (``[1, V]``); ``output_mask`` says which of the three are wanted (the
others come back empty, and the pass by rows is skipped when ``grad_h`` is not wanted).

**Bit-identity.** Every value is an aten kernel's own, on a block of rows or of columns:

* the log-softmax of a block of rows is the rows' log-softmax, and the loss is
  ``nll_loss_forward`` over an ``[N, 1]`` tensor of the picked log-probabilities: the kernel
  sums rows in an order that depends on ``N`` only, so the sum is the one over ``[N, V]``;
* a log-softmax is ``(x - max) - log(sum(exp(x - max)))`` per row, so at the row's maximum it is
  exactly ``-log(sum)``: the forward keeps ``max`` and that number per row, and a block of columns
  of the log-softmax is made again with the same two subtractions;
* the gradient of the log-softmax of a block of columns is ``_log_softmax_backward_data`` over
  the block and one more column, which holds the row's NLL gradient when the target is not in the
  block (the kernel's row sum then is that one value, as over the whole row);
* a block of rows of a matmul's result, or of columns of a sum over rows, is the same dot
  products and sums, which is the kernels' business: a BLAS may take another path for fewer
  rows (MKL does below ~256), and a sum vectorized over columns treats a block's columns in
  other lanes unless the block starts at a multiple of the lanes (blocks start at multiples of
  :data:`ALIGN`). So :mod:`memcompile.rewrites.linearce` runs both, whole and by blocks, on
  random values of the graph's sizes before it rewrites, and picks a block count whose results
  are bitwise equal.

The backward's time is two more matmuls of the head's size (the logits by rows and by columns)
and their log-softmax; the rewrite is used only when a plan does not fit without it.

**The log-softmax on the host.** Where copies cost less than those matmuls (a CPU), the forward
copies each block's log-softmax into host-tier memory (``store.host_empty``: outside the
device's allocator) and the backward copies its blocks of rows, then of columns, back to the
device instead of making the logits again: three ``N x V`` copies in all, and the whole head's
three matmuls:

    loss, total_weight, saved = torch.ops.memcompile.linear_ce_forward_host(
        h, wt, bias, target, reduction, ignore_index, chunks)
    grad_h, grad_wt, grad_bias = torch.ops.memcompile.linear_ce_backward_host(
        grad_output, h, wt, target, reduction, ignore_index, total_weight, saved, chunks,
        output_mask)

The blocks then hold the very values the other ops make again, so the gradients are the same
kernels' on the same inputs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from memcompile.runtime.store import host_empty

log = logging.getLogger(__name__)

__all__ = [
    "ALIGN",
    "backward_host_impl",
    "backward_impl",
    "block",
    "forward_host_impl",
    "forward_impl",
    "run_blocks",
]

aten = torch.ops.aten

_lib = torch.library.Library("memcompile", "FRAGMENT")
_lib.define(
    "linear_ce_forward(Tensor h, Tensor wt, Tensor? bias, Tensor target, int reduction, "
    "SymInt ignore_index, int chunks) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "linear_ce_backward(Tensor grad_output, Tensor h, Tensor wt, Tensor? bias, Tensor target, "
    "int reduction, SymInt ignore_index, Tensor total_weight, Tensor row_max, "
    "Tensor row_logsum, int chunks, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "linear_ce_forward_host(Tensor h, Tensor wt, Tensor? bias, Tensor target, int reduction, "
    "SymInt ignore_index, int chunks) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "linear_ce_backward_host(Tensor grad_output, Tensor h, Tensor wt, Tensor target, "
    "int reduction, SymInt ignore_index, Tensor total_weight, Tensor saved, int chunks, "
    "bool[3] output_mask) -> (Tensor, Tensor, Tensor)"
)


#: Blocks of columns start at multiples of this many: a kernel that vectorizes over them
#: (the bias gradient's sum over rows) then treats each in the same lanes as over the whole
#: (measured: 1001 classes in 2 blocks of 501 sum differently; in blocks of 512 they do not).
ALIGN = 64


def block(size: int, chunks: int, align: int = 1) -> int:
    """Rows (or columns) per block when ``size`` of them are done in at most ``chunks``
    blocks, a multiple of ``align`` (or all of them)."""
    per = align * math.ceil(size / max(1, chunks) / align)
    return max(1, min(size, per))


def _logits(h: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return aten.mm(h, wt) if bias is None else aten.addmm(bias, h, wt)


def _nll_targets(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # Class 0 of an [N, 1] input for every counted row; ignored rows stay ignored.
    return torch.where(target == ignore_index, target, torch.zeros_like(target))


def _forward_blocks(
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    chunks: int,
    *,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    saved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The loss and total weight, a block of rows at a time; per row, the maximum and
    # -log_softmax there into stats (row_max, row_logsum), and the log-softmax into saved, if
    # given.
    rows = h.shape[0]
    picked = h.new_empty(rows, 1)
    # An out-of-range target raises in gather, as it does in nll_loss.
    safe = torch.where(target == ignore_index, torch.zeros_like(target), target)
    step = block(rows, chunks)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        x = _logits(h[start:stop], wt, bias)
        if stats is not None:
            peak, where = x.max(1, keepdim=True)
            stats[0][start:stop] = peak.squeeze(1)
        aten._log_softmax.out(x, 1, False, out=x)  # reads each row before it writes it
        if stats is not None:
            torch.neg(x.gather(1, where).squeeze(1), out=stats[1][start:stop])
        picked[start:stop] = x.gather(1, safe[start:stop, None])
        if saved is not None:
            saved[start:stop].copy_(x)
        del x
    loss, total_weight = aten.nll_loss_forward(
        picked, _nll_targets(target, ignore_index), None, reduction, ignore_index
    )
    return loss, total_weight


def forward_impl(
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nll_loss_forward(_log_softmax(h @ wt + bias, 1), target)`` made a block of rows at a
    time, with each row's maximum and ``-log_softmax`` at that maximum (for the backward)."""
    rows = h.shape[0]
    row_max = h.new_empty(rows)
    row_logsum = h.new_empty(rows)
    loss, total_weight = _forward_blocks(
        h, wt, bias, target, reduction, ignore_index, chunks, stats=(row_max, row_logsum)
    )
    return loss, total_weight, row_max, row_logsum


def _host_tier(h: torch.Tensor) -> None:
    if h.device.type != "cpu":
        # (The pass takes this variant only where the copies cost less than two matmuls:
        # never on a GPU's profile, and it is not built there.)
        raise NotImplementedError(
            f"linear_ce_forward_host keeps the log-probabilities on the host for CPU tensors "
            f"only; got {h.device}"
        )


def forward_host_impl(
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    chunks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss and total weight as :func:`forward_impl` makes them, and the ``N x V``
    log-softmax copied block by block into host-tier memory (``store.host_empty``)."""
    _host_tier(h)
    saved = host_empty((h.shape[0], wt.shape[1]), h.dtype)
    loss, total_weight = _forward_blocks(
        h, wt, bias, target, reduction, ignore_index, chunks, saved=saved
    )
    return loss, total_weight, saved


def _rows_pass(
    grad_output: torch.Tensor,
    wt: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    chunks: int,
    grad_h: torch.Tensor,
    log_softmax_rows: Callable[[int, int], torch.Tensor],
) -> None:
    # grad_h = mm(gl, wt.t()) a block of rows at a time; log_softmax_rows(start, stop) is a new
    # device tensor with those rows' log-softmax, which becomes their gl in place.
    rows = grad_h.shape[0]
    w_back = wt.t()
    step = block(rows, chunks)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        x = log_softmax_rows(start, stop)
        g = aten.nll_loss_backward(
            grad_output, x, target[start:stop], None, reduction, ignore_index, total_weight
        )
        aten._log_softmax_backward_data.out(g, x, 1, x.dtype, out=x)
        del g
        aten.mm.out(x, w_back, out=grad_h[start:stop])
        del x


def _columns_pass(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    chunks: int,
    output_mask: Sequence[bool],
    grad_wt: torch.Tensor,
    grad_bias: torch.Tensor,
    log_softmax_columns: Callable[[int, int, torch.Tensor], None],
) -> None:
    # grad_wt = mm(gl.t(), h) and grad_bias = sum(gl, [0], True) a block of columns at a time;
    # log_softmax_columns(start, stop, out) writes those columns of the log-softmax into out.
    rows, classes = h.shape[0], wt.shape[1]
    # Each row's NLL gradient (``-grad_output / total_weight`` or 0), as the kernel makes it.
    nll_targets = _nll_targets(target, ignore_index)
    per_row = aten.nll_loss_backward(
        grad_output,
        h.new_zeros(rows, 1),
        nll_targets,
        None,
        reduction,
        ignore_index,
        total_weight,
    ).squeeze(1)
    step = block(classes, chunks, ALIGN)
    every_row = torch.arange(rows, device=h.device)
    for start in range(0, classes, step):
        stop = min(start + step, classes)
        width = stop - start
        lsm = h.new_empty(rows, width + 1)
        log_softmax_columns(start, stop, lsm[:, :width])
        lsm[:, width] = 0
        inside = (target >= start) & (target < stop)
        g = h.new_zeros(rows, width + 1)
        column = torch.where(inside, target - start, width)
        g[every_row, column] = per_row
        aten._log_softmax_backward_data.out(g, lsm, 1, h.dtype, out=lsm)
        del g
        gl = lsm[:, :width]
        if output_mask[1]:
            aten.mm.out(gl.t(), h, out=grad_wt[start:stop])
        if output_mask[2]:
            aten.sum.IntList_out(gl, [0], True, out=grad_bias[:, start:stop])
        del lsm, gl


def _both_passes(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    target: torch.Tensor,
    rule: tuple[int, int, torch.Tensor, int],
    output_mask: Sequence[bool],
    rows_of: Callable[[int, int], torch.Tensor],
    columns_of: Callable[[int, int, torch.Tensor], None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The gradients output_mask asks for (the others empty), by the passes that need them;
    # rule: (reduction, ignore_index, total_weight, chunks).
    grad_h, grad_wt, grad_bias = _backward_meta(h, wt, output_mask)
    if output_mask[0]:
        _rows_pass(grad_output, wt, target, *rule, grad_h, rows_of)
    if output_mask[1] or output_mask[2]:
        _columns_pass(
            grad_output, h, wt, target, *rule, output_mask, grad_wt, grad_bias, columns_of
        )
    return grad_h, grad_wt, grad_bias


def backward_impl(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    row_max: torch.Tensor,
    row_logsum: torch.Tensor,
    chunks: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`forward_impl`'s loss for ``h`` (``mm(gl, wt.t())``), for ``wt``
    as AOT makes it (``mm(gl.t(), h)``, ``[V, d]``) and for the bias (``sum(gl, [0], True)``),
    where ``gl`` is the logits' gradient, made by blocks of rows, then of columns; those
    ``output_mask`` does not ask for are empty."""
    rule = (reduction, ignore_index, total_weight, chunks)

    def rows_of(start: int, stop: int) -> torch.Tensor:
        x = _logits(h[start:stop], wt, bias)
        return aten._log_softmax.out(x, 1, False, out=x)

    def columns_of(start: int, stop: int, out: torch.Tensor) -> None:
        x = _logits(h, wt[:, start:stop], None if bias is None else bias[start:stop])
        torch.sub(x, row_max[:, None], out=x)
        torch.sub(x, row_logsum[:, None], out=out)

    return _both_passes(grad_output, h, wt, target, rule, output_mask, rows_of, columns_of)


def backward_host_impl(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    saved: torch.Tensor,
    chunks: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_impl`'s gradients from the host-tier log-softmax ``saved`` instead of
    logits made again: its blocks of rows and of columns are copied to the device in turn.
    ``saved`` is read, never written (a second backward reads it again)."""
    _host_tier(h)
    rule = (reduction, ignore_index, total_weight, chunks)

    def rows_of(start: int, stop: int) -> torch.Tensor:
        x = h.new_empty(stop - start, saved.shape[1])
        return x.copy_(saved[start:stop])

    def columns_of(start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(saved[:, start:stop])

    return _both_passes(grad_output, h, wt, target, rule, output_mask, rows_of, columns_of)


def run_whole(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward and backward of the whole head as AOT's graph has it (aten's ops, the logits
    whole): the loss, the total weight and the three gradients, as :func:`run_blocks` gives
    them; the reference the blocks are checked against."""
    x = _logits(h, wt, bias)
    lsm = aten._log_softmax(x, 1, False)
    del x
    loss, tw = aten.nll_loss_forward(lsm, target, None, reduction, ignore_index)
    g = aten.nll_loss_backward(grad_output, lsm, target, None, reduction, ignore_index, tw)
    gl = aten._log_softmax_backward_data(g, lsm, 1, lsm.dtype)
    del g, lsm
    return loss, tw, (aten.mm(gl, wt.t()), aten.mm(gl.t(), h), aten.sum(gl, [0], True))


def run_blocks(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reduction: int,
    ignore_index: int,
    chunks: int,
    output_mask: Sequence[bool],
    *,
    host: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward and backward of the head by blocks (``host``: the log-softmax kept on the
    host): the loss, the total weight and the three gradients (see :func:`backward_impl`)."""
    rule = (reduction, ignore_index)
    if host:
        loss, tw, saved = forward_host_impl(h, wt, bias, target, *rule, chunks)
        grads = backward_host_impl(
            grad_output, h, wt, target, *rule, tw, saved, chunks, output_mask
        )
    else:
        loss, tw, row_max, row_logsum = forward_impl(h, wt, bias, target, *rule, chunks)
        grads = backward_impl(
            grad_output, h, wt, bias, target, *rule, tw, row_max, row_logsum, chunks, output_mask
        )
    return loss, tw, grads


def _forward_meta(
    h: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = h.shape[0]
    return h.new_empty(()), h.new_empty(()), h.new_empty(rows), h.new_empty(rows)


def _backward_meta(
    h: torch.Tensor, wt: torch.Tensor, output_mask: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The backward's results, empty where ``output_mask`` asks for none.
    rows, features, classes = h.shape[0], h.shape[1], wt.shape[1]
    return (
        h.new_empty(rows, features) if output_mask[0] else h.new_empty(0),
        h.new_empty(classes, features) if output_mask[1] else h.new_empty(0),
        h.new_empty(1, classes) if output_mask[2] else h.new_empty(0),
    )


def _forward_host_meta(
    h: torch.Tensor, wt: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return h.new_empty(()), h.new_empty(()), h.new_empty(h.shape[0], wt.shape[1])


def _backward_fake(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    wt: torch.Tensor,
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    output_mask = args[-1]
    assert isinstance(output_mask, Sequence)
    return _backward_meta(h, wt, output_mask)


_lib.impl("linear_ce_forward", forward_impl, "CompositeExplicitAutograd")
_lib.impl("linear_ce_backward", backward_impl, "CompositeExplicitAutograd")
_lib.impl("linear_ce_forward", _forward_meta, "Meta")
_lib.impl("linear_ce_backward", _backward_fake, "Meta")
_lib.impl("linear_ce_forward_host", forward_host_impl, "CompositeExplicitAutograd")
_lib.impl("linear_ce_backward_host", backward_host_impl, "CompositeExplicitAutograd")
_lib.impl("linear_ce_forward_host", _forward_host_meta, "Meta")
_lib.impl("linear_ce_backward_host", _backward_fake, "Meta")


def _head_flops(h_shape: torch.Size, wt_shape: torch.Size) -> int:
    return 2 * int(h_shape[0]) * int(h_shape[1]) * int(wt_shape[1])


def _heads_formula(heads: int, first: int) -> Callable[..., int]:
    # A flop formula: ``heads`` matmuls of the head's size, whose h and wt shapes are the
    # arguments at ``first`` and ``first + 1``.
    def formula(*shapes: Any, **_: object) -> int:
        return heads * _head_flops(shapes[first], shapes[first + 1])

    return formula


_ops = torch.ops.memcompile
register_flop_formula([_ops.linear_ce_forward, _ops.linear_ce_forward_host])(_heads_formula(1, 0))
# The logits twice more (by rows and by columns), and the two gradient matmuls.
register_flop_formula(_ops.linear_ce_backward)(_heads_formula(4, 1))
# The two gradient matmuls only: the log-softmax comes from the host.
register_flop_formula(_ops.linear_ce_backward_host)(_heads_formula(2, 1))
