"""Benchmark and demo workloads, installed with the package so ``memcompile demo`` works anywhere.

    >>> from memcompile import zoo
    >>> zoo.names()
    ('branchy', 'early_exit', 'early_exit_natural', 'gpt', 'gpt_manual', 'gru', 'moe',
     'moe_natural', 'moe_natural_top2', 'resnet', 'tree_natural', 'treelstm')
    >>> wl = zoo.build("gpt", size="tiny")
    >>> wl.model(*wl.batch(0)).backward()

Each workload module registers a factory ``(size, seed) -> Workload`` with :func:`register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from memcompile.zoo.base import SIZES, Workload, check_size

__all__ = ["SIZES", "Workload", "build", "names", "register"]

_FACTORIES: dict[str, Callable[[str, int], Workload]] = {}
_MODULES = ("gpt", "branchy", "resnet", "moe", "early_exit", "treelstm", "gru", "natural")
_loaded = False


def register(
    name: str,
) -> Callable[[Callable[[str, int], Workload]], Callable[[str, int], Workload]]:
    """Decorator: register ``factory(size, seed) -> Workload`` under ``name``."""

    def deco(factory: Callable[[str, int], Workload]) -> Callable[[str, int], Workload]:
        if name in _FACTORIES:
            raise ValueError(f"zoo workload {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return deco


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in _MODULES:
            importlib.import_module(f"memcompile.zoo.{mod}")
        _loaded = True


def names() -> tuple[str, ...]:
    """Registered workload names, sorted."""
    _load()
    return tuple(sorted(_FACTORIES))


def build(name: str, *, size: str = "tiny", seed: int = 0) -> Workload:
    """Build workload ``name`` at ``size`` (one of :data:`SIZES`) with parameters from ``seed``.

    Two calls with the same arguments give models with identical parameters and identical batches.
    """
    _load()
    check_size(size)
    if name not in _FACTORIES:
        raise ValueError(f"unknown zoo workload {name!r}; choose one of {', '.join(names())}")
    return _FACTORIES[name](size, seed)
