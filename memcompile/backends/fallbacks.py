"""Detect frames Dynamo runs eagerly, so memory there is not silently left unmanaged.

Dynamo records every frame it tries to compile in ``torch._dynamo.utils.get_compilation_metrics()``;
a record with ``fail_type`` set means the frame was *not* compiled and runs eagerly from then on
(for the recompile limit: every call that misses the existing cache entries does):

    fail_reason starts with "Dynamo recompile limit exceeded"   -> kind "recompile_limit"
    fail_reason mentions "graph break in loop"                   -> kind "skipped_frame"
    anything else                                                 -> kind "failed_frame"

:class:`FallbackMonitor` (one per process) turns new records into numbered events. A compiled
model claims the events that appear *during one of its calls* (``cursor()`` when the call starts,
``claim_since(cursor)`` when it ends; see dynamo_hooks.py). A hook attached in the middle of a
model's first call (``torch.compile(backend="memcompile")``: at its first compiled fragment)
claims the events of frames still running below the Dynamo context's call, and those after them
(``claim_running``), then the rest of that call from its attach cursor. Events from before
memcompile could watch are claimed by function (``claim_functions``: the model's own methods;
ambiguous only if the same class also runs under another backend in the process). Each event is
claimed once and warned about once per (frame, kind), with an :class:`EagerFallbackWarning`.
Events no memcompile model claims (other backends' frames) are never reported.

One fallback leaves no record: a call made while a ``TorchDispatchMode`` is active (one that
does not ask Dynamo to ignore it) runs eagerly, compiled code or not, and Dynamo marks the
frames' code as skipped, so the later calls run eagerly too (torch 2.13, until
``torch._dynamo.reset()``). :func:`dispatch_mode_fallback` applies Dynamo's own test when a
model's call starts (``MemCompiler.attach``), kind ``dispatch_mode``.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from torch._dynamo.utils import get_compilation_metrics, set_compilation_metrics_limit
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    any_torch_dispatch_mode_on_stack,
    is_in_any_mode_without_ignore_compile_internals,
)

from memcompile.pipeline import features

log = logging.getLogger(__name__)

__all__ = [
    "REGIONAL_KINDS",
    "EagerFallbackWarning",
    "Fallback",
    "FallbackMonitor",
    "FunctionSpan",
    "code_label",
    "dispatch_mode_fallback",
    "frame_in",
    "function_span",
    "module_functions",
    "monitor",
]

# Dynamo keeps only the last 64 records by default; keep enough to survive a burst of compiles
# between two polls.
_METRICS_LIMIT = 512

_HINTS = {
    "recompile_limit": (
        "raise torch._dynamo.config.recompile_limit (now {limit}) if the recompiles are expected, "
        "or make the changing value dynamic (torch._dynamo.mark_dynamic)"
    ),
    "skipped_frame": (
        "Dynamo cannot resume after a graph break inside a loop: move the loop body into a helper "
        "function, or orchestrate it in a @torch.compiler.disable(recursive=False) function that "
        "calls modules Dynamo compiles"
    ),
    "failed_frame": "run with TORCH_LOGS=graph_breaks to see why Dynamo gave up on this frame",
    "dispatch_mode": (
        "call the compiled model outside the mode: Dynamo also marks the code it skips this way "
        "as not to be compiled, so the model's later calls run eagerly too, until "
        "torch._dynamo.reset()"
    ),
}


# Failures Dynamo swallows (the frame then runs eagerly); any other error propagates to the user
# unless torch._dynamo.config.suppress_errors is set.
_SOFT_FAILURES = frozenset({"Unsupported", "UserError", "SkipFrame", "RecompileLimitExceeded"})


class EagerFallbackWarning(UserWarning):
    """Dynamo runs a frame eagerly; memcompile does not manage the memory it allocates."""


#: Fallback kinds where the frame's code runs eagerly (on every call, or on every call its
#: compiled graphs do not fit: the recompile limit); "recompiling": a frame memcompile runs
#: eagerly after REGIONAL_AFTER compiles (compiler.py). The torch.nn modules such a frame calls
#: become fragments of their own (regions.py). Under a dispatch mode nothing compiles.
REGIONAL_KINDS = frozenset({"skipped_frame", "failed_frame", "recompile_limit", "recompiling"})


@dataclass(frozen=True)
class Fallback:
    """A frame Dynamo did not compile.

    Attributes:
        code: ``function (file:line)`` of the frame.
        kind: ``recompile_limit``, ``skipped_frame``, ``failed_frame`` or ``dispatch_mode``;
            ``recompiling``: a module ``forward`` memcompile runs eagerly after it compiled into
            many distinct graphs (backends/compiler.py, ``REGIONAL_AFTER``).
        reason: Dynamo's reason, first line.
        compile_id: Dynamo's compile id of the failed attempt.
        hint: what the user can do about it.
    """

    code: str
    kind: str
    reason: str
    compile_id: str
    hint: str

    def message(self) -> str:
        if self.kind in REGIONAL_KINDS and features.current().regional:
            return (
                f"memcompile: Dynamo runs {self.code} eagerly ({self.kind}: {self.reason}). "
                "memcompile compiles the torch.nn modules it calls as fragments of their own "
                "(regional capture); the tensor operations between them are not planned, only "
                "measured (a sampled iteration on the CPU, each step on CUDA) and counted in "
                "the prediction from then on, and what they save for backward goes to the host "
                f"tier once a measured step passes the budget. Hint: {self.hint}."
            )
        return (
            f"memcompile: Dynamo runs {self.code} eagerly ({self.kind}: {self.reason}); memory "
            f"allocated there is not managed by memcompile, nor in its predicted peak (a budget "
            f"can be exceeded there). Hint: {self.hint}."
        )

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "kind": self.kind,
            "reason": self.reason,
            "compile_id": self.compile_id,
            "hint": self.hint,
        }


def dispatch_mode_fallback() -> Fallback | None:
    """The fallback a call starting now would be, when a ``TorchDispatchMode`` Dynamo does not
    trace under is active (Dynamo's own test, ``convert_frame``): Dynamo then runs the call's
    frames eagerly without a compilation record, so :class:`FallbackMonitor` never sees it."""
    if torch._dynamo.config.inline_torch_dispatch_torch_compile:
        active = any_torch_dispatch_mode_on_stack()
    else:
        active = is_in_any_mode_without_ignore_compile_internals()
    if not active:
        return None
    mode = _get_current_dispatch_mode()
    return Fallback(
        code="the compiled model's call",
        kind="dispatch_mode",
        reason=f"a TorchDispatchMode ({type(mode).__name__}) is active",
        compile_id="",
        hint=_HINTS["dispatch_mode"],
    )


def _classify(reason: str) -> str:
    if reason.startswith("Dynamo recompile limit exceeded"):
        return "recompile_limit"
    if "graph break in loop" in reason:
        return "skipped_frame"
    return "failed_frame"


#: A function as ``(file, name, first line, last line)``.
FunctionSpan = tuple[str, str, int, int]
_RESUME_PREFIX = "torch_dynamo_resume_in_"
_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


def code_label(code: CodeType) -> str:
    """``function (file:line)`` of a code object, as Dynamo's records name a frame (the
    ``code`` of a :class:`Fallback`, and of a fragment)."""
    return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"


def function_span(code: Any) -> FunctionSpan:
    """``(file, name, first line, last line)`` of a code object."""
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return (
        code.co_filename,
        code.co_name,
        code.co_firstlineno,
        max(lines, default=code.co_firstlineno),
    )


def _frame_of(compile_id: Any) -> str:
    return str(compile_id).split("/")[0] if compile_id is not None else ""


@dataclass
class _Event:
    fallback: Fallback
    filename: str
    function: str
    first_line: int
    claimed: bool = False

    def defined_in(self, functions: Collection[FunctionSpan]) -> bool:
        return frame_in(self.filename, self.function, self.first_line, functions)


def frame_in(file: str, name: str, line: int, functions: Collection[FunctionSpan]) -> bool:
    """Whether the frame of code ``name`` at ``file:line`` is one of ``functions``, or its
    continuation after a graph break: Dynamo names f's continuation at line N
    ``torch_dynamo_resume_in_f_at_N`` (f's name, and N inside f)."""
    if name.startswith(_RESUME_PREFIX):
        name, _, at = name.removeprefix(_RESUME_PREFIX).rpartition("_at_")
        line = int(at) if at.isdigit() else -1
        return any((f, fn) == (file, name) and lo <= line <= hi for f, fn, lo, hi in functions)
    return any((f, fn, lo) == (file, name, line) for f, fn, lo, _ in functions)


def module_functions(model: Any) -> set[FunctionSpan]:
    """The methods of ``model``'s module classes (not torch's own), as function spans."""
    funcs: list[Any] = []
    for cls in {type(m) for m in model.modules()}:
        # Methods the class resolves (an overridden base-class method never runs for it).
        names = {
            n
            for klass in cls.__mro__
            if not klass.__module__.startswith("torch.")
            for n in vars(klass)
        }
        funcs.extend(getattr(cls, n, None) for n in sorted(names))
    out = set()
    for f in funcs:
        code = getattr(getattr(f, "__func__", f), "__code__", None)
        if code is not None:
            out.add(function_span(code))
    return out


class FallbackMonitor:
    """Process-wide reader of Dynamo's compilation records (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[Any, ...]] = set()
        # frame id -> ("function (file:line)", file, function, first line)
        self._frames: dict[str, tuple[str, str, str, int]] = {}
        self._events: list[_Event] = []
        self._warned: set[tuple[str, str]] = set()
        self._stamp: tuple[int, int, int] = (0, 0, 0)
        self._installed = False

    def install(self) -> None:
        """Enlarge Dynamo's record buffer; older records are not memcompile's (idempotent)."""
        with self._lock:
            if self._installed:
                return
            set_compilation_metrics_limit(max(_METRICS_LIMIT, len(get_compilation_metrics())))
            for rec in get_compilation_metrics():
                self._ingest(rec)
            self._events.clear()
            self._stamp = self._records_stamp()
            self._installed = True

    def _ingest(self, rec: Any) -> None:
        # Called with the lock held.
        key = (rec.compile_id, rec.start_time_us, rec.co_name, rec.fail_type)
        if key in self._seen:
            return
        self._seen.add(key)
        frame = _frame_of(rec.compile_id)
        if rec.co_name:
            # Frame ids restart after torch._dynamo.reset(): the latest record names the frame.
            loc = f"{rec.co_name} ({rec.co_filename}:{rec.co_firstlineno})"
            self._frames[frame] = (
                loc,
                rec.co_filename or "",
                rec.co_name,
                rec.co_firstlineno or -1,
            )
        if rec.fail_type is None or rec.is_forward is False:
            return
        if rec.fail_type not in _SOFT_FAILURES and not torch._dynamo.config.suppress_errors:
            return  # the error reached the user: the frame did not quietly run eagerly
        reason = (rec.fail_reason or rec.fail_type).strip().splitlines()[0]
        kind = _classify(rec.fail_reason or "")
        code, filename, function, first_line = self._frames.get(
            frame, (f"<frame {frame}>", "", "", -1)
        )
        hint = _HINTS[kind].format(limit=torch._dynamo.config.recompile_limit)
        fallback = Fallback(code, kind, reason, str(rec.compile_id), hint)
        self._events.append(_Event(fallback, filename, function, first_line))

    @staticmethod
    def _records_stamp() -> tuple[int, int, int]:
        # O(1) change detector on Dynamo's record deque (which set_compilation_metrics_limit may
        # replace): a new record changes its length or its last element.
        records = dynamo_utils._compilation_metrics
        return id(records), len(records), id(records[-1]) if records else 0

    def _poll_locked(self) -> None:
        stamp = self._records_stamp()
        if stamp != self._stamp:  # Dynamo compiled (or failed) something since the last poll
            for rec in get_compilation_metrics():
                self._ingest(rec)
            self._stamp = stamp

    def cursor(self) -> int:
        """Position after every event so far (cheap unless Dynamo just compiled something)."""
        with self._lock:
            self._poll_locked()
            return len(self._events)

    def _claim(self, select: Callable[[int, _Event], bool]) -> list[Fallback]:
        with self._lock:
            self._poll_locked()
            claimed, first_seen = [], []
            for i, e in enumerate(self._events):
                if not e.claimed and select(i, e):
                    e.claimed = True
                    claimed.append(e.fallback)
                    key = (e.fallback.code, e.fallback.kind)
                    if key not in self._warned:
                        self._warned.add(key)
                        first_seen.append(e.fallback)
        for fb in claimed:
            log.info("eager fallback: %s", fb)
        for fb in first_seen:
            warnings.warn(fb.message(), EagerFallbackWarning, stacklevel=4)
        return claimed

    def claim_since(self, cursor: int) -> list[Fallback]:
        """Claim the unclaimed events that happened after ``cursor`` (one model call)."""
        return self._claim(lambda i, _: i >= cursor)

    def claim_running(self, frame: FrameType | None) -> list[Fallback]:
        """Claim the unclaimed events from the first one whose function is running now, on the
        stack from ``frame`` up to the Dynamo context call that runs the model, on.

        For a hook attached in the middle of a model's first call (at its first compiled
        fragment): a frame Dynamo gave up on runs eagerly and is still on the stack, calling
        the frame being compiled; the events after it (helpers it called that failed and
        returned) are the same call's. Frames above the context's call (the user's loop) are
        not the model's."""
        running: set[tuple[str, str, int]] = set()
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_fn" and code.co_filename.endswith(_EVAL_FRAME):
                break  # the Dynamo context's call: the model's frames are all below it
            running.add((code.co_filename, code.co_name, code.co_firstlineno))
            frame = frame.f_back
        with self._lock:
            self._poll_locked()
            first = next(
                (
                    i
                    for i, e in enumerate(self._events)
                    if not e.claimed and (e.filename, e.function, e.first_line) in running
                ),
                len(self._events),
            )
        return self._claim(lambda i, _: i >= first)

    def claim_functions(self, functions: Collection[FunctionSpan]) -> list[Fallback]:
        """Claim unclaimed events of frames of the given functions (or of Dynamo's resume
        functions derived from them)."""
        return self._claim(lambda _, e: e.defined_in(functions))


#: The process-wide monitor. It starts watching when memcompile is imported (for the entry point:
#: at torch.compile(backend="memcompile") time), so earlier records are not attributed to it.
monitor = FallbackMonitor()
monitor.install()
