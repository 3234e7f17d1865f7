"""The prefetch cache: device copies of host-placed parameters, made before a graph asks.

The pilot (``dynamic/prefetch.py``) predicts the next blocks of a dynamic network and copies the
host-placed parameters they read into this cache; the graphs' fetch (``memcompile::reload`` of a
host-placed parameter, ``rewrites/params.py``) goes through :meth:`TieredStore.get`, which asks
the cache first:

    cache = PrefetchCache()
    store.prefetched = cache                   # TieredStore.get consults it for the host tier
    cache.watch(params)                        # host-placed parameters the graphs fetch
    cache.prefetch(p, device, block="F2/blocks.0.experts.3")   # a device copy, now
    cache.prefetch_many(ps, device, block="F2/blocks.0.experts.3")  # a block's: one copy call
    y = store.get(p, device, "host")           # the copy (a hit, handed over) or a fresh one
    cache.evict(keep={...})                    # a misprediction: free the copies nobody took
    cache.trim(limit)                          # at most ``limit`` bytes cached

A hit hands the cached tensor to the graph (it leaves the cache: the graph frees it when done),
so a copy is used at most once. The prefetcher copies a block's parameters with one call
(:meth:`PrefetchCache.prefetch_many`: ``torch._foreach_copy_``, one CUDA event or copy-thread
job for the block), each into an allocation of its own, so each copy is freed where the plan
frees it. (One allocation for the block that the copies view, FSDP's flat layout, would hold a
block's bytes until its last copy dies: more than the plans and the step's prediction count.)
A miss fetches on demand, as without the cache. Correctness never depends on the cache: a copy
whose parameter changed since it was made (its version counter moved, e.g. an optimizer step)
is dropped as stale and fetched again. A copy that failed on the CPU's copy thread raises
:class:`~memcompile.OffloadError` at its first hit, in the step.

Counters (bytes, for the report): ``needed`` (fetches of watched parameters while counting is
on: the forward of a training step), ``hit`` (of those, served from the cache), ``prefetched``,
``wasted`` (copies freed unused, stale ones included), and ``stall_ns`` (time spent in on-demand
fetches while counting, and on the CPU in waits for prefetches the copy thread has not finished:
what the compute would wait for on a GPU, measured here on the CPU).

**Simulated device time** (a GPU estimate with a GPU profile; ``sim_*``): the prefetcher advances
:attr:`PrefetchCache.sim_clock` by each forward call's predicted compute time and issues each
copy at a simulated time (``prefetch(issue_s=…)``); the copies run one after the other on a
simulated copy stream, each taking :attr:`PrefetchCache.copy_seconds` of its bytes. While
counting, a hit waits until its copy is done (``sim_late_s``: the copy was issued too late to
hide) and a miss copies on demand; both add to ``sim_stall_s`` and move the clock. The fetch is
assumed at the clock's current point (the first reader's time within the call is not modelled,
which overstates a stall).

Each copy carries a ``tag`` (the prefetcher's: which predictor source, how many blocks ahead);
:attr:`PrefetchCache.by_tag` counts prefetched, hit and wasted bytes per tag.

**CUDA.** A host-placed CUDA parameter is a pinned CPU tensor (``pinned.py``); its copy runs
on the cache's own side stream, so it overlaps the compute stream's work:

    prefetch  allocates the copy on the compute stream; the side stream waits for the compute
              stream (the block may have just been freed by work still queued there), copies
              (``non_blocking``), records an event ``done``; ``copy.record_stream(side)`` keeps
              the allocator from reusing the block before the copy is done if it is freed
              unused (evicted, trimmed, stale)
    fetch     a hit: the compute stream waits for ``done``; every reader comes after it
              a miss: copied on the compute stream, as without the cache

The GPU's own clock says what the prefetches bought (``gpu_*``, measured, not simulated): while
counting, a hit records an event where the compute stream reaches the fetch, and the time from
there to ``done`` (when positive) is time the compute stream waited for a late copy
(``gpu_wait_s``, ``gpu_late_bytes``); a miss is timed between two events around its copy on the
compute stream (``gpu_miss_s``). Both are counted on the GPU's clock from where the compute
stream reached the fetch; in a step the host cannot keep ahead of (small kernels, the eager
inner compiler), the stream is idle by then and what they count is time the GPU would have
waited for the host anyway. The events are read when :meth:`PrefetchCache.counters` is
called (the report), which waits for them. ``PrefetchCache(asynchronous=False)`` copies on the
compute stream instead (what the overlap buys, for benchmarks).

**CPU.** A prefetch copies at once on the computing thread, unless the CPU's copy thread is on
(``copy_engine.py``, the stand-in for a GPU's copy engine; off by default) and the copy is at
least its ``MIN_BYTES``: then the computing thread goes on, a hit waits for the copy's job (while
counting, the wait is stall time), and a copy dropped unused is waited for
first, so its bytes are freed where the plan frees them. ``asynchronous=False`` copies at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from memcompile.errors import OffloadError
from memcompile.runtime import copy_engine
from memcompile.runtime.copy_engine import CopyJob
from memcompile.runtime.pinned import side_stream

log = logging.getLogger(__name__)

__all__ = ["CacheCounters", "PrefetchCache", "TagCounters"]


@dataclass(frozen=True)
class CacheCounters:
    """A snapshot of :class:`PrefetchCache`'s counters (bytes, except ``stall_ns``/counts)."""

    needed: int
    hit: int
    prefetched: int
    wasted: int
    stale: int
    stall_ns: int
    misses: int
    peak_bytes: int
    sim_stall_s: float = 0.0
    sim_late_s: float = 0.0
    #: CUDA, measured with events (see the module doc); ``None``: no CUDA copy timed
    gpu_wait_s: float | None = None
    gpu_late_bytes: int = 0
    gpu_miss_s: float | None = None


