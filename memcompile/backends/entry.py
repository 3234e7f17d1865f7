"""The ``torch_dynamo_backends`` entry point: ``torch.compile(model, backend="memcompile")``.

torch looks the name up once and then calls this *plain function* for every fragment of every
model compiled with it, passing the ``options`` dict of that ``torch.compile`` call. memcompile
needs one :class:`MemCompiler` per ``torch.compile`` call (its fragments, steps and report), so the
function finds the ``torch._TorchCompileWrapper`` that called it — the object torch creates once per
``torch.compile`` call — and keeps the compiler on it:

    torch.compile(m, backend="memcompile", options=o)
        -> _TorchCompileWrapper(compiler_fn=memcompile_backend, kwargs={"options": o})
             .__call__(gm, inputs) -> memcompile_backend(gm, inputs, options=o)
                                        wrapper._memcompile_compiler = MemCompiler(o)   (first call)

``memcompile.compile(model, **options)`` skips this: it passes a ``MemCompiler`` as the backend.
Do not also register this function with ``torch._dynamo.register_backend``: loading the entry point
would then fail with "duplicate name: memcompile".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from memcompile.backends.compiler import MemCompiler, reset_all
from memcompile.backends.dynamo_hooks import COMPILER_ATTR, ENTRY_ATTR, calling_compile_wrapper

log = logging.getLogger(__name__)

__all__ = ["COMPILER_ATTR", "memcompile_backend"]


# Used when no wrapper is on the stack (torch._dynamo.optimize("memcompile"), direct calls):
# one compiler per distinct options dict.
_unwrapped: dict[int, tuple[Mapping[str, Any] | None, MemCompiler]] = {}


def _compiler_for(options: Mapping[str, Any] | None) -> MemCompiler:
    wrapper = calling_compile_wrapper()
    if wrapper is not None:
        compiler = getattr(wrapper, COMPILER_ATTR, None)
        if compiler is None:
            compiler = MemCompiler(options)
            setattr(wrapper, COMPILER_ATTR, compiler)
        return compiler
    key = id(options)
    entry = _unwrapped.get(key)
    if entry is None or entry[0] is not options:
        entry = (options, MemCompiler(options))
        _unwrapped[key] = entry
    return entry[1]


def memcompile_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Dynamo backend function registered as ``"memcompile"``.

    Raises:
        ValueError, TypeError: bad ``options`` (Dynamo re-raises them as ``BackendCompilerFailed``
            on the first call; ``memcompile.compile`` validates before any call).
    """
    if mode not in (None, "default"):
        raise ValueError(
            f"memcompile does not use torch.compile(mode=...); got mode={mode!r}. Pass memcompile "
            "options through options={...}"
        )
    return _compiler_for(options)(gm, example_inputs)


def _reset() -> None:
    reset_all()


# torch._dynamo.reset() calls `compiler_fn.reset()` on every backend it has cached.
memcompile_backend.reset = _reset  # type: ignore[attr-defined]
# How compiler.py's compile-start hook knows this function behind a torch.compile wrapper.
setattr(memcompile_backend, ENTRY_ATTR, True)
