"""A counter of placement changes: what was priced from where tensors live is priced again.

    before = placement.epoch()
    place_on_host(p)                 # store.py / pinned.py call placement.moved()
    placement.epoch() != before      # -> an optimizer's cost (analysis/optimizer_cost.py) is stale

memcompile moves parameters, gradients and optimizer state between the device and its tiers
rarely (a re-plan, the first offloaded step) but prices the optimizer step at every step of a
training loop; pricing walks every state tensor. The epoch lets that price be kept while nothing
moved (``step/iteration.py``).
"""

from __future__ import annotations

import itertools

__all__ = ["epoch", "moved"]

_counter = itertools.count(1)
_epoch = 0


def epoch() -> int:
    """The number of placement changes so far."""
    return _epoch


def moved() -> None:
    """memcompile moved a parameter, a gradient or optimizer state between the device and a
    tier (or Dynamo's placeholder in or out)."""
    global _epoch
    _epoch = next(_counter)
