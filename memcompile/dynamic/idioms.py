"""The six memory-access idioms of an aten op, after DyNN-Offload's Table V, and their sums.

DyNN-Offload encodes a network's operators by six pervasive memory-access patterns instead of by
operator name: a compact feature space for a small pilot model. Each aten op packet here maps to a
multi-hot 6-vector over :data:`IDIOMS`; a fragment is summarised by the per-idiom op counts of its
forward (or inference) graph:

    >>> from memcompile.dynamic.idioms import IDIOMS, op_idioms
    >>> IDIOMS
    ('layout', 'elementwise', 'indexing', 'reduction', 'stencil', 'dimensionality')
    >>> op_idioms("aten.addmm.default")
    (0, 1, 0, 1, 0, 0)
    >>> graph_idioms(record.profile.forward)    # doctest: +SKIP (op counts of one forward)

The idioms, as this table uses them:

* ``layout``: reads in an order other than the output's (transpose, permute, a copy to another
  layout or dtype);
* ``elementwise``: output element i reads input element i (broadcast included), and fills;
* ``indexing``: gathers or scatters through an index tensor (embedding, index, index_add, scatter,
  a loss reading the target class);
* ``reduction``: many inputs to one output along a dimension: sums, means, norms, softmax, top-k,
  sort, and GEMM contractions;
* ``stencil``: a sliding window over neighbours (convolution, pooling);
* ``dimensionality``: the shape or rank changes without arithmetic (view, reshape, unsqueeze,
  expand, cat, split, select, slice).

An op may show several idioms (``addmm`` is a contraction plus a bias add; ``layer_norm`` a
reduction plus elementwise scaling). Ops that move no data (``alias``, ``detach``, assertions,
``getitem`` on a tuple) are all zeros, listed so that coverage is explicit. The table covers every
op the zoo's forward and backward graphs use (``tests/test_dynamic_idioms.py`` checks it); an op
not in it gets zeros and a debug log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from memcompile.analysis.graph import GraphProfile

log = logging.getLogger(__name__)

__all__ = [
    "IDIOMS",
    "IdiomVector",
    "graph_idioms",
    "is_covered",
    "op_idioms",
    "sum_idioms",
    "table",
]

#: Idiom names, in vector order.
IDIOMS: tuple[str, ...] = (
    "layout",
    "elementwise",
    "indexing",
    "reduction",
    "stencil",
    "dimensionality",
)

IdiomVector = tuple[int, int, int, int, int, int]

_ZERO: IdiomVector = (0, 0, 0, 0, 0, 0)


def _v(*names: str) -> IdiomVector:
    for n in names:
        if n not in IDIOMS:
            raise ValueError(f"unknown idiom {n!r}; idioms are {', '.join(IDIOMS)}")
    return tuple(int(i in names) for i in IDIOMS)  # type: ignore[return-value]


_EW = _v("elementwise")
_DIM = _v("dimensionality")
_RED = _v("reduction")
_RED_EW = _v("reduction", "elementwise")
_IDX = _v("indexing")

# Keyed by op packet ("aten.mm"): every overload of an op shares its access pattern.
_TABLE: dict[str, IdiomVector] = {
    # -- no data movement: aliases, tuple access, runtime assertions
    "_operator.getitem": _ZERO,
    "aten.alias": _ZERO,
    "aten.detach": _ZERO,
    "aten._assert_async": _ZERO,
    "aten._assert_scalar": _ZERO,
    "aten.sym_size": _ZERO,
    "aten.sym_numel": _ZERO,
    "aten.sym_stride": _ZERO,
    # -- elementwise arithmetic, comparisons, activations and their backwards
    **{
        f"aten.{name}": _EW
        for name in (
            "abs add sub rsub mul div neg exp log sqrt rsqrt pow reciprocal sign clamp "
            "clamp_min clamp_max floor_divide remainder eq ne lt le gt ge logical_and logical_or "
            "logical_not bitwise_and bitwise_or where masked_fill relu gelu gelu_backward silu "
            "silu_backward sigmoid sigmoid_backward tanh tanh_backward threshold_backward "
            "hardtanh hardtanh_backward leaky_relu leaky_relu_backward elu elu_backward "
            "native_dropout native_dropout_backward bernoulli rand rand_like randn randn_like "
            "copy copy_ fill fill_ zero zero_ lerp addcmul addcdiv mse_loss_backward "
            "isnan isinf"
        ).split()
    },
    # fills and factories: write-only streams
    **{
        f"aten.{name}": _EW
        for name in (
            "arange empty empty_like empty_strided full full_like new_empty new_empty_strided "
            "new_full new_ones new_zeros ones ones_like scalar_tensor zeros zeros_like"
        ).split()
    },
    # -- layout: element order changes (a copy reads the source in its own strides)
    "aten.t": _v("layout"),
    "aten.transpose": _v("layout"),
    "aten.permute": _v("layout"),
    "aten.clone": _v("layout", "elementwise"),
    "aten.contiguous": _v("layout", "elementwise"),
    "aten._to_copy": _v("layout", "elementwise"),
    # -- dimensionality: shape or rank changes, no arithmetic
    **{
        f"aten.{name}": _DIM
        for name in (
            "view _unsafe_view reshape unsqueeze squeeze expand flatten unflatten select slice "
            "split split_with_sizes unbind narrow as_strided cat stack chunk"
        ).split()
    },
    "aten.slice_scatter": _v("dimensionality", "indexing"),
    "aten.select_scatter": _v("dimensionality", "indexing"),
    # -- indexing: gathers and scatters through an index tensor
    **{
        f"aten.{name}": _IDX
        for name in (
            "embedding index index_select gather scatter index_put index_put_ masked_select "
            "nonzero take"
        ).split()
    },
    "aten.index_add": _v("indexing", "elementwise"),
    "aten.scatter_add": _v("indexing", "elementwise"),
    "aten.embedding_dense_backward": _v("indexing", "reduction"),
    "aten.nll_loss_forward": _v("indexing", "reduction"),
    "aten.nll_loss_backward": _v("indexing", "elementwise"),
    "aten.one_hot": _v("indexing", "elementwise"),
    # -- reductions (GEMMs are contractions)
    **{
        f"aten.{name}": _RED
        for name in "sum mean amax amin max min argmax argmin all any prod std var".split()
    },
    "aten.mm": _RED,
    "aten.bmm": _RED,
    "aten.matmul": _RED,
    "aten.addmm": _v("reduction", "elementwise"),
    "aten.baddbmm": _v("reduction", "elementwise"),
    "aten.topk": _v("reduction", "indexing"),
    "aten.sort": _v("reduction", "indexing"),
    "aten.argsort": _v("reduction", "indexing"),
    **{
        f"aten.{name}": _RED_EW
        for name in (
            "_softmax _softmax_backward_data _log_softmax _log_softmax_backward_data "
            "native_layer_norm native_layer_norm_backward native_batch_norm "
            "_native_batch_norm_legit _native_batch_norm_legit_functional "
            "_native_batch_norm_legit_no_training native_batch_norm_backward mse_loss "
            "_scaled_dot_product_flash_attention_for_cpu "
            "_scaled_dot_product_flash_attention_for_cpu_backward "
            "_scaled_dot_product_efficient_attention "
            "_scaled_dot_product_efficient_attention_backward "
            "_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward "
            "_scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward "
            "linalg_vector_norm cumsum logsumexp"
        ).split()
    },
    # -- stencils: sliding windows
    "aten.convolution": _v("stencil", "reduction"),
    "aten.convolution_backward": _v("stencil", "reduction"),
    "aten.max_pool2d_with_indices": _v("stencil", "reduction", "indexing"),
    "aten.max_pool2d_with_indices_backward": _v("stencil", "indexing"),
    "aten.avg_pool2d": _v("stencil", "reduction"),
    "aten.avg_pool2d_backward": _v("stencil", "elementwise"),
    "aten._adaptive_avg_pool2d": _v("stencil", "reduction"),
    "aten._adaptive_avg_pool2d_backward": _v("stencil", "elementwise"),
}


def _packet(target: str) -> str:
    # "aten.mm.default" -> "aten.mm"; "_operator.getitem" stays (no overload suffix).
    if target.startswith("aten."):
        parts = target.split(".")
        return ".".join(parts[:2])
    return target


def table() -> dict[str, IdiomVector]:
    """A copy of the table: op packet (``"aten.mm"``) -> idiom vector."""
    return dict(_TABLE)


def is_covered(target: str) -> bool:
    """Whether ``target`` (``"aten.mm.default"``, ``"_operator.getitem"``) has a table entry."""
    return _packet(target) in _TABLE


def op_idioms(target: str) -> IdiomVector:
    """The idiom vector of an FX target name (as ``NodeProfile.target``); zeros if unknown."""
    vec = _TABLE.get(_packet(target))
    if vec is None:
        log.debug("no memory-access idioms for %s; counted as zeros", target)
        return _ZERO
    return vec


def sum_idioms(targets: Iterable[str]) -> IdiomVector:
    """Per-idiom op counts over ``targets``."""
    acc = [0] * len(IDIOMS)
    for t in targets:
        for i, x in enumerate(op_idioms(t)):
            acc[i] += x
    return tuple(acc)  # type: ignore[return-value]


def graph_idioms(graph: GraphProfile | None) -> IdiomVector:
    """Per-idiom op counts of a profiled graph's ``call_function`` nodes (zeros for ``None``)."""
    if graph is None:
        return _ZERO
    return sum_idioms(n.target for n in graph.nodes if n.op == "call_function")
