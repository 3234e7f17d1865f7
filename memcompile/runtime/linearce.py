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
  :data:`ALIGN`). So :mod:`memcompile.passes.linearce` runs both, whole and by blocks, on
  random values of the graph's sizes before it rewrites, and picks a block count whose results
  are bitwise equal.

The backward's time is two more matmuls of the head's size (the logits by rows and by columns)
and their log-softmax; the rewrite is used only when a plan does not fit without it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

log = logging.getLogger(__name__)

__all__ = ["ALIGN", "backward_impl", "block", "forward_impl"]

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
    picked = h.new_empty(rows, 1)
    # An out-of-range target raises in gather, as it does in nll_loss.
    safe = torch.where(target == ignore_index, torch.zeros_like(target), target)
    step = block(rows, chunks)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        x = _logits(h[start:stop], wt, bias)
        peak, where = x.max(1, keepdim=True)
        row_max[start:stop] = peak.squeeze(1)
        aten._log_softmax.out(x, 1, False, out=x)  # reads each row before it writes it
        torch.neg(x.gather(1, where).squeeze(1), out=row_logsum[start:stop])
        picked[start:stop] = x.gather(1, safe[start:stop, None])
        del x
    loss, total_weight = aten.nll_loss_forward(
        picked, _nll_targets(target, ignore_index), None, reduction, ignore_index
    )
    return loss, total_weight, row_max, row_logsum


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
    rows, classes = h.shape[0], wt.shape[1]
    dtype = h.dtype
    grad_h, grad_wt, grad_bias = _backward_meta(h, wt, output_mask)
    if output_mask[0]:
        w_back = wt.t()
        step = block(rows, chunks)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            x = _logits(h[start:stop], wt, bias)
            aten._log_softmax.out(x, 1, False, out=x)
            g = aten.nll_loss_backward(
                grad_output, x, target[start:stop], None, reduction, ignore_index, total_weight
            )
            aten._log_softmax_backward_data.out(g, x, 1, dtype, out=x)
            del g
            aten.mm.out(x, w_back, out=grad_h[start:stop])
            del x
    if not (output_mask[1] or output_mask[2]):
        return grad_h, grad_wt, grad_bias
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
        x = _logits(h, wt[:, start:stop], None if bias is None else bias[start:stop])
        torch.sub(x, row_max[:, None], out=x)
        lsm = h.new_empty(rows, width + 1)
        torch.sub(x, row_logsum[:, None], out=lsm[:, :width])
        del x
        lsm[:, width] = 0
        inside = (target >= start) & (target < stop)
        g = h.new_zeros(rows, width + 1)
        column = torch.where(inside, target - start, width)
        g[every_row, column] = per_row
        aten._log_softmax_backward_data.out(g, lsm, 1, dtype, out=lsm)
        del g
        gl = lsm[:, :width]
        if output_mask[1]:
            aten.mm.out(gl.t(), h, out=grad_wt[start:stop])
        if output_mask[2]:
            aten.sum.IntList_out(gl, [0], True, out=grad_bias[:, start:stop])
        del lsm, gl
    return grad_h, grad_wt, grad_bias


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


def _head_flops(h_shape: torch.Size, wt_shape: torch.Size) -> int:
    return 2 * int(h_shape[0]) * int(h_shape[1]) * int(wt_shape[1])


@register_flop_formula(torch.ops.memcompile.linear_ce_forward)
def _forward_flops(h_shape: torch.Size, wt_shape: torch.Size, *_: object, **__: object) -> int:
    return _head_flops(h_shape, wt_shape)


@register_flop_formula(torch.ops.memcompile.linear_ce_backward)
def _backward_flops(
    grad_shape: torch.Size, h_shape: torch.Size, wt_shape: torch.Size, *_: object, **__: object
) -> int:
    # The logits twice, and the two gradient matmuls.
    return 4 * _head_flops(h_shape, wt_shape)
