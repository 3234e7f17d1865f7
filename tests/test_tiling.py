"""Row tiling (rewrites/tiling/): an elementwise result made a block of rows at a time equals the
whole op bit for bit, the chain's operands are never held whole, a value other readers need
stays for them, the probe's verdict is obeyed, and training under a budget only tiling reaches
stays bit-identical with the predicted peak equal to the allocator's."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
import memcompile.pipeline.built as built
from memcompile import zoo
from memcompile.pipeline import features
from memcompile.planning.plan import MemoryPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.tiling import build as tiling_build
from memcompile.rewrites.tiling import find as tiling_find
from memcompile.rewrites.tiling import probe as tiling_probe
from memcompile.rewrites.tiling.build import row_tile_pass
from memcompile.rewrites.tiling.find import _views_as, find_row_tilings
from memcompile.rewrites.tiling.probe import tiles_exactly
from memcompile.runtime.store import TieredStore, register_store

from helpers import train_under_budget

aten = torch.ops.aten
CTX = PassContext(fragment="F0", graph="backward")
B, T, K, H = 2, 24, 16, 40
N = B * T


def _branch_backward(dy, x, w, b):
    # Branchy's branch backward: the mean's broadcast gradient scaled, the recomputed
    # pre-activation, the GELU's gradient; the weight gradient sums over every row.
    g = aten.div.Scalar(aten.expand.default(aten.unsqueeze.default(dy, -1), [B, T, H]), H)
    h = aten.view.default(aten.addmm.default(b, x, aten.t.default(w)), [B, T, H])
    gx = aten.view.default(aten.gelu_backward.default(g, h), [N, H])
    return aten.mm.default(aten.t.default(gx), x), aten.sum.dim_IntList(gx, [0])


def _branch_forward(dy, x, w, b, *, in_place=False):
    # Branchy's branch forward: the mean over the last dim of the GELU of a linear layer (with
    # ``in_place``, the GELU written into its input, as the in-place pass leaves it).
    h = aten.view.default(aten.addmm.default(b, x, aten.t.default(w)), [B, T, H])
    g = aten.gelu.out(h, out=h) if in_place else aten.gelu.default(h)
    return aten.mul.Tensor(aten.mean.dim(g, [-1]), dy)


def _mlp_backward(x, w1, b1, d_out, w2, *, late_reader=False):
    # GPT's MLP backward: the recomputed pre-activation is read by the GELU (for the down
    # projection's weight gradient) before the GELU's gradient reads it.
    pre = aten.view.default(aten.addmm.default(b1, x, aten.t.default(w1)), [B, T, H])
    act = aten.view.default(aten.gelu.default(pre), [N, H])
    d_w2 = aten.mm.default(aten.t.default(d_out), act)
    d_act = aten.view.default(aten.mm.default(d_out, w2), [B, T, H])
    d_pre = aten.gelu_backward.default(d_act, pre)
    out = (d_w2, aten.mm.default(aten.t.default(aten.view.default(d_pre, [N, H])), x))
    return (*out, aten.relu.default(pre)) if late_reader else out


def _forward_read_early(dy, x, w, b):
    # Branchy's branch forward with the pre-activation read whole before the mean too (as a
    # swap plan's offload reads it): the mean's blocks may make it again or read it.
    pre = aten.addmm.default(b, x, aten.t.default(w))
    early = aten.sum.default(pre)
    g = aten.gelu.default(aten.view.default(pre, [B, T, H]))
    return aten.add.Tensor(aten.mul.Tensor(aten.mean.dim(g, [-1]), dy), early)


def _swapped_backward(dy, x, h_host, *, key, late_reader=False):
    # Branchy's branch backward in a plan that swaps the pre-activation: reloaded whole from its
    # host copy, read by the GELU's gradient alone (or also by a later reader).
    g = aten.div.Scalar(aten.expand.default(aten.unsqueeze.default(dy, -1), [B, T, H]), H)
    h = torch.ops.memcompile.reload.default(h_host, torch.device("cpu"), key, 0)
    torch.ops.memcompile.wait.default(h, key)
    gx = aten.view.default(aten.gelu_backward.default(g, aten.view.default(h, [B, T, H])), [N, H])
    out = (aten.mm.default(aten.t.default(gx), x), aten.sum.dim_IntList(gx, [0]))
    return (*out, aten.relu.default(h)) if late_reader else out


def _inputs(fn):
    g = torch.Generator().manual_seed(0)
    if fn in (_branch_backward, _branch_forward, _forward_read_early):
        shapes = [(B, T), (N, K), (H, K), (H,)]
    elif fn is _swapped_backward:
        shapes = [(B, T), (N, K), (N, H)]
    else:
        shapes = [(N, K), (H, K), (H,), (N, K), (K, H)]
    return [torch.randn(s, generator=g) for s in shapes]


def _trace(fn, **kwargs):
    return make_fx(lambda *a: fn(*a, **kwargs), tracing_mode="fake")(*_inputs(fn))


def _full_rows(gm: fx.GraphModule, op) -> list[str]:
    """Nodes of ``op`` that make all ``N`` rows."""
    return [
        n.name
        for n in gm.graph.nodes
        if n.target is op and n.meta["val"].numel() == N * n.meta["val"].shape[-1]
    ]


def test_the_branch_backward_is_made_by_blocks_bit_identically():
    gm = _trace(_branch_backward)
    (found,) = find_row_tilings(gm, blocks=4)
    assert found.op == "aten.gelu_backward.default"
    # The scaled gradient and the pre-activation (with its view) are made by blocks.
    assert {n.split("_")[0] for n in found.chain} == {"div", "addmm", "view"}
    assert found.kept == ()
    assert found.rows == N and found.nbytes == 2 * N * H * 4

    out = row_tile_pass(gm, CTX, blocks=4)
    assert out is not gm
    (done,) = out.meta["memcompile_row_tiles"]
    assert done.new
    assert _full_rows(gm, aten.addmm.default) and not _full_rows(out, aten.addmm.default)
    assert not _full_rows(out, aten.div.Scalar)
    assert len(out.graph.find_nodes(op="call_function", target=aten.addmm.default)) == 4
    args = _inputs(_branch_backward)
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_row_reduction_is_made_by_blocks_and_its_operands_never_whole(in_place):
    gm = _trace(_branch_forward, in_place=in_place)
    found = {t.node: t for t in find_row_tilings(gm, blocks=4)}
    # The mean (whose chain holds the GELU) and the GELU itself are candidates; the mean's
    # chain takes the GELU's.
    assert {t.op for t in found.values()} == {"aten.mean.dim", "aten.gelu.default"}
    out = row_tile_pass(gm, CTX, blocks=4)
    (done,) = out.meta["memcompile_row_tiles"]
    assert done.op == "aten.mean.dim"
    gelu = aten.gelu.out if in_place else aten.gelu.default
    assert _full_rows(gm, aten.addmm.default) and _full_rows(gm, gelu)
    # By blocks the in-place GELU is the functional one.
    assert not _full_rows(out, aten.addmm.default) and not _full_rows(out, aten.gelu.default)
    assert not out.graph.find_nodes(op="call_function", target=aten.gelu.out)
    assert len(out.graph.find_nodes(op="call_function", target=aten.mean.out)) == 4
    args = _inputs(_branch_forward)
    assert torch.equal(gm(*args), out(*args))
    assert torch.equal(out(*args), _branch_forward(*args))


def test_a_value_read_earlier_stays_for_its_reader_and_the_blocks_make_it_again():
    gm = _trace(_mlp_backward)
    found = [t for t in find_row_tilings(gm, blocks=3) if "gelu_backward" in t.op]
    assert len(found) == 1
    (t,) = found
    # The pre-activation (an addmm and its view) stays for the GELU; the gradient's matmul
    # is made by blocks only.
    assert {n.split("_")[0] for n in t.kept} == {"addmm", "view"}
    assert any(n.startswith("mm") for n in t.chain if n not in t.kept)
    out = row_tile_pass(gm, CTX, blocks=3)
    gelu_backwards = [n for n in out.graph.nodes if n.target is aten.gelu_backward.grad_input]
    assert len(gelu_backwards) == 3
    # The whole pre-activation is read by the GELU alone now: it dies there.
    (pre,) = next(n for n in out.graph.nodes if n.target is aten.gelu.default).all_input_nodes
    assert set(pre.users) == {n for n in out.graph.nodes if n.target is aten.gelu.default}
    args = _inputs(_mlp_backward)
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ahead", [None, True])
def test_a_swapped_operand_is_reloaded_a_block_of_rows_at_a_time(ahead):
    store = TieredStore()
    key = register_store(store)
    gm = _trace(_swapped_backward, key=key)
    (found,) = find_row_tilings(gm, blocks=4)
    assert found.op == "aten.gelu_backward.default"
    (leaf,) = found.reloaded  # the reload's view, read by rows only
    assert leaf in found.leaves
    assert found.nbytes == 2 * N * H * 4  # the scaled gradient and the reload go

    out = row_tile_pass(gm, CTX, blocks=4, ahead=ahead)
    reloads = out.graph.find_nodes(op="call_function", target=torch.ops.memcompile.reload.default)
    assert [tuple(r.meta["val"].shape) for r in reloads] == [(N // 4, H)] * 4
    waits = out.graph.find_nodes(op="call_function", target=torch.ops.memcompile.wait.default)
    assert sorted(w.args[0] for w in waits) == sorted(reloads)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    grads = out.graph.find_nodes(op="call_function", target=aten.gelu_backward.grad_input)
    assert len(grads) == 4
    if ahead:  # each block's copy is issued before the previous block computes (a GPU's overlap)
        assert all(order[reloads[i + 1]] < order[grads[i]] for i in range(3))
    else:  # on the CPU, where a copy hides nothing: after it, so that it is not held through it
        assert all(order[grads[i]] < order[reloads[i + 1]] for i in range(3))
    args = _inputs(_swapped_backward)
    before = store.bytes_in["host"]
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)
    assert store.bytes_in["host"] - before == 2 * N * H * 4  # the whole once, then by blocks


def test_a_swapped_operand_read_again_later_is_reloaded_whole():
    key = register_store(TieredStore())
    gm = _trace(_swapped_backward, key=key, late_reader=True)
    assert all(not t.reloaded for t in find_row_tilings(gm, blocks=4))


def _two_readers_of_a_reload(g, probs_host, w, other, *, key):
    # The softmax's gradient reads the reloaded probabilities by rows only (its own tiling
    # reloads them by rows); a later op's chain makes that gradient again (kept whole for an
    # earlier reader) and reads the same reload (Mixtral's router backward).
    probs = torch.ops.memcompile.reload.default(probs_host, torch.device("cpu"), key, 0)
    torch.ops.memcompile.wait.default(probs, key)
    d = aten._softmax_backward_data.default(g, aten.detach.default(probs), -1, torch.float32)
    early = aten.sum.default(d)
    return aten.sum.dim_IntList(aten.add.Tensor(other, aten.mm.default(d, w)), [0]), early


def test_two_tilings_never_remove_what_the_other_reads():
    key = register_store(TieredStore())
    gen = torch.Generator().manual_seed(0)
    args = [
        torch.randn(N, H, generator=gen),
        torch.randn(N, H, generator=gen).softmax(-1),
        torch.randn(H, K, generator=gen),
        torch.randn(N, K, generator=gen),
    ]
    gm = make_fx(lambda *a: _two_readers_of_a_reload(*a, key=key), tracing_mode="fake")(*args)
    found = {t.op: t for t in find_row_tilings(gm, blocks=4)}
    # Both are candidates: the softmax's gradient alone (its reload by rows), and the add
    # whose chain keeps that gradient and reads the reload whole.
    assert found["aten._softmax_backward_data.default"].reloaded
    add = found["aten.add.Tensor"]
    assert any(c.startswith("_softmax") for c in add.kept)
    out = row_tile_pass(gm, CTX, blocks=4)  # one of the two, never both
    assert len(out.meta["memcompile_row_tiles"]) == 1
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kept", [0, 1])
def test_a_matmul_kept_for_an_earlier_reader_is_made_again_only_if_allowed(kept):
    gm = _trace(_forward_read_early)
    (t,) = [t for t in find_row_tilings(gm, blocks=4, max_kept_matmuls=kept) if "mean" in t.op]
    out = row_tile_pass(gm, CTX, blocks=4, max_kept_matmuls=kept)
    addmms = out.graph.find_nodes(op="call_function", target=aten.addmm.default)
    if kept:  # made again by the blocks: it dies at its earlier reader
        assert [c for c in t.kept if c.startswith("addmm")]
        assert len(addmms) == 1 + 4
    else:  # read by rows from the whole, made once
        assert not [c for c in t.chain if c.startswith("addmm")]
        assert len(addmms) == 1
    assert not _full_rows(out, aten.gelu.default)
    args = _inputs(_forward_read_early)
    assert torch.equal(gm(*args), out(*args))


HEADS, D = 3, 8


def _attention_backward(d_out, v, probs):
    # Hand-written attention's backward: the probabilities' gradient (a batched matmul), the
    # softmax's gradient over the last dim, then the query and key gradients (which sum over
    # rows: they read the result whole).
    d_probs = aten.view.default(
        aten.bmm.default(d_out, aten.transpose.int(v, 1, 2)), [B, HEADS, T, T]
    )
    d_scores = aten._softmax_backward_data.default(d_probs, probs, -1, torch.float32)
    flat = aten.view.default(d_scores, [B * HEADS, T, T])
    return aten.bmm.default(aten.transpose.int(flat, 1, 2), d_out), aten.bmm.default(flat, v)


def test_the_softmax_gradient_is_made_by_blocks_of_whole_batches():
    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(B * HEADS, T, D, generator=g),
        torch.randn(B * HEADS, T, D, generator=g),
        torch.randn(B, HEADS, T, T, generator=g).softmax(-1),
    ]
    gm = make_fx(_attention_backward, tracing_mode="fake")(*args)
    (found,) = find_row_tilings(gm, blocks=4)
    assert found.op == "aten._softmax_backward_data.default"
    assert {n.split("_")[0] for n in found.chain} == {"bmm", "view"}
    assert found.rows == B * HEADS * T and found.align == T
    out = row_tile_pass(gm, CTX, blocks=4)
    # 6 batches of T rows in 4 blocks: blocks of 2 whole batches, so 3 of them.
    products = [
        tuple(n.meta["val"].shape)
        for n in out.graph.find_nodes(op="call_function", target=aten.bmm.default)
    ]
    assert products.count((2, T, T)) == 3 and (B * HEADS, T, T) not in products
    assert (
        len(out.graph.find_nodes(op="call_function", target=aten._softmax_backward_data.out)) == 3
    )
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


def _attention_backward_swapped(d_out, v_host, probs, *, key, late_reader=False):
    # Hand-written attention's backward in a plan that swaps the values: reloaded whole from
    # their host copy, read transposed by the probabilities' gradient (a batched matmul) alone,
    # or also by a later reader.
    v = torch.ops.memcompile.reload.default(v_host, torch.device("cpu"), key, 0)
    torch.ops.memcompile.wait.default(v, key)
    d_probs = aten.view.default(
        aten.bmm.default(d_out, aten.transpose.int(v, 1, 2)), [B, HEADS, T, T]
    )
    d_scores = aten._softmax_backward_data.default(d_probs, probs, -1, torch.float32)
    flat = aten.view.default(d_scores, [B * HEADS, T, T])
    d_k = aten.bmm.default(aten.transpose.int(flat, 1, 2), d_out)
    return (d_k, aten.bmm.default(flat, v)) if late_reader else d_k


def _attention_backward_args():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(B * HEADS, T, D, generator=g),
        torch.randn(B * HEADS, T, D, generator=g),
        torch.randn(B, HEADS, T, T, generator=g).softmax(-1),
    ]


def test_a_swapped_batched_matmul_operand_is_reloaded_a_range_of_batches_at_a_time():
    store = TieredStore()
    key = register_store(store)
    args = _attention_backward_args()
    gm = make_fx(lambda *a: _attention_backward_swapped(*a, key=key), tracing_mode="fake")(*args)
    (found,) = find_row_tilings(gm, blocks=4)
    # The transposed reload is read by the batched matmul only: reloaded by its batches.
    (leaf,) = found.reloaded_batches
    assert leaf.startswith("transpose") and leaf in found.leaves and not found.reloaded
    assert found.nbytes == B * HEADS * T * T * 4 + B * HEADS * T * D * 4  # d_probs and the reload

    out = row_tile_pass(gm, CTX, blocks=4)
    reloads = out.graph.find_nodes(op="call_function", target=torch.ops.memcompile.reload.default)
    # 6 batches in blocks of 2 whole batches: each block reloads its own 2 from the host copy.
    assert [tuple(r.meta["val"].shape) for r in reloads] == [(2, T, D)] * 3
    waits = out.graph.find_nodes(op="call_function", target=torch.ops.memcompile.wait.default)
    assert sorted(w.args[0] for w in waits) == sorted(reloads)
    products = out.graph.find_nodes(op="call_function", target=aten.bmm.default)
    assert [tuple(p.meta["val"].shape) for p in products[:3]] == [(2, T, T)] * 3
    before = store.bytes_in["host"]
    assert torch.equal(gm(*args), out(*args))
    # The whole once (``gm``), then by blocks (``out``).
    assert store.bytes_in["host"] - before == 2 * B * HEADS * T * D * 4


def test_a_swapped_batched_matmul_operand_read_again_later_is_reloaded_whole():
    key = register_store(TieredStore())
    args = _attention_backward_args()
    gm = make_fx(
        lambda *a: _attention_backward_swapped(*a, key=key, late_reader=True), tracing_mode="fake"
    )(*args)
    (found,) = find_row_tilings(gm, blocks=4)
    assert not found.reloaded_batches and not found.reloaded
    out = row_tile_pass(gm, CTX, blocks=4)
    reloads = out.graph.find_nodes(op="call_function", target=torch.ops.memcompile.reload.default)
    assert [tuple(r.meta["val"].shape) for r in reloads] == [(B * HEADS, T, D)]
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


def _attention_probs(q, k, v, mask):
    # Hand-written attention's probabilities (recomputed in a backward): scores by a batched
    # matmul, scaled, the causal mask ([T, T], the same for every batch) filled in, softmax.
    scores = aten.view.default(aten.bmm.default(q, aten.transpose.int(k, 1, 2)), [B, HEADS, T, T])
    masked = aten.masked_fill.Scalar(aten.mul.Tensor(scores, 0.125), mask, float("-inf"))
    probs = aten.view.default(aten._softmax.default(masked, -1, False), [B * HEADS, T, T])
    return aten.bmm.default(probs, v)


def _attention_recomputed_backward(q, k, v, mask, d_out, *, early=False, viewed=False):
    # The probabilities recomputed in a backward, read first by the value gradient, then by
    # the softmax's gradient (``early``: the value gradient is read before that, scaled;
    # ``viewed``: viewed before that, the view returned).
    scores = aten.view.default(aten.bmm.default(q, aten.transpose.int(k, 1, 2)), [B, HEADS, T, T])
    masked = aten.masked_fill.Scalar(aten.mul.Tensor(scores, 0.125), mask, float("-inf"))
    probs = aten._softmax.default(masked, 3, False)  # the last dim, counted from the front
    flat = aten.view.default(probs, [B * HEADS, T, T])
    d_v = aten.bmm.default(aten.transpose.int(flat, 1, 2), d_out)
    if early:
        d_v = aten.mul.Tensor(d_v, 0.5)
    if viewed:
        d_v = aten.view.default(d_v, [B, HEADS, T, D])
    d_probs = aten.view.default(
        aten.bmm.default(d_out, aten.transpose.int(v, 1, 2)), [B, HEADS, T, T]
    )
    d_scores = aten._softmax_backward_data.default(d_probs, probs, -1, torch.float32)
    return d_v, aten.bmm.default(aten.view.default(d_scores, [B * HEADS, T, T]), k)


def _recomputed_backward_args():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B * HEADS, T, D, generator=g) for _ in range(3)]
    return [
        *args,
        torch.ones(T, T, dtype=torch.bool).triu(1),
        torch.randn(B * HEADS, T, D, generator=g),
    ]


def _whole_scores(gm: fx.GraphModule) -> set[object]:
    """The ops of ``gm`` that make a value the size of all the scores."""
    whole = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("val") is not None]
    return {n.target for n in whole if n.meta["val"].numel() == B * HEADS * T * T}


@pytest.mark.parametrize("viewed", [False, True])
def test_the_value_gradient_is_made_by_the_blocks_that_make_the_probabilities(viewed):
    args = _recomputed_backward_args()
    gm = make_fx(lambda *a: _attention_recomputed_backward(*a, viewed=viewed), tracing_mode="fake")(
        *args
    )
    out = row_tile_pass(gm, CTX, blocks=4)
    # The softmax's gradient makes the probabilities by blocks, and each block its batches of
    # the value gradient too (the matmul that read them whole first): nothing keeps them.
    (done,) = out.meta["memcompile_row_tiles"]
    assert done.op == "aten._softmax_backward_data.default"
    (absorbed,) = done.absorbed
    assert absorbed.startswith("bmm") and not done.kept
    # 6 batches in blocks of 2: 3 blocks, each making its scores once and its value gradient.
    products = out.graph.find_nodes(op="call_function", target=aten.bmm.out)
    assert [tuple(p.kwargs["out"].meta["val"].shape) for p in products] == [(2, T, D)] * 3
    scores = [
        n
        for n in out.graph.find_nodes(op="call_function", target=aten.bmm.default)
        if tuple(n.meta["val"].shape) == (2, T, T)
    ]
    assert len(scores) == 2 * 3  # the scores and the probabilities' gradient, per block
    # Only the softmax gradient's buffer is whole (read by the key gradient).
    assert _whole_scores(out) <= {aten.empty.memory_format, aten.view.default, aten.slice.Tensor}
    if viewed:  # the view of the value gradient moved after the blocks that make it
        (view,) = [
            n
            for n in out.graph.nodes
            if n.meta.get("val") is not None and tuple(n.meta["val"].shape) == (B, HEADS, T, D)
        ]
        assert view.args[0].target is aten.empty.memory_format
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        assert all(order[p] < order[view] for p in products)
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


def test_the_blocks_out_forms_get_the_fake_values_fake_dispatch_gives(monkeypatch):
    # An out= form's value is the view it writes into, taken without a fake dispatch: the same
    # shapes, strides and storages as dispatching every node.
    args = _recomputed_backward_args()
    gm = make_fx(lambda *a: _attention_recomputed_backward(*a), tracing_mode="fake")(*args)
    fast = row_tile_pass(gm, CTX, blocks=4)
    outs = {
        n: name
        for n in fast.graph.nodes
        if (name := tiling_build._out_argument(n.target)) is not None
    }
    assert outs  # the softmax gradient's blocks and the value gradient's batches
    monkeypatch.setattr(tiling_build, "_out_argument", lambda target: None)
    slow = row_tile_pass(gm, CTX, blocks=4)
    fast_nodes = [n for n in fast.graph.nodes if n.op == "call_function"]
    slow_nodes = [n for n in slow.graph.nodes if n.op == "call_function"]
    assert [n.name for n in fast_nodes] == [n.name for n in slow_nodes]

    def layout(v):
        return (v.shape, v.stride(), v.storage_offset(), v.dtype)

    storages: dict[object, object] = {}
    for f, s in zip(fast_nodes, slow_nodes, strict=True):
        fv, sv = f.meta["val"], s.meta["val"]
        assert layout(fv) == layout(sv), f.name
        # The same storage sharing: one storage of the fast graph is one of the slow graph's.
        key = fv.untyped_storage()._cdata
        assert storages.setdefault(key, sv.untyped_storage()._cdata) == sv.untyped_storage()._cdata
    for n, name in outs.items():
        assert n.meta["val"] is n.kwargs[name].meta["val"]


def test_a_graph_tiled_again_on_the_same_values_takes_the_blocks_values_made_before():
    # A search builds many graphs sharing their nodes' values: the second tiling of the same
    # op on the same values takes the first's fake values (no dispatch), the same objects.
    gm = _trace(_branch_backward)
    memo: dict = {}
    first = row_tile_pass(gm, CTX, blocks=4, inlined=memo)
    assert len(memo) == 1
    again = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # shares the values, as builds do
    second = row_tile_pass(again, CTX, blocks=4, inlined=memo)
    assert len(memo) == 1
    tiled = [n for n in first.graph.nodes if n.name.startswith(tiling_build.PREFIX)]
    by_name = {n.name: n for n in second.graph.nodes}
    assert tiled and all(by_name[n.name].meta["val"] is n.meta["val"] for n in tiled)
    args = _inputs(_branch_backward)
    for a, b in zip(gm(*args), second(*args), strict=True):
        assert torch.equal(a, b)


def test_the_same_op_twice_in_one_graph_never_shares_the_blocks_values():
    # Two copies of one op on the same leaves (a recomputed copy) have one key: the second
    # gets values of its own, else the profile would count the two results as one buffer.

    def twice(dy, x, w, b):
        # _branch_backward's op twice on the same leaf nodes.
        e = aten.expand.default(aten.unsqueeze.default(dy, -1), [B, T, H])
        wt = aten.t.default(w)
        outs = []
        for _ in range(2):
            g = aten.div.Scalar(e, H)
            h = aten.view.default(aten.addmm.default(b, x, wt), [B, T, H])
            gx = aten.view.default(aten.gelu_backward.default(g, h), [N, H])
            outs += [aten.mm.default(aten.t.default(gx), x), aten.sum.dim_IntList(gx, [0])]
        return tuple(outs)

    gm = make_fx(twice, tracing_mode="fake")(*_inputs(_branch_backward))
    memo: dict = {}
    out = row_tile_pass(gm, CTX, blocks=4, inlined=memo)
    done = out.meta["memcompile_row_tiles"]
    assert len(done) == 2 and len(memo) == 1
    by_name = {n.name: n for n in out.graph.nodes}
    a, b = (by_name[t.new].meta["val"] for t in done)
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata


def test_probabilities_kept_for_an_earlier_reader_are_made_by_their_own_blocks_too():
    # The value gradient is read (scaled) before the softmax's gradient: the blocks cannot make
    # it, so the probabilities are kept whole for it, made by their own blocks.
    args = _recomputed_backward_args()
    gm = make_fx(lambda *a: _attention_recomputed_backward(*a, early=True), tracing_mode="fake")(
        *args
    )
    out = row_tile_pass(gm, CTX, blocks=4)
    done = {t.op: t for t in out.meta["memcompile_row_tiles"]}
    # The softmax's gradient makes the probabilities again by blocks (kept whole for the value
    # gradient), and the softmax itself is made by blocks: no whole scores or their gradient.
    assert {"aten._softmax.default", "aten._softmax_backward_data.default"} <= set(done)
    assert not done["aten._softmax_backward_data.default"].absorbed
    assert any(c.startswith("_softmax") for c in done["aten._softmax_backward_data.default"].kept)
    assert _whole_scores(out) <= {
        aten.empty.memory_format,
        aten.view.default,
        aten.slice.Tensor,
        aten.transpose.int,
    }
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


def test_the_softmax_is_made_by_blocks_with_the_mask_repeated_per_batch():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(B * HEADS, T, D, generator=g) for _ in range(3)]
    args.append(torch.ones(T, T, dtype=torch.bool).triu(1))
    gm = make_fx(_attention_probs, tracing_mode="fake")(*args)
    (found,) = [t for t in find_row_tilings(gm, blocks=4) if t.op == "aten._softmax.default"]
    assert {n.split("_")[0] for n in found.chain} == {"bmm", "view", "mul", "masked"}
    assert "mask_1" in found.leaves and found.align == T
    out = row_tile_pass(gm, CTX, blocks=4)
    # No [B, H, T, T] scores: the softmax's result alone is whole.
    whole = [n for n in out.graph.nodes if n.meta.get("val") is not None and n.op != "placeholder"]
    big = {n.target for n in whole if n.meta["val"].numel() == B * HEADS * T * T}
    assert big <= {aten.empty.memory_format, aten.view.default, aten.slice.Tensor}
    assert torch.equal(gm(*args), out(*args))


def test_a_value_read_after_the_op_is_read_whole_by_the_blocks():
    # The pre-activation is whole at the op anyway (a reader after it): it is a leaf, read by
    # rows, and the blocks make only the gradient's matmul.
    gm = _trace(_mlp_backward, late_reader=True)
    (t,) = [t for t in find_row_tilings(gm, blocks=3) if "gelu_backward" in t.op]
    assert [n.split("_")[0] for n in t.chain] == ["mm", "view"] and not t.kept
    assert any(leaf.startswith("view") for leaf in t.leaves)
    out = row_tile_pass(gm, CTX, blocks=3)
    assert len(out.graph.find_nodes(op="call_function", target=aten.addmm.default)) == 1
    args = _inputs(_mlp_backward)
    for a, b in zip(gm(*args), out(*args), strict=True):
        assert torch.equal(a, b)


def test_a_leaf_written_between_the_chain_and_the_op_leaves_it_whole():
    # The blocks read the leaves at the op: an in-place write into one after the chain read it
    # would change what they read.
    def written(dy, x, w, b):
        h = aten.view.default(aten.addmm.default(b, x, aten.t.default(w)), [B, T, H])
        aten.add_.Tensor(x, 1.0)
        g = aten.div.Scalar(aten.expand.default(aten.unsqueeze.default(dy, -1), [B, T, H]), H)
        return aten.sum.dim_IntList(aten.gelu_backward.default(g, h), [0])

    gm = make_fx(written, tracing_mode="fake")(*_inputs(_branch_backward))
    assert not find_row_tilings(gm)
    assert find_row_tilings(_trace(_branch_backward))  # the same op, nothing written between


def test_a_long_recurrence_is_searched_back_a_bounded_number_of_values():
    # An unrolled recurrence (the zoo GRU) makes each step's chain reach back through every
    # earlier step: the search recursed once per value (GRU small at 0.7x its peak had not
    # finished its first step after 13 minutes) and 300 steps raise RecursionError. It now
    # reads what is further back than tiling_find._MAX_DEPTH values as a leaf.
    def unrolled(x):
        h = x
        for _ in range(300):
            h = aten.mul.Tensor(h, aten.sigmoid.default(h))
        return aten.add.Tensor(aten.mean.dim(h, [-1]), 1.0)

    gm = make_fx(unrolled, tracing_mode="fake")(torch.randn(N, H))
    found = find_row_tilings(gm)
    assert len(found) == 301  # every sigmoid, mul and the mean
    longest = max(len(t.chain) for t in found)
    assert tiling_find._MAX_DEPTH <= longest <= 2 * tiling_find._MAX_DEPTH, longest
    mean = next(t for t in found if t.op == str(aten.mean.dim))
    # It reads by rows the values where the search stopped, not the recurrence's input.
    inputs = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    assert mean.leaves and not inputs & set(mean.leaves), mean.leaves


def test_the_probes_verdict_is_obeyed(monkeypatch):
    gm = _trace(_branch_backward)
    monkeypatch.setattr(tiling_build, "tiles_exactly", lambda *a: False)
    assert row_tile_pass(gm, CTX) is gm


def test_tiles_exactly_tells_different_bits_apart():
    def graph(fn) -> fx.Graph:
        return make_fx(fn, tracing_mode="fake")(torch.randn(64, 8)).graph

    leaf = [next(iter(graph(lambda x: x).find_nodes(op="placeholder"))).meta["val"]]
    tiling_probe._exact_cache.clear()
    assert tiles_exactly(graph(lambda x: x / 3), graph(lambda x: x / 3), leaf)
    assert not tiles_exactly(graph(lambda x: x / 3), graph(lambda x: x * (1 / 3)), leaf)


def _floor(monkeypatch, tiled: bool, **options) -> int:
    # The searched floor: no fast "no" (its bound would come first at a 1-byte budget).
    monkeypatch.setattr(
        features, "FEATURES", features.FEATURES.replace(row_tiling=tiled, fast_no=False)
    )
    torch._dynamo.reset()
    wl = zoo.build("branchy", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, **options)
    with pytest.raises(memcompile.MemoryBudgetError) as info:
        compiled(*wl.batch(0)).backward()
    return info.value.min_feasible


def _train_within(name: str, budget: int, **options) -> memcompile.MemReport:
    """Train ``name`` (tiny) under ``budget``: bit-identical to eager over 3 Adam steps
    (train_under_budget asserts it), measured within the budget and equal to the prediction,
    each branch's GELU gradient made by blocks; the report."""
    compiled, _, measured = train_under_budget(name, "adam", budget, **options)
    assert measured <= budget
    rep = memcompile.report(compiled)
    assert rep.predicted_peak == measured
    (plan,) = rep.plan.fragments
    assert len([op for op in plan.row_tiled if "gelu_backward" in op]) == 8
    return rep


