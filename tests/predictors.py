"""Stand-in predictors for the pilot's prefetcher (``Prefetcher.predictor``), shared by the CPU
and CUDA tests."""

from __future__ import annotations

import math
from collections.abc import Sequence

from memcompile.dynamic.pilot import Prediction


class AlwaysWrong:
    """Predicts the block that just ran, every horizon: never the next one in an MoE forward
    (each expert and each block's router runs once per step)."""

    active = "adversarial"

    def __init__(self, horizon: int = 2) -> None:
        self.horizon = horizon
        self.last: str | None = None

    def observe(
        self, block: str, fragment: str, sizes: Sequence[int] = (), idioms: object = None
    ) -> None:
        self.last = block

    def predict(self) -> Prediction:
        return Prediction(
            blocks=(self.last,) * self.horizon,
            sources=("adversarial",) * self.horizon,
            confidence=(math.nan,) * self.horizon,
        )

    def end_step(self) -> None:
        pass
