"""Regional capture: the modules a frame Dynamo runs eagerly calls become fragments of their own.

Dynamo gives up on a whole frame when it meets a graph break it cannot resume from (one inside a
loop, say ``int(router(x).argmax())`` in a layer loop) and runs it eagerly from then on. The user
modules that frame calls still have their own frames, which Dynamo compiles; the ``torch.nn``
modules it calls (``nn.Linear``, ``nn.Embedding``, ``nn.Sequential`` ...) do not, because Dynamo
skips frames in torch's own files. This module turns each of those into a fragment of the same
:class:`MemCompiler`, so the compute runs under the one budget and only the glue between calls
(a mean, an add, a loss) stays eager::

    class MoE(nn.Module):                   # forward falls back: "graph break in loop"
        def forward(self, tok):
            x = self.emb(tok)                               # region "emb" -> F0 (Embedding)
            for l in range(L):
                e = int(self.router[l](x).mean(0).argmax()) # "router.0".."router.L-1": one
                x = x + self.experts[l][e](x)               #   graph, F1 (Linear); Expert is
            return self.head(x)                             #   the user's: Dynamo compiles it
                                                            # region "head" -> F2 (Linear)

:func:`find_regions` decides: for each module of the model whose ``forward`` fell back, the
``torch.nn`` modules it holds directly or through containers (``ModuleList``, ``ModuleDict``) — a
user module is left to Dynamo, and when its own ``forward`` falls back it is searched the same way.
:func:`install_regions` applies: each region's ``_compiled_call_impl`` (the hook
``nn.Module.compile`` uses) becomes a gate that, while the compiled model's call runs, calls the
module through a function Dynamo compiles with the model's own backend. Modules of one structure
(type, parameter and buffer shapes) share that function's code object, so one graph serves all of
them, as the experts of an MoE share theirs; the code object is named for the module's type and
first path, which is what the report shows. Outside the compiled model's calls (the user calls
the module or the uncompiled model directly) and while Dynamo traces (a compiled frame that also
calls the module inlines it), the gate calls the module as usual.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import skip_code

from memcompile.backends.fallbacks import (
    REGIONAL_KINDS,
    Fallback,
    FunctionSpan,
    code_label,
    frame_in,
    function_span,
)
from memcompile.backends.unplanned import UnplannedWatch

__all__ = [
    "Region",
    "RegionSet",
    "eager_readers",
    "find_regions",
    "forward_label",
    "install_regions",
]

# Containers have no forward of their own: the modules in them are called from the frame that
# holds the container.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class Region:
    """A module called from a frame Dynamo runs eagerly, compiled as a fragment of its own.

    Attributes:
        path: the module's name in the model (``"router.0"``).
        kind: its type's name (``"Linear"``).
        structure: type, parameter and buffer shapes and dtypes: modules with the same
            structure share one compiled graph.
        caller: the fallen-back frame that calls it, ``function (file:line)``.
    """

    path: str
    kind: str
    structure: str
    caller: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "caller": self.caller}


def forward_label(module: nn.Module) -> str | None:
    """``forward (file:line)`` of a module's forward, as Dynamo's records name frames."""
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return None if code is None else code_label(code)


def _builtin(module: nn.Module) -> bool:
    # Dynamo skips frames of torch's own modules (trace_rules); those of user classes it compiles.
    return type(module).__module__.startswith(("torch.nn.", "torch.ao."))


def _called(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """The modules ``module``'s forward can call: its children, and the modules inside its
    container children (recursively)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS):
            yield from _called(child, path)
        else:
            yield path, child