def test_row_tiling_lowers_branchys_smallest_plan_and_trains_bit_identically(monkeypatch):
    recompute = dict(swap=False, offload_params=False, pilot="off")
    untiled = _floor(monkeypatch, False, **recompute)
    tiled = _floor(monkeypatch, True, **recompute)
    assert tiled < untiled
    budget = (tiled + untiled) // 2
    rep = _train_within("branchy", budget, **recompute)
    # The record survives JSON.
    assert MemoryPlan.from_json(rep.plan.to_json()) == rep.plan
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(row_tiling=False))
    with pytest.raises(memcompile.MemoryBudgetError):
        train_under_budget("branchy", "adam", budget, **recompute)


def test_each_built_graph_is_searched_for_tilings_once_for_both_matmul_allowances(monkeypatch):
    # _same_tilings, the skip's bound and the rewrite with 0 and with MAX_KEPT_MATMULS matmuls
    # made again ask for the same decisions: each graph is searched once, for both allowances.
    searched: list[tuple[fx.GraphModule, tuple[int, ...], int, int]] = []
    real = tiling_find.find_row_tilings_each

    def counting(gm, allowances, *, blocks=tiling_find.BLOCKS, start=0, stop=None):
        stop = len(gm.graph.nodes) if stop is None else stop
        searched.append((gm, tuple(allowances), start, stop))  # keeps gm alive: ids not reused
        return real(gm, allowances, blocks=blocks, start=start, stop=stop)

    def alone(gm, **kwargs):
        raise AssertionError("row_tile_pass searched a graph itself")

    monkeypatch.setattr(tiling_build, "find_row_tilings", alone)
    monkeypatch.setattr(built, "find_row_tilings_each", counting)
    _floor(monkeypatch, True, swap=False, offload_params=False, pilot="off")
    assert searched
    assert {k for _, ks, _, _ in searched for k in ks} == {0, tiling_find.MAX_KEPT_MATMULS}
    ops = [(id(gm), i) for gm, _, start, stop in searched for i in range(start, stop)]
    assert len(ops) == len(set(ops)), "an op was searched twice"


