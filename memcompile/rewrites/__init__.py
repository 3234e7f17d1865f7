"""Graph in, graph out. Each file is a rewrite: a ``find_x(...)`` (or ``plan_x``) that decides
and returns a frozen decision, and an ``x_pass(gm, ctx, *, decided)`` that applies it; only
``pipeline/`` calls both. ``context`` and ``rebuild`` are the helpers they share. Row tiling is
a package of its own: ``tiling/find.py`` decides, ``tiling/build.py`` applies, ``tiling/probe.py``
checks the blocks' bits.
"""
