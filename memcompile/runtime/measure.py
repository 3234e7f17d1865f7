"""Measured device peak of running a function: the number every prediction is checked against.

    peak = memcompile.measure_peak(step)            # bytes, absolute, like max_memory_allocated
    m = memcompile.runtime.measure.measure(step)    # + resident bytes, per-range peaks, result

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: already absolute.

CPU: torch's CPU allocator reports to the profiler (``profile_memory=True``), whose "Total
Allocated" counts only from its own start. So the peak is

    resident bytes at the start  +  max over allocation events of (total allocated − level at start)

where the resident bytes are the distinct storages of every tensor the function can reach:
its arguments, the parameters, buffers and gradients of modules it can reach, optimizer state,
and what ``fn`` refers to through its closure, ``self`` or module globals (or what is passed as
``resident=``). A block allocated before the measurement and freed during it is invisible to the
profiler; :func:`measure` warns when reachable tensors vanish that way (free them first, e.g.
``zero_grad(set_to_none=True)``). Never a ``TorchDispatchMode`` tracker: Dynamo silently runs
compiled frames eagerly while one is active.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memcompile.errors import format_bytes
from memcompile.runtime.store import is_host_placed

log = logging.getLogger(__name__)

__all__ = [
    "CpuInterval",
    "MeasurementWarning",
    "PeakMeasurement",
    "allocation_events",
    "allocation_trace",
    "measure",
    "measure_peak",
    "reachable_tensors",
    "resident_bytes",
    "storage_sizes",
]

_RANGE_PREFIX = "memcompile:"
_MAX_DEPTH = 4
_CANARY_BYTES = 12_347  # an odd size no tensor of a model has


class MeasurementWarning(UserWarning):
    """A measurement is known to be incomplete."""


@dataclass(frozen=True)
class PeakMeasurement:
    """What :func:`measure` saw.

    Attributes:
        peak: absolute device peak while ``fn`` ran, bytes.
        resident_bytes: bytes resident at the start (CPU: reachable storages; CUDA: allocated).
        device: ``"cpu"`` or ``"cuda"``.
        ranges: absolute peak inside each ``memcompile:*`` profiler range (fragment calls),
            keyed by range name (CPU only).
        unseen_free_bytes: bytes of reachable tensors allocated before the measurement that were
            freed during it; the CPU peak may be overstated by up to this much.
        result: what ``fn`` returned.
        complete: the profiler recorded every allocation (CPU; checked with a canary).
    """

    peak: int
    resident_bytes: int
    device: str
    ranges: dict[str, int] = field(default_factory=dict)
    unseen_free_bytes: int = 0
    result: Any = None
    complete: bool = True


def _walk(obj: Any, out: dict[int, torch.Tensor], seen: dict[int, int], depth: int) -> None:
    # ``seen``: the least depth each object was walked at. One reached again by a shorter path
    # is walked again: first reached deep (through a function's closure), its own objects may
    # have been past the depth limit then.
    if depth > _MAX_DEPTH or seen.get(id(obj), _MAX_DEPTH + 1) <= depth:
        return
    seen[id(obj)] = depth
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), obj)
        if obj.grad is not None:
            out.setdefault(id(obj.grad), obj.grad)
        return
    if isinstance(obj, nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            _walk(t, out, seen, depth + 1)
        return
    if isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                _walk(p, out, seen, depth + 1)
        for state in obj.state.values():
            _walk(state, out, seen, depth + 1)
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk(v, out, seen, depth + 1)
        return
    if isinstance(obj, functools.partial):
        _walk(obj.func, out, seen, depth + 1)
        _walk(obj.args, out, seen, depth + 1)
        _walk(obj.keywords, out, seen, depth + 1)
        return
    if callable(obj):
        # What a function can reach: its bound object, closure cells and referenced globals.
        owner = getattr(obj, "__self__", None)
        if owner is not None:
            _walk(owner, out, seen, depth + 1)
        fn = getattr(obj, "__func__", obj)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                _walk(cell.cell_contents, out, seen, depth + 1)
            except ValueError:  # an empty cell
                pass
        code, globs = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is not None and globs is not None:
            for name in code.co_names:
                if name in globs:
                    _walk(globs[name], out, seen, depth + 1)


def reachable_tensors(*objects: Any) -> list[torch.Tensor]:
    """Tensors reachable from ``objects`` (see the module docstring), each once."""
    out: dict[int, torch.Tensor] = {}
    seen: dict[int, int] = {}
    for obj in objects:
        _walk(obj, out, seen, 0)
    return list(out.values())


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory: ``t`` itself, or the inner tensors of a
    wrapper subclass (a ``DTensor``'s local shard, as FSDP2's sharded parameters are), which
    has no storage of its own."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [p for a in attrs for p in plain_tensors(getattr(t, a))]


def storage_sizes(
    tensors: Iterable[Any], device: str | None = None, *, keep_host: bool = False
) -> dict[int, int]:
    """``{storage address: nbytes}`` of the real tensors among ``tensors`` (on ``device`` if
    given): shared storages appear once. Fake and meta tensors have no memory and are skipped;
    so are host-tier tensors (runtime/store.py), which have none on the device, or with
    ``keep_host`` they are listed with 0 bytes (their addresses identify them). A wrapper
    subclass (``DTensor``) counts the storages of the tensors it wraps."""
    found: dict[int, int] = {}
    plain = (p for t in tensors if isinstance(t, torch.Tensor) for p in plain_tensors(t))
    for t in plain:
        if (
            not isinstance(t, torch.Tensor)
            or isinstance(t, torch._subclasses.FakeTensor)
            or t.device.type == "meta"
            or (device is not None and t.device.type != device)
        ):
            continue
        s = t.untyped_storage()
        if is_host_placed(t):
            if keep_host:
                found[s.data_ptr()] = 0
        elif s.nbytes():
            found[s.data_ptr()] = s.nbytes()
    return found


def resident_bytes(*objects: Any, device: str = "cpu") -> int:
    """Distinct storage bytes on ``device`` of the tensors reachable from ``objects``."""
    return sum(storage_sizes(reachable_tensors(*objects), device).values())


def _pick_device(tensors: list[torch.Tensor], device: str | torch.device | None) -> str:
    if device is not None:
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"measure_peak: device must be 'cpu' or 'cuda'; got {device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("measure_peak: device='cuda' but CUDA is not available")
        return kind
    return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"


def _measure_cuda(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> PeakMeasurement:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return PeakMeasurement(torch.cuda.max_memory_allocated(), start, "cuda", result=result)


def allocation_trace(
    prof: torch.profiler.profile, range_prefix: str = _RANGE_PREFIX
) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
    """CPU allocation levels and named ranges of a finished ``profile_memory=True`` session.

    Returns ``(levels, ranges)``: ``levels`` is ``(time_ns, bytes allocated since the session
    started)`` after each allocation or free the profiler saw, in time order; ``ranges`` is
    ``(name, start_ns, end_ns)`` of every ``record_function`` whose name starts with
    ``range_prefix``.
    """
    events, ranges = allocation_events(prof, range_prefix)
    return [(t, level) for t, _, level in events], ranges


def allocation_events(
    prof: torch.profiler.profile, range_prefix: str = _RANGE_PREFIX
) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """As :func:`allocation_trace`, with each event's size: ``(time_ns, bytes, level)``
    (negative bytes: a free).

    The level counts only blocks allocated during the session. A free of an older block (a
    tensor from before, or garbage the collector happens to reclaim meanwhile) does not lower
    it: such blocks were never part of the measured function's memory, and the profiler's own
    running total would otherwise drift with whatever Python frees in between.
    """
    raw, ranges = _allocations(prof, range_prefix)
    return _levels(raw), ranges


def _levels(raw: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(time_ns, bytes, level)`` of each ``(time_ns, bytes, address)`` event: the bytes of
    the blocks allocated since the first event still live after it (a free of an older block
    does not count: see :func:`allocation_events`)."""
    live: dict[int, int] = {}
    level = 0
    events: list[tuple[int, int, int]] = []
    for t, size, ptr in raw:
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            level += size
        elif ptr in live:
            level -= live.pop(ptr)
        events.append((t, size, level))
    return events