def test_one_search_for_both_allowances_finds_what_each_finds_alone():
    for fn in (_mlp_backward, _branch_backward, _forward_read_early):
        gm = _trace(fn)
        both = tiling_find.find_row_tilings_each(gm, (0, 1), blocks=4)
        assert both[0] == find_row_tilings(gm, blocks=4, max_kept_matmuls=0)
        assert both[1] == find_row_tilings(gm, blocks=4, max_kept_matmuls=1)
    # (Tilings that make a matmul again differ between the two: the MLP's kept pre-activation.)
    gm = _trace(_mlp_backward)
    both = tiling_find.find_row_tilings_each(gm, (0, 1), blocks=4)
    assert both[0] != both[1]


def test_a_swapping_plan_over_its_target_falls_back_to_recomputing(monkeypatch):
    # With no reload read by rows, tiling acts on values the graphs make only: with swaps
    # allowed the smallest plan is still no larger than recomputing alone.
    monkeypatch.setattr(tiling_find, "_reloaded", lambda *a, **k: set())
    host = dict(offload_params=True, pilot="off")
    assert _floor(monkeypatch, True, **host) <= _floor(monkeypatch, True, swap=False, **host)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_swapping_plan_reloads_by_rows_below_the_recomputing_floor(monkeypatch, tier):
    # Branchy (tiny): each branch's swapped pre-activation is reloaded a block of rows at a
    # time for the GELU's gradient, so swapping (no recomputation) fits where recomputing does
    # not. On the disk tier the planner's own plan recomputes: the compiler also plans
    # swapping instead, and keeps that.
    host = dict(offload_params=True, pilot="off", offload_to=tier)
    swapping = _floor(monkeypatch, True, **host)
    recomputing = _floor(monkeypatch, True, swap=False, **host)
    assert swapping < recomputing
    budget = (swapping + recomputing) // 2
    (plan,) = _train_within("branchy", budget, **host).plan.fragments
    assert len(plan.swapped) == 8 and not plan.recomputed
    monkeypatch.setattr(tiling_find, "_reloaded", lambda *a, **k: set())
    with pytest.raises(memcompile.MemoryBudgetError):
        train_under_budget("branchy", "adam", budget, **host)


