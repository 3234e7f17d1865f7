"""Predict the device peak of a whole training step from its fragments' profiles.

Replays the observed call sequence of one step (``F0.fw F1.fw … F1.bw F0.bw``) over the fragments'
:class:`FragmentProfile` s:

    live = resident (parameters, buffers, the first fragment's inputs)
    F.fw        peak = live + saved(earlier fragments) + F's activation inputs + F.forward peak
                       + outputs of earlier calls the caller still holds
                saved += F.saved + F.saved inputs (autograd keeps the inputs its backward reads;
                         by storage address when known: calls saving one storage hold it once)
    F.bw        peak = live + held outputs + saved(others) + grads so far
                       (held outputs: the last forward's user outputs not saved for the
                       backward, those the caller still held when the backward began)
                       + gradients of activation inputs autograd holds for their producer
                       + max(F.backward peak, F.backward end + accumulate)
                       + outputs of earlier forward calls the caller still holds
                (F.backward peak with its incoming gradients freed at their last use, but for
                the step's first backward, whose gradient the engine's root holds; a kept
                input nothing else holds, which died during it, counted to its last reader)
                saved -= F.saved; grads += F's gradients of parameters without one yet

Gradients are keyed by parameter storage, so fragments that share parameters (a tree cell's
leaf, one-child and n-children graphs; an RNN cell called per time step) hold one gradient
each. What autograd does with a second contribution to a parameter within one backward is
what ``accumulate`` prices: the engine sums the two out of place, so the sum (the parameter's
size) exists next to the old sum and the new gradient (the call's outputs stay alive until all
are summed) before the old one is freed; the largest such sum of the call is its transient
(or the largest AccumulateGrad layout copy, whichever is larger). A host-placed parameter's
gradient arrives in the host tier (``rewrites/params.py``), but autograd's sum of two host
gradients is a new device tensor: from the second contribution on, that parameter's gradient
is device memory until its last contribution, when AccumulateGrad's hook sends it back to the
host.
A gradient that exists when the step begins (a later micro-batch of gradient accumulation,
``zero_grad(set_to_none=False)``) is resident for the whole step; the step's contributions to it
live as a new one would until the last, which AccumulateGrad adds into ``.grad`` in place and
frees (``grads_present``).

The outputs the caller still holds: a forward call's user outputs its backward does not read
live as long as Python keeps them. A tree's encoder keeps every node's ``h`` and ``c`` in a list
until the root is done, an RNN its states; they are not the next call's activation inputs (a
``stack`` copies them). The compiler measures when each one's storage dies (:class:`OutputLife`,
a weak reference's callback: the position in the step of the first call that began after it)
and the replay counts it at every call it was alive for, once per storage: not where the call
reads it as an input (its activation inputs count it) or where a backward keeps it (counted with
the saved storages). The last forward call's are its ``held`` outputs (below).

For a single-fragment step this is exactly :meth:`FragmentProfile.step_peak`. With several
fragments it is an estimate: activations that Python code between fragments allocates or holds
are not visible to memcompile.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from memcompile.analysis.fragment_profile import FragmentProfile, ParamGrad
from memcompile.analysis.graph import GraphProfile

__all__ = [
    "NO_STORAGES",
    "CacheUse",
    "CallStorages",
    "OutputLife",
    "StepPrediction",
    "ViewStorages",
    "cache_peak",
    "simulate_step",
]


@dataclass(frozen=True)
class StepPrediction:
    """Result of :func:`simulate_step`.

    Attributes:
        peak: predicted absolute device peak of the step, bytes.
        call_peaks: predicted absolute peak during each call of the sequence.
        peak_call: index into the sequence of the call holding the peak (-1: before any call).
        exact: the step is one fragment called once forward and once backward (the model is exact).
        own_peaks: each call's own graph peak within its call peak (the forward's, or the
            backward's with its gradient accumulation); ``None`` where the call runs no graph.
            The rest of ``call_peaks`` is what the step holds around it (planning/replan.py).
    """

    peak: int
    call_peaks: tuple[int, ...]
    peak_call: int
    exact: bool
    own_peaks: tuple[int | None, ...] = ()

    def fragment_peaks(self, sequence: Sequence[tuple[int, str, int]]) -> dict[int, int]:
        """Largest predicted peak during any call of each fragment."""
        out: dict[int, int] = {}
        for (index, _, _), p in zip(sequence, self.call_peaks, strict=True):
            out[index] = max(out.get(index, 0), p)
        return out


def _grad_key(
    index: int, block: int, grad: ParamGrad, storages: Mapping[int, int] | None
) -> Hashable:
    # The parameter's storage when the call's inputs are known; else one parameter set per
    # (fragment, block), as if no two fragments shared parameters.
    if storages is not None and grad.position in storages:
        return storages[grad.position]
    return (index, block, grad.position)


def _call_grads(
    prof: FragmentProfile, index: int, block: int, storages: Mapping[int, int] | None
) -> list[tuple[Hashable, ParamGrad]]:
    if not prof.param_grads and prof.grad_bytes:  # a profile made by hand: one lump
        return [((index, block, -1), ParamGrad(-1, prof.grad_bytes))]
    return [(_grad_key(index, block, g, storages), g) for g in prof.param_grads]


#: As profiles name them: the pilot's in-graph prediction and copy (``rewrites/pilot_prefetch.py``),
#: and the fetch of a host-placed parameter (``rewrites/params.py``; forward graphs reload nothing
#: else).
_PILOT_PREFETCH = "memcompile.pilot_prefetch.default"
_FETCH = "memcompile.reload.default"


class CacheUse(NamedTuple):
    """What the pilot's prefetch cache held through one forward call, as measured.

    Attributes:
        start: bytes cached when the call started.
        taken: of those, bytes its graph's fetches took (hits: a copy moves from the cache
            into the graph); the rest are copies for later blocks, held through the graph.
        at_op: bytes cached right after the graph's ``pilot_prefetch`` op copied (``None``:
            it did not run in this call; the copies are made at the tail).
        taken_at_op: bytes taken before that op.
    """

    start: int
    taken: int
    at_op: int | None
    taken_at_op: int


def cache_peak(graph: GraphProfile, use: CacheUse) -> int:
    """The peak of forward ``graph`` with the cache beside it: a copy the graph takes is cache
    bytes until its fetch (the profile counts it from there, as if fetched on demand; the hits
    are taken as the graph's first fetches), copies for later blocks are held from the start,
    and from the ``pilot_prefetch`` op on the cache holds what that op left it."""
    op = next((i for i, n in enumerate(graph.nodes) if n.target == _PILOT_PREFETCH), None)
    others = max(0, use.start - use.taken)
    after = others
    if use.at_op is not None:
        after = max(0, use.at_op - (use.taken - use.taken_at_op))
    unfetched, peak = use.taken, 0
    for i, node in enumerate(graph.nodes):
        if unfetched and node.target == _FETCH:
            unfetched -= min(unfetched, node.new_bytes)
        held = after if op is not None and i >= op else others
        peak = max(peak, node.live_bytes + unfetched + held)
    return peak


class OutputLife(NamedTuple):
    """The storage of one held output of a forward call (a user output its backward does not
    read), and when it died, as measured.

    Attributes:
        address: the storage's address.
        nbytes: its bytes.
        died: position in the step of the first call that began after the storage was freed
            (``None``: alive when the step ended).
    """

    address: int
    nbytes: int
    died: int | None


#: Storages (address -> bytes) of the activation inputs a forward call's backward reads: those
#: it saves whole and those it reads through views (autograd keeps the storage alive either way).
ViewStorages = Mapping[int, int]


class CallStorages(NamedTuple):
    """Storages of one call that the step's replay counts by address
    (:func:`simulate_step`), so that what several calls share is counted once.

    Attributes:
        kept: :data:`ViewStorages` of the inputs its backward reads (a forward call).
        outputs: its saved outputs that are also user outputs (address -> bytes), read after
            it returned.
        grad_inputs: its activation inputs whose gradients its backward makes (its profile's
            ``activation_grads``): input position -> storage address.
        cache: bytes the pilot's prefetch cache held after it (a forward call's tail).
        cache_use: what the cache held through it (a forward call with the pilot on): its
            copies taken by the graph, for later blocks, made by the graph's own prediction.
        held: bytes of its held user outputs (``FragmentProfile.held_output_positions``) the
            caller still held when the step's first backward began (the step's last forward
            call; ``None``: not measured).
        tangents: the step's first backward call: input positions of its incoming gradients
            still alive after it returned, held by someone else (the engine's root holds the
            loss's); ``None``: not measured.
        inputs: a forward call's activation input storages (address -> bytes); under a budget.
        lives: a forward call's held outputs and when each one's storage died
            (:class:`OutputLife`; ``died`` is set by a weak reference's callback); under a
            budget (without one the replay counts only the last forward's, ``held``).
        kept_at: of ``kept``, the whole storages its backward reads (``saved_input_reads``):
            address -> input position (the first that has it).
    """

    kept: ViewStorages
    outputs: ViewStorages
    grad_inputs: Mapping[int, int]
    cache: int = 0
    held: int | None = None
    cache_use: CacheUse | None = None
    tangents: frozenset[int] | None = None
    inputs: ViewStorages | None = None
    lives: tuple[OutputLife, ...] = ()
    kept_at: Mapping[int, int] = {}


#: A call whose storages are not recorded.
NO_STORAGES = CallStorages({}, {}, {})


class _HeldOutputs:
    """Held outputs of earlier forward calls still alive, by storage (see the module doc)."""

    def __init__(self) -> None:
        self._alive: dict[int, tuple[int, int]] = {}  # address -> (bytes, token)
        self._ends: list[tuple[int, int, int]] = []  # heap of (died, token, address)
        self._token = 0
        self.bytes = 0

    def add(self, lives: Sequence[OutputLife], counted: Callable[[int], bool]) -> None:
        """A forward call's outputs, but for storages counted elsewhere (``counted``). An
        address still listed was freed during this call and reused (its heap entry, whose
        token no longer matches, is then ignored)."""
        for life in lives:
            if counted(life.address):
                continue
            self.drop(life.address)
            self._token += 1
            self._alive[life.address] = (life.nbytes, self._token)
            self.bytes += life.nbytes
            if life.died is not None:
                heapq.heappush(self._ends, (life.died, self._token, life.address))

    def advance(self, position: int) -> None:
        """Forget the storages that died before the call at ``position`` began."""
        ends = self._ends
        while ends and ends[0][0] <= position:
            _, token, address = heapq.heappop(ends)
            entry = self._alive.get(address)
            if entry is not None and entry[1] == token:
                self.drop(address)

    def drop(self, address: int) -> None:
        """Stop counting ``address`` here (dead, or now counted elsewhere)."""
        entry = self._alive.pop(address, None)
        if entry is not None:
            self.bytes -= entry[0]

    def among(self, addresses: Iterable[int]) -> int:
        """Bytes of the alive storages among ``addresses``."""
        return sum(self._alive[a][0] for a in addresses if a in self._alive)


def simulate_step(
    profiles: Mapping[int, FragmentProfile | None],
    sequence: Sequence[tuple[int, str, int]],
    *,
    resident_bytes: int,
    call_profiles: Sequence[FragmentProfile | None] | None = None,
    call_storages: Sequence[Mapping[int, int] | None] | None = None,
    call_views: Sequence[Mapping[int, int]] | None = None,
    call_saved_outputs: Sequence[Mapping[int, int]] | None = None,
    call_input_grads: Sequence[Mapping[int, int]] | None = None,
    call_cache: Sequence[int] | None = None,
    call_cache_use: Sequence[CacheUse | None] | None = None,
    call_held: Sequence[int | None] | None = None,
    call_tangents: Sequence[frozenset[int] | None] | None = None,
    call_inputs: Sequence[Mapping[int, int] | None] | None = None,
    call_lives: Sequence[Sequence[OutputLife]] | None = None,
    call_kept_at: Sequence[Mapping[int, int]] | None = None,
    grads_present: Collection[Hashable] = (),
) -> StepPrediction:
    """Replay ``sequence`` (fragment index, kind, block key) over ``profiles``.

    Args:
        profiles: fragment index -> profile (``None`` for empty fragments, which allocate nothing).
        sequence: the calls of one step, kinds ``forward``/``backward``/``inference``.
        resident_bytes: parameters and buffers resident for the whole step (the first fragment's
            activation inputs are added here, they are held by the caller).
        call_profiles: each call's own profile, where it differs from its fragment's (a graph
            compiled for dynamic sizes, profiled at the sizes of that call); a backward call's
            is its forward's.
        call_storages: each call's parameters, input position -> storage address: calls that
            read one storage add to one gradient. ``None`` (or a position missing): calls
            with the same (index, block key) use the same parameters, others different ones.
        call_views: each forward call's input storages (address -> bytes) that its backward
            reads, whole (``FragmentProfile.saved_input_positions``) or through views
            (``saved_view_inputs``): each is counted once, from the first forward that keeps
            it to the last backward that releases it (every expert of a layer saves the
            layer's expert input: one storage); those of the first forward are the caller's
            (in ``resident_bytes`` with its inputs). Given, they replace the profiles'
            ``saved_input_bytes``; ``None``: those are counted per call.
        call_saved_outputs: each forward call's saved outputs that are also user outputs
            (``FragmentProfile.saved_output_positions``; address -> bytes, part of its
            ``saved_bytes``): counted once with the storages of ``call_views``, so a later call
            saving one as its input (an expert saving its router's output) adds nothing; the
            call's own backward reads them (its peak counts them) and releases them.
        call_input_grads: each forward call's activation inputs with a gradient
            (``FragmentProfile.activation_grads``): input position -> storage address. The
            gradient a backward makes for one is held after it (autograd's engine keeps it for
            the producer's backward) while the backwards that run next read that storage too
            (every expert of a layer reads its expert input: their gradients are summed into
            the first, in place); it is released at the next backward that does not read it
            (the producer's, which counts it as its incoming gradient). ``None``: not held.
        call_cache: bytes the pilot's prefetch cache held after each forward call (the next
            blocks' host-placed parameters, copied late in its graph or at its tail;
            ``dynamic/prefetch.py``), as measured in the step replayed: added to that call's
            end state, when its graph has freed its transients (seen: an early-exit step
            peaking at its first fragment's tail with 68,896 B of copies). ``None``: none.
        call_cache_use: what the cache held through each forward call (:class:`CacheUse`,
            :func:`cache_peak`), as measured; ``None``: nothing before its end.
        call_held: bytes of each forward call's held outputs (``held_output_bytes``) that the
            caller still held when the step's backward began, as measured in the step replayed
            (a loop keeping only the loss drops the logits); ``None`` (for the sequence or a
            call): not measured, all of them are held.
        call_tangents: for the step's first backward call, the input positions of the incoming
            gradients someone else held through it (the engine's root holds the loss's), as
            measured in the step replayed; the others (AOTAutograd's zeros for outputs that
            got no gradient) die at their last reader. ``None``: all held to the end.
        call_inputs: each forward call's activation input storages (address -> bytes), as
            measured: a held output of an earlier call that this call reads is counted with its
            activation inputs, not again. ``None``: none known.
        call_lives: each forward call's held outputs and when they died (:class:`OutputLife`),
            as measured: counted at every later call they were alive for (the last forward
            call's are ``call_held``'s). ``None``: not measured, none counted.
        call_kept_at: of each forward call's ``call_views``, the whole storages its backward
            reads, address -> input position (``FragmentProfile.saved_input_reads``). With
            ``call_lives``: a storage only that backward keeps, which the lives show died
            during it (the caller dropped it: the previous fragment's output), is counted up
            to its last reader in the backward, where autograd frees it, not through the
            whole call. ``None``: through the whole call.
        grads_present: gradient keys (parameter storages, as ``call_storages`` name them)
            whose ``.grad`` exists when the step begins (a later micro-batch of gradient
            accumulation, or ``zero_grad(set_to_none=False)``); their bytes are in
            ``resident_bytes``. A backward's contributions to one are held as for a new
            gradient (the engine sums them in its input buffer) until the last, then added
            into ``.grad`` in place and freed.
    """
    for name, per_call in (
        ("call_profiles", call_profiles),
        ("call_storages", call_storages),
        ("call_views", call_views),
        ("call_saved_outputs", call_saved_outputs),
        ("call_input_grads", call_input_grads),
        ("call_cache", call_cache),
        ("call_cache_use", call_cache_use),
        ("call_held", call_held),
        ("call_tangents", call_tangents),
        ("call_inputs", call_inputs),
        ("call_lives", call_lives),
        ("call_kept_at", call_kept_at),
    ):
        if per_call is not None and len(per_call) != len(sequence):
            raise ValueError(f"{name} has {len(per_call)} entries for {len(sequence)} calls")

    def profile(i: int) -> FragmentProfile | None:
        return call_profiles[i] if call_profiles is not None else profiles.get(sequence[i][0])

    def grads_of(i: int) -> list[tuple[Hashable, ParamGrad]]:
        prof = profile(i)
        index, kind, block = sequence[i]
        if kind != "backward" or prof is None or prof.backward is None:
            return []
        return _call_grads(prof, index, block, call_storages[i] if call_storages else None)

    # The last backward call contributing to each gradient: AccumulateGrad runs after it.
    last_use: dict[Hashable, int] = {}
    for i in range(len(sequence)):
        for key, _ in grads_of(i):
            last_use[key] = i
    base = resident_bytes
    peak = base
    peak_call = -1
    call_peaks: list[int] = []
    own_peaks: list[int | None] = []
    saved = grads = 0
    held = 0
    first_forward = True
    # Parameter -> contributions to its gradient so far, and that gradient's device bytes.
    contributions: dict[Hashable, int] = {}
    on_device: dict[Hashable, int] = {}
    # A forward saves its call's bytes; its backward releases exactly those.
    open_saved: dict[int, list[tuple[int, int, Mapping[int, int], Mapping[int, int], int]]] = {}
    # Gradients of activation inputs held between backwards: storage address -> bytes.
    input_grads: dict[int, int] = {}
    held_input_grads = 0
    first_backward = True
    # Storages kept through views -> how many open forwards keep them, and their bytes in all
    # (the first forward's are the caller's: in base).
    view_refs: dict[int, int] = {}
    callers: set[int] = set()
    viewed = 0
    first_call = -1
    # Held outputs of earlier forward calls the caller still holds; the last forward call's are
    # ``held`` (what the backward began with).
    outputs_held = _HeldOutputs()
    last_forward = max((i for i, (_, k, _) in enumerate(sequence) if k == "forward"), default=-1)
    # Held output storage -> position of the first call after its death (None: outlived the
    # step), the latest forward's where an address is reused.
    deaths: dict[int, int | None] = {}

    def kept_elsewhere(address: int) -> bool:
        return address in callers or bool(view_refs.get(address))

    for i, (index, kind, _) in enumerate(sequence):
        prof = profile(i)
        outputs_held.advance(i)
        if prof is None:
            call_peaks.append(base + saved + viewed + grads + outputs_held.bytes)
            own_peaks.append(None)
            continue
        activations = prof.input_bytes - prof.static_input_bytes
        if kind in ("forward", "inference"):
            if first_forward:
                base += activations  # the step's own inputs stay held by the caller
                activations = 0
                first_forward = False
                first_call = i
            views = call_views[i] if kind == "forward" and call_views is not None else {}
            reading = call_inputs[i] if call_inputs is not None else None
            # Storages an earlier call's backward keeps that this call reads are among its
            # activations (all it reads when known: an expert reads the router's saved output
            # without saving it; else those it keeps too).
            mine = sum(
                n
                for a, n in (views if reading is None else reading).items()
                if view_refs.get(a) and a not in callers
            )
            own = prof.forward_peak
            # The cache beside the graph (its copies, taken or not) and at its end.
            training = kind == "forward"
            cache = call_cache[i] if training and call_cache is not None else 0
            use = call_cache_use[i] if training and call_cache_use is not None else None
            during = max(own, prof.forward.end_bytes + cache) if cache else own
            if use is not None:
                during = max(during, cache_peak(prof.forward, use) + prof.inner_adjust[0])
            earlier = outputs_held.bytes - (outputs_held.among(reading) if reading else 0)
            p = base + saved + viewed - mine + grads + activations + during + earlier
            if kind == "forward":
                # The first forward's inputs are the caller's (in base): only later ones, which
                # Python may drop while autograd keeps them, add to what is saved. An input two
                # fragments both save counts twice (an overestimate: sizes are not storages).
                inputs = 0 if i == first_call or call_views is not None else prof.saved_input_bytes
                if i == first_call:
                    callers.update(views)
                outs = call_saved_outputs[i] if call_saved_outputs is not None else {}
                outputs = max(prof.saved_bytes - sum(outs.values()), 0)
                for address, nbytes in (*views.items(), *outs.items()):
                    if address not in callers and not view_refs.get(address):
                        viewed += nbytes
                        outputs_held.drop(address)  # kept by this call's backward from now on
                    view_refs[address] = view_refs.get(address, 0) + 1
                saved += outputs + inputs
                open_saved.setdefault(index, []).append((outputs, inputs, views, outs, i))
            alive = call_held[i] if call_held is not None else None
            held = prof.held_output_bytes if alive is None else alive
            if kind == "forward" and call_lives is not None:
                deaths.update((life.address, life.died) for life in call_lives[i])
                if i != last_forward:
                    outputs_held.add(call_lives[i], kept_elsewhere)
        else:  # backward
            bw = prof.backward
            if bw is None:
                call_peaks.append(base + saved + viewed + grads + outputs_held.bytes)
                own_peaks.append(None)
                continue
            opened = open_saved.get(index)
            outputs, inputs, views, outs, forward = (
                opened.pop() if opened else (prof.saved_bytes, 0, {}, {}, -1)
            )
            # Its kept storages that nothing else holds and that died during it: freed at
            # their last reader in the graph (autograd releases a saved tensor there).
            kept_at = call_kept_at[forward] if call_kept_at is not None and forward >= 0 else {}
            freed = {
                a: n
                for a, n in views.items()
                if a in kept_at
                and view_refs.get(a) == 1
                and a not in callers
                and i + 1 < len(sequence)
                and deaths.get(a, -1) == i + 1
            }
            releasing = {kept_at[a] for a in freed}
            reads: Mapping[int, int] = (
                call_input_grads[forward] if call_input_grads is not None and forward >= 0 else {}
            )
            for address in [a for a in input_grads if a not in reads.values()]:
                held_input_grads -= input_grads.pop(address)  # this backward's, or lost
            others = max(saved - outputs - inputs, 0)
            # Its own saved outputs are in its backward's peak (that graph's inputs).
            for address, nbytes in outs.items():
                view_refs[address] -= 1
                if not view_refs[address] and address not in callers:
                    viewed -= nbytes
            # The call's gradients against those of earlier calls (see the module docstring).
            summed = 0  # the largest out-of-place sum of a first and a second gradient
            to_device = 0  # host gradients whose sum is now a device tensor
            added = 0
            for key, g in grads_of(i):
                count = contributions.get(key, 0)
                contributions[key] = count + 1
                if count == 0:  # the first: autograd keeps this very tensor
                    on_device[key] = 0 if g.host else g.nbytes
                    added += on_device[key]
                elif count == 1 and g.host and not on_device[key]:
                    to_device += g.nbytes
                    on_device[key] = g.nbytes
                elif count == 1:
                    summed = max(summed, g.nbytes)
            accumulate = to_device + max(summed, prof.clone_bytes)
            # Its saved inputs stay until the call ends (the graph's profile treats every
            # forward input as the caller's).
            # Incoming gradients another backward made die at their last use; the step's first
            # backward's (the loss's) is held by the engine's root (fragment.py).
            handed = prof.handed_peak
            if first_backward:
                root = call_tangents[i] if call_tangents is not None else None
                if root is None and not releasing:
                    bw_peak = prof.backward_peak
                elif root is None:  # as profiled: all held to the end but the released
                    as_profiled = {p for p, _ in prof.tangent_storages} - set(prof.released)
                    bw_peak = prof.backward_peak_holding(as_profiled, releasing)
                else:
                    bw_peak = prof.backward_peak_holding(root, releasing)
            elif releasing:
                bw_peak = prof.backward_peak_holding(None, releasing)
            else:
                bw_peak = prof.backward_peak if handed is None else handed
            first_backward = False
            own = max(bw_peak, bw.end_bytes + accumulate)
            p = base + held + others + inputs + viewed - sum(freed.values()) + grads
            p += held_input_grads + own
            p += outputs_held.bytes
            saved = others
            for address, nbytes in views.items():  # the last reader's backward frees it
                view_refs[address] -= 1
                if not view_refs[address] and address not in callers:
                    viewed -= nbytes
            grads += added + to_device
            for position, nbytes in prof.activation_grads:
                read = reads.get(position)
                if read is not None and read not in input_grads:
                    input_grads[read] = nbytes
                    held_input_grads += nbytes
            for key, g in grads_of(i):
                if last_use[key] == i and (key in grads_present or g.host) and on_device[key]:
                    # Added into the existing .grad in place (or, a host gradient summed on the
                    # device, sent back to the host): freed after the call.
                    grads -= on_device[key]
                    on_device[key] = 0
        call_peaks.append(p)
        own_peaks.append(own)
        if p > peak:
            peak, peak_call = p, i
    kinds = [k for _, k, _ in sequence]
    exact = len({i for i, _, _ in sequence}) == 1 and kinds in (
        ["forward", "backward"],
        ["inference"],
    )
    return StepPrediction(peak, tuple(call_peaks), peak_call, exact, tuple(own_peaks))