def _allocations(
    prof: torch.profiler.profile, range_prefix: str = _RANGE_PREFIX
) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """A finished session's CPU allocation events ``(time_ns, bytes, address)`` in time order
    (negative bytes: a free), and its ranges whose names start with ``range_prefix``."""
    from torch._C._profiler import _EventType, _ExtraFields_Allocation

    allocs: list[tuple[int, int, int, int]] = []
    ranges: list[tuple[str, int, int]] = []
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler session has not finished (no results to read)")
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        ef = e.extra_fields
        if isinstance(ef, _ExtraFields_Allocation):
            if ef.device.type == "cpu":
                allocs.append((e.start_time_ns, e.id, ef.alloc_size, ef.ptr))
        elif e.tag == _EventType.TorchOp and e.name.startswith(range_prefix):
            ranges.append((e.name, e.start_time_ns, e.end_time_ns))
        stack.extend(e.children)
    allocs.sort()
    return [(t, size, ptr) for t, _, size, ptr in allocs], ranges


def range_levels(levels: Sequence[tuple[int, int]], t0: int, t1: int) -> tuple[int, int]:
    """``(opening, highest)`` allocation levels of a profiler range from ``t0`` to ``t1``:
    the level of the last event before it, and the highest level from then to its end
    (``levels``: :func:`allocation_trace`'s ``(time_ns, level)``)."""
    before = [lv for t, lv in levels if t < t0]
    opening = before[-1] if before else 0
    return opening, max([opening, *(lv for t, lv in levels if t0 <= t <= t1)])