def test_gpts_mlp_backward_is_tiled_below_its_floor_and_trains_bit_identically(monkeypatch):
    # GPT (small) under a budget no plan meets (best effort, warned): its smallest plan makes
    # the MLP backward's GELU gradient by blocks from a recomputed pre-activation that stays
    # for the GELU (kept), the matmuls by rows probed bit-identical on this CPU.
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(row_tiling=True))
    # Bit-identical to eager over 3 Adam steps (train_under_budget asserts it).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memcompile.MemoryBudgetWarning)  # the measured step's
        compiled, _, measured = train_under_budget(
            "gpt",
            "adam",
            1,
            size="small",
            over_budget=True,
            on_infeasible="best_effort",
            swap=False,
            offload_params=False,
        )
    rep = memcompile.report(compiled)
    assert measured == rep.predicted_peak
    (plan,) = rep.plan.fragments
    assert [op for op in plan.row_tiled if "gelu_backward" in op], plan.row_tiled


def test_whether_a_leaf_views_as_rows_is_torchs_answer_for_its_layout() -> None:
    # Asked of layouts (cached), not of fake tensors: a recurrence asks it of a few layouts
    # hundreds of times.
    _views_as.cache_clear()
    assert _views_as((4, 6, 8), (48, 8, 1), 24)  # contiguous
    assert not _views_as((4, 6, 8), (8, 32, 1), 24)  # batch and time transposed
    assert _views_as((4, 1, 8), (8, 8, 1), 4)  # a size-1 dimension's stride is free
    assert _views_as((4, 6, 8), (48, 8, 1), 24)
    assert _views_as.cache_info().hits == 1
    x = torch.randn(6, 4, 8).transpose(0, 1)
    assert (x.shape, x.stride()) == ((4, 6, 8), (8, 32, 1))
    with pytest.raises(RuntimeError):
        x.view(24, 8)  # torch agrees with the second answer


