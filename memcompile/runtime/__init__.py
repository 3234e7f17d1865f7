"""Runtime pieces: measurement of device peaks (and, later, swap ops and tiered stores)."""
