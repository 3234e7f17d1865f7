"""memcompile's graph ops: swap a tensor out to a tier and back.

    host = torch.ops.memcompile.offload(x, store, tier)    # copy x to the store's tier
    y    = torch.ops.memcompile.reload(host, device, store, tier)  # copy back to the device

Real custom ops (``torch.library.custom_op``, functional, with fake kernels), so they survive
AOTAutograd, FX codegen and Inductor, and the analysis can recognise them. ``offload`` returns a
CPU tensor whose memory is outside the device allocator (see ``store.py``); ``reload`` returns a
new device tensor. Neither returns (a view of) its input.
"""

from __future__ import annotations

import torch

from memcompile.runtime.store import get_store

__all__ = ["TIERS", "offload", "reload"]

#: Tier codes carried by the graph nodes.
TIERS: tuple[str, ...] = ("host", "disk")


@torch.library.custom_op("memcompile::offload", mutates_args=())
def offload(x: torch.Tensor, store: int, tier: int) -> torch.Tensor:
    """Copy ``x`` to tier ``TIERS[tier]`` of store ``store``; returns the tier's tensor."""
    return get_store(store).put(x, TIERS[tier])  # type: ignore[arg-type]


@offload.register_fake
def _(x: torch.Tensor, store: int, tier: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op("memcompile::reload", mutates_args=())
def reload(h: torch.Tensor, device: torch.device, store: int, tier: int) -> torch.Tensor:
    """A new tensor on ``device`` with the values of the swapped tensor ``h``."""
    return get_store(store).get(h, device, TIERS[tier])  # type: ignore[arg-type]


@reload.register_fake
def _(h: torch.Tensor, device: torch.device, store: int, tier: int) -> torch.Tensor:
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
