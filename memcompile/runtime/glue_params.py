"""Parameters only the eager glue reads, in the host tier, fetched around their module's forward.

A Hugging Face MoE with eager experts keeps its experts in 3-D parameters that only eager code
reads (``self.gate_up_proj[expert_idx]`` in a routing loop Dynamo runs eagerly): no fragment
takes them, so no plan can fetch them, and they stay on the device with their gradients. Once
the budget puts parameters on the host (``offload_params=True``, or ``"auto"`` deciding so for
the step), :class:`GlueParams` moves those too and fetches them as FSDP fetches a shard, around
the forward of the module that holds them::

    module.forward pre-hook     y = fetch(p)          a device copy; autograd: p -> Fetch -> y
                                module._parameters[name] = y
      eager glue                w = y[e]; F.linear(x, w)
                                  saves w: a view of y -> the glue's pack hook keeps only
                                  (p, w's geometry), no copy (runtime/glue.py)
    forward hook                module._parameters[name] = p;  y's device bytes go
    backward                    LinearBackward        w <- unpack: that view, fetched from p
                                FetchBackward         y's summed gradient -> p.grad, on the host

The gradient each read contributes is summed in the Fetch node's input as eager sums it in the
parameter's own, in the same order, and reaches ``p.grad`` once (a copy, then ``+=`` for later
micro-batches): values stay bit-identical. The module's forward holds its parameters on the
device (one MoE layer's experts, not the model's); everything else about them — the optimizer
step, the state — is where host-placed parameters' is (``runtime/store.place_on_host``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from memcompile.runtime.pinned import pinned_copy
from memcompile.runtime.store import TieredStore, can_host_place, host_tier_copy, is_host_placed

__all__ = ["GlueParam", "GlueParams"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueParam:
    """A parameter only eager code reads, moved to the host tier.

    Attributes:
        module: the path of the module that holds it (``""``: the model itself).
        name: its name in that module.
        nbytes: its bytes.
    """

    module: str
    name: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _to_param(g: torch.Tensor) -> torch.Tensor:
    # The gradient where the parameter is: the host tier (CPU), pinned host memory (CUDA).
    if not can_host_place(g):  # a view (an expanded zero, a slice): a tensor of its own
        g = g.clone()
    return pinned_copy(g) if g.device.type == "cuda" else host_tier_copy(g)


class _Fetch(torch.autograd.Function):
    """``p``'s device copy; its gradient goes back to ``p``, on the host."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, p: torch.Tensor, store: TieredStore, device: torch.device
    ) -> torch.Tensor:
        return _copy(p, store, device)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _to_param(g), None, None


class GlueParams:
    """The glue-only parameters of one compiled model, and their fetches.

    Args:
        store: the compiler's tiered store.
    """

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._local = threading.local()
        self.params: list[GlueParam] = []
        # A fetched device copy's storage address -> its parameter, while the module's forward
        # runs (the glue's pack hook keeps a saved view of the copy as the parameter's)
        self._fetched: dict[int, torch.Tensor] = {}

    def install(
        self,
        model: nn.Module,
        names: Iterable[str],
        device: torch.device,
        place: Callable[[torch.Tensor], int],
    ) -> int:
        """Move the parameters ``names`` (``model.named_parameters()`` names) to the host tier
        with ``place`` (``ResidentSet.move_to_host``) and fetch each around its module's
        forward. Returns the device bytes freed."""
        owners: dict[str, list[str]] = {}
        modules = dict(model.named_modules())
        new: list[GlueParam] = []
        for full in dict.fromkeys(names):  # in the caller's (the model's) order
            path, _, name = full.rpartition(".")
            owners.setdefault(path, []).append(name)
        freed = 0
        for path, names_ in owners.items():
            module = modules[path]
            for name in names_:
                p = module._parameters[name]
                assert p is not None
                nbytes = p.untyped_storage().nbytes()
                freed += place(p)
                new.append(GlueParam(path, name, nbytes))
            module.register_forward_pre_hook(self._pre_hook(tuple(names_), device))
            module.register_forward_hook(self._post_hook(), always_call=True)
        log.info(
            "memcompile: %d parameter(s) only eager code reads moved to the host tier (%s), "
            "fetched around their modules' forward",
            len(new),
            ", ".join(f"{g.module}.{g.name}" if g.module else g.name for g in new),
        )
        self.params.extend(new)
        return freed

    def _held(self, module: nn.Module) -> list[list[tuple[str, torch.Tensor, torch.Tensor]]]:
        # The module's open forwards on this thread, each with the copies its pre-hook swapped
        # in (a call nested in another of the same module swaps none: it reads the outer's).
        held = self._local.__dict__.setdefault("held", {})
        return held.setdefault(id(module), [])

    def _pre_hook(self, names: tuple[str, ...], device: torch.device) -> Any:
        store, fetched = self._store, self._fetched

        @torch._dynamo.disable(reason="memcompile: fetches a glue-read parameter")
        def fetch(module: nn.Module, args: Any) -> None:
            swapped: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            for name in names:
                p = module._parameters[name]
                if p is None or not is_host_placed(p):
                    continue
                if torch.is_grad_enabled() and p.requires_grad:
                    y = _Fetch.apply(p, store, device)
                else:
                    y = _copy(p, store, device)
                fetched[y.untyped_storage().data_ptr()] = p
                # Read as the parameter by the module's code; restored by the forward hook.
                module._parameters[name] = y  # type: ignore[assignment]
                swapped.append((name, p, y))
            self._held(module).append(swapped)

        return fetch

    def _post_hook(self) -> Any:
        fetched = self._fetched

        @torch._dynamo.disable(reason="memcompile: returns a glue-read parameter to the host")
        def restore(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._held(module)
            for name, p, y in stack.pop() if stack else ():
                module._parameters[name] = p  # type: ignore[assignment]
                fetched.pop(y.untyped_storage().data_ptr(), None)

        return restore

    def source(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host parameter ``t`` (a saved tensor) is a view of a fetched copy of, if any."""
        if not self._fetched:
            return None
        return self._fetched.get(t.untyped_storage().data_ptr())

    def real(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (a module's ``parameters()``), with each fetched copy a module holds
        during its forward replaced by the parameter it stands for."""
        fetched = self._fetched
        if not fetched:
            return list(tensors)
        return [t if t.is_leaf else fetched.get(t.untyped_storage().data_ptr(), t) for t in tensors]


def _copy(p: torch.Tensor, store: TieredStore, device: torch.device) -> torch.Tensor:
    # A device copy of the host parameter (without autograd: evaluation, a frozen parameter).
    y = store.get(p.detach(), device, "host")
    store.wait(y)
    return y
