"""Block traces: per training step, the sequence of blocks that ran, saved as JSON lines.

A *block* is one call of a fragment with a given identity: one compiled graph serves every expert
of an MoE, and the parameters it is called with tell the experts apart. The compiler calls
:meth:`TraceRecorder.on_block` before every fragment call; the recorder names the block, stamps
it and, when the step is over, appends it to ``trace_path`` as one JSON line:

    compiled = memcompile.compile(model, trace_path="moe.jsonl")
    ...train...
    steps = read_trace("moe.jsonl")          # list[StepTrace], for offline pilot training
    steps[3].blocks("forward")     # ('3f1c…/', '9a0e…/blocks.0', '77d2…/blocks.0.experts.1', …)

    {"step": 3, "events": [{"phase": "forward", "fragment": "3f1c…", "block": "3f1c…/",
                            "t_us": 0.0, "sizes": [64]}, …],
     "idioms": {"3f1c…": [1, 4, 2, 0, 0, 3], …}}     # per fragment, see idioms.py

Block ids are stable across runs and processes (never addresses or Dynamo compile ids):

    block id = fragment id (structural hash: graph + input metadata + Dynamo sources)
               + "/" + the module that owns the call's parameters

The owner is the longest common module path of the qualified names of the parameters the call
was given (``blocks.0.experts.3`` for an expert, ``blocks.0`` for a block's router fragment,
``""`` for a fragment of the root module). Dynamo's own sources cannot tell experts apart: the
graph of ``Expert.forward`` was traced once, with sources ``L['self'].fc1.weight``, and the other
experts reuse it. So the names come from the model's ``named_parameters()``, mapped by storage
address (the compiler already keys blocks by the first parameter's address); the model is the one
given to ``memcompile.compile``, else the module whose compiled call is on the stack at the
block's first forward. Without a model (a compiled function), the owner is ``#k``: the block's
order of first appearance within its fragment, which is stable only for the same input stream.
Parameter storages replaced after the first step (not done by torch's optimizers) keep their old
names: names are resolved once per (fragment, address).

Cheap features per event: microseconds since the step's first call, the element counts of the
first few non-parameter tensor inputs of forward calls (for an expert: tokens routed to it), and
the values of the call's small integer outputs (:func:`small_int_outputs`: for an MoE router,
its per-expert token counts, which decide the next blocks). The compiler reports the outputs
after the call returned (``on_block_end``). CUDA tensors are read too, at the call's end (never
inside a graph): reading their values makes the host wait for the device, but a small integer
tensor that leaves a fragment is, in the case this is for, read by the model's own Python next
(the router's counts decide which experts it calls: the reason Dynamo broke the graph there),
which waits the same. The values are read only while a recorder or the pilot runs. Traces
written before outputs were recorded read back with ``outputs=()``. A model whose Python turns
a fragment's output into numbers itself (``e = int(router(x).argmax())``: a frame Dynamo runs
eagerly, backends/regions.py) has those numbers on the call's event as ``reads``
(runtime/scalar_reads.py), one tuple per read, in order.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from memcompile.dynamic.idioms import IDIOMS, IdiomVector, graph_idioms
from memcompile.records import FragmentRecord, RecordIndex
from memcompile.runtime.small_ints import small_int_outputs

log = logging.getLogger(__name__)

__all__ = [
    "BlockEvent",
    "StepTrace",
    "TraceRecorder",
    "block_owner",
    "read_trace",
]

#: Non-parameter tensor inputs whose sizes an event keeps.
MAX_SIZES = 4

_PHASES = ("forward", "backward", "inference")


@dataclass(frozen=True)
class BlockEvent:
    """One fragment call.

    Attributes:
        phase: ``"forward"``, ``"backward"`` or ``"inference"``.
        fragment: the fragment's stable id (16 hex digits).
        block: the stable block id, ``"<fragment>/<owner>"`` (see the module docstring).
        t_us: microseconds since the step's first call.
        sizes: element counts of up to :data:`MAX_SIZES` non-parameter tensor inputs (forward and
            inference calls; empty for backward calls).
        outputs: the values of the call's small integer outputs, flattened
            (:func:`small_int_outputs`; empty for backward calls and in older traces).
        reads: the numbers the model's Python read from tensors after the call returned and
            before the next call (runtime/scalar_reads.py: ``int(router(x).argmax())``,
            ``conf.item()``), one tuple per read, in order (empty when none, and in older
            traces).
    """

    phase: str
    fragment: str
    block: str
    t_us: float
    sizes: tuple[int, ...] = ()
    outputs: tuple[tuple[int, ...], ...] = ()
    reads: tuple[tuple[int | float, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "phase": self.phase,
            "fragment": self.fragment,
            "block": self.block,
            "t_us": round(self.t_us, 3),
            "sizes": list(self.sizes),
        }
        if self.outputs:
            d["outputs"] = [list(o) for o in self.outputs]
        if self.reads:
            d["reads"] = [list(r) for r in self.reads]
        return d


@dataclass(frozen=True)
class StepTrace:
    """The blocks of one training step, in call order.

    Attributes:
        step: the compiler's step number.
        events: the calls, in order.
        idioms: (fragment id, per-idiom op counts of its forward graph) of the fragments that ran.
    """

    step: int
    events: tuple[BlockEvent, ...]
    idioms: tuple[tuple[str, IdiomVector], ...] = ()

    def blocks(self, *phases: str) -> tuple[str, ...]:
        """Block ids of the events in ``phases`` (all phases if none given)."""
        return tuple(e.block for e in self.events if not phases or e.phase in phases)

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "events": [e.to_dict() for e in self.events],
                "idioms": {f: list(v) for f, v in self.idioms},
            }
        )


def _event_from(d: Any, where: str) -> BlockEvent:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: an event must be an object; got {type(d).__name__}")
    missing = [k for k in ("phase", "fragment", "block", "t_us") if k not in d]
    if missing:
        raise ValueError(f"{where}: event lacks {', '.join(missing)}")
    if d["phase"] not in _PHASES:
        raise ValueError(f"{where}: phase must be one of {', '.join(_PHASES)}; got {d['phase']!r}")
    return BlockEvent(
        phase=str(d["phase"]),
        fragment=str(d["fragment"]),
        block=str(d["block"]),
        t_us=float(d["t_us"]),
        sizes=tuple(int(s) for s in d.get("sizes", ())),
        outputs=_lists_from(d.get("outputs", ()), where, "outputs", (int,)),  # type: ignore[arg-type]
        reads=_lists_from(d.get("reads", ()), where, "reads", (int, float)),
    )


def _lists_from(
    v: Any, where: str, what: str, kinds: tuple[type, ...]
) -> tuple[tuple[int | float, ...], ...]:
    """``v`` as a tuple of tuples, each value of one of ``kinds`` (never a bool)."""
    if not isinstance(v, (list, tuple)) or not all(
        isinstance(o, list) and all(isinstance(x, kinds) and not isinstance(x, bool) for x in o)
        for o in v
    ):
        names = "ints" if kinds == (int,) else "numbers"
        raise ValueError(f"{where}: {what} must be a list of lists of {names}")
    return tuple(tuple(o) for o in v)


def read_trace(path: str | os.PathLike[str]) -> list[StepTrace]:
    """The steps saved in a JSON-lines trace file, in file order.

    Raises:
        ValueError: a line is not JSON or not a step; the message names the file and line.
    """
    steps: list[StepTrace] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
            if not isinstance(d, dict) or "step" not in d or "events" not in d:
                raise ValueError(f"{where}: expected an object with 'step' and 'events'")
            events = tuple(_event_from(e, f"{where} event {i}") for i, e in enumerate(d["events"]))
            idioms = d.get("idioms", {})
            for f, v in idioms.items():
                if not isinstance(v, list) or len(v) != len(IDIOMS):
                    raise ValueError(f"{where}: idioms of {f} must be a list of {len(IDIOMS)} ints")
            steps.append(
                StepTrace(
                    int(d["step"]),
                    events,
                    tuple((str(f), tuple(int(x) for x in v)) for f, v in idioms.items()),  # type: ignore[misc]
                )
            )
    return steps


def block_owner(names: Sequence[str]) -> str:
    """The longest common module path of parameter names (``"blocks.0.experts.3"`` for
    ``["blocks.0.experts.3.fc1.weight", "blocks.0.experts.3.fc2.bias"]``)."""
    if not names:
        return ""
    paths = [n.split(".")[:-1] for n in names]  # drop the attribute ("weight")
    common: list[str] = []
    for parts in zip(*paths, strict=False):  # up to the shortest path
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def _calling_module(max_depth: int = 200) -> torch.nn.Module | None:
    # The root module of the compiled call in progress: Dynamo's compile_wrapper frame holds the
    # wrapped callable (``module.__call__``/``forward``) as ``fn``.
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "compile_wrapper":
            owner = getattr(frame.f_locals.get("fn"), "__self__", None)
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


def _storage_names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(t.untyped_storage().data_ptr(), name)
    return names


class _BlockNamer:
    """(fragment index, block address) -> stable block id; resolved once per pair."""

    def __init__(self, model: Callable[[], torch.nn.Module | None]) -> None:
        self._model = model
        self._found: weakref.ref[torch.nn.Module] | None = None
        self._names: dict[int, str] | None = None
        self._labels: dict[tuple[int, int], str] = {}
        self._ordinals: dict[int, dict[int, int]] = {}

    def label(self, record: FragmentRecord, block: int, phase: str) -> str:
        key = (record.index, block)
        label = self._labels.get(key)
        if label is None:
            label = self._resolve(record, block, phase)
            self._labels[key] = label
        return label

    def _resolve(self, record: FragmentRecord, block: int, phase: str) -> str:
        storages = record.blocks.get(block)
        if not block or not storages:
            return f"{record.id}/"
        names = self._storage_names(phase)
        if names is not None and not all(s in names for s in storages):
            # Storages move (offload_params puts parameters in the host tier): look again.
            self._names = None
            names = self._storage_names(phase)
        if names is not None and all(s in names for s in storages):
            return f"{record.id}/{block_owner([names[s] for s in storages])}"
        ordinals = self._ordinals.setdefault(record.index, {})
        return f"{record.id}/#{ordinals.setdefault(block, len(ordinals))}"

    def _storage_names(self, phase: str) -> dict[int, str] | None:
        if self._names is not None:
            return self._names
        model = self._model()
        if model is None and self._found is not None:
            model = self._found()
        if model is None and phase != "backward":  # backward runs outside the compiled call
            model = _calling_module()
            if model is not None:
                self._found = weakref.ref(model)
        if model is None:
            return None
        self._names = _storage_names(model)
        return self._names

    def reset(self) -> None:
        self._names = None
        self._labels.clear()
        self._ordinals.clear()


_live: weakref.WeakSet[TraceRecorder] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for r in list(_live):
        r.flush()


class TraceRecorder:
    """Records the block sequence of every step; the compiler calls :meth:`on_block`.

    Args:
        path: JSON-lines file the steps are appended to (``None``: keep them in memory only).
        records: the compiler's fragment records (``MemCompiler.records``).
        model: the compiled module, when known (``None``: found from the stack, see above).
        keep: completed steps kept in memory (:meth:`steps`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        records: Callable[[], Sequence[FragmentRecord]],
        model: Callable[[], torch.nn.Module | None] = lambda: None,
        keep: int = 1000,
    ) -> None:
        if keep < 1:
            raise ValueError(f"TraceRecorder: keep must be >= 1; got {keep}")
        self.path = None if path is None else os.fspath(path)
        self._record = RecordIndex(records)
        self._idioms: dict[str, IdiomVector] = {}
        self._namer = _BlockNamer(model)
        self._lock = threading.Lock()
        self._done: deque[StepTrace] = deque(maxlen=keep)
        self._step: int | None = None
        self._events: list[BlockEvent] = []
        self._t0 = 0
        self._unwritten: list[StepTrace] = []
        if self.path is not None:
            # A fresh file per run: a trace mixes no runs.
            with open(self.path, "w", encoding="utf-8"):
                pass
        _live.add(self)

    # -- called by the compiler, on the training thread ---------------------------------------
    def on_block(self, step: int, index: int, kind: str, block: int, args: Sequence[Any]) -> None:
        """Record one call of fragment ``index`` in training step ``step`` (the compiler's count).

        ``args`` are the call's inputs; only the sizes of its non-parameter tensors are read.
        """
        now = time.perf_counter_ns()
        record = self._record(index)
        if record is None:  # called before the record exists (should not happen)
            return
        if record.id not in self._idioms:
            profile = record.profile
            self._idioms[record.id] = graph_idioms(profile.forward if profile else None)
        if step != self._step:
            self._end_step()
            self._step, self._t0 = step, now
        sizes: tuple[int, ...] = ()
        if kind != "backward" and args:
            static = record.static_inputs
            sizes = tuple(
                a.numel()
                for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and i not in static
            )[:MAX_SIZES]
        self._events.append(
            BlockEvent(
                phase=kind,
                fragment=record.id,
                block=self._namer.label(record, block, kind),
                t_us=(now - self._t0) / 1000,
                sizes=sizes,
            )
        )

    def on_block_end(
        self,
        step: int,
        index: int,
        kind: str,
        block: int,
        outputs: Any,
        small_ints: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        """Fragment ``index``'s call (the last :meth:`on_block`) returned ``outputs``: keep the
        values of its small integer outputs (:func:`small_int_outputs`) on its event.
        ``small_ints``: those values, when the caller read them already (the compiler reads them
        once per call for every observer and the prefetcher)."""
        if kind == "backward" or step != self._step or not self._events:
            return
        found = small_ints if small_ints is not None else small_int_outputs(outputs)
        if not found:
            return
        last = self._events[-1]
        record = self._record(index)
        if record is None or last.fragment != record.id or last.phase != kind:
            return  # not the call on_block saw last (should not happen: calls do not nest)
        self._events[-1] = dataclasses.replace(last, outputs=found)

    def on_block_reads(
        self, step: int, index: int, kind: str, block: int, values: tuple[int | float, ...]
    ) -> None:
        """The model's Python read ``values`` from a tensor after fragment ``index``'s call (the
        last :meth:`on_block`) returned: kept on its event, after the reads before it."""
        if step != self._step or not self._events:
            return
        last = self._events[-1]
        record = self._record(index)
        if record is None or last.fragment != record.id or last.phase != kind:
            return
        self._events[-1] = dataclasses.replace(last, reads=(*last.reads, values))

    def reset(self) -> None:
        """The compiler forgot its fragments (``torch._dynamo.reset()``): end the step."""
        self._end_step()
        self._step = None
        self._record.clear()
        self._idioms.clear()
        self._namer.reset()

    # -- reading ---------------------------------------------------------------------------
    def steps(self) -> list[StepTrace]:
        """Completed steps kept in memory (the step in progress is not included)."""
        with self._lock:
            return list(self._done)

    def flush(self) -> None:
        """End the step in progress and write every completed step to ``path``."""
        self._end_step()
        self._step = None
        self._write()

    # -- internals -------------------------------------------------------------------------
    def _end_step(self) -> None:
        if self._step is None or not self._events:
            return
        ids = dict.fromkeys(e.fragment for e in self._events)
        done = StepTrace(self._step, tuple(self._events), tuple((f, self._idioms[f]) for f in ids))
        self._events = []
        with self._lock:
            self._done.append(done)
            self._unwritten.append(done)
        self._write()

    def _write(self) -> None:
        if self.path is None:
            with self._lock:
                self._unwritten.clear()
            return
        with self._lock:
            pending, self._unwritten = self._unwritten, []
        if pending:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(s.to_json() + "\n" for s in pending))