@pytest.mark.slow
def test_hand_written_attention_trains_bit_identically_with_its_value_gradient_by_blocks():
    # The zoo's hand-written attention GPT (small) with the host tier, at its smallest plan:
    # each layer's value gradient is made by the blocks that make its probabilities (absorbed
    # readers) and its values reloaded by batches; 3 Adam steps equal eager's bit for bit, and
    # the allocator measures the predicted peak.
    compiled, _, measured = train_under_budget(
        "gpt_manual",
        "adam",
        1,
        size="small",
        over_budget=True,
        offload_params=True,
        pilot="off",
        on_infeasible="best_effort",
    )
    rep = memcompile.report(compiled)
    assert rep.predicted_peak == measured
    (fragment,) = rep.fragments
    assert fragment.profile.backward is not None
    targets = [n.target for n in fragment.profile.backward.nodes]
    assert targets.count("aten.bmm.out") == 4 * tiling_find.BLOCKS  # 4 layers' value gradients


def test_tiling_changes_name_what_the_blocks_replace_and_what_they_hold_for_less_time():
    # GPT's MLP backward: the recomputed pre-activation stays for the GELU (kept: held for less
    # time, not replaced); the rest of the chain and the GELU's gradient are replaced.
    gm = _trace(_mlp_backward)
    tilings = find_row_tilings(gm, blocks=4, max_kept_matmuls=1)
    (found,) = [t for t in tilings if t.op == "aten.gelu_backward.default"]
    assert found.kept
    replaced, until = tiling_build.tiling_changes(gm, (found,))
    assert replaced == (set(found.chain) - set(found.kept)) | {found.node}
    # Held for less time, up to the op: the chain (its kept values too), not the op's result.
    assert until == dict.fromkeys(set(found.chain), found.node)
    assert tiling_build.tiling_changes(gm, ()) == (frozenset(), {})


