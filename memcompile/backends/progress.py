"""A notice for a fragment whose compile runs long, so a budgeted first step is not silent.

Planning a large graph under a budget can take minutes on a CPU (the GRU (small) at 0.7x its
peak: ~3 minutes for its first step, benchmarks/results/compile_time.md), and everything the
compiler says about it is at INFO or DEBUG, which a default setup does not show. The compiler
wraps each fragment's compile in :func:`slow_compile_notice`:

    with slow_compile_notice("F3", nodes=812, budget=14_889_779):
        compiled = build...                # planning, rewriting, the inner compiler

    # after SLOW_COMPILE_S seconds, once (from a timer thread), at WARNING:
    #   memcompile: F3 is still compiling after 60 s (a graph of 812 nodes, budget 14.20 MiB):
    #   planning a large graph under a budget can take minutes; TORCH_LOGS="+memcompile" ...
    # and when it is done, only if the first was said:
    #   memcompile: F3 compiled in 192 s

Nothing is said for a compile shorter than that.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from memcompile.errors import format_bytes

log = logging.getLogger(__name__)

__all__ = ["SLOW_COMPILE_S", "slow_compile_notice"]

#: Seconds a fragment's compile runs before the user is told it is still going.
SLOW_COMPILE_S = 60.0


@contextlib.contextmanager
def slow_compile_notice(
    name: str, *, nodes: int, budget: int | None, after_s: float | None = None
) -> Iterator[None]:
    """Say once (WARNING) that fragment ``name`` is still compiling when the block has run for
    ``after_s`` seconds (default :data:`SLOW_COMPILE_S`), and how long it took once it is done."""
    wait = SLOW_COMPILE_S if after_s is None else after_s
    start = time.perf_counter()
    said = threading.Event()
    limit = "no budget" if budget is None else f"budget {format_bytes(budget)}"

    def notice() -> None:
        said.set()
        log.warning(
            "memcompile: %s is still compiling after %.0f s (a graph of %d nodes, %s): planning "
            'a large graph under a budget can take minutes; TORCH_LOGS="+memcompile" shows '
            "its progress",
            name,
            time.perf_counter() - start,
            nodes,
            limit,
        )

    timer = threading.Timer(wait, notice)
    timer.daemon = True  # an interpreter exiting mid-compile does not wait for it
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            log.warning("memcompile: %s compiled in %.0f s", name, time.perf_counter() - start)
