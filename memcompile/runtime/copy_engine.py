"""The CPU device's copy engine: host<->device copies on a background thread, a GPU's DMA stand-in.

On a GPU, copies between pinned host memory and the device run on a copy engine while the
compute stream works; memcompile issues them on a side stream and waits on an event before the
first use (``store.py``, ``cache.py``). On the CPU device the "device" and the host tier are the
same RAM, and a copy on the computing thread hides nothing. This module gives the CPU the same
shape: one background thread runs the copies in the order they were issued (FIFO, like a
stream), and each copy returns a :class:`CopyJob`, the event a reader waits on::

    job = submit(dst, src)      # dst.copy_(src) on the copy thread; returns at once
    ...                         # the computing thread goes on (OMP keeps its own threads)
    job.wait()                  # before the first use of dst: done, or its error raised here

**Off by default** (``MEMCOMPILE_COPY_THREAD=1`` turns it on, :func:`using` in benchmarks and
tests): measured on this project's 2-core CPU it makes training slower, not faster
(``benchmarks/results/copy_thread.md``). The bench GPT's host-tier plan spends 13.8 ms a step of
its ~1 s on reloads and fetches, the thread takes 2.9 ms of that off the computing thread, and
the step still runs 7 % slower (997 against 936 ms, 21 paired steps; 6 % in two earlier runs):
the thread needs the GIL to start each copy, and shares the memory bus with the compute. A small
MoE's prefetches (a block of 9 tensors, 264 KiB) cost more to hand over than to make, even as one
job per block: 67 us to issue and 138 us in the hits' waits, against 53 + 29 us copied on the
computing thread (``benchmarks/results/block_copy.md``).
What it is for: a host whose copies are slow (the disk tier's reads) or a CPU with cores to
spare, measured there first.

Where it is used when on (CPU device only; CUDA keeps its streams):

    prefetch cache   a pilot prefetch of a block's host-placed parameters (cache.py), one
                     job for the block: a hit waits for its job at the fetch, a copy dropped
                     unused is waited for first (its bytes are freed when the plan says, not
                     when the thread is done)
    store.get        the reload of a swapped tensor (a ``put`` result; its graph has a
                     ``memcompile::wait`` before the first reader, ``store.wait``)

Not used for: a ``put`` (the copy must finish before its source is freed, which the graph
decides: the thread would hold the source's bytes longer than the plan predicts), a host-placed
parameter's on-demand fetch (its graph has no ``wait``; it is a miss anyway, needed now) and
copies under :data:`MIN_BYTES`. The memory of every copy is allocated on the computing thread,
where the plan put it, so predictions and the CPU profiler's measurements do not change.

The thread uses a core, as a DMA engine would use its own hardware: on a 2-core machine with
``OMP_NUM_THREADS=1`` compute has one core and the copies the other. Correctness never depends
on timing: every reader waits for its job. The thread starts with the first copy, stops after
:data:`IDLE_EXIT_S` without work, at :func:`shutdown` (``torch._dynamo.reset()`` through the
compilers' reset, and interpreter exit) and is started again by the next copy; a forked child
starts its own.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = [
    "IDLE_EXIT_S",
    "MIN_BYTES",
    "CopyJob",
    "active",
    "copy_all",
    "running",
    "shutdown",
    "submit",
    "submit_many",
    "using",
    "worth",
]

#: Seconds without a copy after which the thread exits (the next copy starts it again).
IDLE_EXIT_S = 30.0

#: Copies smaller than this run at once on the computing thread: handing one to the thread
#: costs more than it takes (this CPU, 2026-11-29: ~12-40 us to issue and wake the thread, which
#: needs the GIL to start; a 256 KiB copy takes 8 us).
MIN_BYTES = 1 << 20


def _from_env(value: str | None) -> bool:
    """``MEMCOMPILE_COPY_THREAD``: ``1`` on, ``0`` or unset off; anything else is warned about
    and leaves it off."""
    if value in (None, "", "0"):
        return False
    if value == "1":
        return True
    warnings.warn(
        f"MEMCOMPILE_COPY_THREAD={value!r}: expected 0 or 1; the CPU's copy thread stays off",
        stacklevel=2,
    )
    return False


_enabled = _from_env(os.environ.get("MEMCOMPILE_COPY_THREAD"))


def copy_all(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, non_blocking: bool = False
) -> None:
    """``dsts[i].copy_(srcs[i])`` for each, in one call: ``copy_`` for one tensor,
    ``torch._foreach_copy_`` for more (a block's copies, ``cache.py``); under ``no_grad``, so a
    copy from a parameter that requires grad is not an autograd result."""
    with torch.no_grad():
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0], non_blocking=non_blocking)
        else:
            torch._foreach_copy_(list(dsts), list(srcs), non_blocking=non_blocking)


class CopyJob:
    """One copy call issued to the thread (:func:`copy_all`: one tensor, or a list): :meth:`wait`
    blocks until it is done and raises its error, if it had one (once per waiter)."""

    __slots__ = ("_done", "_dst", "_error", "_src")

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        self._dst: Sequence[torch.Tensor] | None = dsts
        self._src: Sequence[torch.Tensor] | None = srcs
        self._error: BaseException | None = None
        self._done = threading.Event()

    def _run(self) -> None:
        dsts, srcs = self._dst, self._src
        try:
            assert dsts is not None and srcs is not None
            # (Grad mode is per thread: this one's is on; copy_all turns it off.)
            copy_all(dsts, srcs)
        except BaseException as e:  # handed to the waiter
            self._error = e
        finally:
            self._dst = self._src = None  # the copy holds no memory once done
            self._done.set()

    @property
    def done(self) -> bool:
        """The copy finished (or failed)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the copy is done; raise the error it hit on the thread.

        Raises:
            RuntimeError or OSError: what ``copy_`` raised on the thread (the caller turns it
                into its own error, e.g. ``OffloadError``)."""
        self._done.wait()
        if self._error is not None:
            raise self._error


class _Engine:
    """The thread and its queue (one per process: one DMA engine)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(self, job: CopyJob) -> None:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._queue, self._thread, self._pid = queue.SimpleQueue(), None, os.getpid()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, args=(self._queue,), name="memcompile-copy", daemon=True
                )
                self._thread.start()
                log.debug("memcompile copy thread started")
            self._queue.put(job)

    def _loop(self, jobs: queue.SimpleQueue[CopyJob | None]) -> None:
        while True:
            try:
                job = jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    # A copy submitted meanwhile is in the queue: take it, or exit for good.
                    if not jobs.empty():
                        continue
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
            if job is None:
                return
            job._run()

    def shutdown(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None or self._pid != os.getpid():
                return
            # After every copy issued so far (they finish first); a copy issued from now on
            # goes to a new queue and thread, never to this one.
            self._queue.put(None)
            self._queue = queue.SimpleQueue()
        thread.join()
        log.debug("memcompile copy thread stopped")

    def running(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()


_engine = _Engine()


def active() -> bool:
    """Whether CPU copies go to the thread (``MEMCOMPILE_COPY_THREAD=1``, or inside
    ``using(True)``)."""
    return _enabled


def worth(nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` goes to the thread: :func:`active` and at least
    :data:`MIN_BYTES`."""
    return _enabled and nbytes >= MIN_BYTES


def submit(dst: torch.Tensor, src: torch.Tensor) -> CopyJob:
    """Issue ``dst.copy_(src)`` on the copy thread; wait on the returned job before reading
    ``dst``. Both stay referenced until the copy is done."""
    job = CopyJob([dst], [src])
    _engine.submit(job)
    return job


def submit_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> CopyJob:
    """:func:`submit` for a list: ``torch._foreach_copy_(dsts, srcs)`` on the copy thread, one
    job (a block's prefetch, ``cache.py``)."""
    job = CopyJob(dsts, srcs)
    _engine.submit(job)
    return job


def running() -> bool:
    """Whether the copy thread is alive now."""
    return _engine.running()


def shutdown() -> None:
    """Finish the copies issued and stop the thread (the next copy starts it again)."""
    _engine.shutdown()


@contextlib.contextmanager
def using(on: bool) -> Iterator[None]:
    """Copies go to the thread (``on``) or run on the computing thread inside the block
    (benchmarks comparing the two; tests)."""
    global _enabled
    old, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = old


atexit.register(shutdown)
