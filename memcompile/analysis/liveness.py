"""Liveness replay of one graph order, in array operations.

The planner's search prices thousands of saved sets, and each price replays liveness over the
forward and the backward order several times (``schedule.sink`` tries moves by replaying
them): on the GRU small's 5,000-node joint graph, three replays of ~3,000 nodes per evaluation,
~12,000 per search. A replay walks the order once; here the walk is a handful of NumPy passes
over the graph's (node, storage) pairs instead of a Python loop over nodes:

    birth[s]   first position that makes s live: -1 for what is live on entry, the first read of
               a storage swapped in late, the first node producing it
    death[s]   last position reading it (the end for what is kept or held; its birth when
               nothing reads it)
    live(p)    sum of nbytes[s] over birth[s] <= p <= death[s]      (cumulative sum of +/- at
                                                                    birth and after death)
    peak       max over p of live(p) + workspace[order[p]], the first such p (p = -1: entry)

A recomputed forward node that produces a storage which arrives live (saved or swapped in)
makes a copy of it with its own key past the storages'. A node that produces a storage after
its death (nothing reads it there) makes it live again to the end, as the loop it replaces
did. ``JointModel._replay`` is the caller; ``tests/test_liveness.py`` checks every answer
against that loop, kept there as the oracle.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import numpy as np

__all__ = ["Liveness", "Replayed"]

#: (peak, bytes live at the end, peak position, storages live at the peak).
Replayed = tuple[int, int, int, frozenset[int]]

_NEVER = np.iinfo(np.int64).max // 4  # a birth that never happens


class Liveness:
    """The arrays a replay needs, built once per graph.

    Args:
        storages: per node, the storages its value holds (joint node index -> storage ids).
        inputs: per node, the nodes it reads.
        forward: per node, whether it is a forward node (a recomputation when in a backward
            order that has storages live on entry).
        persistent: storages never counted (parameters, inputs, host copies).
        nbytes: per storage, its bytes.
        workspace: per node, its kernel scratch.
    """

    def __init__(
        self,
        storages: Sequence[Sequence[int]],
        inputs: Sequence[Sequence[int]],
        forward: Sequence[bool],
        persistent: Collection[int],
        nbytes: Sequence[int],
        workspace: Sequence[int],
    ) -> None:
        n_storages = len(nbytes)
        self.n_nodes = len(storages)
        self.n_storages = n_storages
        self.nbytes = np.asarray(nbytes, dtype=np.int64).reshape(n_storages)
        self.workspace = np.asarray(workspace, dtype=np.int64).reshape(self.n_nodes)
        self.persistent = np.zeros(n_storages, dtype=bool)
        self.persistent[list(persistent)] = True
        # (node, storage) pairs a node produces (its value's storages), in node order.
        pair_of: dict[tuple[int, int], int] = {}
        prod_node: list[int] = []
        prod_storage: list[int] = []
        prod_reads_own: list[bool] = []  # the node also reads that storage (a view, out=)
        for i, sids in enumerate(storages):
            read = {s for j in inputs[i] for s in storages[j]}
            for s in dict.fromkeys(sids):  # a storage two outputs share is one pair
                pair_of[i, s] = len(prod_node)
                prod_node.append(i)
                prod_storage.append(s)
                prod_reads_own.append(s in read)
        self.prod_node = np.asarray(prod_node, dtype=np.int64)
        self.prod_storage = np.asarray(prod_storage, dtype=np.int64)
        forward_arr = np.asarray(forward, dtype=bool).reshape(self.n_nodes)
        # Pairs that may become copies: a forward node's storage it does not read itself.
        self.prod_copyable = forward_arr[self.prod_node] & ~np.asarray(prod_reads_own, dtype=bool)
        self.prod_copyable &= ~self.persistent[self.prod_storage]
        # (reader, pair read) for every storage of every input node of every node.
        read_node: list[int] = []
        read_pair: list[int] = []
        for i, ins in enumerate(inputs):
            for j in ins:
                for s in storages[j]:
                    read_node.append(i)
                    read_pair.append(pair_of[j, s])
        self.read_node = np.asarray(read_node, dtype=np.int64)
        self.read_pair = np.asarray(read_pair, dtype=np.int64)

    def replay(
        self,
        order: Sequence[int],
        live_on_entry: Iterable[int],
        keep: Collection[int],
        late: Collection[int] = (),
    ) -> Replayed:
        """Liveness over ``order`` (see ``JointModel._replay``): (peak, end, peak position,
        storages live at the peak). ``keep``: storages held to the end (as produced, never as
        copies); ``late``: storages that become live at their first read."""
        n_storages, n = self.n_storages, len(order)
        order_arr = np.asarray(order, dtype=np.int64).reshape(n)
        pos = np.full(self.n_nodes, -1, dtype=np.int64)
        pos[order_arr] = np.arange(n, dtype=np.int64)
        entry = np.zeros(n_storages, dtype=bool)
        entry[list(live_on_entry)] = True
        entry &= ~self.persistent
        late_mask = np.zeros(n_storages, dtype=bool)
        late_mask[list(late)] = True
        prod_pos = pos[self.prod_node]
        in_order = prod_pos >= 0
        # Copies: recomputed forward nodes producing a storage that arrives live (or late).
        copied = self.prod_copyable & in_order & (entry | late_mask)[self.prod_storage]
        n_copies = int(copied.sum())
        key = self.prod_storage.copy()  # the storage each produced pair counts as
        key[copied] = n_storages + np.arange(n_copies, dtype=np.int64)
        total = n_storages + n_copies
        nbytes, persistent = self.nbytes, self.persistent
        if n_copies:  # copies are never persistent
            nbytes = np.concatenate([nbytes, self.nbytes[self.prod_storage[copied]]])
            persistent = np.concatenate([persistent, np.zeros(n_copies, dtype=bool)])
        # Reads: a read of a copied pair reads the copy.
        read_pos = pos[self.read_node]
        reading = read_pos >= 0
        read_key = key[self.read_pair][reading]
        read_pos = read_pos[reading]
        last = np.full(total, -2, dtype=np.int64)  # -2: never read
        np.maximum.at(last, read_key, read_pos)
        entry_keys = np.flatnonzero(entry)
        last[entry_keys] = np.maximum(last[entry_keys], -1)
        if keep:
            last[np.fromiter(keep, dtype=np.int64, count=len(keep))] = n
        # Births: live on entry; the first read of a late storage (not of a copy); the first
        # node producing a storage (not a persistent one).
        birth = np.full(total, _NEVER, dtype=np.int64)
        birth[entry_keys] = -1
        late_reads = read_key < n_storages
        late_reads[late_reads] = late_mask[read_key[late_reads]]
        np.minimum.at(birth, read_key[late_reads], read_pos[late_reads])
        producing = in_order & ~persistent[key]
        prod_key, prod_at = key[producing], prod_pos[producing]
        np.minimum.at(birth, prod_key, prod_at)
        born = birth < _NEVER
        # Death: the last read; a storage nothing reads after its birth dies there, but one
        # read only before it (an order that reads before producing) lives to the end.
        death = np.where(last == -2, birth, last)
        death = np.where(born & (last != -2) & (last < birth), n, death)
        # A node producing a storage after its death makes it live again, to the end.
        after = prod_at > death[prod_key]
        rebirth = np.full(total, _NEVER, dtype=np.int64)
        np.minimum.at(rebirth, prod_key[after], prod_at[after])
        reborn = rebirth < _NEVER
        # Live bytes at positions -1 .. n-1 (index p + 1), before the frees at each position.
        delta = np.zeros(n + 3, dtype=np.int64)
        keys = np.flatnonzero(born)
        np.add.at(delta, birth[keys] + 1, nbytes[keys])
        freed = keys[death[keys] < n]
        np.add.at(delta, death[freed] + 2, -nbytes[freed])
        again = np.flatnonzero(reborn)
        np.add.at(delta, rebirth[again] + 1, nbytes[again])
        live = np.cumsum(delta)[: n + 1]
        here = live.copy()
        here[1:] += self.workspace[order_arr]
        at = int(np.argmax(here))
        peak, peak_pos = int(here[at]), at - 1
        end_bytes = int(nbytes[keys[death[keys] >= n]].sum() + nbytes[again].sum())
        raw = keys[keys < n_storages]
        spans = (birth[raw] <= peak_pos) & (peak_pos <= death[raw])
        at_peak = set(raw[spans].tolist())
        raw_again = again[again < n_storages]
        at_peak.update(raw_again[rebirth[raw_again] <= peak_pos].tolist())
        return peak, end_bytes, peak_pos, frozenset(at_peak)
