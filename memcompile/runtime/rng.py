"""Dropout masks replayed from the random generator's state (CPU).

``rewrites/dropout.py`` (``replay=True``) replaces each ``native_dropout`` of the joint graph with

    state = torch.ops.memcompile.dropout_draw(x, p)                  # random
    mask  = torch.ops.memcompile.dropout_replay(state, size, stride, p)   # deterministic

``dropout_draw`` returns the default CPU generator's state and then makes exactly the draw that
``native_dropout(x, p, train=True)`` makes (``empty_like(x, dtype=bool).bernoulli_(1 - p)``: the
same mask, the same generator state afterwards; checked by ``tests/test_dropout.py`` for
contiguous, permuted and strided inputs), so every later random op sees eager's stream.
``dropout_replay`` draws that mask again from ``state`` and puts the generator back as it found
it: a pure function of its arguments, so the planner may recompute the mask in the backward
(from a 5 KiB saved state) instead of keeping it (1 byte per element) -- what
``torch.utils.checkpoint``'s ``preserve_rng_state`` does for a whole block, here per mask.

CPU only: the state is the Mersenne-Twister generator's (``torch.get_rng_state()``). CUDA's
Philox generator would replay from a (seed, offset) pair; that path is not verified here, so the
pass leaves CUDA dropouts to the saved-mask rewrite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["STATE_BYTES", "dropout_draw", "dropout_replay"]

#: Bytes of the CPU generator's state (``torch.get_rng_state()``): what a replayed mask keeps.
STATE_BYTES: int = torch.get_rng_state().numel()


@torch.library.custom_op(
    "memcompile::dropout_draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def dropout_draw(x: torch.Tensor, p: float) -> torch.Tensor:
    """The generator's state, then ``native_dropout(x, p, True)``'s draw (its mask discarded)."""
    state = torch.get_rng_state()
    torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
    return state


@dropout_draw.register_fake
def _(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty(STATE_BYTES, dtype=torch.uint8, device="cpu")


@torch.library.custom_op(
    "memcompile::dropout_replay",
    mutates_args=(),
    schema="(Tensor state, SymInt[] size, SymInt[] stride, float p) -> Tensor",
)
def dropout_replay(
    state: torch.Tensor, size: Sequence[int], stride: Sequence[int], p: float
) -> torch.Tensor:
    """The mask ``native_dropout`` drew from generator state ``state`` (the generator is left as
    it was)."""
    before = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return torch.empty_strided(size, stride, dtype=torch.bool).bernoulli_(1.0 - p)
    finally:
        torch.set_rng_state(before)


@dropout_replay.register_fake
def _(state: torch.Tensor, size: Sequence[int], stride: Sequence[int], p: float) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=torch.bool, device="cpu")
