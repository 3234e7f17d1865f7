"""What the CLI's ``TARGET`` argument names, turned into a zoo :class:`Workload`.

    memcompile inspect gpt                      # a zoo workload (--size tiny|small|bench)
    memcompile inspect mypkg.models:make        # a function returning (model, batch[, loss])

A ``module:function`` target is imported (the current directory is on the path, as for
``python -m``) and called with no arguments. It returns:

* ``(model, batch)``: ``batch`` is a tuple ``(*inputs, targets)``; the loss is
  ``cross_entropy(model(*inputs), targets)`` with the class dimension last (both flattened);
* ``(model, batch, loss)``: ``loss(model, batch)`` returns the scalar loss, ``model`` being the
  compiled model.

Either way the model and its loss are wrapped in one module whose ``forward(*batch)`` returns the
loss, so the loss is inside the compiled region, as for the zoo's workloads, and its memory is
planned too. Every failure raises :class:`TargetError` with a one-line message.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo.base import Workload

log = logging.getLogger(__name__)

__all__ = ["LossModule", "TargetError", "resolve_target"]

LossFn = Callable[[Callable[..., torch.Tensor], tuple[Any, ...]], torch.Tensor]


class TargetError(ValueError):
    """A TARGET that cannot be loaded; the message is one line for the CLI."""


def _cross_entropy(model: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> torch.Tensor:
    *inputs, targets = batch
    logits = model(*inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LossModule(nn.Module):
    """``forward(*batch)`` is ``loss(model, batch)``: the user's model with its loss inside."""

    def __init__(self, model: nn.Module, loss: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss(self.model, batch)


def _load_function(spec: str) -> Callable[[], Any]:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise TargetError(f"target {spec!r}: expected module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules are importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(f"target {spec!r}: cannot import {module_name!r} ({e})") from None
    except Exception as e:  # the module itself failed while importing
        raise TargetError(
            f"target {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise TargetError(f"target {spec!r}: {module_name!r} has no function {func_name!r}")
    return func


def _from_function(spec: str) -> Workload:
    func = _load_function(spec)
    try:
        made = func()
    except Exception as e:
        raise TargetError(f"target {spec!r}: calling it raised {type(e).__name__}: {e}") from None
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TargetError(
            f"target {spec!r} must return (model, batch) or (model, batch, loss); "
            f"got {type(made).__name__}"
        )
    model, batch, *rest = made
    if not isinstance(model, nn.Module):
        raise TargetError(
            f"target {spec!r}: model must be an nn.Module, got {type(model).__name__}"
        )
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    loss: LossFn = rest[0] if rest else _cross_entropy
    if not callable(loss):
        raise TargetError(f"target {spec!r}: loss must be callable, got {type(loss).__name__}")
    if not rest and len(batch) < 2:
        raise TargetError(
            f"target {spec!r}: with no loss function the batch must be (*inputs, targets)"
        )
    return Workload(
        name=spec,
        summary=f"{type(model).__name__} from {spec}",
        model=LossModule(model, loss),
        batch_fn=lambda step: batch,
        dynamic=False,
        single_fragment=False,
    )


def resolve_target(spec: str, *, size: str = "tiny", seed: int = 0) -> Workload:
    """The workload ``spec`` names: a zoo name, or ``module:function`` (module docstring).

    Raises:
        TargetError: unknown zoo name, import failure, or a function returning something else.
    """
    from memcompile import zoo

    if ":" in spec:
        return _from_function(spec)
    if spec not in zoo.names():
        raise TargetError(
            f"unknown target {spec!r}: give a zoo workload ({', '.join(zoo.names())}) "
            "or module:function"
        )
    try:
        return zoo.build(spec, size=size, seed=seed)
    except ValueError as e:
        raise TargetError(str(e)) from None
