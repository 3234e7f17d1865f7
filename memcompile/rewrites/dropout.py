"""Make dropout outputs recomputable: rebuild them from the saved mask instead of the random op.

A dropout in AOT's joint graph is one random op with two outputs, and autograd saves the mask
for ``native_dropout_backward``:

    nd   = aten.native_dropout(x, p, train)       random: draws from the generator
    out  = nd[0]                                  -> every forward user of the output
    mask = nd[1]                                  -> native_dropout_backward(grad, mask, scale)

Random ops are never recomputed (recomputing would draw new numbers), so ``out`` and everything
computed from it (GPT's residual stream) must be saved whenever the backward needs them. This
pass rewrites the output as a pure function of ``x`` and the mask:

    nd   = aten.native_dropout(x, p, train)       still draws the mask (same random stream)
    mask = nd[1]
    dropout_masked = aten.mul.Tensor(x, mask)
    dropout_scaled = aten.mul.Tensor(dropout_masked, scale)   -> the users of ``out``

so the planner may recompute ``dropout_scaled`` (and what depends on it) in the backward from
``x`` and the mask (1 byte per element, kept). ``nd[0]`` is dropped right after the op.

Bit-identity. The values are the kernel's own arithmetic, replayed:

* CPU (``native_dropout_cpu``, aten/src/ATen/native/Dropout.cpp): ``input.mul(mask).mul_(scale)``
  with ``scale = 1 / (1 - p)`` (0 when ``p == 1``) as a C++ double. ``mul_`` by a Scalar rounds
  the scale to the tensor's dtype first (seen for float16/bfloat16: multiplying by the double
  scale differs in the last bit for p = 0.1), so ``scale`` here is that rounded value; for
  float32/float64 the rounding is what the kernel does anyway.
* CUDA (``fused_dropout_kernel[_vec]``, aten/src/ATen/native/cuda/Dropout.cu): one fused kernel
  computing ``src * keep * scale`` in the accumulate type with ``scale = accscalar_t(1.0 /
  accscalar_t(1 - p))`` (float for float32/float16/bfloat16, double for float64), rounded once to
  the output dtype; ``p == 1`` returns zeros without drawing, ``train=False`` a clone. The scale
  here follows that formula: on an H100 (torch 2.11, CUDA 13) ``mul`` by it matched the fused
  kernel bit for bit for all four dtypes, 204 values of p, contiguous and strided inputs, where
  the double ``1/(1-p)`` missed a quarter of the p for float32 (benchmarks/dropout_identity.py,
  results in benchmarks/results/dropout_recompute.md).

Other devices, non-floating dtypes, ``p == 1`` on CUDA and ``train=False`` are left alone.
The rewrite costs two elementwise multiplies per dropout in the forward (``nd[0]`` is still
computed) and one more activation-sized transient while they run, so the backend applies it
only when a budget cannot be met without it (see ``pipeline/fragment.py``).

**Replayed masks** (``replay=True``, CPU, static shapes). The mask itself is recomputed too, by
drawing it again from the generator's state (``runtime/rng.py``):

    dropout_state  = memcompile.dropout_draw(x, p)     random: the state, then native_dropout's draw
    dropout_replay = memcompile.dropout_replay(dropout_state, size, stride, p)   pure: the mask
    dropout_masked = aten.mul.Tensor(x, dropout_replay)
    dropout_scaled = aten.mul.Tensor(dropout_masked, scale)

``native_dropout`` is gone; the generator advances exactly as it did. The planner may keep the
5 KiB state instead of the mask (1 byte per element) and replay the mask in the backward. It
costs a second draw per dropout in the forward, and one per replay, so the backend tries it
only after the saved-mask rewrite misses the budget.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import copy_node, rebuilt_module
from memcompile.runtime.rng import STATE_BYTES

log = logging.getLogger(__name__)

__all__ = ["DropoutRewrite", "dropout_pass", "dropout_scale", "saved_after"]

aten = torch.ops.aten

#: Name prefixes of the nodes the pass creates (plans and tests recognise them by these).
MASKED_PREFIX = "dropout_masked"
SCALED_PREFIX = "dropout_scaled"
STATE_PREFIX = "dropout_state"
MASK_PREFIX = "dropout_replay"

_DRAW = torch.ops.memcompile.dropout_draw.default
_REPLAY = torch.ops.memcompile.dropout_replay.default


@dataclass(frozen=True)
class DropoutRewrite:
    """One rewritten dropout: node names in the input graph (``dropout``, ``replaced_output``,
    ``replaced_mask``) and in the rewritten one (``output``, ``mask``, ``state``)."""

    #: The random op.
    dropout: str
    #: The node that now carries its output (``dropout_scaled``).
    output: str
    #: The op's output and mask getitems.
    replaced_output: str
    replaced_mask: str
    #: The mask's node now: the op's mask getitem, or the replayed mask.
    mask: str
    #: The generator state the mask is replayed from (``replay=True``), else ``None``.
    state: str | None = None


def saved_after(names: Collection[str], rewrites: Sequence[DropoutRewrite]) -> frozenset[str]:
    """A saved set named in the input graph, named in the rewritten one: a dropout's output is
    now its rebuilt product; a replayed mask is kept as the state it is replayed from. Plans of
    the rewritten graph start from the input graph's plan this way (``planner.py``'s ``start``):
    the same choices, with each replayed mask's bytes taken off."""
    out = set(names)
    for r in rewrites:
        if r.replaced_output in out:
            out.discard(r.replaced_output)
            out.add(r.output)
        if r.state is not None and r.replaced_mask in out:
            out.discard(r.replaced_mask)
            out.add(r.state)
    return frozenset(out)


