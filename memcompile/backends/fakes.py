"""The real parameters behind fake example inputs (DDP's graph splitting).

Dynamo hands a backend the real tensors a frame was traced with. DDP's graph splitter
(``torch._dynamo.backends.distributed.DDPOptimizer``, on whenever the compiled module is wrapped
in ``DistributedDataParallel``) does not: it splits the frame's graph at gradient-bucket
boundaries and compiles each piece with *fake* copies of its inputs, parameters included. A
fake parameter has no storage, so nothing can move to the host tier from it, and its bytes
cannot be matched with the step's measured storages. The fake mode that made the copies still
maps each real tensor to its fake one (its converter's memo); :func:`real_inputs` reads that map
backwards:

    DDPOptimizer:  compile(submod, [fake(x), fake(W1), fake(b1)])
    real_inputs:   [fake(x), W1, b1]     # the parameters are the model's own objects again

Only ``nn.Parameter`` inputs are replaced: activations stay fake (their real values are the
previous piece's outputs, which do not exist yet at compile time). The memo is private API;
where it is missing the inputs come back unchanged and the caller says what that costs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode

log = logging.getLogger(__name__)

__all__ = ["real_inputs"]


def _fake_to_real(mode: Any) -> dict[int, torch.Tensor] | None:
    """id(fake) -> real tensor for every tensor ``mode`` converted (``None``: no memo)."""
    try:
        converter = mode.fake_tensor_converter
        ids = converter.meta_converter.describer.lookup_tensor  # real tensor -> memo id
        memo = converter.tensor_memo  # memo id -> fake tensor
        pairs = list(ids.items())
    except AttributeError:  # another torch version: its memo is laid out differently
        return None
    out: dict[int, torch.Tensor] = {}
    for real, tid in pairs:
        fake = memo.get(tid)
        if fake is not None:
            out[id(fake)] = real
    return out


def real_inputs(example_inputs: Sequence[Any]) -> tuple[list[Any], int]:
    """``example_inputs`` with each fake ``nn.Parameter`` replaced by the real parameter it was
    made from, and how many fake parameters had no real one found. Inputs that are not fake are
    returned as they are (Dynamo's usual call)."""
    inputs = list(example_inputs)
    fakes = [
        i
        for i, t in enumerate(inputs)
        if isinstance(t, torch._subclasses.FakeTensor) and isinstance(t, torch.nn.Parameter)
    ]
    if not fakes:
        return inputs, 0
    mode = detect_fake_mode(inputs)
    found = _fake_to_real(mode) if mode is not None else None
    missing = 0
    for i in fakes:
        real = found.get(id(inputs[i])) if found is not None else None
        if isinstance(real, torch.nn.Parameter) and not isinstance(
            real, torch._subclasses.FakeTensor
        ):
            inputs[i] = real
        else:
            missing += 1
    log.debug("real parameters behind %d fake inputs (%d not found)", len(fakes), missing)
    return inputs, missing
