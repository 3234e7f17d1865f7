"""Decisions as frozen data: a fragment's plan (``plan``), how it is searched (``planner``,
the ``milp`` yardstick), and how a step over its budget shares it between fragments
(``replan``). Reads ``analysis/``; never changes a graph.
"""
