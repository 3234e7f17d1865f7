"""In-place kernels for a classifier's loss head (log-softmax + NLL).

Cross-entropy over a large vocabulary is the largest transient of a language model's step: for
``N`` tokens and ``V`` classes the logits, their log-softmax and, in the backward, the gradient
of the NLL and of the log-softmax are ``N x V`` each. Eager holds two of them in the forward and
three in the backward (GPT bench size: 16 MiB each, 48 MiB of a 196 MiB step peak). These ops
compute the same values into the buffer the result replaces:

    lsm = torch.ops.memcompile.log_softmax_(logits, dim)                 # logits' memory
    g   = torch.ops.memcompile.nll_log_softmax_backward_(
              lsm, grad_out, target, weight, reduction, ignore_index, total_weight, dim, chunks)
                                                                         # lsm's memory

Bit-identity: every value is the aten kernel's own (``aten._log_softmax``,
``aten.nll_loss_backward``, ``aten._log_softmax_backward_data``), written through their ``out=``
variants into the memory they read. Both row kernels read a row's element before they write it
(the log-softmax reads the row for its maximum and sum first), so the result is the one a fresh
buffer gets (``tests/test_losshead.py`` checks it bit for bit). The forward runs once over the
whole tensor and needs no scratch. The backward runs ``chunks`` blocks of rows: each block's
NLL gradient (``nll_loss_backward``'s ``N x V`` output, ``-weight / total_weight`` at the target,
with ``total_weight`` the forward's) is one block of scratch. More blocks, less scratch, more
kernel calls: the graph pass picks the count. The forward's loss reduction (a sum over all rows)
is left to ``aten.nll_loss_forward`` as it was.

The backward overwrites the saved log-softmax, which is safe only when the graph is not kept for
another backward: under ``retain_graph=True`` it writes a new buffer instead, and warns once,
since the step then holds one ``N x V`` buffer more than planned.

Both ops return (an alias of) the tensor they overwrite, declared ``Tensor(a!) -> Tensor(a!)``
like aten's in-place ops, so graph passes see the storage is reused and compilers keep readers
of the old values before them (the rewrite only uses them where there are none).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

log = logging.getLogger(__name__)

__all__ = ["log_softmax_", "nll_log_softmax_backward_", "row_block", "workspace_bytes"]

aten = torch.ops.aten

_lib = torch.library.Library("memcompile", "FRAGMENT")
_lib.define("log_softmax_(Tensor(a!) self, int dim) -> Tensor(a!)")
_lib.define(
    "nll_log_softmax_backward_(Tensor(a!) self, Tensor grad_output, Tensor target, "
    "Tensor? weight, int reduction, SymInt ignore_index, Tensor total_weight, int dim, "
    "int chunks) -> Tensor(a!)"
)

_warned_retained = False


def row_block(rows: int, chunks: int) -> int:
    """Rows per block when ``rows`` rows are done in ``chunks`` blocks."""
    return max(1, math.ceil(rows / max(1, chunks)))


def workspace_bytes(rows: int, row_bytes: int, chunks: int, *, backward: bool) -> int:
    """Scratch of one call: none in the forward (in place), one block of rows in the backward
    (its NLL gradient)."""
    return row_block(rows, chunks) * row_bytes if backward else 0


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() != 2 or dim % 2 != 1 or not x.is_contiguous():
        raise ValueError(
            f"memcompile loss head: expected contiguous [rows, classes] with dim=-1 or 1, got "
            f"shape {tuple(x.shape)}, strides {x.stride()}, dim {dim}"
        )
    return x


def log_softmax_(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` overwritten with ``aten._log_softmax(x, dim, False)``."""
    rows = _rows(x, dim)
    aten._log_softmax.out(rows, 1, False, out=rows)
    return x


def nll_log_softmax_backward_(
    lsm: torch.Tensor,
    grad_output: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    dim: int,
    chunks: int,
) -> torch.Tensor:
    """The gradient of ``nll_loss(log_softmax(logits))`` w.r.t. the logits, in ``lsm``'s memory
    (a new tensor when the autograd graph is kept for another backward)."""
    global _warned_retained
    rows = _rows(lsm, dim)
    if grad_output.dim() != 0:
        raise ValueError("memcompile loss head: only reductions 'mean' and 'sum' are rewritten")
    out = rows
    in_backward = torch._C._current_graph_task_id() != -1
    if in_backward and torch._C._autograd._get_current_graph_task_keep_graph():
        # Another backward will read the saved log-softmax again: do not overwrite it.
        out = torch.empty_like(rows)
        if not _warned_retained:
            _warned_retained = True
            warnings.warn(
                "memcompile: backward(retain_graph=True) keeps the saved log-softmax of the "
                f"loss head, so this step holds {out.nbytes} more bytes than its plan "
                "predicted",
                stacklevel=2,
            )
    step = row_block(rows.shape[0], chunks)
    for start in range(0, rows.shape[0], step):
        stop = start + step
        block = rows[start:stop]
        g = aten.nll_loss_backward(
            grad_output, block, target[start:stop], weight, reduction, ignore_index, total_weight
        )
        aten._log_softmax_backward_data.out(g, block, 1, block.dtype, out=out[start:stop])
        del g
    return out


def _overwritten(x: torch.Tensor, *_: object) -> torch.Tensor:
    # Meta kernel of both ops: the result is the tensor they overwrite.
    return x


_lib.impl("log_softmax_", log_softmax_, "CompositeExplicitAutograd")
_lib.impl("nll_log_softmax_backward_", nll_log_softmax_backward_, "CompositeExplicitAutograd")
_lib.impl("log_softmax_", _overwritten, "Meta")
_lib.impl("nll_log_softmax_backward_", _overwritten, "Meta")
