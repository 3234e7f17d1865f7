"""Dynamic networks: block traces and the prefetch pilot (the dynamic-networks issue)."""