def test_the_bound_on_the_tiled_peak_is_never_above_the_tiled_graphs_peak():
    from memcompile.analysis.graph import profile_graph

    gm = _trace(_branch_backward)
    tilings = find_row_tilings(gm, blocks=4)
    tiled = row_tile_pass(gm, CTX, blocks=4)
    before = profile_graph(gm, kind="backward")
    after = profile_graph(tiled, kind="backward")
    bound = built._least_tiled_peak(gm, before, tilings)
    assert after.peak_bytes < before.peak_bytes  # the blocks lower it here
    assert bound.least <= after.peak_bytes
    assert all(b <= after.peak_bytes for b in bound.blocks.values())


def _summed_gradients(g0, g1, g2, x):
    # An unrolled recurrent net's backward: an input's gradient summed over the time steps
    # that read it, each step's gradient made whole by select_backward as it comes (the
    # LSTM's, issue 41); the in-place pass then writes the sums into the dying gradients.
    shape = [B, T, H]
    acc = aten.add.Tensor(
        aten.select_backward.default(g0, shape, 1, 0),
        aten.select_backward.default(g1, shape, 1, 1),
    )
    acc = aten.add.Tensor(acc, aten.select_backward.default(g2, shape, 1, 2))
    return aten.mm.default(aten.t.default(aten.view.default(acc, [N, H])), x)