def dropout_scale(p: float, dtype: torch.dtype, device_type: str) -> float | None:
    """The scalar that ``mul(mul(x, mask), scale)`` needs to equal ``native_dropout(x, p)[0]``
    bit for bit on ``device_type``, or ``None`` where that is not known to hold."""
    if not dtype.is_floating_point:
        return None
    p1m = 1.0 - p
    if device_type == "cpu":
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        # mul_(Scalar) converts the scale to the tensor's dtype before multiplying.
        return float(torch.tensor(scale, dtype=dtype).item())
    if device_type == "cuda":
        if p1m <= 0:  # p == 1: zeros_like, not x * 0 (signs of zero and NaNs would differ)
            return None
        if dtype == torch.float64:
            return 1.0 / p1m
        keep = float(torch.tensor(p1m, dtype=torch.float32).item())  # accscalar_t(p1m)
        return float(torch.tensor(1.0 / keep, dtype=torch.float32).item())
    return None


def _fake_op(op: torch._ops.OpOverload, *args: object) -> torch.Tensor:
    # Run the op on the fake values to get the new node's meta['val'] (shapes, strides, storage).
    fake = next(a for a in args if isinstance(a, torch._subclasses.FakeTensor))
    with fake.fake_mode:
        return op(*args)


def _rewritable(nd: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, float, float] | None:
    """(input, output getitem, mask getitem, scale, p) of a dropout the pass can rewrite, else
    None."""
    named = dict(zip(("input", "p", "train"), nd.args, strict=False)) | dict(nd.kwargs)
    x, p, train = named.get("input"), named.get("p"), named.get("train")
    if not isinstance(x, fx.Node) or not isinstance(p, (int, float)) or train is False:
        return None
    getitems = {u.args[1]: u for u in nd.users if u.target is operator.getitem}
    if len(getitems) != len(nd.users) or 0 not in getitems or 1 not in getitems:
        return None
    out_val, x_val = getitems[0].meta.get("val"), x.meta.get("val")
    if not isinstance(out_val, torch._subclasses.FakeTensor) or not isinstance(
        x_val, torch._subclasses.FakeTensor
    ):
        return None
    scale = dropout_scale(float(p), out_val.dtype, out_val.device.type)
    if scale is None:
        return None
    product = _fake_op(
        aten.mul.Tensor, _fake_op(aten.mul.Tensor, x_val, getitems[1].meta["val"]), scale
    )
    # The users (and AOT's output strides) were traced against the op's layout; symbolic sizes
    # are compared without adding guards.
    same = product.dtype == out_val.dtype and all(
        statically_known_true(a == b)
        for a, b in zip(
            (*product.shape, *product.stride()), (*out_val.shape, *out_val.stride()), strict=True
        )
    )
    if not same:
        return None
    return x, getitems[0], getitems[1], scale, float(p)


