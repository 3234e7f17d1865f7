"""Plans cached across runs: a fragment planned once is not searched again in the next process.

Planning a fragment under a budget searches: the planner's plans, the late rewrites of each
built candidate (in place, blocks of rows, values made again), the alternatives. The second run
of the same script gets the same fragments with the same options, so this module keeps what the
search decided, as data, in the user's cache directory (as Inductor's FX graph cache does), and
the pipeline (``pipeline/fragment.py``) replays it instead of searching::

    key   = sha256(joint graph: ops, names, shapes; the fragment's inputs; the options; the
                   switches; what is resident; the device profile; memcompile's and torch's
                   versions)
    entry = {derivation: [["in_place"], ["fetch", [3, 4]], ...],   how the joint was rewritten
             late: [["in_place"], ["tiling", 0], ["remat", [...]]],  the built graphs' rewrites
             plan: FragmentPlan, hosted, host_peak, prefetch_reserve,
             graphs: digest of the built forward and backward}

    replay: the derivation applied to AOT's joint graph, the plan built with the recorded late
            rewrites (no planner call, no trial profile), the built graphs' digest compared with
            the entry's: equal -> the decided fragment; else a log line and the full search.

JSON, never pickle; one file per key (``<key>.json``), written atomically. A missing, corrupt or
stale entry is a log line and a plan as without the cache. The directory is
``$MEMCOMPILE_CACHE_DIR``, else ``memcompile/plans`` under Inductor's cache directory
(``$TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``); ``MEMCOMPILE_PLAN_CACHE=0``
turns it off (``features.plan_cache``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from memcompile import config
from memcompile.analysis.graph import format_arg, target_name, value_meta
from memcompile.pipeline import features
from memcompile.pipeline.env import FragmentEnv, FragmentSpec
from memcompile.planning.plan import FragmentPlan
from memcompile.runtime.store import is_host_placed

__all__ = [
    "DERIVATION",
    "FORMAT",
    "LATE",
    "CachedPlan",
    "Step",
    "cache_dir",
    "derived",
    "fragment_key",
    "graphs_digest",
    "load",
    "store",
]

log = logging.getLogger(__name__)

#: The entries' layout; a change makes every older entry a miss.
FORMAT = 1
#: ``gm.meta`` key of a joint graph's derivation from AOT's: the steps that made it.
DERIVATION = "memcompile_derivation"
#: ``gm.meta`` key (on a built forward graph) of the late rewrites its build applied.
LATE = "memcompile_late_rewrites"

#: A step of a derivation or of the late rewrites: its name, then JSON-able arguments.
Step = tuple[Any, ...]


@dataclass(frozen=True)
class CachedPlan:
    """What the search decided for one fragment, enough to build it again without searching.

    Attributes:
        derivation: the joint graph's rewrites from AOT's, in order (``pipeline/fragment.py``
            replays them).
        late: the late rewrites of the built graphs, in order (``search.build``).
        plan: the plan as decided.
        hosted: input positions moved to the host tier by this plan.
        host_peak: the smallest peak found with the parameters on the host, when tried.
        prefetch_reserve: bytes left to the pilot's prefetch cache.
        graphs: :func:`graphs_digest` of the built forward and backward graphs.
    """

    derivation: tuple[Step, ...]
    late: tuple[Step, ...]
    plan: FragmentPlan
    hosted: tuple[int, ...]
    host_peak: int | None
    prefetch_reserve: int
    graphs: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CachedPlan:
        return cls(
            derivation=tuple(_step(s) for s in data["derivation"]),
            late=tuple(_step(s) for s in data["late"]),
            plan=FragmentPlan.from_dict(data["plan"]),
            hosted=tuple(int(i) for i in data["hosted"]),
            host_peak=None if data["host_peak"] is None else int(data["host_peak"]),
            prefetch_reserve=int(data["prefetch_reserve"]),
            graphs=str(data["graphs"]),
        )


def _step(s: Any) -> Step:
    """A step read back from JSON: a name, then its arguments."""
    if not isinstance(s, list) or not s or not isinstance(s[0], str):
        raise ValueError(f"not a step: {s!r}")
    return tuple(s)


def derived(src: fx.GraphModule, out: fx.GraphModule, *step: Any) -> fx.GraphModule:
    """``out`` (a rewrite of ``src``) with its derivation: ``src``'s and ``step``. A rewrite
    that changed nothing (``out is src``) adds no step: replayed, it changes nothing either."""
    if out is not src:
        out.meta[DERIVATION] = (*src.meta.get(DERIVATION, ()), tuple(step))
    return out


# -- where ---------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$MEMCOMPILE_CACHE_DIR``, else ``memcompile/plans`` in Inductor's cache directory."""
    env = os.environ.get("MEMCOMPILE_CACHE_DIR")
    if env:
        return Path(env)
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir()) / "memcompile" / "plans"


