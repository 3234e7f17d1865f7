"""Shared fixtures. Tests run with OMP_NUM_THREADS=1 (see README): compiled code on these shared
2-core machines is otherwise ~100x slower."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """A clean Dynamo cache and counters before and after the test."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
