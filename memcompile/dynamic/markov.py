"""The Markov (last-successor) block predictor: the pilot's fallback and its baseline.

For each block it remembers the blocks that followed it the last time it ran, one per horizon,
and predicts that they follow again:

    m = MarkovPredictor(horizon=2)
    for b in (0, 1, 2, 0, 1, 3):
        m.observe(b)
    m.predict()          # (-1, -1): block 3 has not been followed by anything yet
    m.observe(0)
    m.predict()          # (1, 3): what followed 0 last time (1, then 3)

Unknown predictions are :data:`UNKNOWN`. It costs one dict lookup per prediction and learns
from a single occurrence, so it is right from the second step of a static network on.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

__all__ = ["UNKNOWN", "MarkovPredictor"]

#: A prediction the predictor cannot make.
UNKNOWN = -1


class MarkovPredictor:
    """Last-successor predictor of the next ``horizon`` blocks (ints >= 0)."""

    def __init__(self, horizon: int = 2) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"MarkovPredictor: horizon must be an int >= 1; got {horizon!r}")
        self.horizon = horizon
        self._next: dict[int, list[int]] = {}
        self._recent: deque[int] = deque(maxlen=horizon + 1)

    def observe(self, block: int) -> None:
        """``block`` ran next: it is successor ``j`` of the block ``j`` calls back."""
        if block < 0:
            raise ValueError(f"MarkovPredictor: block ids are >= 0; got {block}")
        recent = self._recent
        for j in range(1, min(len(recent), self.horizon) + 1):
            prev = recent[-j]
            successors = self._next.get(prev)
            if successors is None:
                successors = self._next[prev] = [UNKNOWN] * self.horizon
            successors[j - 1] = block
        recent.append(block)

    def successors(self) -> list[int]:
        """:meth:`predict` as a new list, for a caller that overwrites some of it (the pilot's
        own predictions replace Markov's where it has better ones)."""
        recent = self._recent
        if recent:
            successors = self._next.get(recent[-1])
            if successors is not None:
                return successors[:]
        return [UNKNOWN] * self.horizon

    def predict(self) -> tuple[int, ...]:
        """The next ``horizon`` blocks after the last one observed (:data:`UNKNOWN` if unseen)."""
        if not self._recent:
            return (UNKNOWN,) * self.horizon
        successors = self._next.get(self._recent[-1])
        return tuple(successors) if successors is not None else (UNKNOWN,) * self.horizon
