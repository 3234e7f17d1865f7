"""Row tiling: an elementwise result made a block of rows at a time, from operands that then
exist only a block at a time.

In a built backward, an elementwise op often reads values made just for it: a pre-activation
the plan recomputes, a gradient the graph broadcasts and scales. Branchy's branch backward at
bench size holds three 16 MiB tensors for one 16 MiB result (the recomputed pre-activation,
the dense scaled gradient, and the result written into it). Each row of the result depends on
the same row of those operands only, so they can be made a block of rows at a time:

    built backward before                               after
      g = div(expand(dy, [B, T, H]), H)                   out = empty([B*T, H])
      p = view(addmm(b, x, w_t), [B, T, H])               for each block r of rows (BLOCKS):
      gx = gelu_backward(g, p)                              g_r = div(view(expand(..))[r], H)
      ... = sum(view(gx, ..)); mm(t(view(gx)), x)           p_r = addmm(b, x[r], w_t)
                                                            gelu_backward.grad_input(
                                                                g_r, p_r, grad_input=out[r])
                                                          gx = view(out, [B, T, H])

The result is whole again for its readers (the weight gradient sums over every row: making it
by blocks would change the order of that sum), so only the operands' memory goes: the result
plus one block of each, instead of the result and every operand.

**What is tiled.** The *op* is an elementwise op with an ``out=`` form (``inplace.OPS`` and
``FORWARD_OPS``, or that form already, writing into an operand), a ``mean``/``sum`` over the
last dim only (branchy's forward: the mean of a GELU of a linear layer, whose 16 MiB GELU
output is then never whole), or ``_softmax``/``_softmax_backward_data`` over the last dim
(:data:`_ROW_OPS`), whose result is dense, with static sizes, and not a graph output.
Its *chain* is the values it reads, transitively, that are made row by row: ``view``/``reshape``
between ``[B, T, H]`` and ``[B*T, H]`` of such a value, pointwise ops (``torch.Tag.pointwise``;
an elementwise ``out=`` node that wrote into its operand counts as its functional op; ``detach``
and ``alias`` count as views), the row ops of :data:`_ROW_OPS`, ``mm``/``addmm`` whose row
operand is such a value or a leaf, and ``bmm`` of two leaves (blocks then hold whole batches:
``align`` rows). An op inside another's chain goes with that chain, unless the other keeps it
whole for earlier readers (then it is made by its own blocks too, where neither removes what
the other reads). Everything the chain reads from outside is a *leaf*, read whole: a leaf with
the op's rows is sliced per block (``view`` to ``[rows, k]`` first), a ``bmm``'s operands by
ranges of batches, one whose leading sizes are all 1 (a bias, a scalar) is read as it is, one
whose ``[P, k]`` rows repeat every ``P`` rows of its reader (a causal mask read by
``[B, H, T, T]`` scores) is repeated per block, a matmul's right operand always whole; any other
leaf leaves the op untiled. Values are handled as ``[rows, k]`` throughout. A chain value read
after the op is whole there anyway: it is read as a leaf instead, and the search runs again.

A chain value that other nodes read too is *kept*: it stays in the graph for them and the
blocks make it again (GPT's recomputed pre-activation, read by the GELU for the down
projection's weight gradient and then by the GELU's gradient: it now dies at the GELU, which
the in-place pass then writes into). Only when those readers all come before the op (else it
would be held whole at the op anyway), and with at most ``max_kept_matmuls`` matmuls made
again (:data:`MAX_KEPT_MATMULS`): a chain that would make more reads those matmuls whole, as
leaves, instead (no time; held whole up to the op). The compiler tries none first. The op is
tiled only where the values that go are at least half its result's bytes, and where nothing
between the chain's first node and the op writes into a leaf (the blocks read the leaves at
the op).

**Absorbed readers.** Where every other reader of a kept value is a ``bmm`` that reads it
through views nothing else reads (in its memory order, then transposes of later dims), whose
other operand is not made by the chain, and whose product nothing but views reads before the
op, the blocks make those products too, each block its own batches into the product's buffer
(``bmm.out``), and the value is not kept. Hand-written attention's value gradient reads the
recomputed probabilities before their gradient is made::

    before                                      after
      p = _softmax(scores)  # whole, 8 MiB        d_v = empty([B*H, T, D])
      d_v = bmm(transpose(view(p)), d_out)        for each block r of whole batches:
      d_s = _softmax_backward_data(d_p, p, ...)     p_r = _softmax(scores_r)
                                                    bmm.out(transpose(view(p_r)), d_out[r],
                                                            out=d_v[r])
                                                    _softmax_backward_data.out(d_p_r, p_r, ...)

so the probabilities are made once per step instead of twice (their own blocks for ``d_v``,
then the gradient's), and never whole. The product's views placed before the op move after
it; the probe compares the products too.

**Reloads by rows.** A leaf that is a swapped tensor's ``reload`` (or a view of it), read by
rows only, goes with its ``wait``: each block reloads its own rows from the host copy, on a GPU
the next block's copy issued before this block computes, so that it overlaps (on a CPU the copy
runs on the computing thread: issued early it would only be held through this block)::

    before                                       after
      h = memcompile.reload(h_host, dev, s, 0)     for each block r of rows:
      memcompile.wait(h, s)                          h_r = memcompile.reload(
      gx = gelu_backward(g, view(h, [B, T, H]))          view(h_host, [B*T, H])[r], dev, s, 0)
                                                     memcompile.wait(h_r, s)
                                                     gelu_backward.grad_input(g_r, h_r, ...)

(branchy's host tier: a plan that swaps every pre-activation peaks as low as one that
recomputes them, without their matmuls). Likewise a reload read only as a batched matmul's
operand (directly, or through views and transposes of its later dims, ``v.transpose(1, 2)``):
each block reloads its own batches, the host copy's first dim, and makes the leaf's views of
them (hand-written attention's host tier: the values, reloaded whole for the probabilities'
gradient, 2 MiB a layer at the bench GPT's size, held beside the scores' blocks).

**Bit-identical, measured.** A block of rows of ``addmm`` is the same dot products as the whole,
and an elementwise kernel computes each element alike, but that is the kernels' business (a
BLAS may pick another path for fewer rows). So each distinct chain is run once, whole and by
blocks, on random values of its leaves' metadata, on the graph's device, and tiled only if the
results are bitwise equal (:func:`tiles_exactly`; cached per chain). A chain that differs is
left as it was and logged.

Decided by :func:`find_row_tilings` (``find.py``), rewritten by :func:`row_tile_pass`
(``build.py``) where the probe (:func:`tiles_exactly`, ``probe.py``) finds the blocks
bit-identical. The compiler tries the pass on built graphs whose plan is over its target and
keeps it only where the exact profile's peak drops (``pipeline/built.py``), as for
``inplace.py``'s ``built=True``.
"""
