"""Where memcompile meets Dynamo's objects: finding them, and the per-call hook.

``torch.compile`` returns a module or function whose Dynamo context (``_TorchDynamoContext``)
runs its ``enter_exit_hooks`` at the start of every call and their cleanups at the end. memcompile
appends one hook per compiled model: it notes the fallback monitor's position when a call starts and
claims the frames Dynamo gave up on during the call when it ends (an O(1) check unless Dynamo
compiled something during the call).
This is the only memcompile code that runs when Dynamo runs a frame eagerly, so it is what makes
the warning appear in the call where the fallback happens, attributed to the right model.

    ctx = dynamo_context(compiled)          # from the object torch.compile returned
    ctx = calling_dynamo_context()          # from inside a backend call (stack walk)
    wrapper = calling_compile_wrapper()     # the torch._TorchCompileWrapper calling the backend
    model = calling_compiled_module(ctx)    # the module torch.compile wrapped (stack walk)
    compile_fn = hookless(ctx)              # the same backend, without memcompile's call hook
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

__all__ = [
    "COMPILER_ATTR",
    "ENTRY_ATTR",
    "HOOK_ATTR",
    "calling_compile_wrapper",
    "calling_compiled_module",
    "calling_dynamo_context",
    "dynamo_context",
    "hookless",
    "install_call_hook",
]

#: Attribute of a Dynamo context that holds memcompile's call hook (or marks a region's context).
HOOK_ATTR = "_memcompile_hook"
#: Attribute of ``torch._TorchCompileWrapper`` that holds the MemCompiler of that compile call.
COMPILER_ATTR = "_memcompile_compiler"
#: Attribute that marks memcompile's entry-point backend function (backends/entry.py).
ENTRY_ATTR = "_memcompile_entry"


def _NO_HOOK() -> Callable[[], None]:
    return lambda: None


def dynamo_context(compiled: Any) -> _TorchDynamoContext | None:
    """The Dynamo context of what ``torch.compile`` returned (module or function), else None."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if isinstance(ctx, _TorchDynamoContext):
        return ctx
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if isinstance(contents, _TorchDynamoContext):
            return contents
    return None


def _calling_self(accept: Callable[[FrameType, Any], bool], max_depth: int) -> Any | None:
    """The ``self`` of the nearest caller frame (up to ``max_depth`` frames above the function
    that asks) that ``accept(frame, self)`` accepts, else None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and accept(frame, owner):
            return owner
        frame = frame.f_back
    return None


def calling_compile_wrapper(max_depth: int = 6) -> Any | None:
    """The ``torch._TorchCompileWrapper`` on the call stack (it calls backends directly)."""
    return _calling_self(lambda _, s: isinstance(s, torch._TorchCompileWrapper), max_depth)


def calling_dynamo_context(max_depth: int = 200) -> _TorchDynamoContext | None:
    """The context whose compiled callable is running (found from inside a backend call)."""
    return _calling_self(
        lambda f, s: f.f_code.co_name == "compile_wrapper" and isinstance(s, _TorchDynamoContext),
        max_depth,
    )


def install_call_hook(ctx: _TorchDynamoContext, enter: Callable[[], Callable[[], None]]) -> bool:
    """Run ``enter()`` at the start of every call through ``ctx`` and the function it returns at
    the end (once per ctx: a second install is ignored). Returns whether it was installed now."""
    if getattr(ctx, HOOK_ATTR, None) is not None:
        return False
    setattr(ctx, HOOK_ATTR, enter)
    ctx.enter_exit_hooks.append(enter)
    return True


def hookless(ctx: _TorchDynamoContext) -> _TorchDynamoContext:
    """A copy of ``ctx`` without memcompile's call hook: functions it wraps compile with the same
    backend object (so Dynamo's backend guard matches the model's) but a call of one is not a
    call of the model."""
    own = getattr(ctx, HOOK_ATTR, None)
    twin = copy.copy(ctx)
    twin.enter_exit_hooks = [h for h in ctx.enter_exit_hooks if h is not own]
    twin.cleanup_fns = []
    # Marked as hooked: a fragment compiled under it finds it on the stack (calling_dynamo_context)
    # and must not install the model's call hook there.
    setattr(twin, HOOK_ATTR, _NO_HOOK)
    return twin


def calling_compiled_module(
    ctx: _TorchDynamoContext, max_depth: int = 400
) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped with ``ctx``, when one of its calls is on the stack
    (found from inside a backend call; ``None`` for a compiled function)."""
    owner = _calling_self(
        lambda _, s: isinstance(s, OptimizedModule) and getattr(s, "dynamo_ctx", None) is ctx,
        max_depth,
    )
    return owner._orig_mod if owner is not None else None
