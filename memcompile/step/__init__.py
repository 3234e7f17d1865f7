"""What memcompile watches between compiles: every fragment call of a step (``monitor``), what
the step holds resident on the device (``resident``), the whole step against the budget and the
re-plans that follow (``budget``), and the checks made at a step's end (``checks``).
"""