def _replayable(nd: fx.Node, mask: fx.Node) -> tuple[list[int], list[int]] | None:
    """(size, stride) of the mask a CPU dropout draws, when its mask can be replayed."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return None
    dims = (*val.shape, *val.stride())
    if not all(isinstance(d, int) for d in dims):  # symbolic sizes would need graph nodes
        return None
    return [int(d) for d in val.shape], [int(d) for d in val.stride()]


def dropout_pass(gm: fx.GraphModule, ctx: PassContext, *, replay: bool = False) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` whose dropout outputs are ``x * mask * scale``.

    ``gm`` is not changed (the caller may still partition it). The copy shares the fake values
    of every node it keeps, so storages keep their identity; the new nodes get fresh ones. The
    rewritten dropouts are in the result's ``meta['memcompile_dropouts']`` (a tuple of
    :class:`DropoutRewrite`). ``replay``: where it is supported (CPU, static shapes) the mask is
    drawn again from the generator's saved state instead of kept (module docstring).
    """
    targets: dict[fx.Node, tuple[fx.Node, fx.Node, fx.Node, float, float]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.native_dropout.default:
            found = _rewritable(n)
            if found is None:
                log.debug("%s: %s left alone (no bit-identical rewrite known)", ctx.fragment, n)
            else:
                targets[n] = found
    by_output = {out: (nd, x, mask, scale) for nd, (x, out, mask, scale, _) in targets.items()}
    replays = {}
    if replay:
        for nd, (_, _, mask, _, _) in targets.items():
            layout = _replayable(nd, mask)
            if layout is not None:
                replays[nd] = layout

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    rewrites: list[DropoutRewrite] = []

    def copy(n: fx.Node) -> None:
        env[n] = copy_node(new, n, lambda a: env[a])

    for n in gm.graph.nodes:
        if n in env:  # a mask getitem copied early (below)
            continue
        if n in replays:  # the random op becomes the draw and the replayed mask
            _draw_and_replay(new, env, n, targets[n], replays[n])
            continue
        if n not in by_output:
            copy(n)
            continue
        nd, x, mask, scale = by_output[n]
        if mask not in env:  # it only reads ``nd``, which is copied: take it now
            copy(mask)
        masked = new.create_node(
            "call_function", aten.mul.Tensor, (env[x], env[mask]), name=MASKED_PREFIX
        )
        scaled = new.create_node(
            "call_function", aten.mul.Tensor, (masked, scale), name=SCALED_PREFIX
        )
        masked_val = _fake_op(aten.mul.Tensor, x.meta["val"], mask.meta["val"])
        scaled_val = _fake_op(aten.mul.Tensor, masked_val, scale)
        for node, val in ((masked, masked_val), (scaled, scaled_val)):
            # Provenance (stack trace, module stack, partitioner tag) is the output's.
            node.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
            node.meta["val"] = val
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        env[n] = scaled  # every user of the output reads the product; the getitem is gone
        state = env[mask].args[0] if nd in replays else None
        rewrites.append(
            DropoutRewrite(
                dropout=nd.name,
                output=scaled.name,
                replaced_output=n.name,
                replaced_mask=mask.name,
                mask=env[mask].name,
                state=state.name if isinstance(state, fx.Node) else None,
            )
        )

    out_gm = rebuilt_module(gm, new, "memcompile_dropouts", rewrites)
    log.info(
        "%s: %d of %d dropouts rewritten as x * mask * scale (recomputable; %d masks replayed)",
        ctx.fragment,
        len(rewrites),
        sum(
            1
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target is aten.native_dropout.default
        ),
        len(replays),
    )
    return out_gm


def _draw_and_replay(
    new: fx.Graph,
    env: dict[fx.Node, fx.Node],
    nd: fx.Node,
    found: tuple[fx.Node, fx.Node, fx.Node, float, float],
    layout: tuple[list[int], list[int]],
) -> None:
    """Append ``state = dropout_draw(x, p)`` and ``mask = dropout_replay(state, ...)`` in place
    of ``nd``; the mask getitem's readers get the replayed mask."""
    x, _, mask, _, p = found
    size, stride = layout
    state = new.create_node("call_function", _DRAW, (env[x], p), name=STATE_PREFIX)
    replayed = new.create_node("call_function", _REPLAY, (state, size, stride, p), name=MASK_PREFIX)
    state_val = _fake_op(_DRAW, x.meta["val"], p)
    mask_val = _fake_op(_REPLAY, state_val, size, stride, p)
    for node, val in ((state, state_val), (replayed, mask_val)):
        node.meta = {k: v for k, v in nd.meta.items() if k not in ("val", "tensor_meta")}
        node.meta["val"] = val
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    # Scratch inside the calls (runtime/rng.py): the draw's discarded mask; the generator state
    # the replay puts back afterwards.
    state.meta["memcompile_workspace"] = mask.meta["val"].numel()
    replayed.meta["memcompile_workspace"] = STATE_BYTES
    env[mask] = replayed
