"""Joint accounting of a fragment's forward and backward graphs.

:func:`profile_fragment` profiles both graphs with one shared storage namespace and derives what
crosses the forward→backward boundary. With ``R`` the bytes of every forward input (parameters,
buffers, user inputs), one training step of a single-fragment model peaks at

    R + max( forward peak,
             held outputs + backward peak,      # the loss the caller holds during backward
             held outputs + backward end + largest AccumulateGrad clone )

which is :meth:`FragmentProfile.step_peak`. The backward graph's peak already includes the saved
activations (live on entry, freed at last use) and the gradients it has produced so far.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._prims_common import is_non_overlapping_and_dense_or_false

from memcompile.analysis.graph import (
    GraphProfile,
    StorageIds,
    covers_storage,
    profile_graph,
    sym_to_int,
)

log = logging.getLogger(__name__)

__all__ = [
    "FragmentProfile",
    "ParamGrad",
    "accumulate_clone_bytes",
    "backward_profiler",
    "profile_fragment",
]

_OFFLOAD = torch.ops.memcompile.offload.default


@dataclass(frozen=True)
class ParamGrad:
    """The gradient one backward call produces for one parameter (or buffer).

    Attributes:
        position: the parameter's position among the forward inputs.
        nbytes: bytes of the gradient's storage (0 for a second input sharing it).
        host: the gradient leaves the graph in the host tier (a host-placed parameter's,
            ``rewrites/params.py``): it costs the device nothing until autograd sums it with
            another contribution (see ``analysis/step_model.py``).
    """

    position: int
    nbytes: int
    host: bool = False


@dataclass(frozen=True)
class FragmentProfile:
    """Memory facts of one compiled fragment (forward, and backward when it trains).

    Attributes:
        forward: the forward (or inference) graph's profile.
        backward: the backward graph's profile, ``None`` for inference graphs.
        input_bytes: distinct storage bytes of all forward inputs (held by the caller).
        static_input_bytes: of which parameters and buffers.
        saved_bytes: forward outputs read by the backward (new storages), live between the two.
        held_output_bytes: user-visible outputs not saved for backward; the caller holds them.
        grad_bytes: storages of gradients for parameters/buffers (they become ``.grad``).
        clone_bytes: largest gradient AccumulateGrad copies because its layout differs from the
            parameter's, plus the copy's measured scratch (transient), 0 if none.
        saved_input_bytes: activation inputs (not parameters or buffers) the backward reads:
            autograd keeps them alive until then, whether or not the caller does (in a
            multi-fragment step, a fragment's input is often the last one's output, dropped).
        param_grads: each parameter's gradient, by input position, device and host ones; a
            step with several calls that read one parameter sums them (``analysis/step_model.py``).
        saved_view_inputs: positions of activation inputs the backward reads that are views
            into a larger storage (not in ``saved_input_bytes``): autograd keeps that whole
            storage alive, which the step's replay counts once per storage (by address).
        saved_input_positions: positions of the inputs in ``saved_input_bytes`` (whole
            storages). Calls of one graph often save the same storage (every expert of a layer
            saves the layer's expert input): the step's replay counts each once by address.
        saved_output_positions: positions among the forward's outputs of saved tensors (in
            ``saved_bytes``) that are also user outputs: a later fragment may save the same
            storage (a router's output, which every expert of its layer saves as its input);
            the step's replay counts it once by address.
        activation_grads: ``(position, bytes)`` of each gradient the backward returns for an
            activation input (not a parameter or buffer) in storage it allocates (a gradient
            that is the incoming one passed through costs nothing). Calls reading one input
            (every expert of a layer reads its expert input) add to one gradient, which the
            autograd engine holds between their backwards (``analysis/step_model.py``).
        backward_handed_peak: the backward's peak (as ``backward.peak_bytes``) when its
            incoming gradients die at their last use, as they do when another fragment's
            backward made them: the autograd engine hands them over and AOT's backward keeps no
            reference (measured: a 64 KiB incoming gradient freed right after its last reader).
            ``backward.peak_bytes`` holds them to the end, as for the step's first backward,
            whose gradient the engine's root holds (measured: the loss's).
        held_output_positions: positions among the forward's outputs of the user outputs in
            ``held_output_bytes``: the compiler checks at the step's first backward whether the
            caller still holds them (a training loop that keeps only the loss drops the
            logits), and the step's replay counts only those it does.
        tangent_storages: ``(position, storage ids)`` of each incoming gradient among the
            backward's inputs. ``backward.peak_bytes`` holds them to the end but for the
            ``released`` ones (freed after their last reader); the step's first backward holds
            only those someone else holds too (the engine's root holds the loss's;
            AOTAutograd's zeros for outputs that got no gradient die at their last reader), see
            :meth:`backward_peak_holding`.
        tangent_names: the backward graph's placeholder name of each of those
            (``tangents_1``, ...: the joint graph's names too).
        released: positions of the incoming gradients profiled as freed after their last
            reader (``profile_fragment``'s ``released_tangents``).
        saved_input_reads: ``(position, bytes, node)`` of each whole-storage activation input
            the backward reads (``saved_input_positions``), with the index in
            ``backward.nodes`` of its last reader. The backward's profile counts none of them
            (forward inputs are the caller's); where nothing else holds one (the caller dropped
            it: a multi-fragment step's previous output), autograd frees it after that reader,
            which :meth:`backward_peak_holding` prices when told (``releasing``).
        inner_adjust: ``(forward, backward)`` bytes by which the inner compiler's code peaks
            above (negative: below) these graphs' profile, measured when it compiled them
            (``backends/inner_peak.py``: Inductor fuses, reuses and reorders buffers; the eager
            inner compiler runs the profile exactly, ``(0, 0)``). :attr:`forward_peak`,
            :attr:`backward_peak`, :attr:`handed_peak` and :meth:`backward_peak_holding`
            include it; ``forward`` and ``backward`` (the graphs' node by node profiles) do not.
    """

    forward: GraphProfile
    backward: GraphProfile | None
    input_bytes: int
    static_input_bytes: int
    saved_bytes: int
    held_output_bytes: int
    grad_bytes: int
    clone_bytes: int
    saved_input_bytes: int = 0
    param_grads: tuple[ParamGrad, ...] = ()
    saved_view_inputs: tuple[int, ...] = ()
    saved_input_positions: tuple[int, ...] = ()
    saved_output_positions: tuple[int, ...] = ()
    activation_grads: tuple[tuple[int, int], ...] = ()
    backward_handed_peak: int | None = None
    held_output_positions: tuple[int, ...] = ()
    tangent_storages: tuple[tuple[int, tuple[int, ...]], ...] = ()
    tangent_names: tuple[str, ...] = ()
    released: tuple[int, ...] = ()
    saved_input_reads: tuple[tuple[int, int, int], ...] = ()
    inner_adjust: tuple[int, int] = (0, 0)

    @property
    def training(self) -> bool:
        return self.backward is not None

    @property
    def forward_peak(self) -> int:
        """The forward's tracked peak as the inner compiler's code runs it."""
        return self.forward.peak_bytes + self.inner_adjust[0]

    @property
    def backward_peak(self) -> int:
        """The backward's tracked peak (``backward.peak_bytes``) as the inner compiler's code
        runs it."""
        if self.backward is None:
            raise ValueError("an inference fragment has no backward")
        return self.backward.peak_bytes + self.inner_adjust[1]

    @property
    def handed_peak(self) -> int | None:
        """``backward_handed_peak`` as the inner compiler's code runs it."""
        if self.backward_handed_peak is None:
            return None
        return self.backward_handed_peak + self.inner_adjust[1]

    @property
    def approximate(self) -> bool:
        """Sizes were symbolic (evaluated at the example inputs) or kernel workspaces unmeasured."""
        graphs = [self.forward] + ([self.backward] if self.backward is not None else [])
        return any(g.approximate or not g.workspace_measured for g in graphs)

    def phase_peaks(self) -> dict[str, int]:
        """Tracked peak of each phase, relative to the forward inputs ``R``."""
        peaks = {"forward": self.forward_peak}
        if self.backward is not None:
            peaks["backward"] = self.held_output_bytes + self.backward_peak
            peaks["accumulate"] = (
                self.held_output_bytes + self.backward.end_bytes + self.clone_bytes
            )
        return peaks

    def backward_peak_holding(
        self, held: Collection[int] | None, releasing: Collection[int] = ()
    ) -> int:
        """The backward's peak (as ``backward.peak_bytes``) with only the incoming gradients at
        input positions ``held`` held to the end, the others freed after their last reader
        (``None``: all freed so, as when another fragment's backward made them: the
        ``backward_handed_peak``). ``releasing``: forward input positions of saved activation
        inputs nothing else holds, counted until their last reader (``saved_input_reads``)."""
        if self.backward is None:
            raise ValueError("an inference fragment has no backward")
        return self._holding(held, releasing) + self.inner_adjust[1]

    def _holding(self, held: Collection[int] | None, releasing: Collection[int]) -> int:
        assert self.backward is not None
        inputs = [(b, k) for pos, b, k in self.saved_input_reads if pos in releasing]
        if held is None:
            if self.backward_handed_peak is None:
                return _handed_peak(self.backward, set(), inputs)
            free = {
                s for pos, sids in self.tangent_storages if pos not in self.released for s in sids
            }
            return _handed_peak(self.backward, free, inputs)
        released = set(self.released)
        keep = {s for pos, sids in self.tangent_storages if pos in held for s in sids}
        free = {
            s
            for pos, sids in self.tangent_storages
            if pos not in held and pos not in released
            for s in sids
        }
        # One profiled as freed early but held now: its bytes on top (an upper bound).
        again = {
            s
            for pos, sids in self.tangent_storages
            if pos in held and pos in released
            for s in sids
        }
        extra = sum(st.nbytes for st in self.backward.storages if st.id in again)
        return _handed_peak(self.backward, free - keep, inputs) + extra

    def step_peak(self) -> int:
        """Absolute device peak of a step whose only fragment is this one (grads start as None)."""
        return self.input_bytes + max(self.phase_peaks().values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_bytes": self.input_bytes,
            "static_input_bytes": self.static_input_bytes,
            "saved_bytes": self.saved_bytes,
            "held_output_bytes": self.held_output_bytes,
            "grad_bytes": self.grad_bytes,
            "clone_bytes": self.clone_bytes,
            "phase_peaks": self.phase_peaks(),
            "approximate": self.approximate,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict() if self.backward is not None else None,
        }


def _handed_peak(
    bw: GraphProfile, tangents: set[int], inputs: Sequence[tuple[int, int]] = ()
) -> int:
    """``bw``'s peak had the storages ``tangents`` (held to the end in ``bw``) been freed
    after their last reader (a node reading a value that aliases them), and with ``inputs``
    (``(bytes, node index)``: untracked inputs) counted up to and including their last reader."""
    if inputs:
        base = _handed_curve(bw, tangents)
        return max(
            (lv + sum(b for b, last in inputs if k <= last) for k, lv in enumerate(base)),
            default=0,
        )
    if not tangents:
        return bw.peak_bytes
    return max(_handed_curve(bw, tangents), default=0)


def _handed_curve(bw: GraphProfile, tangents: set[int]) -> list[int]:
    """Each node's live bytes in ``bw`` had ``tangents`` been freed after their last reader."""
    if not tangents:
        return [n.live_bytes for n in bw.nodes]
    sizes = {st.id: st.nbytes for st in bw.storages if st.id in tangents}
    last = _last_reads(bw)
    return [
        n.live_bytes - sum(b for sid, b in sizes.items() if last.get(sid, -1) < k)
        for k, n in enumerate(bw.nodes)
    ]


def _last_reads(bw: GraphProfile) -> dict[int, int]:
    """Storage id -> index in ``bw.nodes`` of the last node reading a value on it."""
    of = {n.name: n.storages for n in bw.nodes}
    last: dict[int, int] = {}
    for k, n in enumerate(bw.nodes):
        for name in n.inputs:
            for sid in of.get(name, ()):
                last[sid] = k
    return last


def _output_vals(gm: fx.GraphModule) -> list[Any]:
    out = gm.graph.find_nodes(op="output")[0]
    args = out.args[0]
    return [a.meta.get("val") if isinstance(a, fx.Node) else None for a in args]


def _distinct_bytes(ids: StorageIds, vals: Sequence[Any]) -> int:
    seen: dict[int, None] = {}
    for v in vals:
        for sid in ids.ids_of(v):
            seen[sid] = None
    return sum(ids.nbytes(s) for s in seen)


def _needs_clone(grad: torch.Tensor, param: torch.Tensor) -> bool:
    # AccumulateGrad steals a gradient only if it "obeys the layout contract": the parameter's
    # strides when the parameter is non-overlapping and dense, contiguous otherwise.
    try:
        if is_non_overlapping_and_dense_or_false(param):
            return tuple(grad.stride()) != tuple(param.stride())
        return not grad.is_contiguous()
    except Exception:  # symbolic strides that cannot be compared: assume it is stolen
        log.debug("cannot compare gradient and parameter layouts; assuming no clone")
        return False


def accumulate_clone_bytes(
    grads: Sequence[Any],
    params: Sequence[Any],
    static: Collection[int],
    clone_workspace: Callable[[torch.Tensor], int | None] | None = None,
) -> int:
    """Largest transient of AccumulateGrad copying a gradient into its parameter's layout.

    Args:
        grads: ``meta['val']`` of the backward's outputs (aligned with the forward inputs).
        params: ``meta['val']`` of the forward inputs.
        static: positions of parameters and buffers (only their gradients reach AccumulateGrad).
        clone_workspace: measures the copy kernel's scratch (``workspace.clone_workspace``).
    """
    clone = 0
    for i, g in enumerate(grads[: len(params)]):
        param = params[i]
        if i in static and isinstance(g, torch.Tensor) and isinstance(param, torch.Tensor):
            if _needs_clone(g, param):
                n, _ = sym_to_int(g.numel() * g.element_size())
                scratch = clone_workspace(g) if clone_workspace is not None else 0
                clone = max(clone, n + (scratch or 0))
    return clone


@dataclass(frozen=True)
class _ForwardSide:
    """What :func:`profile_fragment` learns from the forward graph alone; ``ids`` as they stand
    once it has (the backward's storages are numbered after these)."""

    fw: GraphProfile
    ids: StorageIds
    in_vals: list[Any]
    input_bytes: int
    static: list[Any]
    static_input_bytes: int
    outs: list[Any]
    tracked_user: list[int]
    fw_out_ids: frozenset[int]


def _forward_side(
    fw_gm: fx.GraphModule,
    *,
    training: bool,
    static_input_indices: Sequence[int],
    num_mutated_inputs: int,
    num_user_outputs: int,
    forward_workspace: Mapping[str, int] | None,
) -> _ForwardSide:
    ids = StorageIds()
    placeholders = fw_gm.graph.find_nodes(op="placeholder")
    fw = profile_graph(
        fw_gm,
        kind="forward" if training else "inference",
        persistent_inputs=range(len(placeholders)),
        ids=ids,
        workspace=forward_workspace,
    )
    in_vals = [p.meta.get("val") for p in placeholders]
    input_bytes = _distinct_bytes(ids, in_vals)
    static = [in_vals[i] for i in static_input_indices if i < len(in_vals)]
    static_input_bytes = _distinct_bytes(ids, static)
    outs = _output_vals(fw_gm)
    user = outs[num_mutated_inputs : num_mutated_inputs + num_user_outputs]
    tracked_user = [sid for v in user for sid in ids.ids_of(v) if sid not in fw.persistent]
    fw_out_ids = (
        frozenset(sid for v in outs for sid in ids.ids_of(v)) - fw.persistent
        if training
        else frozenset()
    )
    return _ForwardSide(
        fw, ids, in_vals, input_bytes, static, static_input_bytes, outs, tracked_user, fw_out_ids
    )


@dataclass(frozen=True)
class _BackwardSide:
    bw: GraphProfile
    placeholders: list[fx.Node]
    tangents: list[int]  # positions of incoming gradients among the placeholders
    tangent_ids: dict[int, tuple[int, ...]]
    held_tangents: list[int]


def _backward_side(
    front: _ForwardSide,
    ids: StorageIds,
    bw_gm: fx.GraphModule,
    released_tangents: Collection[str],
    backward_workspace: Mapping[str, int] | None,
    *,
    costs: bool = True,
) -> _BackwardSide:
    fw = front.fw
    bw_placeholders = bw_gm.graph.find_nodes(op="placeholder")
    # Backward inputs that are not saved forward values are incoming gradients (tangents):
    # autograd holds them until the backward call returns.
    tangents = [
        i
        for i, p in enumerate(bw_placeholders)
        if not set(ids.ids_of(p.meta.get("val"))) & (front.fw_out_ids | fw.persistent)
    ]
    bw_tangent_ids = {i: ids.ids_of(bw_placeholders[i].meta.get("val")) for i in tangents}
    held_tangents = [i for i in tangents if bw_placeholders[i].name not in released_tangents]
    bw = profile_graph(
        bw_gm,
        kind="backward",
        held_inputs=held_tangents,
        persistent_storages=fw.persistent,
        ids=ids,
        workspace=backward_workspace,
        costs=costs,
    )
    return _BackwardSide(bw, bw_placeholders, tangents, bw_tangent_ids, held_tangents)


def backward_profiler(
    fw_gm: fx.GraphModule,
    *,
    static_input_indices: Sequence[int],
    num_mutated_inputs: int,
    num_user_outputs: int,
    forward_workspace: Mapping[str, int] | None = None,
    released_tangents: Collection[str] = (),
    costs: bool = True,
) -> Callable[[fx.GraphModule, Mapping[str, int] | None], GraphProfile]:
    """``profile_fragment(fw_gm, bw_gm, ...).backward`` for many backward graphs of one forward
    (a pass's trial rewrites of the backward), given each its workspace: the forward is
    profiled once, and each backward numbered from a copy of the storage ids as
    :func:`profile_fragment` has them then, so the profiles are the same (the GRU small's
    forward, as long as its backward, was profiled again by every trial). ``costs``: as
    :func:`~memcompile.analysis.graph.profile_graph`'s, for the backwards (``False``: their
    memory only)."""
    front = _forward_side(
        fw_gm,
        training=True,
        static_input_indices=static_input_indices,
        num_mutated_inputs=num_mutated_inputs,
        num_user_outputs=num_user_outputs,
        forward_workspace=forward_workspace,
    )

    def profile(bw_gm: fx.GraphModule, workspace: Mapping[str, int] | None) -> GraphProfile:
        side = _backward_side(
            front, front.ids.copy(), bw_gm, released_tangents, workspace, costs=costs
        )
        return side.bw

    return profile


def profile_fragment(
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule | None,
    *,
    static_input_indices: Sequence[int],
    num_mutated_inputs: int,
    num_user_outputs: int,
    forward_workspace: Mapping[str, int] | None = None,
    backward_workspace: Mapping[str, int] | None = None,
    clone_workspace: Callable[[torch.Tensor], int | None] | None = None,
    dropped_outputs: Collection[int] = (),
    released_tangents: Collection[str] = (),
) -> FragmentProfile:
    """Profile a fragment's graphs as AOTAutograd hands them to the inner compiler.

    Args:
        fw_gm: forward (or inference) graph; its placeholders are the fragment's flat inputs.
        bw_gm: backward graph, or ``None`` for an inference fragment.
        static_input_indices: positions of parameters and buffers among the inputs.
        num_mutated_inputs: leading forward outputs that are new values of mutated inputs
            (copied back by AOT's epilogue, then dropped).
        num_user_outputs: the user-visible outputs after those (intermediate bases included).
        forward_workspace, backward_workspace: measured kernel scratch per node name of each
            graph (see analysis/workspace.py); ``None``: not measured (the profile says so).
        clone_workspace: measures the scratch of AccumulateGrad's copy of a gradient (a fake
            tensor) into its parameter's layout; counted with the largest such copy.
        dropped_outputs: positions among the forward's outputs of user outputs the caller
            drops before the backward: not in ``held_output_bytes`` (still listed in
            ``held_output_positions``, so a step that holds them again is seen).
        released_tangents: names of incoming gradients (backward placeholders) no one else
            holds through the backward (a step showed it: AOTAutograd's zeros for an output
            that got no gradient), freed after their last reader; the others are held to the
            end (the loss's, which the engine's root holds).
    """
    front = _forward_side(
        fw_gm,
        training=bw_gm is not None,
        static_input_indices=static_input_indices,
        num_mutated_inputs=num_mutated_inputs,
        num_user_outputs=num_user_outputs,
        forward_workspace=forward_workspace,
    )
    ids, fw, in_vals, outs = front.ids, front.fw, front.in_vals, front.outs
    input_bytes, static_input_bytes = front.input_bytes, front.static_input_bytes
    static, tracked_user, fw_out_ids = front.static, front.tracked_user, front.fw_out_ids
    if bw_gm is None:
        held = sum(ids.nbytes(s) for s in dict.fromkeys(tracked_user))
        return FragmentProfile(fw, None, input_bytes, static_input_bytes, 0, held, 0, 0)

    back = _backward_side(front, ids, bw_gm, released_tangents, backward_workspace)
    bw, bw_placeholders, tangents = back.bw, back.placeholders, back.tangents
    bw_tangent_ids, held_tangents = back.tangent_ids, back.held_tangents
    bw_in_ids = [sid for p in bw_placeholders for sid in ids.ids_of(p.meta.get("val"))]
    saved = dict.fromkeys(s for s in bw_in_ids if s in fw_out_ids)
    saved_bytes = sum(ids.nbytes(s) for s in saved)
    static_ids = {sid for v in static for sid in ids.ids_of(v)}
    # Only inputs that are their whole storage: a view into a larger one (a row of an
    # embedding table's output, read by every call of a tree cell) keeps that storage alive,
    # but counting it once per call would count it many times over: such inputs are listed
    # (saved_view_inputs) for the step's replay, which counts each storage once by address.
    activation_ids = {
        sid for v in in_vals if covers_storage(v) for sid in ids.ids_of(v)
    } - static_ids
    saved_inputs = dict.fromkeys(s for s in bw_in_ids if s in activation_ids)
    saved_input_bytes = sum(ids.nbytes(s) for s in saved_inputs)
    static_set = set(static_input_indices)
    bw_in_set = set(bw_in_ids)
    saved_positions = tuple(
        i
        for i, v in enumerate(in_vals)
        if i not in static_set
        and covers_storage(v)
        and any(s in saved_inputs for s in ids.ids_of(v))
    )
    saved_views = tuple(
        i
        for i, v in enumerate(in_vals)
        if i not in static_set
        and isinstance(v, torch.Tensor)
        and not covers_storage(v)
        and any(s in bw_in_set for s in ids.ids_of(v))
    )
    held_positions = tuple(
        j
        for j in range(num_mutated_inputs, num_mutated_inputs + num_user_outputs)
        if isinstance(outs[j], torch.Tensor)
        and any(s not in saved and s not in fw.persistent for s in ids.ids_of(outs[j]))
    )
    kept_user = {
        s
        for j in held_positions
        if j not in dropped_outputs
        for s in ids.ids_of(outs[j])
        if s not in saved and s not in fw.persistent
    }
    held = sum(ids.nbytes(s) for s in kept_user)
    user_ids = set(tracked_user)
    shared_outputs = tuple(
        j
        for j in range(num_mutated_inputs + num_user_outputs, len(outs))
        if isinstance(outs[j], torch.Tensor)
        and covers_storage(outs[j])
        and any(sid in saved and sid in user_ids for sid in ids.ids_of(outs[j]))
    )

    # Backward outputs line up with the forward inputs (None where no gradient flows).
    grads = _output_vals(bw_gm)
    grad_nodes = bw_gm.graph.find_nodes(op="output")[0].args[0]
    grad_sids: dict[int, None] = {}
    param_grads: list[ParamGrad] = []
    counted: set[int] = set()
    activation_grads: list[tuple[int, int]] = []
    for i, g in enumerate(grads[: len(in_vals)]):
        if not isinstance(g, torch.Tensor):
            continue
        if i not in static_set:
            fresh = [
                s
                for s in ids.ids_of(g)
                if s not in bw_in_set and s not in counted and s not in fw.persistent
            ]
            counted.update(fresh)
            if fresh:
                activation_grads.append((i, sum(ids.nbytes(s) for s in fresh)))
            continue
        # Gradients of host-placed parameters leave through memcompile::offload
        # (rewrites/params.py): they are host-tier memory, never part of the device's grads.
        node = grad_nodes[i]
        host = isinstance(node, fx.Node) and node.target is _OFFLOAD
        sids = [s for s in ids.ids_of(g) if s not in counted]
        counted.update(sids)
        param_grads.append(ParamGrad(i, sum(ids.nbytes(s) for s in sids), host))
        if not host:
            grad_sids.update(dict.fromkeys(sids))
    clone = accumulate_clone_bytes(grads, in_vals, static_set, clone_workspace)
    grad_bytes = sum(ids.nbytes(s) for s in grad_sids)
    log.debug(
        "fragment: inputs %d B (static %d B), saved %d B, held %d B, grads %d B, clone %d B",
        input_bytes,
        static_input_bytes,
        saved_bytes,
        held,
        grad_bytes,
        clone,
    )
    reads = _last_reads(bw)
    return FragmentProfile(
        fw,
        bw,
        input_bytes,
        static_input_bytes,
        saved_bytes,
        held,
        grad_bytes,
        clone,
        saved_input_bytes=saved_input_bytes,
        param_grads=tuple(param_grads),
        saved_view_inputs=saved_views,
        saved_input_positions=saved_positions,
        saved_output_positions=shared_outputs,
        activation_grads=tuple(activation_grads),
        backward_handed_peak=_handed_peak(
            bw, {s for i in held_tangents for s in bw_tangent_ids[i]}
        ),
        held_output_positions=held_positions,
        tangent_storages=tuple((i, tuple(bw_tangent_ids[i])) for i in tangents),
        tangent_names=tuple(bw_placeholders[i].name for i in tangents),
        released=tuple(i for i in tangents if i not in held_tangents),
        saved_input_reads=tuple(
            (i, sum(ids.nbytes(s) for s in sids), max((reads.get(s, -1) for s in sids), default=-1))
            for i in saved_positions
            for sids in [set(ids.ids_of(in_vals[i]))]
        ),
    )
