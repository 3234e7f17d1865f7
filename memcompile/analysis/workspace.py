"""Measured kernel workspace: scratch memory an op allocates and frees inside one call.

``meta['val']`` shows an op's outputs, not the temporaries its kernel uses: oneDNN reorders in
``convolution_backward``, the float noise behind ``native_dropout``'s mask, SDPA's buffers. They
count toward the device peak when the op runs at the peak, so they are measured, not guessed:

    for each distinct (op, input shapes/strides/dtypes) in the graph:
        build inputs of that metadata (zeros for integer tensors, so indices stay in range)
        run the op once to warm it up, then once under the allocator's eye
                                                         (CPU profiler / CUDA peak stats)
        workspace = peak inside the op - bytes of its new outputs

Probes of one graph share one profiler session; results are cached per process. The global RNG
is forked around the probes, so random ops do not shift the user's random stream. Only ``aten``
and ``prims`` ops with tensor outputs are probed (and nodes marked with :data:`PROBE_META`);
views and aliases have no kernel, but for an ``out=`` overload (``inplace.py``'s rewrites),
which is probed with its arguments sharing memory as they do in the graph.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.graph import sym_to_int, tensor_vals
from memcompile.runtime.measure import allocation_trace, range_levels
from memcompile.runtime.ops import HOST_RESULTS

log = logging.getLogger(__name__)

__all__ = [
    "PROBE_META",
    "clear_cache",
    "clone_workspace",
    "materialize",
    "metadata_key",
    "probe_workspaces",
]

_PROBED_NAMESPACES = ("aten", "prims")
#: Node meta key: probe this node's op though it is not an aten or prims op.
PROBE_META = "memcompile_probe_workspace"
_RANGE_PREFIX = "memcompile_probe:"
_cache: dict[tuple[Any, ...], int] = {}


def clear_cache() -> None:
    """Forget measured workspaces (tests)."""
    _cache.clear()


def _sym_key(xs: Any) -> tuple[Any, ...]:
    return tuple(str(s) if isinstance(s, torch.SymInt) else s for s in xs)


def _meta_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        offset = x.storage_offset()
        return ("T", _sym_key(x.shape), _sym_key(x.stride()), str(offset), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_meta_key(a) for a in x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(x))
    return repr(x)


def _concrete(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value, _ = sym_to_int(x) if isinstance(x, torch.SymInt) else (x.node.hint, True)
        if value is None:
            raise ValueError("unbacked symbol")
        return value
    if isinstance(x, (list, tuple)):
        return type(x)(_concrete(a) for a in x)
    return x


_Bases = dict[tuple[StorageWeakRef, torch.dtype], torch.Tensor]


def materialize(
    v: Any, device: torch.device, bases: _Bases, *, floats: _Bases | None = None
) -> Any:
    """Real tensors of ``v``'s metadata. Arguments that share a storage share one here too
    (``bases``: one buffer per storage and dtype), so that an ``out=`` node writing into one of
    its inputs is probed as it runs: some kernels then need a temporary (oneDNN's
    ``gelu_backward`` reorders a broadcast gradient written into its other input).
    ``floats``: where floating-point buffers are kept instead, shared with other calls (random
    values; an integer buffer is zeros, so that indices stay in range, and stays the call's)."""
    if isinstance(v, torch.Tensor):
        shape, stride = _concrete(tuple(v.shape)), _concrete(tuple(v.stride()))
        key = (StorageWeakRef(v.untyped_storage()), v.dtype)
        floating = v.dtype.is_floating_point or v.dtype.is_complex
        store = floats if floating and floats is not None else bases
        base = store.get(key)
        if base is None:
            numel = _concrete(v.untyped_storage().nbytes()) // v.element_size()
            if floating:
                base = torch.randn(numel, dtype=v.dtype, device=device)
            else:
                base = torch.zeros(numel, dtype=v.dtype, device=device)
            store[key] = base
        return base.as_strided(shape, stride, _concrete(v.storage_offset()))
    if isinstance(v, (list, tuple)):
        return type(v)(materialize(a, device, bases, floats=floats) for a in v)
    if isinstance(v, Mapping):  # kwargs: an out= argument is a tensor
        return {k: materialize(a, device, bases, floats=floats) for k, a in v.items()}
    return _concrete(v)


def metadata_key(v: torch.Tensor | None) -> tuple[Any, ...]:
    """The key of a probe that runs on :func:`materialize`'s values of ``v``'s (static)
    metadata: its sizes, strides, offset, dtype and device (``()`` for ``None``, an absent
    optional operand). Row tiling's and the linear cross-entropy's bit-identity probes cache
    their verdicts by it."""
    if v is None:
        return ()
    return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, str(v.device))