def _summed_gradients_built():
    from memcompile.rewrites.inplace import in_place_pass

    inputs = [torch.randn(B, H) for _ in range(3)] + [torch.randn(N, K)]
    gm = make_fx(_summed_gradients, tracing_mode="fake")(*inputs)
    return in_place_pass(gm, CTX, built=True)


def test_blocks_that_would_hold_more_than_the_peak_are_not_built():
    # The second sum's blocks read all three gradients whole and write a new buffer, where the
    # sums were written into the gradients as they died: the blocks cannot lower the peak.
    from types import SimpleNamespace

    from memcompile.analysis.graph import profile_graph
    from memcompile.rewrites.inplace import in_place_pass

    gm = _summed_gradients_built()
    (found,) = find_row_tilings(gm, max_kept_matmuls=0)
    assert len(found.leaves) == 3
    before = profile_graph(gm, kind="backward")
    tiled = in_place_pass(row_tile_pass(gm, CTX, decided=(found,)), CTX, built=True)
    after = profile_graph(tiled, kind="backward")
    assert after.peak_bytes > before.peak_bytes  # built, it is rejected
    bound = built._least_tiled_peak(gm, before, (found,))
    # Whatever the pass makes of the tiling, the bound is under the peak; with the blocks, over.
    assert bound.least < before.peak_bytes <= bound.blocks[found.node] <= after.peak_bytes
    assert tiling_build.made_by_own_blocks(gm, (found,), found.node)
    phases = {"forward": 0, "backward": before.peak_bytes, "accumulate": 0}
    profile = SimpleNamespace(forward=None, backward=before, phase_peaks=lambda: phases)
    assert built._tiling_cannot_lower(profile, gm, gm, 0, built.TilingSearch())