class CpuInterval:
    """The CPU profiler's peak over an interval that is not one function call: begun in one
    place, ended in another (memcompile samples a training iteration this way, from its first
    fragment call to its optimizer step: ``step/checks.py``). :func:`measure` runs a function
    through one.

    Args:
        roots: what the resident bytes at the start are reachable from (see the module
            docstring).
        inside: may begin inside a session of memcompile's that runs (else it opens its own,
            and the intervals in that one read as incomplete, as when any other profiler
            begins; :meth:`start` passes True).

    Intervals nest. The first opens a profiler session; one begun while it runs (memcompile's
    sample of an iteration inside the user's ``measure_peak``) reads the same session, between
    two marker allocations of a size of its own, and its measurement comes when the session is
    read (:meth:`end` returns ``None``; :meth:`then` gets it)::

        measure_peak(an iteration)  |-------------------------------------|  the session
        the budget's sample             |+m .......................+m|        read at its end

    A session is never stopped and begun again inside: a ``record_function`` range open across
    the two (the optimizer step's, whose hooks end the sample) corrupts the profiler's state.
    An interval still open when the session ends, or when another profiler stops it, reads as
    incomplete; none begins while another profiler (the user's own) runs.
    """

    @classmethod
    def start(cls, *roots: Any) -> CpuInterval | None:
        """An interval from now, or ``None`` while another profiler runs (the user's own
        profiling is never disturbed: memcompile samples another time)."""
        if torch._C._autograd._profiler_enabled() and not _SESSION.alive():
            return None
        return cls(*roots, inside=True)

    def __init__(self, *roots: Any, inside: bool = False) -> None:
        self._roots = roots
        # Keep storage addresses only: holding the tensors would keep e.g. old gradients alive.
        self._before = storage_sizes(reachable_tensors(*roots), "cpu")
        self.resident = sum(self._before.values())
        self._vanished = 0
        self._result: PeakMeasurement | None = None
        self._then: list[Callable[[PeakMeasurement], object]] = []
        _SESSION.open(self, inside=inside)

    def _read(self, events: Sequence[tuple[int, int, int]], ranges: Sequence[RangeSpan]) -> None:
        """The measurement from its piece of the session: the ``(time_ns, bytes, address)``
        allocation events in time order from its start to its end, and the ranges."""
        levels = [(t, level) for t, _, level in _levels(events)]
        highest = max((level for _, level in levels), default=0)
        resident, per_range = self.resident, dict[str, int]()
        for name, t0, t1 in ranges:
            _, top = range_levels(levels, t0, t1)
            per_range[name] = max(per_range.get(name, 0), resident + top)
        self._done(PeakMeasurement(resident + highest, resident, "cpu", per_range, self._vanished))

    def _lost(self) -> None:
        self._done(PeakMeasurement(self.resident, self.resident, "cpu", complete=False))

    def _done(self, m: PeakMeasurement) -> None:
        self._result = m
        then, self._then = self._then, []
        for fn in then:
            fn(m)

    def then(self, fn: Callable[[PeakMeasurement], object]) -> None:
        """Call ``fn`` with the measurement once there is one (now, if there is)."""
        if self._result is not None:
            fn(self._result)
        else:
            self._then.append(fn)

    def cancel(self) -> None:
        """Stop without reading (a session it opened ends: those inside it read as
        incomplete)."""
        self._then.clear()
        _SESSION.close(self, read=False)

    def end(self) -> PeakMeasurement | None:
        """Stop and read: the absolute peak since the start, per ``memcompile:*`` range too
        (``complete`` False: the profiler lost events, e.g. another session stopped this one).
        ``None`` for an interval inside another's session, which is read when that one ends
        (:meth:`then`)."""
        # Reachable storages from before that are gone now were freed without a profiler event.
        after = storage_sizes(reachable_tensors(*self._roots), "cpu")
        self._vanished = sum(n for ptr, n in self._before.items() if ptr not in after)
        _SESSION.close(self, read=True)
        return self._result


