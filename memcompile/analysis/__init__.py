"""Facts and prices about graphs: sizes, liveness, costs, profiles, the joint and step models.

Nothing here changes a graph. ``graph`` (GraphProfile, storage ids), ``liveness`` (the array
replay), ``costmodel`` (device profiles), ``workspace`` (measured kernel scratch), ``timeline``
(a graph's copy and compute times), ``fragment_profile`` (a forward+backward pair),
``joint_model`` and ``schedule`` (the planner's memory model of a joint graph and its
memory-aware orders), ``step_model`` (a whole step's replay across fragments).
"""