def _writes_out(target: torch._ops.OpOverload) -> bool:
    # An ``out=`` overload: it runs a kernel, though its result is an argument's memory.
    return any(a.is_out for a in target._schema.arguments)


def _arg_storages(node: fx.Node) -> list[StorageWeakRef]:
    """The storages of ``node``'s tensor arguments (fake values), in argument order."""
    return [
        StorageWeakRef(t.untyped_storage())
        for a in node.all_input_nodes
        for t in tensor_vals(a.meta.get("val"))
    ]


def _alias_key(node: fx.Node) -> tuple[int, ...]:
    """Which tensor arguments of ``node`` share a storage: for each, the position of the first
    one with its storage (part of the probe's cache key)."""
    seen: dict[StorageWeakRef, int] = {}
    return tuple(seen.setdefault(ref, len(seen)) for ref in _arg_storages(node))


def _probeable(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.is_view:
        return False
    # memcompile's own kernels state their scratch, or ask for the probe (``linearce.py``'s
    # ops: their many small temporaries are easier measured than summed).
    if target.namespace not in _PROBED_NAMESPACES and not node.meta.get(PROBE_META):
        return False
    outs = tensor_vals(node.meta.get("val"))
    if not outs or any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outs):
        return False
    inputs = set(_arg_storages(node))
    # Aliases of an input have no kernel, but for an ``out=`` overload's result.
    aliases = all(StorageWeakRef(t.untyped_storage()) in inputs for t in outs)
    return not aliases or _writes_out(target)


def _run_probes(
    jobs: Sequence[tuple[tuple[Any, ...], fx.Node]], device: torch.device
) -> dict[tuple[Any, ...], int]:
    results: dict[tuple[Any, ...], int] = {}
    calls: list[tuple[tuple[Any, ...], Callable[[], Any], int]] = []
    # Floating-point buffers are shared by every probe reading the same storage (an unrolled
    # recurrence reads 96 slices of one projection: one random fill, not 96); integer ones
    # (zeros, so that indices stay in range) are each probe's own, which no other probe's
    # out= write can change.
    shared: dict[tuple[StorageWeakRef, torch.dtype], torch.Tensor] = {}
    for key, node in jobs:
        try:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
            bases: dict[tuple[StorageWeakRef, torch.dtype], torch.Tensor] = {}
            args = materialize(args, device, bases, floats=shared)
            kwargs = materialize(kwargs, device, bases, floats=shared)
        except Exception as e:  # unbacked sizes, unsupported metadata: no probe
            log.debug("no workspace probe for %s: %s", node.target, e)
            results[key] = 0
            continue
        inputs = set(_arg_storages(node))  # new output memory only: an out= result is theirs
        host = HOST_RESULTS.get(node.target, ())  # results in host memory: not the device's
        out_bytes = sum(
            _concrete(t.untyped_storage().nbytes())
            for i, t in enumerate(tensor_vals(node.meta["val"]))
            if StorageWeakRef(t.untyped_storage()) not in inputs and i not in host
        )
        assert isinstance(node.target, torch._ops.OpOverload)  # _probeable checked it
        calls.append((key, functools.partial(node.target, *args, **kwargs), out_bytes))

    # Each op runs once unmeasured first: a kernel's first call may set up state it keeps (a
    # oneDNN primitive cache, say), which is not scratch and which later calls do not allocate.
    if device.type == "cuda":
        for key, call, out_bytes in calls:
            try:
                call()
            except Exception as e:
                log.debug("workspace probe %s failed: %s", key[0], e)
                results[key] = 0
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            try:
                call()  # the outputs are freed at once; the peak stat keeps the high-water mark
            except Exception as e:
                log.debug("workspace probe %s failed: %s", key[0], e)
                results[key] = 0
                continue
            torch.cuda.synchronize()
            results[key] = max(0, torch.cuda.max_memory_allocated() - start - out_bytes)
        return results

    from torch.profiler import ProfilerActivity, profile

    failed: set[int] = set()
    for i, (key, call, _) in enumerate(calls):
        try:
            call()
        except Exception as e:
            log.debug("workspace probe %s failed: %s", key[0], e)
            failed.add(i)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (_, call, _) in enumerate(calls):
            if i in failed:
                continue
            with torch.profiler.record_function(f"{_RANGE_PREFIX}{i}"):
                out = call()
                del out
    levels, ranges = allocation_trace(prof, _RANGE_PREFIX)
    for name, t0, t1 in ranges:
        i = int(name[len(_RANGE_PREFIX) :])
        key, _, out_bytes = calls[i]
        start, peak = range_levels(levels, t0, t1)
        results[key] = max(0, peak - start - out_bytes)
    for i in failed:
        results[calls[i][0]] = 0
    return results