# -- the key ---------------------------------------------------------------------------------
def _meta(v: Any) -> str:
    """``value_meta`` and what else a plan depends on: a tensor's offset, whether it is a
    parameter and in the host tier; the values of the items of tuples and of plain numbers."""
    if isinstance(v, torch.Tensor):
        param = " param" if isinstance(v, torch.nn.Parameter) else ""
        host = " host" if is_host_placed(v) else ""
        return f"{value_meta(v)} +{v.storage_offset()}{param}{host}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_meta(x) for x in v) + ")"
    if isinstance(v, (int, float, bool)):
        return f"{type(v).__name__}({v})"
    return value_meta(v)


def _named(node: fx.Node) -> str:
    return f"%{node.name}"  # a plan names nodes: their names are part of the key


#: Arguments of memcompile's ops that are keys of this process's objects, not the plan.
_PROCESS_KEYS = frozenset({"store", "hook"})


def _graph_text(gm: fx.GraphModule) -> str:
    """Each node: name, op, target, arguments, value metadata. The arguments of memcompile's
    ops that name this process's objects (the tiered store's key: a process counter) are
    written as ``K``."""
    lines = []
    for n in gm.graph.nodes:
        args: Any = n.args
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.name.startswith("memcompile::"):
            names = [a.name for a in schema.arguments]
            args = tuple(
                "K" if i < len(names) and names[i] in _PROCESS_KEYS else a
                for i, a in enumerate(args)
            )
        lines.append(
            f"{n.name}={n.op}:{target_name(n.target)}"
            f"({format_arg(args, _named)}, {format_arg(n.kwargs, _named)})"
            f" :: {_meta(n.meta.get('val'))}"
        )
    return "\n".join(lines)


def graphs_digest(fw: fx.GraphModule, bw: fx.GraphModule) -> str:
    """A digest of built graphs: equal for the same rewrites of the same joint graph."""
    h = hashlib.sha256()
    for gm in (fw, bw):
        h.update(_graph_text(gm).encode())
        h.update(b"\x1e")
    return h.hexdigest()


def fragment_key(
    traced: fx.GraphModule,
    num_fwd_outputs: int,
    static: Sequence[int],
    spec: FragmentSpec,
    env: FragmentEnv,
    host: Sequence[int],
) -> str:
    """The key of a fragment's plan: everything the search reads (see the module docstring).
    ``host``: the parameters a plan may move to the host tier (their resident bytes differ)."""
    options = dataclasses.asdict(env.config)
    options.pop("trace_path", None)  # where the pilot's trace goes: not what it plans
    resident = env.resident
    parts = {
        "format": FORMAT,
        "memcompile": config.VERSION,
        "torch": torch.__version__,
        "joint": hashlib.sha256(_graph_text(traced).encode()).hexdigest(),
        "num_fwd_outputs": num_fwd_outputs,
        "static": list(static),
        "inputs": [_meta(t) for t in spec.example_inputs],
        "may_host": [resident.may_host(t) for t in spec.example_inputs],
        "alias_sources": sorted(spec.alias_sources.items()),
        "device": str(spec.device),
        "inner": spec.inner,
        "dropped_outputs": sorted(spec.dropped_outputs),
        "released_tangents": sorted(spec.released_tangents),
        "replan": [
            spec.replan_resident,
            spec.replan_saved_cap,
            list(spec.replan_start),
            spec.host_replan,
            spec.inner_excess,
        ],
        "config": repr(sorted(options.items())),
        "features": repr(features.current()),
        "resident": [
            resident.resident_bytes(spec),
            resident.resident_bytes(spec, host=host),
            resident.host_step,
            resident.max_block_host_bytes,
            resident.device_other_bytes,
            env.pilot_plans,
        ],
        "profile": env.cost_profile(spec.example_inputs).to_dict(),
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# -- reading and writing ----------------------------------------------------------------------
def load(key: str) -> CachedPlan | None:
    """The entry of ``key``, or ``None`` (missing; corrupt: logged)."""
    path = cache_dir() / f"{key}.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("memcompile: plan cache entry %s unreadable (%s): planning again", path, e)
        return None
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError(f"format {data.get('format')!r}, key {data.get('key')!r}")
        return CachedPlan.from_dict(data["entry"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("memcompile: plan cache entry %s is corrupt (%s): planning again", path, e)
        return None


def store(key: str, entry: CachedPlan) -> None:
    """Write ``entry`` under ``key`` (atomically: a reader sees the old file or the new one).
    A directory that cannot be written is a log line: the plan stands without the cache."""
    where = cache_dir()
    text = json.dumps(
        {"format": FORMAT, "key": key, "memcompile": config.VERSION, "entry": entry.to_dict()}
    )
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, where / f"{key}.json")
        finally:
            Path(tmp).unlink(missing_ok=True)  # gone once replaced; left only on a failure
    except OSError as e:
        log.warning("memcompile: plan cache %s not written (%s)", where, e)
        return
    log.debug("memcompile: plan cached as %s", where / f"{key}.json")
