"""What runs with the graphs: memcompile's custom ops, the host and disk store, the pilot's
prefetch cache, pinned host copies, measured peaks, and the loss head's kernels."""
