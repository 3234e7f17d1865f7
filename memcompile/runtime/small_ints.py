"""The small integer outputs of a fragment call: what the pilot and the block traces read.

An MoE router's per-expert counts decide the next blocks (``dynamic/pilot.py``). A call's
outputs are read at its end, once, by :func:`small_int_outputs`; the pilot's in-graph op
(``rewrites/pilot_prefetch.py``) reads the same outputs inside the graph, picked by the same
limits.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MAX_OUTPUTS", "MAX_OUTPUT_ELEMENTS", "READ_DEVICES", "small_int_outputs"]

#: Small integer outputs whose values an event keeps, and the most elements one may have.
MAX_OUTPUTS = 4
MAX_OUTPUT_ELEMENTS = 32
#: Devices whose small integer outputs :func:`small_int_outputs` reads.
READ_DEVICES = ("cpu", "cuda")

_tolist = torch._C.TensorBase.tolist

_INT_DTYPES = frozenset(
    (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)  # not bool: masks
)


def small_int_outputs(outputs: Any) -> tuple[tuple[int, ...], ...]:
    """The values of the small integer tensors among a call's outputs, in output order.

    Kept: CPU and CUDA tensors of an integer dtype (not bool) with 1 to
    :data:`MAX_OUTPUT_ELEMENTS` elements, flattened; at most :data:`MAX_OUTPUTS` of them.
    Outputs may be a tensor or (nested) lists and tuples; anything else is skipped. Reading a
    CUDA tensor waits for the device (see the module docstring): call this at a fragment's end,
    not inside a graph.
    """
    found: list[tuple[int, ...]] = []
    stack = [outputs]
    while stack and len(found) < MAX_OUTPUTS:
        o = stack.pop()
        if isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif (
            isinstance(o, torch.Tensor)
            and o.dtype in _INT_DTYPES
            and o.device.type in READ_DEVICES
            and 0 < o.numel() <= MAX_OUTPUT_ELEMENTS
        ):
            # torch's own tolist, not torch.Tensor's: while the pilot watches the model's reads
            # (scalar_reads.py) that is wrapped, and this read is memcompile's, not the model's.
            found.append(tuple(_tolist(o.detach().reshape(-1))))
    return tuple(found)