def test_blocks_the_probe_would_leave_whole_do_not_count(monkeypatch):
    from types import SimpleNamespace

    from memcompile.analysis.graph import profile_graph

    gm = _summed_gradients_built()
    before = profile_graph(gm, kind="backward")
    monkeypatch.setattr(tiling_build, "tiles_exactly", lambda *a: False)
    (found,) = find_row_tilings(gm, max_kept_matmuls=0)
    assert not tiling_build.made_by_own_blocks(gm, (found,), found.node)
    phases = {"forward": 0, "backward": before.peak_bytes, "accumulate": 0}
    profile = SimpleNamespace(forward=None, backward=before, phase_peaks=lambda: phases)
    assert not built._tiling_cannot_lower(profile, gm, gm, 0, built.TilingSearch())


def test_an_op_another_chain_makes_is_not_made_by_its_own_blocks():
    # The GELU's gradient's chain makes the scaled gradient and the pre-activation: were one of
    # them an op of its own, the pass would make it with that chain.
    gm = _trace(_branch_backward)
    (found,) = find_row_tilings(gm, blocks=4)
    inner = dataclasses.replace(found, node=found.chain[-1], chain=found.chain[:-1])
    assert tiling_build.made_by_own_blocks(gm, (found,), found.node)
    assert not tiling_build.made_by_own_blocks(gm, (inner, found), inner.node)


#: The stand-in profile's peak: above any value of the traced graphs (a tiled op's result
#: buffer alone does not reach it).
PEAK = 1 << 30


def _profile_at(gm: fx.GraphModule, peak_at: str, *, accumulate: bool = False, new: int = 0):
    """A stand-in for the built graphs' FragmentProfile: ``gm`` as the backward, at its peak
    (:data:`PEAK` bytes) at node ``peak_at`` only, which allocates ``new`` bytes there; the
    accumulation at the peak too with ``accumulate``."""
    from types import SimpleNamespace

    nodes = tuple(
        SimpleNamespace(
            name=n.name,
            live_bytes=PEAK if n.name == peak_at else 10,
            storages=(),
            new_bytes=new if n.name == peak_at else 0,
            workspace_bytes=0,
        )
        for n in gm.graph.nodes
    )
    backward = SimpleNamespace(nodes=nodes, peak_bytes=PEAK, storages=())
    peaks = {"forward": 50, "backward": PEAK, "accumulate": PEAK if accumulate else 20}
    return SimpleNamespace(forward=None, backward=backward, phase_peaks=lambda: peaks)


def test_tiling_is_skipped_only_where_no_tiling_can_lower_the_peak():
    gm = _trace(_branch_backward)
    (found,) = find_row_tilings(gm, blocks=4)
    search = built.TilingSearch()
    after = next(n.name for n in gm.graph.find_nodes(op="call_function", target=aten.mm.default))
    # Held after the op by a node the blocks keep, by values they do not touch: not lowered.
    assert built._tiling_cannot_lower(_profile_at(gm, after), gm, gm, 0, search)
    # Held at the op, which the blocks replace: it may be.
    assert not built._tiling_cannot_lower(_profile_at(gm, found.node), gm, gm, 0, search)
    # The accumulation (outputs and what the graph holds at its end) is at the peak as well.
    assert built._tiling_cannot_lower(
        _profile_at(gm, found.node, accumulate=True), gm, gm, 0, search
    )


def test_a_peak_at_a_node_the_in_place_pass_may_rewrite_counts_without_its_new_bytes():
    # After the blocks tile_rows runs the in-place pass, which lowers the nodes it rewrites
    # (here the forward's GELU, writing into its dying input) by their new bytes.
    gm = _trace(_branch_forward)
    (gelu,) = gm.graph.find_nodes(op="call_function", target=aten.gelu.default)
    (mean,) = gm.graph.find_nodes(op="call_function", target=aten.mean.dim)
    search = built.TilingSearch()
    allowances = (0, tiling_find.MAX_KEPT_MATMULS)
    search._found[(gm, allowances)] = (0, dict.fromkeys(allowances, ()))  # no tiling at all
    new = PEAK - 5
    assert not built._tiling_cannot_lower(_profile_at(gm, gelu.name, new=new), gm, gm, 0, search)
    assert built._tiling_cannot_lower(_profile_at(gm, gelu.name, new=0), gm, gm, 0, search)
    # The mean is not one the pass rewrites.
    assert built._tiling_cannot_lower(_profile_at(gm, mean.name, new=new), gm, gm, 0, search)


def test_the_search_of_a_range_of_ops_finds_what_the_whole_search_finds_there():
    # Each op's tiling is its own: the search split anywhere finds the same tilings.
    for fn in (_mlp_backward, _branch_backward, _forward_read_early):
        gm = _trace(fn)
        whole = tiling_find.find_row_tilings_each(gm, (0, 1), blocks=4)
        n = len(gm.graph.nodes)
        for cut in range(n + 1):
            head = tiling_find.find_row_tilings_each(gm, (0, 1), blocks=4, stop=cut)
            tail = tiling_find.find_row_tilings_each(gm, (0, 1), blocks=4, start=cut)
            assert {k: head[k] + tail[k] for k in (0, 1)} == whole
        # The fragment's search asked for the ops from a peak first, then for all of them.
        search = built.TilingSearch()
        search(gm, 0, start=n // 2)
        assert search(gm, 0) == find_row_tilings(gm, max_kept_matmuls=0)
        assert search(gm, 1) == find_row_tilings(gm, max_kept_matmuls=1)


def test_the_skip_searched_from_the_peak_decides_as_the_bound_over_every_tiling():
    # Only the tilings of ops from the first node at the peak on can lower that node's count:
    # the skip, which searches those only, decides as the bound with all of them would.
    for fn in (_mlp_backward, _branch_backward, _forward_read_early):
        gm = _trace(fn)
        every = find_row_tilings(gm, max_kept_matmuls=0)
        for n in gm.graph.nodes:
            profile = _profile_at(gm, n.name)
            whole = built._least_tiled_peak(gm, profile.backward, every).least >= PEAK
            search = built.TilingSearch()
            assert built._tiling_cannot_lower(profile, gm, gm, 0, search) == whole
