"""The numbers Python reads from tensors during a compiled model's call.

A dynamic network written the natural way decides in Python: its eager frame turns a fragment's
output into a number and branches on it (zoo/natural.py)::

    probs = self.routers[l](h).softmax(-1).mean((0, 1))    # a fragment, then eager glue
    e = int(probs.argmax())                                 # Tensor.__int__   -> sink((e,))
    x = x + experts[e](h)                                   # the next block: expert e
    ids = probs.topk(2).indices.tolist()                    # Tensor.tolist    -> sink((e1, e2))
    if conf.item() >= threshold: break                      # Tensor.item      -> sink((0.93,))

Those numbers are what the pilot needs (an int names the next block, dynamic/rules.py: ``X[e]``;
a float is a feature of the next prediction, dynamic/pilot.py), and they never leave a graph as
outputs. While a reader is active (:func:`reading`, around a model call whose compiler wants
them), ``torch.Tensor``'s ``__int__``, ``__index__``, ``__float__``, ``item`` and ``tolist`` are
wrapped: each calls the original and hands its result to the calling thread's sink: one int or
float (bools are not decisions of this kind), or a ``tolist`` of at most :data:`MAX_READ` ints.
Outside such calls the original methods are back in place, so nothing changes for other code;
other threads meanwhile see the wrappers, which pass their reads to no sink.

Dynamo must never trace a wrapper: it would inline it, and a frame it compiles would break its
graph elsewhere than without memcompile (a user's ``.item()`` is a graph break of its own). So
the originals are put back while Dynamo compiles (its compile start and end callbacks) and the
wrappers again afterwards: what Dynamo traces is the unwrapped ``torch.Tensor``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.eval_frame import skip_code

from memcompile.runtime.compile_callbacks import ensure_compile_callbacks

log = logging.getLogger(__name__)

__all__ = ["MAX_READ", "READ_METHODS", "Read", "installed", "reading", "start", "stop"]

#: The tensor methods whose integer results are read.
READ_METHODS = ("__int__", "__index__", "__float__", "item", "tolist")
#: Longest ``tolist`` result passed on (a list of expert indices, not a tensor's contents).
MAX_READ = 64

#: One read: an int or float, or a list of ints.
Read = tuple[int | float, ...]
Sink = Callable[[Read], None]

_local = threading.local()
_lock = threading.Lock()
_readers = 0  # active reading() contexts, all threads
_compiling = False  # between Dynamo's compile start and end callbacks
_own: dict[str, Any] = {}  # torch.Tensor's own attribute each wrapper replaced (absent: inherited)
_wrapped = False
_sink_failed = False


def _scalars(out: Any) -> Read | None:
    if type(out) is int or type(out) is float:
        return (out,)
    if type(out) is list and 0 < len(out) <= MAX_READ and all(type(v) is int for v in out):
        return tuple(out)
    return None


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        sink = getattr(_local, "sink", None)
        if sink is not None:
            values = _scalars(out)
            if values is not None:
                _deliver(sink, values)
        return out

    read.__name__ = read.__qualname__ = name
    read.__doc__ = original.__doc__
    return read


# Nor must Dynamo compile a wrapper's frame when an eager frame calls it (the rest of a frame
# after a graph break runs eagerly with Dynamo's callback set): one code object for all four.
skip_code(_wrapper("item", torch.Tensor.item).__code__)


@torch._dynamo.disable
def _deliver(sink: Sink, values: Read) -> None:
    # Dynamo off for the sink and all it calls (the pilot, the prefetch cache): its callback
    # is set in the eager frame that reads, and would compile memcompile's own code.
    global _sink_failed
    try:
        sink(values)
    except Exception:  # a reader's failure must not change what the user's code computes
        if not _sink_failed:
            _sink_failed = True
            log.warning(
                "memcompile: a read of a tensor's value failed in its observer", exc_info=True
            )


def _wrap() -> None:
    global _wrapped
    if _wrapped:
        return
    for name in READ_METHODS:
        original = getattr(torch.Tensor, name)
        if name in vars(torch.Tensor):
            _own[name] = original
        setattr(torch.Tensor, name, _wrapper(name, original))
    _wrapped = True


def _unwrap() -> None:
    global _wrapped
    if not _wrapped:
        return
    for name in READ_METHODS:
        if name in _own:
            setattr(torch.Tensor, name, _own.pop(name))
        else:
            delattr(torch.Tensor, name)
    _wrapped = False


def installed() -> bool:
    """Whether ``torch.Tensor``'s read methods are wrapped now."""
    return _wrapped


def _on_compile_start(args: Any = None) -> None:
    global _compiling
    with _lock:
        _compiling = True
        _unwrap()


def _on_compile_end(args: Any = None) -> None:
    global _compiling
    with _lock:
        _compiling = False
        if _readers:
            _wrap()


def start(sink: Sink) -> Sink | None:
    """From now on, numbers this thread reads from tensors (module docstring) go to ``sink``,
    until :func:`stop` is given what this returned (the sink it replaced)."""
    global _readers
    ensure_compile_callbacks(_on_compile_start, _on_compile_end)  # once: kept across resets
    previous: Sink | None = getattr(_local, "sink", None)
    _local.sink = sink
    with _lock:
        _readers += 1
        if not _compiling:
            _wrap()
    return previous


def stop(previous: Sink | None) -> None:
    """End the latest :func:`start` on this thread (``previous``: what it returned)."""
    global _readers
    _local.sink = previous
    with _lock:
        _readers = max(_readers - 1, 0)
        if not _readers:
            _unwrap()


@contextmanager
def reading(sink: Sink) -> Iterator[None]:
    """:func:`start` and :func:`stop` around a block; nested blocks read into the innermost."""
    previous = start(sink)
    try:
        yield
    finally:
        stop(previous)
