"""Every fragment call of a training step, as the step's replay needs it.

The call wrapper of each compiled graph (``backends/call_wrapper.py``) tells the monitor about a
call twice, around the graph::

    call = monitor.on_call(site, block, args, sizes)    # the step's record; what the call reads
    out = graph(args)                                   # (args are cleared: boxed convention)
    small_ints = monitor.on_return(call, out, small_ints)  # what the caller keeps of its outputs
    monitor.on_cache(nbytes, use)                       # the pilot's cache beside a forward call

A training step is its forward calls, then its backward calls: the next forward after a
backward starts a new step. A step of inference calls ends when its first call repeats. At a
step's end the recorded calls become ``last_step`` (with each call's sizes and
:class:`CallStorages`) and the :class:`StepListener` is told (the budget's check, the checks of
``step/checks.py``); after the step's first backward it is told what that backward showed the
plans assume wrongly (outputs the caller dropped, incoming gradients no one else held).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.analysis.step_model import (
    NO_STORAGES,
    CacheUse,
    CallStorages,
    OutputLife,
    ViewStorages,
)
from memcompile.records import FragmentRecord, SizeKey, StepEvent
from memcompile.runtime.small_ints import small_int_outputs

__all__ = ["BlockObserver", "Call", "CallSite", "StepListener", "StepMonitor"]

log = logging.getLogger(__name__)

# A step that never sees a backward (inference loops) is cut at this many calls.
_MAX_STEP_EVENTS = 100_000

#: What the step's first backward found of its last forward's held outputs: (fragment index,
#: output positions the caller had dropped, positions it still held).
OutputsFound = tuple[int, frozenset[int], frozenset[int]]


class BlockObserver(Protocol):
    """Sees every fragment call (``MemCompiler.block_observers``), e.g. the trace recorder.

    ``on_block`` runs before the call with the step number, the :data:`StepEvent` fields and the
    call's arguments (read sizes only: a reference kept would keep activations alive)."""

    def on_block(
        self, step: int, index: int, kind: str, block: int, args: Sequence[Any]
    ) -> None: ...

    def reset(self) -> None: ...

    # Optional: ``on_block_end(step, index, kind, block, outputs, small_ints=...)`` runs after a
    # forward or inference call returned, with its outputs and their small integer values
    # (runtime/small_ints.py's ``small_int_outputs``, computed once per call and shared with
    # the prefetcher); called only on observers that define it, see ``StepMonitor.on_return``.
    # Optional: ``on_block_reads(step, index, kind, block, values)`` runs when the model's Python
    # reads numbers from tensors after a forward or inference call returned (``int(t)``,
    # ``t.item()``, ``t.tolist()``: runtime/scalar_reads.py), one tuple per read; see
    # ``StepMonitor.on_reads``.


class StepListener(Protocol):
    """Told what the monitor saw (``MemCompiler``: the budget's check and re-plans)."""

    def step_ended(self, *, in_call: bool) -> None:
        """A step ended (``last_step`` is it); ``in_call``: inside a fragment call (the next
        step's first), not between two model calls."""

    def first_backward(
        self, index: int, outputs: OutputsFound | None, held: frozenset[int]
    ) -> None:
        """The step's first backward call (of F{index}) returned: ``outputs``, what its start
        found of the last forward's held outputs; ``held``, the input positions of its incoming
        gradients someone else held through it."""


@dataclass(frozen=True)
class CallSite:
    """What the monitor reads of one compiled graph's calls, fixed when the graph is wrapped.

    Attributes:
        index: the fragment's index.
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        static: positions of its parameter and buffer inputs (a forward's other inputs are its
            activations).
        saved_outputs: positions of its saved outputs that are also user outputs (a forward).
        held_outputs: positions of the user outputs the caller may hold (a forward).
        tangents: input positions of its incoming gradients (a backward).
    """

    index: int
    kind: str
    static: frozenset[int] = frozenset()
    saved_outputs: tuple[int, ...] = ()
    held_outputs: tuple[int, ...] = ()
    tangents: tuple[int, ...] = ()
    #: A forward's activation input positions, once its first call showed how many inputs.
    activations: list[tuple[int, ...]] = field(default_factory=list, compare=False, repr=False)