#: ``(name, start_ns, end_ns)`` of a ``memcompile:*`` profiler range.
RangeSpan = tuple[str, int, int]


class _Session:
    """memcompile's one CPU profiler session: the interval that opened it, and those inside
    it with their markers' sizes."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._owner: CpuInterval | None = None
        self._inside: dict[CpuInterval, int] = {}  # open, by marker size
        self._ended: dict[CpuInterval, int] = {}  # ended, to be read with the session
        self._markers = 0
        self._sizes: set[int] = set()  # the session's markers (cancelled ones too)

    def alive(self) -> bool:
        """The session runs (no other profiler stopped it)."""
        return self._prof is not None and torch._C._autograd._profiler_enabled()

    def open(self, interval: CpuInterval, *, inside: bool) -> None:
        """Begin ``interval``: inside the session that runs (its markers), else a session."""
        if inside and self.alive():
            # An odd size no tensor of a model has, allocated at its start and at its end.
            self._markers += 1
            size = _CANARY_BYTES + 2 * self._markers
            self._inside[interval] = size
            self._sizes.add(size)
            torch.empty(size, dtype=torch.uint8)
            return
        self._drop()
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._owner = interval
        self._sizes = {_CANARY_BYTES}
        self._prof.__enter__()
        # A canary of a size nothing else allocates: if its events are missing, the profiler
        # lost events and the peaks cannot be trusted.
        torch.empty(_CANARY_BYTES, dtype=torch.uint8)

    def close(self, interval: CpuInterval, *, read: bool) -> None:
        """End ``interval``: its end marker, or (its own session) the session, read or not."""
        if interval in self._inside:
            size = self._inside.pop(interval)
            if not read:
                return
            if self.alive():
                torch.empty(size, dtype=torch.uint8)
                self._ended[interval] = size
            else:
                interval._lost()
        elif interval is self._owner:
            if read:
                self._read()
            else:
                self._drop()
        elif read and interval._result is None:  # its session ended before it
            interval._lost()

    def _drop(self) -> None:
        """End the session unread: the intervals in it are incomplete."""
        prof, self._prof, self._owner = self._prof, None, None
        if prof is not None and torch._C._autograd._profiler_enabled():
            prof.__exit__(None, None, None)
        inside = [*self._inside, *self._ended]
        self._inside.clear()
        self._ended.clear()
        for interval in inside:
            interval._lost()

    def _read(self) -> None:
        """End the session and give each interval its events: the owner all of them, each one
        inside those between its markers; the markers and the canary in no one's."""
        prof, owner = self._prof, self._owner
        assert owner is not None
        if not torch._C._autograd._profiler_enabled():  # stopped by another session: lost
            owner._lost()
            self._prof = None
            self._drop()
            return
        prof.__exit__(None, None, None)
        ended = self._ended
        self._prof, self._owner, self._ended = None, None, {}
        for interval in self._inside:  # the session ends under an open one
            interval._lost()
        self._inside.clear()
        events, ranges = _allocations(prof)
        ranges = [r for r in ranges if r[1] <= r[2]]
        # Each marker's (and the canary's) allocation positions, and what no one counts:
        # those and their frees.
        sizes = self._sizes
        marks: dict[int, list[int]] = {}
        blips: set[int] = set()
        for i, (_, size, ptr) in enumerate(events):
            if size in sizes:
                marks.setdefault(size, []).append(i)
                blips.add(i)
                free = next(
                    (j for j in range(i + 1, len(events)) if events[j][1:] == (-size, ptr)), None
                )
                if free is not None:
                    blips.add(free)
        if _CANARY_BYTES not in marks:  # the profiler lost events
            for interval in (owner, *ended):
                interval._lost()
            return
        kept = [(i, e) for i, e in enumerate(events) if i not in blips]
        owner._read([e for _, e in kept], ranges)
        for interval, size in ended.items():
            at = marks.get(size, [])
            if len(at) != 2:
                interval._lost()
                continue
            t0, t1 = events[at[0]][0], events[at[1]][0]
            interval._read(
                [e for i, e in kept if at[0] < i < at[1]],
                [r for r in ranges if t0 <= r[1] and r[2] <= t1],
            )