def probe_workspaces(gm: fx.GraphModule) -> dict[str, int] | None:
    """Workspace bytes of each node of ``gm`` that has some (node name -> bytes).

    Returns ``None`` when the workspaces cannot be measured now: a profiler session is already
    running (the CPU probe needs its own, and nesting them corrupts the outer one).
    """
    jobs: dict[tuple[Any, ...], fx.Node] = {}
    keys: dict[str, tuple[Any, ...]] = {}
    device = torch.device("cpu")
    for node in gm.graph.nodes:
        if not _probeable(node):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        key = (str(node.target), _meta_key(args), _meta_key(kwargs), _alias_key(node))
        keys[node.name] = key
        if key not in _cache and key not in jobs:
            jobs[key] = node
            outs = tensor_vals(node.meta.get("val"))
            device = outs[0].device
    if jobs and device.type == "cpu" and torch.autograd.profiler._is_profiler_enabled:
        log.info("kernel workspaces not measured: a profiler session is active")
        return None
    if jobs:
        # Random ops must not advance the user's random stream (bit-identity with eager).
        devices = [device] if device.type == "cuda" else []
        # Backends run under AOTAutograd's fake mode: probes need real tensors and kernels.
        with _disable_current_modes(), torch.random.fork_rng(devices=devices), torch.no_grad():
            _cache.update(_run_probes(list(jobs.items()), device))
        log.debug("probed %d distinct ops for workspace", len(jobs))
    found = {name: _cache[key] for name, key in keys.items() if _cache.get(key, 0) > 0}
    # memcompile's own kernels state their scratch (e.g. rewrites/losshead.py): no probe needed.
    for node in gm.graph.nodes:
        if node.meta.get("memcompile_workspace"):
            found[node.name] = int(node.meta["memcompile_workspace"])
    return found


def clone_workspace(grad: torch.Tensor) -> int | None:
    """Scratch of copying ``grad`` (a fake tensor) into a contiguous tensor: AccumulateGrad's
    clone of a gradient whose layout differs from its (contiguous) parameter's. ``None`` if it
    cannot be measured now."""
    graph = fx.Graph()
    src = graph.placeholder("grad")
    src.meta["val"] = grad
    node = graph.call_function(
        torch.ops.aten.clone.default, (src,), {"memory_format": torch.contiguous_format}
    )
    node.meta["val"] = grad.clone(memory_format=torch.contiguous_format)
    graph.output(node)
    found = probe_workspaces(fx.GraphModule({}, graph))
    return None if found is None else found.get(node.name, 0)
