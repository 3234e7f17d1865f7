"""A notice for a fragment whose compile runs long, so a budgeted first step is not silent.

Planning a large graph under a budget can take minutes on a CPU (the GRU (small) at 0.7x its
peak: ~3 minutes for its first step, benchmarks/results/compile_time.md), and everything the
compiler says about it is at INFO or DEBUG, which a default setup does not show. The compiler
wraps each fragment's compile in :func:`slow_compile_notice`:

    with slow_compile_notice("F3", nodes=812, budget=14_889_779):
        compiled = build...                # planning, rewriting, the inner compiler

    # after SLOW_COMPILE_S seconds (from a thread of its own), at WARNING:
    #   memcompile: F3 is still compiling after 60 s (a graph of 812 nodes, budget 14.20 MiB;
    #   now: the planner, call 2: the parameters on the host): planning a large graph under a
    #   budget can take minutes; TORCH_LOGS="+memcompile" ...
    # then every SLOW_COMPILE_S seconds, with what the pipeline is doing (pipeline/stage.py):
    #   memcompile: F3 is still compiling after 120 s (now: building plan 3: row tiling)
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
from memcompile.pipeline import stage

log = logging.getLogger(__name__)

__all__ = ["SLOW_COMPILE_S", "slow_compile_notice"]

#: Seconds a fragment's compile runs before the user is told it is still going.
SLOW_COMPILE_S = 60.0


@contextlib.contextmanager
def slow_compile_notice(
    name: str,
    *,
    nodes: int,
    budget: int | None,
    after_s: float | None = None,
    every_s: float | None = None,
) -> Iterator[None]:
    """Say (WARNING) that fragment ``name`` is still compiling when the block has run for
    ``after_s`` seconds (default :data:`SLOW_COMPILE_S`), again every ``every_s`` seconds
    (the same default) with what the pipeline is doing then, and how long it took once it is
    done."""
    wait = SLOW_COMPILE_S if after_s is None else after_s
    every = SLOW_COMPILE_S if every_s is None else every_s
    start = time.perf_counter()
    said = threading.Event()
    done = threading.Event()
    compiling = threading.get_ident()
    limit = "no budget" if budget is None else f"budget {format_bytes(budget)}"

    def doing() -> str:
        text = stage.now(compiling)
        return f"now: {text}" if text else ""

    def notices() -> None:
        if done.wait(wait):
            return
        said.set()
        now = doing()
        log.warning(
            "memcompile: %s is still compiling after %.0f s (a graph of %d nodes, %s%s): "
            "planning a large graph under a budget can take minutes; "
            'TORCH_LOGS="+memcompile" shows its progress',
            name,
            time.perf_counter() - start,
            nodes,
            limit,
            f"; {now}" if now else "",
        )
        while not done.wait(every):
            now = doing()
            log.warning(
                "memcompile: %s is still compiling after %.0f s%s",
                name,
                time.perf_counter() - start,
                f" ({now})" if now else "",
            )

    # A daemon: an interpreter exiting mid-compile does not wait for it.
    thread = threading.Thread(target=notices, name=f"memcompile-notice-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        stage.clear()
        if said.is_set():
            log.warning("memcompile: %s compiled in %.0f s", name, time.perf_counter() - start)