def _structure(module: nn.Module) -> str:
    tensors = [
        f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    return f"{type(module).__module__}.{type(module).__qualname__}[{','.join(tensors)}]"


def find_regions(model: nn.Module, fallbacks: Collection[Fallback]) -> tuple[Region, ...]:
    """The ``torch.nn`` modules called from the model's modules whose ``forward`` runs eagerly
    (a fallback of a kind in ``REGIONAL_KINDS``), in the model's module order."""
    fallen = {fb.code for fb in fallbacks if fb.kind in REGIONAL_KINDS}
    if not fallen:
        return ()
    regions: list[Region] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        caller = forward_label(module)
        if caller not in fallen or _builtin(module):
            continue
        for path, child in _called(module, prefix):
            if _builtin(child) and id(child) not in seen:
                seen.add(id(child))
                regions.append(Region(path, type(child).__name__, _structure(child), caller))
    return tuple(regions)


def _parse_label(label: str) -> tuple[str, str, int] | None:
    # "function (file:line)" -> (file, function, line)
    name, _, rest = label.partition(" (")
    file, _, line = rest.removesuffix(")").rpartition(":")
    return (file, name, int(line)) if line.isdigit() and file else None


def eager_readers(model: nn.Module, fallbacks: Collection[Fallback]) -> tuple[str, ...]:
    """The paths of the model's modules whose own ``forward`` runs eagerly (a fallback of a kind
    in ``REGIONAL_KINDS``, or a continuation of it after a graph break, Dynamo's
    ``torch_dynamo_resume_in_forward_at_N``): the parameters they hold directly are read by eager
    code, in model order."""
    frames = [
        parsed
        for fb in fallbacks
        if fb.kind in REGIONAL_KINDS and (parsed := _parse_label(fb.code)) is not None
    ]
    if not frames:
        return ()
    found: list[str] = []
    for path, module in model.named_modules():
        spans = list(_forward_spans(module))
        if spans and any(frame_in(f, n, line, spans) for f, n, line in frames):
            found.append(path)
    return tuple(found)


def _forward_spans(module: nn.Module) -> Iterator[FunctionSpan]:
    # The module's forward and the functions it wraps (functools.wraps: Hugging Face's
    # experts-implementation decorator wraps the class's own forward).
    fn = getattr(type(module), "forward", None)
    for _ in range(8):
        code = getattr(fn, "__code__", None)
        if code is None:
            return
        yield function_span(code)
        fn = getattr(fn, "__wrapped__", None)


def _calling(call: Callable[..., Any]) -> Callable[..., Any]:
    # The template of every region's function: its code object is copied per structure (named
    # for it) and its one free variable is the module's _call_impl.
    def region(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return region


def _gate(
    regions: RegionSet,
    compiled: Callable[..., Any],
    call_impl: Callable[..., Any],
) -> Callable[..., Any]:
    """A region's ``_compiled_call_impl``: the compiled region during the model's calls, the
    module's own ``_call_impl`` otherwise, and while the regions run directly."""

    def gate(*args: Any, **kwargs: Any) -> Any:
        if not regions.direct and regions.running() and not torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        return call_impl(*args, **kwargs)

    return gate


# Dynamo must not compile the gate's frame itself (the model's eager frame runs with Dynamo's
# callback set): it would trace the thread-local test into a guard and the module into a graph
# named for the gate. The frames it calls are compiled as usual. (Dynamo inlines a module call
# in a frame it traces through ``_call_impl``, never reaching the gate.)
skip_code(_gate(None, print, print).__code__)  # type: ignore[arg-type]


class RegionSet:
    """The regions installed for one compiled model, and whether one of its calls is running.

    Args:
        compile_fn: wraps a function so Dynamo compiles it with the model's backend (a Dynamo
            context without memcompile's call hook: a region's call is not a model call).
        unplanned: the compiler's direct mode, which the regions follow.
    """

    def __init__(
        self,
        compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
        unplanned: UnplannedWatch | None = None,
    ) -> None:
        self._compile = compile_fn
        self._unplanned = unplanned
        self._codes: dict[str, types.CodeType] = {}
        self._local = threading.local()
        self.regions: list[Region] = []

    @property
    def direct(self) -> bool:
        """The regions call their modules directly: the model's calls run in the direct mode
        (no budget, the step seen: backends/unplanned.py), what the compiled regions would run,
        without Dynamo's call."""
        return self._unplanned is not None and self._unplanned.direct

    def running(self) -> bool:
        """Whether a call of the compiled model is running on this thread."""
        return getattr(self._local, "depth", 0) > 0

    def enter(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def leave(self) -> None:
        self._local.depth = max(getattr(self._local, "depth", 0) - 1, 0)

    def _code(self, region: Region) -> types.CodeType:
        code = self._codes.get(region.structure)
        if code is None:
            template = _calling(print).__code__
            code = template.replace(
                co_name=region.kind,
                co_filename=f"<memcompile region {region.path}>",
                co_firstlineno=1,
            )
            if sys.version_info >= (3, 11):
                code = code.replace(co_qualname=region.kind)
            self._codes[region.structure] = code
        return code

    def install(self, module: nn.Module, region: Region) -> bool:
        """Route ``module``'s calls during the model's calls through a compiled region.
        Returns False when the module already has a compiled call (``nn.Module.compile``, or
        installed before)."""
        if module._compiled_call_impl is not None:
            return False
        function = types.FunctionType(
            self._code(region),
            _calling.__globals__,
            region.kind,
            None,
            (types.CellType(module._call_impl),),
        )
        gate = _gate(self, self._compile(function), module._call_impl)
        module._compiled_call_impl = gate
        self.regions.append(region)
        return True


def install_regions(model: nn.Module, regions: Collection[Region], into: RegionSet) -> int:
    """Install each region of ``model`` into ``into``; returns how many were new."""
    modules = dict(model.named_modules(remove_duplicate=False))
    new = 0
    for region in regions:
        module = modules.get(region.path)
        if module is not None and into.install(module, region):
            new += 1
    return new