_SESSION = _Session()


def _measure_cpu(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], roots: tuple[Any, ...]
) -> PeakMeasurement:
    interval = CpuInterval(*roots)
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        interval.cancel()
        raise
    m = interval.end()
    assert m is not None  # (its own session)
    if not m.complete:
        warnings.warn(
            "measure_peak: the CPU profiler lost allocation events during this measurement; the "
            "measured peak is unreliable (measure again)",
            MeasurementWarning,
            stacklevel=3,
        )
    if m.unseen_free_bytes:
        warnings.warn(
            f"measure_peak: {format_bytes(m.unseen_free_bytes)} of tensors allocated before the "
            "measurement were freed during it; the CPU profiler does not see those frees, so the "
            "peak may be overstated by up to that much. Free them before measuring "
            "(e.g. optimizer.zero_grad(set_to_none=True)).",
            stacklevel=3,
        )
    return dataclasses.replace(m, result=result)


def measure(
    fn: Callable[..., Any],
    *args: Any,
    resident: Iterable[Any] | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> PeakMeasurement:
    """Run ``fn(*args, **kwargs)`` once and measure its absolute device peak.

    Args:
        fn: the function to run (e.g. one training step).
        resident: extra objects (tensors, modules, optimizers) resident during ``fn`` that it
            cannot reach by itself; they are added to the resident bytes (CPU).
        device: ``"cpu"`` or ``"cuda"``; by default CUDA if any reachable tensor is on CUDA.

    ``resident`` and ``device`` are keyword-only and are not passed on to ``fn``.
    """
    if not callable(fn):
        raise TypeError(f"measure_peak: fn must be callable; got {type(fn).__name__}")
    roots = (fn, args, kwargs, list(resident) if resident is not None else [])
    kind = _pick_device(reachable_tensors(*roots), device)
    m = _measure_cuda(fn, args, kwargs) if kind == "cuda" else _measure_cpu(fn, args, kwargs, roots)
    log.debug("measured peak %d B (resident %d B) on %s", m.peak, m.resident_bytes, m.device)
    return m


def measure_peak(
    fn: Callable[..., Any],
    *args: Any,
    resident: Iterable[Any] | None = None,
    device: str | torch.device | None = None,
    **kwargs: Any,
) -> int:
    """Absolute device peak in bytes of running ``fn(*args, **kwargs)`` (see :func:`measure`)."""
    return measure(fn, *args, resident=resident, device=device, **kwargs).peak
