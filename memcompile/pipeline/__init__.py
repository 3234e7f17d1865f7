"""How one fragment is decided and rewritten, top to bottom: ``fragment`` names the stages in
order, ``search`` holds the candidate plans and the one rule that chooses among them, ``built``
the rewrites of built graphs kept only when their exact profile is lower, ``features`` the
switches tests and benchmarks turn off.
"""