class Call:
    """One call between :meth:`StepMonitor.on_call` and :meth:`StepMonitor.on_return`."""

    __slots__ = ("block", "reads", "roots", "site")

    def __init__(
        self,
        site: CallSite,
        block: int,
        roots: list[tuple[int, StorageWeakRef]] | None,
        reads: ViewStorages | None,
    ) -> None:
        self.site = site
        self.block = block
        #: The step's first backward: a weak reference to each incoming gradient's storage.
        self.roots = roots
        #: A forward's activation input storages, read before the call cleared its arguments.
        self.reads = reads


def view_storages(args: Sequence[Any], positions: Sequence[int]) -> dict[int, int]:
    """:data:`ViewStorages` of one call: the storages of its inputs at ``positions``."""
    out: dict[int, int] = {}
    for i in positions:
        t = args[i] if i < len(args) else None
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


class StepMonitor:
    """The step being recorded and the last complete one (see the module docstring).

    Args:
        budgeted: whether a budget is set: only then are the lives of a forward's outputs and
            the whole storages its backward reads measured (nothing is planned on them else).
        records: the compiled fragments (``MemCompiler.records``).
        listener: told when a step ends and after its first backward.
        present_grads: under a budget, called at each step's first call with its arguments:
            the gradients that exist then (parameter storage address -> the gradient's device
            bytes; a later micro-batch of gradient accumulation,
            ``zero_grad(set_to_none=False)``).

    Attributes:
        last_step: fragment calls of the last complete training step observed.
        last_step_sizes: each call's size-symbol values, parallel to the steps.
        last_step_storages: each call's :class:`CallStorages` (empty but for forwards saving
            inputs or making gradients of activation inputs).
        steps_observed: complete steps so far.
        steps_started: steps begun so far (an optimizer step counts the micro-batches of its
            iteration by it).
        last_step_grads: ``present_grads`` at the last complete step's first call.
        observers: told of every fragment call, in order (dynamic/: trace recorder, pilot).
    """

    def __init__(
        self,
        *,
        budgeted: bool,
        records: Callable[[], list[FragmentRecord]],
        listener: StepListener,
        present_grads: Callable[[Sequence[Any]], Mapping[int, int]] = lambda args: {},
    ) -> None:
        self._budgeted = budgeted
        self._present_grads = present_grads
        self._records = records
        self._listener = listener
        self.observers: list[BlockObserver] = []
        self.last_step: tuple[StepEvent, ...] = ()
        self.last_step_sizes: tuple[SizeKey, ...] = ()
        self.last_step_storages: tuple[CallStorages, ...] = ()
        self.steps_observed = 0
        self.steps_started = 0
        self.last_step_grads: Mapping[int, int] = {}
        self._step_grads: Mapping[int, int] = {}
        self._step: list[StepEvent] = []
        self._step_sizes: list[SizeKey] = []
        self._step_storages: list[CallStorages] = []
        #: Fragment index -> positions of activation inputs its backward reads, whole or through
        #: views (its profile's saved_input_positions and saved_view_inputs), those that get
        #: gradients, and those of the first kind (whole storages).
        self._call_reads: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        # The step's latest forward call with held outputs: its position in the step and weak
        # references to those outputs' storages with their bytes (``_on_held_outputs``).
        self._held_refs: tuple[int, list[tuple[int, StorageWeakRef, int, int]]] = (-1, [])
        # This step's weak references to its forward calls' held output storages, whose
        # callbacks note when each dies (``_on_forward_outputs``); dropped with the step.
        self._output_refs: list[weakref.ref[Any]] = []
        #: Fragments that made a step's latest forward call with held outputs, the one its first
        #: backward checks: only their calls take those weak references (empty: every
        #: fragment's, until a backward shows which; a tree's cells, called hundreds of times
        #: a step, then take none). ``_latest_held``: (position in the step, fragment) of the
        #: step's latest such call so far.
        self._last_forwards: set[int] = set()
        self._latest_held: tuple[int, int] = (-1, -1)
        # What the step's first backward found of its last forward's held outputs.
        self._step_dropped: OutputsFound | None = None
        self._step_trains = False
        self._last_kind = ""
        self._open_blocks: dict[int, list[tuple[int, SizeKey]]] = {}

    def reset(self) -> None:
        """Forget every step (``torch._dynamo.reset()``: the fragments are gone); the observers
        are the compiler's to reset (outside its lock: a recorder flushes its step)."""
        self.last_step = ()
        self.last_step_sizes = ()
        self.last_step_storages = ()
        self.steps_observed = 0
        self.steps_started = 0
        self.last_step_grads = {}
        self._step_grads = {}
        self._step = []
        self._step_sizes = []
        self._step_storages = []
        self._call_reads.clear()
        self._held_refs = (-1, [])
        self._output_refs = []
        self._last_forwards.clear()
        self._latest_held = (-1, -1)
        self._step_dropped = None
        self._step_trains = False
        self._last_kind = ""
        self._open_blocks.clear()

    def reads(
        self, index: int, kept: tuple[int, ...], grads: tuple[int, ...], whole: tuple[int, ...]
    ) -> None:
        """F{index}'s forward calls' backward reads the activation inputs at ``kept`` (those at
        ``whole`` as whole storages), and makes the gradients of those at ``grads``: read per
        call, so that the step's replay counts a storage several calls keep, or a gradient
        several calls add to, once."""
        self._call_reads[index] = (kept, grads, whole)

    # -- one call ----------------------------------------------------------------------------
    def on_call(self, site: CallSite, block: int, args: Sequence[Any], sizes: SizeKey) -> Call:
        """Before the graph runs (its ``args`` are still there)."""
        kind = site.kind
        # The step's first backward: which incoming gradients outlive the call (held by someone
        # else through it); AOTAutograd's zeros for outputs without a gradient die inside it.
        # One weak reference per incoming gradient, first backward only.
        roots = (
            [
                (pos, StorageWeakRef(args[pos].untyped_storage()))
                for pos in site.tangents
                if pos < len(args) and isinstance(args[pos], torch.Tensor)
            ]
            if kind == "backward" and self._last_kind != "backward"
            else None
        )
        self._record(site.index, kind, block, args, sizes)
        # Under a budget, how long the caller holds a forward's outputs (simulate_step's lives:
        # ~6 us a call, which a step without a budget does not pay: nothing is planned on it).
        reads = None
        if kind == "forward" and self._budgeted:
            if not site.activations:
                site.activations.append(tuple(i for i in range(len(args)) if i not in site.static))
            reads = view_storages(args, site.activations[0])
        return Call(site, block, roots, reads)

    def on_return(
        self,
        call: Call,
        outputs: Any,
        small_ints: tuple[tuple[int, ...], ...] | None = None,
    ) -> tuple[tuple[int, ...], ...] | None:
        """After the graph returned ``outputs``. ``small_ints``: their small integer values when
        already read (by the graph's pilot op); returns them as read for the observers (``None``:
        no observer wanted them)."""
        site = call.site
        if call.roots is not None:
            held = frozenset(p for p, ref in call.roots if not ref.expired())
            self._after_first_backward(site.index, held)
        if site.saved_outputs:  # saved outputs other fragments may save too (simulate_step)
            self._on_saved_outputs(view_storages(outputs, site.saved_outputs))
        if site.held_outputs:  # does the caller still hold them when the backward begins?
            self._on_held_outputs(site.index, outputs, site.held_outputs)
        if call.reads is not None:  # how long the caller holds them (simulate_step's lives)
            self._on_forward_outputs(call.reads, outputs, site.held_outputs)
        if site.kind != "backward":  # observers see the outputs (a router's counts)
            small_ints = self._on_call_end(site, call.block, outputs, small_ints)
        return small_ints

    def wants_reads(self) -> bool:
        """Whether an observer takes the numbers the model's Python reads (``on_block_reads``)."""
        return any(hasattr(o, "on_block_reads") for o in self.observers)

    def on_reads(self, values: tuple[int | float, ...]) -> None:
        """The model's Python read ``values`` from a tensor (runtime/scalar_reads.py): hand them to
        the observers as a read after the step's latest call, when that is a forward or
        inference call (a router's, whose output decided them)."""
        if not self._step:
            return
        index, kind, block = self._step[-1]
        if kind == "backward":
            return
        for observer in self.observers:
            read = getattr(observer, "on_block_reads", None)
            if read is not None:
                read(self.steps_observed, index, kind, block, values)

    def on_cache(self, nbytes: int, use: CacheUse) -> None:
        """The forward call just recorded left the pilot's prefetch cache holding ``nbytes``
        (its tail ran); ``use``: what the cache held through the call."""
        if self._step_storages and (nbytes or use.start or use.at_op):
            self._step_storages[-1] = self._step_storages[-1]._replace(cache=nbytes, cache_use=use)

    def end_step_if_done(self) -> None:
        """A model call starts and none of its frames runs: end a step whose backward is done
        (so its checks run now, not in the next step's first fragment)."""
        if self._step and self._last_kind == "backward":
            self._end_step(in_call=False)

    # -- the step's record -------------------------------------------------------------------
    def _record(
        self, index: int, kind: str, block: int, args: Sequence[Any], sizes: SizeKey
    ) -> None:
        # A training step is its forward calls, then its backward calls: the next forward after a
        # backward starts a new step. A step of inference calls ends when its first call repeats
        # (a training forward may repeat a shared fragment, e.g. one graph for every expert).
        step = self._step
        if (
            kind != "backward"
            and step
            and (
                self._last_kind == "backward"
                or (not self._step_trains and step[0][:2] == (index, kind))
                or len(step) >= _MAX_STEP_EVENTS
            )
        ):
            self._end_step(in_call=True)
            step = self._step
        if not step:  # a step begins: the gradients it starts with (accumulation)
            self.steps_started += 1
            self._step_grads = self._present_grads(args) if self._budgeted else {}
        if kind == "forward":
            self._open_blocks.setdefault(index, []).append((block, sizes))
        elif kind == "backward":
            if self._last_kind != "backward":
                self._check_held_outputs()
            # Backward calls come in reverse forward order: pair with the latest open forward
            # (its parameters, and the sizes its saved tensors have).
            opened = self._open_blocks.get(index)
            block, sizes = opened.pop() if opened else (0, ())
        step.append((index, kind, block))
        self._step_sizes.append(sizes)
        read = self._call_reads.get(index) if kind == "forward" else None
        if read is None:
            self._step_storages.append(NO_STORAGES)
        else:
            kept, grads, whole = read
            addresses = {
                i: args[i].untyped_storage().data_ptr()
                for i in grads
                if i < len(args) and isinstance(args[i], torch.Tensor)
            }
            # Used with the outputs' lives only, which are measured under a budget.
            kept_at = (
                {
                    args[i].untyped_storage().data_ptr(): i
                    for i in reversed(whole)
                    if i < len(args) and isinstance(args[i], torch.Tensor)
                }
                if self._budgeted
                else {}
            )
            self._step_storages.append(
                CallStorages(view_storages(args, kept), {}, addresses, kept_at=kept_at)
            )
        self._step_trains |= kind == "forward"
        self._last_kind = kind
        for observer in self.observers:
            observer.on_block(self.steps_observed, index, kind, block, args)

    def _on_held_outputs(
        self, index: int, outputs: Sequence[Any], positions: Sequence[int]
    ) -> None:
        # After a forward call of F{index} with held outputs (the step's latest such call so
        # far): weak references to the storages of its user outputs the backward does not
        # read, checked when the backward begins. Taken only by the fragments a backward
        # showed to make a step's latest such call (by every fragment until one did).
        at = len(self._step) - 1
        self._latest_held = (at, index)
        last = self._last_forwards
        if last and index not in last:
            return
        refs: list[tuple[int, StorageWeakRef, int, int]] = []
        for j in positions:
            t = outputs[j] if j < len(outputs) else None
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                refs.append((j, StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        self._held_refs = (at, refs)

    def _on_forward_outputs(
        self, reads: ViewStorages, outputs: Sequence[Any], positions: Sequence[int]
    ) -> None:
        # After a forward call: the storages it read, and a weak reference to each storage of
        # its held outputs whose callback notes the position in the step of the first call
        # after its death. Storage objects are preserved while the storage lives (its last
        # tensor or view), so the callback runs when the memory is freed. The references are
        # dropped with the step: a death after it leaves ``died`` unset (alive to its end).
        storages, step = self._step_storages, self._step
        if not storages:
            return
        at = len(storages) - 1
        lives: list[OutputLife] = []
        for j in positions:
            t = outputs[j] if j < len(outputs) else None
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or any(life.address == address for life in lives):
                continue
            died = functools.partial(self._output_died, storages, step, at, len(lives))
            self._output_refs.append(weakref.ref(storage, died))
            lives.append(OutputLife(address, nbytes, None))
        storages[at] = storages[at]._replace(inputs=reads, lives=tuple(lives))

    def _output_died(
        self, storages: list[CallStorages], step: list[StepEvent], at: int, k: int, _ref: Any
    ) -> None:
        # A held output's storage was freed (weak reference callback; see _on_forward_outputs).
        if storages is not self._step_storages:  # a later step's: the step ended with it alive
            return
        lives = list(storages[at].lives)
        lives[k] = lives[k]._replace(died=len(step))
        storages[at] = storages[at]._replace(lives=tuple(lives))

    def _after_first_backward(self, index: int, held: frozenset[int]) -> None:
        # After the step's first backward call (the latest recorded, of F{index}): its
        # incoming gradients (input positions) that someone else held through it.
        if self._step_storages and self._step and self._step[-1][1] == "backward":
            self._step_storages[-1] = self._step_storages[-1]._replace(tangents=held)
        outputs, self._step_dropped = self._step_dropped, None
        self._listener.first_backward(index, outputs, held)

    def _check_held_outputs(self) -> None:
        # The step's first backward: how much of its last forward's held outputs the caller
        # still holds (a loop keeping only ``out.loss`` has dropped the logits by now).
        at, refs = self._held_refs
        (latest, index), self._latest_held = self._latest_held, (-1, -1)
        self._held_refs = (-1, [])
        if latest < 0:
            return
        self._last_forwards.add(index)
        if at != latest:  # that call took no references: its fragment does from now on
            return
        if not 0 <= at < len(self._step_storages) or self._step[at][1] != "forward":
            return
        alive: dict[int, int] = {}  # storage -> bytes
        dead: list[int] = []
        held: list[int] = []
        for j, ref, address, nbytes in refs:
            if ref.expired():
                dead.append(j)
            else:
                held.append(j)
                alive[address] = nbytes
        self._step_storages[at] = self._step_storages[at]._replace(held=sum(alive.values()))
        # Decided at the end of this backward call, with its incoming gradients: not at the
        # step's end (the next step's first call), so a re-plan applies from the next model
        # call on (the step after next, otherwise).
        self._step_dropped = (self._step[at][0], frozenset(dead), frozenset(held))

    def _on_saved_outputs(self, storages: ViewStorages) -> None:
        # The forward call just recorded returned these saved user outputs.
        if self._step_storages:
            self._step_storages[-1] = self._step_storages[-1]._replace(outputs=storages)

    def _on_call_end(
        self,
        site: CallSite,
        block: int,
        outputs: Any,
        small_ints: tuple[tuple[int, ...], ...] | None,
    ) -> tuple[tuple[int, ...], ...] | None:
        # After a forward or inference call returned: its outputs, e.g. an MoE router's
        # per-expert counts, which decide the next blocks (dynamic/pilot.py). Nothing is read
        # here unless an observer wants them: reading a CUDA tensor's values waits for the
        # device (dynamic/trace.py: at a call's end only, where the model's own Python reads a
        # router's counts next anyway). The small integer values are read once per call, here
        # unless given (``small_ints``: the graph's pilot op read them), and returned for the
        # prefetcher's tail (None: no observer wanted them; the tail reads them itself).
        for observer in self.observers:
            end = getattr(observer, "on_block_end", None)
            if end is not None:
                if small_ints is None:
                    small_ints = small_int_outputs(outputs)
                end(
                    self.steps_observed,
                    site.index,
                    site.kind,
                    block,
                    outputs,
                    small_ints=small_ints,
                )
        return small_ints

    def _end_step(self, *, in_call: bool) -> None:
        self.last_step = tuple(self._step)
        self.last_step_sizes = tuple(self._step_sizes)
        self.last_step_storages = tuple(self._step_storages)
        self.last_step_grads = self._step_grads
        self.steps_observed += 1
        self._step = []
        self._step_sizes = []
        self._step_storages = []
        self._step_trains = False
        self._open_blocks.clear()
        self._output_refs = []
        self._held_refs = (-1, [])
        self._latest_held = (-1, -1)
        self._step_dropped = None
        self._listener.step_ended(in_call=in_call)

    # -- reading the step --------------------------------------------------------------------
    def current_step(self) -> tuple[StepEvent, ...]:
        """The most recent step: the one in progress once it has reached its backward (or the
        last complete one before that), else the calls seen so far."""
        return self.current_step_views()[0]

    def current_step_views(
        self,
    ) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...], tuple[CallStorages, ...]]:
        """:meth:`current_step`, each call's size key and :class:`CallStorages`."""
        step = self._step
        if step and (step[-1][1] == "backward" or not self.last_step):
            return tuple(step), tuple(self._step_sizes), tuple(self._step_storages)
        return self.last_step, self.last_step_sizes, self.last_step_storages

    def current_step_grads(self) -> Mapping[int, int]:
        """The gradients :meth:`current_step` began with (``present_grads``)."""
        step = self._step
        if step and (step[-1][1] == "backward" or not self.last_step):
            return self._step_grads
        return self.last_step_grads

    def step_sequence(self) -> tuple[StepEvent, ...]:
        """The step predictions replay: :meth:`current_step`, with the backward assumed (reverse
        forward order) when only the forward has been seen so far."""
        return self.sequence_and_sizes()[0]

    def sequence_and_sizes(self) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...]]:
        """:meth:`step_sequence` and each call's size key."""
        seq, sizes, _ = self.sequence_sizes_views()
        return seq, sizes

    def sequence_sizes_views(
        self,
    ) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...], tuple[CallStorages, ...] | None]:
        """:meth:`step_sequence`, each call's size key and :class:`CallStorages` (``None``: not
        recorded; the replay then counts each call's saved inputs by its profile)."""
        seq, sizes, recorded = self.current_step_views()
        if len(sizes) != len(seq):  # not recorded (calls made before sizes were): the hints
            sizes = ((),) * len(seq)
        kept = recorded if len(recorded) == len(seq) else None
        if seq and not any(kind == "backward" for _, kind, _ in seq):
            training = {
                r.index for r in self._records() if r.profile is not None and r.profile.training
            }
            back = [
                (e, k)
                for e, k in zip(reversed(seq), reversed(sizes), strict=True)
                if e[1] == "forward" and e[0] in training
            ]
            seq = seq + tuple((i, "backward", b) for (i, _, b), _ in back)
            sizes = sizes + tuple(k for _, k in back)
            if kept is not None:
                kept = kept + (NO_STORAGES,) * len(back)
        return seq, sizes, kept

    @property
    def step_trains(self) -> bool:
        """Whether the step in progress has a training forward call (a backward will follow)."""
        return self._step_trains

    @property
    def last_kind(self) -> str:
        """The kind of the latest call (``""`` before any)."""
        return self._last_kind