@dataclass
class _Entry:
    copy: torch.Tensor
    version: int
    nbytes: int
    block: str
    tag: str
    ready_s: float = -math.inf
    #: CUDA: recorded on the side stream when the copy is done; CPU: the copy thread's job
    #: (copy_engine.py); ``None``: a synchronous copy (or one waited for already)
    done: torch.cuda.Event | CopyJob | None = None
    #: the keys of the cached entries made by the same copy call (a block's, prefetch_many),
    #: this one's included: they share ``done``
    batch: set[int] = field(default_factory=set)


@dataclass
class TagCounters:
    """Bytes of the copies made under one tag: copied, used (hit), freed unused (wasted)."""

    prefetched: int = 0
    hit: int = 0
    wasted: int = 0


#: Timed CUDA events kept before the cache reads those already done (a long run without a
#: report must not hold an event per fetch forever).
MAX_PENDING_EVENTS = 4096


def _finish(entry: _Entry) -> None:
    # A copy dropped unused: if the copy thread still writes it, wait, so its bytes are freed
    # here, where the plan frees them, not when the thread is done with them.
    if isinstance(entry.done, CopyJob) and not entry.done.done:
        with contextlib.suppress(Exception):  # a failed copy nobody reads: nothing to report
            entry.done.wait()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class PrefetchCache:
    """Device copies of host-placed parameters, keyed by the host storage; see the module doc.

    Args:
        asynchronous: CUDA copies from pinned memory run on a side stream (else on the compute
            stream, in order with its work).
        time_gpu: CUDA: measure the compute stream's waits and on-demand copies with events.
    """

    def __init__(self, *, asynchronous: bool = True, time_gpu: bool = True) -> None:
        self.asynchronous = asynchronous
        #: CUDA: time hits and misses with events (the ``gpu_*`` counters; see the module doc).
        self.time_gpu = time_gpu
        self._spare_events: list[torch.cuda.Event] = []  # read already: recorded again later
        self._side: dict[int, torch.cuda.Stream] = {}  # device index -> the copies' stream
        # CUDA timing, read by counters(): (arrived, done, bytes) per hit, (start, end) per miss
        self._hit_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._miss_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._gpu_wait_s = self._gpu_miss_s = 0.0
        self._gpu_late_bytes = 0
        self._gpu_timed = False
        self._entries: dict[int, _Entry] = {}
        #: prefetch_many copies a block with one call (else one by one: benchmarks compare)
        self.batched = True
        self._watched: set[int] = set()
        self.bytes = 0
        #: Count fetches as needed (the forward of a training step); set by the prefetcher.
        self.counting = False
        self.needed = self.hit = self.prefetched = self.wasted = self.stale = 0
        #: Bytes of copies handed to a graph (every hit, counting or not): a call's share of
        #: what the cache held when it started is what it took (the rest stays cached).
        self.taken = 0
        self.stall_ns = self.misses = self.peak_bytes = 0
        #: per copy tag: bytes prefetched, hit, wasted
        self.by_tag: dict[str, TagCounters] = {}
        #: Simulated device time (see the module doc): the clock, the stall, the copy stream's
        #: free time, and a copy's seconds by its bytes (``None``: no simulation).
        self.sim_clock = 0.0
        self.sim_stall_s = self.sim_late_s = 0.0
        self._copy_free_s = 0.0
        self.copy_seconds: Callable[[int], float] | None = None

    # -- what the graphs fetch ------------------------------------------------------------
    def watch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Host-placed parameters whose fetches count (hits and misses)."""
        self._watched.update(_key(t) for t in tensors)

    def watches(self, h: torch.Tensor) -> bool:
        return h.device.type == "cpu" and _key(h) in self._watched

    def watches_key(self, key: int) -> bool:
        """:meth:`watches` for a CPU tensor whose storage address is ``key``."""
        return key in self._watched

    def fetch(
        self,
        h: torch.Tensor,
        on_demand: Callable[[], torch.Tensor],
        *,
        key: int | None = None,
        nbytes: int | None = None,
    ) -> torch.Tensor:
        """The cached copy of ``h`` (a hit, handed over), else ``on_demand()`` (a miss).
        ``key`` and ``nbytes``: ``h``'s storage address and bytes, where the caller has them."""
        if key is None or nbytes is None:
            storage = h.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
            fresh = (
                entry.version == h._version
                and entry.copy.shape == h.shape
                and entry.copy.stride() == h.stride()
                and entry.copy.dtype == h.dtype
            )
            if fresh:
                self.taken += entry.nbytes
                if isinstance(entry.done, CopyJob):
                    self._wait_for_thread(entry)
                elif entry.done is not None:
                    # A block's copies share the event: late, they are all late.
                    block_bytes = entry.nbytes + sum(
                        e.nbytes for k in entry.batch if k != key and (e := self._entries.get(k))
                    )
                    self._wait_for(entry, block_bytes)
                entry.batch.discard(key)
                if entry.done is not None:
                    # Waited for: the rest of the block's copies need no wait (on CUDA the
                    # compute stream's later work is ordered after this one), and the event is
                    # read or reused once.
                    for k in entry.batch:
                        if (sibling := self._entries.get(k)) is not None:
                            sibling.done = None
                if self.counting:
                    self.needed += nbytes
                    self.hit += nbytes
                    late = max(0.0, entry.ready_s - self.sim_clock)
                    self.sim_late_s += late
                    self._sim_wait(late)
                self.by_tag[entry.tag].hit += entry.nbytes
                return entry.copy
            # The parameter changed after the copy was made: never serve old values.
            _finish(entry)
            self.stale += entry.nbytes
            self.wasted += entry.nbytes
            self.by_tag[entry.tag].wasted += entry.nbytes
            entry.batch.discard(key)
            log.debug("prefetch cache: stale copy of %s dropped", entry.block)
        if not self.counting:
            return on_demand()
        # a pinned host tensor (a CUDA model's parameter): its copy runs on the compute stream
        timed = self.time_gpu and h.is_pinned()
        if timed:
            began = self._event()
            began.record()
        start = time.perf_counter_ns()
        out = on_demand()
        self.stall_ns += time.perf_counter_ns() - start
        if timed:
            ended = self._event()
            ended.record()
            self._miss_events.append((began, ended))
            self._gpu_timed = True
            self._bound_events()
        self.needed += nbytes
        self.misses += 1
        if self.copy_seconds is not None:
            self._sim_wait(self.copy_seconds(nbytes))
        return out

    def _sim_wait(self, seconds: float) -> None:
        if seconds > 0:
            self.sim_stall_s += seconds
            self.sim_clock += seconds

    def sim_advance(self, seconds: float) -> None:
        """The simulated device computed for ``seconds``."""
        self.sim_clock += seconds

    # -- the prefetcher's side -------------------------------------------------------------
    def has(self, h: torch.Tensor) -> bool:
        return _key(h) in self._entries

    def has_key(self, key: int) -> bool:
        """:meth:`has` for the host-placed tensor whose cache key (:meth:`key`) is ``key``."""
        return key in self._entries

    def prefetch(
        self,
        h: torch.Tensor,
        device: torch.device,
        block: str,
        tag: str = "",
        *,
        issue_s: float | None = None,
    ) -> int:
        """Copy ``h`` to ``device`` now (if not cached yet); returns the bytes copied. ``tag``:
        what the copy's use and waste are counted under (:attr:`by_tag`); ``issue_s``: when
        the copy is issued on the simulated clock (``None``: not simulated, ready at once)."""
        key = _key(h)
        if key in self._entries:
            return 0
        return self._prefetch_batch({key: h}, device, block, tag, issue_s)

    def prefetch_many(
        self,
        tensors: Sequence[torch.Tensor],
        device: torch.device,
        block: str,
        tag: str = "",
        *,
        issue_s: float | None = None,
        limit: float = math.inf,
    ) -> int:
        """:meth:`prefetch` for ``tensors`` (one block's), in order while the cache holds at
        most ``limit`` bytes, with one copy call and one event (CUDA) or job (the CPU's copy
        thread) for all of them: ``torch._foreach_copy_`` into a device allocation each, so
        each copy is freed on its own, where the plan frees it. Returns the bytes copied.

        ``batched = False`` copies them one by one instead (:meth:`prefetch`, what the
        benchmarks compare with)."""
        todo: dict[int, torch.Tensor] = {}
        room = limit - self.bytes
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._entries or key in todo:
                continue
            room -= storage.nbytes()
            if room < 0:
                break
            todo[key] = t
        if len(todo) < 2 or not self.batched:
            return sum(self.prefetch(t, device, block, tag, issue_s=issue_s) for t in todo.values())
        return self._prefetch_batch(todo, device, block, tag, issue_s)

    def _prefetch_batch(
        self,
        todo: dict[int, torch.Tensor],
        device: torch.device,
        block: str,
        tag: str,
        issue_s: float | None,
    ) -> int:
        # One copy call for the tensors (``copy_`` for one, ``_foreach_copy_`` for a block): an
        # allocation each (each freed when the plan says), one event or job they all wait on.
        srcs = list(todo.values())
        dsts = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in srcs
        ]
        nbytes = [t.untyped_storage().nbytes() for t in srcs]
        total = sum(nbytes)
        done: torch.cuda.Event | CopyJob | None = None
        cuda = dsts[0].device.type == "cuda"
        if cuda and self.asynchronous and all(t.is_pinned() for t in srcs):
            compute = torch.cuda.current_stream(dsts[0].device)
            side = side_stream(self._side, dsts[0].device)
            side.wait_stream(compute)  # the copies' blocks may have been freed by queued work
            with torch.cuda.stream(side):
                copy_engine.copy_all(dsts, srcs, non_blocking=True)
            done = self._event()
            done.record(side)
            for d in dsts:  # freed unused while the copy runs: not reused before it ends
                d.record_stream(side)
        elif not cuda and self.asynchronous and copy_engine.worth(total):
            done = copy_engine.submit_many(dsts, srcs)  # the CPU's copy engine (copy_engine.py)
        else:
            copy_engine.copy_all(dsts, srcs)
        ready = -math.inf
        if issue_s is not None and self.copy_seconds is not None:
            ready = self._copy_free_s = max(issue_s, self._copy_free_s) + self.copy_seconds(total)
        batch = set(todo)
        for (key, t), copy, n in zip(todo.items(), dsts, nbytes, strict=True):
            self._entries[key] = _Entry(copy, t._version, n, block, tag, ready, done, batch)
        self.bytes += total
        self.prefetched += total
        self.by_tag.setdefault(tag, TagCounters()).prefetched += total
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return total

    def retag_key(self, key: int, tag: str) -> None:
        """Count the cached copy of the host-placed tensor whose cache key (:meth:`key`) is
        ``key`` (its bytes, use or waste) under ``tag`` from now on: the prediction that keeps
        it now, not the one that made it."""
        entry = self._entries.get(key)
        if entry is None or entry.tag == tag:
            return
        self.by_tag[entry.tag].prefetched -= entry.nbytes
        self.by_tag.setdefault(tag, TagCounters()).prefetched += entry.nbytes
        entry.tag = tag

    def evict(self, keep: Collection[int] = ()) -> int:
        """Free the copies whose host storage is not in ``keep`` (a misprediction); returns the
        bytes freed."""
        freed = 0
        for key in [k for k in self._entries if k not in keep]:
            freed += self._drop(key)
        return freed

    def trim(self, limit: int, prefer: Collection[int] = ()) -> int:
        """Free copies until at most ``limit`` bytes are cached: the newest first, those whose
        host storage is in ``prefer`` last; returns the bytes freed."""
        freed = 0
        order = [k for k in self._entries if k not in prefer] + [
            k for k in self._entries if k in prefer
        ]
        for key in reversed(order):
            if self.bytes <= limit:
                break
            freed += self._drop(key)
        return freed

    def _drop(self, key: int) -> int:
        entry = self._entries.pop(key)
        _finish(entry)
        entry.batch.discard(key)
        self.bytes -= entry.nbytes
        self.wasted += entry.nbytes
        self.by_tag[entry.tag].wasted += entry.nbytes
        return entry.nbytes

    def clear(self) -> int:
        """Free every copy (counted as wasted); returns the bytes freed."""
        return self.evict()

    def counters(self) -> CacheCounters:
        """The counters now; on CUDA it first waits for the timed copies and reads their events."""
        self._read_events()
        return CacheCounters(
            needed=self.needed,
            hit=self.hit,
            prefetched=self.prefetched,
            wasted=self.wasted,
            stale=self.stale,
            stall_ns=self.stall_ns,
            misses=self.misses,
            peak_bytes=self.peak_bytes,
            sim_stall_s=self.sim_stall_s,
            sim_late_s=self.sim_late_s,
            gpu_wait_s=self._gpu_wait_s if self._gpu_timed else None,
            gpu_late_bytes=self._gpu_late_bytes,
            gpu_miss_s=self._gpu_miss_s if self._gpu_timed else None,
        )

    def _wait_for_thread(self, entry: _Entry) -> None:
        # A hit on a copy the CPU's copy thread made: wait until it is done (while counting,
        # the wait is stall time: the copy was issued too late to hide).
        job = entry.done
        assert isinstance(job, CopyJob)
        start = time.perf_counter_ns()
        waited = not job.done
        try:
            job.wait()  # raises the copy's error, if any
        except (OSError, RuntimeError) as e:
            raise OffloadError(f"host tier: the prefetch of {entry.block} failed: {e}") from e
        if waited and self.counting:
            self.stall_ns += time.perf_counter_ns() - start

    # -- CUDA ------------------------------------------------------------------------------------
    def _wait_for(self, entry: _Entry, nbytes: int) -> None:
        # A hit on a side-stream copy: the compute stream waits for it (and, while counting,
        # marks where it arrived, to measure how long it waited: late, ``nbytes`` were).
        done = entry.done
        assert isinstance(done, torch.cuda.Event)
        compute = torch.cuda.current_stream(entry.copy.device)
        if self.counting and self.time_gpu:
            arrived = self._event()
            arrived.record(compute)  # before the wait: where the stream arrived
            compute.wait_event(done)
            self._hit_events.append((arrived, done, nbytes))
            self._gpu_timed = True
            self._bound_events()
        else:
            compute.wait_event(done)
            self._spare_events.append(done)  # waited for: free to record again

    def _event(self) -> torch.cuda.Event:
        # A timing event, reused once read: creating one per copy costs host time per fetch.
        spare = self._spare_events
        return spare.pop() if spare else torch.cuda.Event(enable_timing=True)

    def _bound_events(self) -> None:
        if len(self._hit_events) + len(self._miss_events) > MAX_PENDING_EVENTS:
            self._read_events(block=False)

    def _read_events(self, *, block: bool = True) -> None:
        """Add the timed hits' waits and misses' copies to the ``gpu_*`` counters. ``block``:
        wait for every event (else read those done and keep the rest)."""
        hits: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        for arrived, done, nbytes in self._hit_events:
            if not block and not (arrived.query() and done.query()):
                hits.append((arrived, done, nbytes))
                continue
            arrived.synchronize()
            done.synchronize()
            waited = arrived.elapsed_time(done) / 1e3  # ms; > 0: done after the arrival
            if waited > 0:
                self._gpu_wait_s += waited
                self._gpu_late_bytes += nbytes
            self._spare_events += (arrived, done)
        misses: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for began, ended in self._miss_events:
            if not block and not ended.query():
                misses.append((began, ended))
                continue
            ended.synchronize()
            self._gpu_miss_s += began.elapsed_time(ended) / 1e3
            self._spare_events += (began, ended)
        self._hit_events, self._miss_events = hits, misses

    @staticmethod
    def key(t: torch.Tensor) -> int:
        """The cache key of a host-placed tensor (its storage address)."""
        return _key(t)
