"""Child-Sum TreeLSTM over Python syntax trees (``treelstm``).

The trees are real: the function definitions (``FunctionDef``/``AsyncFunctionDef`` subtrees of
at most ``max_nodes`` nodes) in the source of a fixed, sorted list of standard-library modules,
parsed with :mod:`ast`, so nothing is downloaded and the pool is the same on every run of a given
CPython (the sources, and so the pool, differ between Python versions). A node's input is the
embedding of its AST class name, indexed in the sorted list of :mod:`ast` node classes. The
label is a bucket of the function's statement count (1 | 2 | 3-4 | 5-8 | 9+), computed from the
tree, so it is deterministic and learnable by counting.

The Child-Sum cell (Tai et al., 2015) computes a node from its input ``x`` and its children's
states: ``i, o, u`` from ``x`` and the sum of the children's ``h``; one forget gate per child.

Batches are tensors only (node types, children in CSR form, root indices, labels), with each
tree's nodes in post-order so children precede parents; no Python tree objects reach Dynamo, so
nothing is guarded on tree identity. Dynamo fragments per step:

* ``forward`` (compiled) embeds all nodes, breaks the graph at ``_encode``, and resumes with the
  classifier head + loss: two fragments. The first compiles twice: static for the first batch,
  then dynamic in the node count once that changes.
* ``_encode`` (``torch.compiler.disable(recursive=False)``) walks the nodes and calls the cell
  once per node: orchestration only (lists, ``stack`` of child states).
* ``TreeLSTMCell.forward`` is a compiled frame per node, one graph shared by every node of
  every tree. Dynamo specialises sizes 0 and 1, so the number of children gives at most three
  graphs: leaves (0), one child, and one dynamic graph for two or more.

So a step with ``N`` nodes runs ``N + 2`` fragments, and the whole run needs at most six compiles
whatever the tree shapes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator

_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(max_nodes=32, trees=3, d_embed=16, hidden=32),
    "small": dict(max_nodes=100, trees=16, d_embed=64, hidden=128),
    "bench": dict(max_nodes=200, trees=32, d_embed=128, hidden=256),
}
# Pure-Python standard-library modules present in every CPython >= 3.10; sorted.
_SOURCE_MODULES = (
    "argparse",
    "calendar",
    "configparser",
    "csv",
    "difflib",
    "fractions",
    "gettext",
    "inspect",
    "ipaddress",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "tokenize",
)
_MIN_NODES = 8  # skip trivial functions (``def f(): pass``)
_STMT_BUCKETS = (2, 3, 5, 9)  # class k: statement count in [bucket[k-1], bucket[k])
NODE_TYPES: tuple[str, ...] = tuple(
    sorted(n for n, obj in vars(ast).items() if isinstance(obj, type) and issubclass(obj, ast.AST))
)
_TYPE_ID = {name: i for i, name in enumerate(NODE_TYPES)}


@dataclass(frozen=True)
class Tree:
    """One function's AST in post-order: node ``j``'s children are ``children[j]`` (< ``j``)."""

    types: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    label: int


def _to_tree(fn: ast.AST) -> Tree:
    types: list[int] = []
    children: list[tuple[int, ...]] = []

    def visit(node: ast.AST) -> int:
        kids = tuple(visit(child) for child in ast.iter_child_nodes(node))
        types.append(_TYPE_ID[type(node).__name__])
        children.append(kids)
        return len(types) - 1

    visit(fn)
    statements = sum(isinstance(n, ast.stmt) for n in ast.walk(fn)) - 1  # not the def itself
    label = sum(statements >= b for b in _STMT_BUCKETS)
    return Tree(tuple(types), tuple(children), label)


@functools.cache
def function_trees(max_nodes: int) -> tuple[Tree, ...]:
    """Every function of ``_MIN_NODES..max_nodes`` nodes in the source modules, in file order."""
    trees = []
    for name in _SOURCE_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):  # no source (e.g. a frozen build): skip
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = sum(1 for _ in ast.walk(node))
                if _MIN_NODES <= size <= max_nodes:
                    trees.append(_to_tree(node))
    if not trees:
        raise RuntimeError("found no standard-library source to parse")
    return tuple(trees)


def collate(trees: list[Tree]) -> tuple[torch.Tensor, ...]:
    """Concatenate ``trees`` into ``(node_type, child_ptr, child_idx, roots, labels)``.

    ``node_type`` (N,); node ``j``'s children are ``child_idx[child_ptr[j]:child_ptr[j + 1]]``
    (global indices, all < ``j``); ``roots`` (B,) and ``labels`` (B,) per tree.
    """
    types: list[int] = []
    ptr = [0]
    idx: list[int] = []
    roots: list[int] = []
    for tree in trees:
        base = len(types)
        types.extend(tree.types)
        for kids in tree.children:
            idx.extend(base + k for k in kids)
            ptr.append(len(idx))
        roots.append(len(types) - 1)  # post-order: the root comes last
    labels = [tree.label for tree in trees]
    return tuple(torch.tensor(v, dtype=torch.long) for v in (types, ptr, idx, roots, labels))


class TreeLSTMCell(nn.Module):
    """Child-Sum TreeLSTM cell."""

    def __init__(self, d_embed: int, hidden: int) -> None:
        super().__init__()
        self.w_iou = nn.Linear(d_embed, 3 * hidden)
        self.u_iou = nn.Linear(hidden, 3 * hidden, bias=False)
        self.w_f = nn.Linear(d_embed, hidden)
        self.u_f = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, child_h: torch.Tensor, child_c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: (d_embed,); ``child_h``, ``child_c``: (children, hidden), children >= 0."""
        iou = self.w_iou(x) + self.u_iou(child_h.sum(dim=0))
        i, o, u = iou.chunk(3, dim=-1)
        f = torch.sigmoid(self.w_f(x) + self.u_f(child_h))  # one forget gate per child
        c = torch.sigmoid(i) * torch.tanh(u) + (f * child_c).sum(dim=0)
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTMClassifier(nn.Module):
    """``forward(node_type, child_ptr, child_idx, roots, labels)`` returns the loss."""

    def __init__(self, vocab: int, d_embed: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_embed)
        self.cell = TreeLSTMCell(d_embed, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(
        self,
        node_type: torch.Tensor,
        child_ptr: torch.Tensor,
        child_idx: torch.Tensor,
        roots: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        h = self._encode(self.embed(node_type), child_ptr, child_idx, roots)
        return F.cross_entropy(self.head(h), labels)

    @torch.compiler.disable(recursive=False)
    def _encode(
        self, x: torch.Tensor, child_ptr: torch.Tensor, child_idx: torch.Tensor, roots: torch.Tensor
    ) -> torch.Tensor:
        """Root states (B, hidden). Orchestration only; the math is in the cell.

        No comprehensions here: on Python 3.11 they are frames of their own, which Dynamo
        would try (and fail) to compile; ``map`` runs no Python frame.
        """
        ptr, kids = child_ptr.tolist(), child_idx.tolist()
        leaf = x.new_zeros(0, self.cell.u_f.in_features)
        hs: list[torch.Tensor] = []
        cs: list[torch.Tensor] = []
        # unbind, not x[j]: one backward node for all rows instead of one dense grad per node.
        for j, x_j in enumerate(x.unbind(0)):
            ch = kids[ptr[j] : ptr[j + 1]]
            if ch:
                child_h = torch.stack(list(map(hs.__getitem__, ch)))
                child_c = torch.stack(list(map(cs.__getitem__, ch)))
                # One graph for every child count >= 2 from the start (0 and 1 are specialised
                # by Dynamo anyway), rather than a static graph for the first count seen.
                torch._dynamo.maybe_mark_dynamic(child_h, 0)
                torch._dynamo.maybe_mark_dynamic(child_c, 0)
            else:
                child_h = child_c = leaf
            h, c = self.cell(x_j, child_h, child_c)
            hs.append(h)
            cs.append(c)
        return torch.stack(list(map(hs.__getitem__, roots.tolist())))


@register("treelstm")
def build_treelstm(size: str, seed: int) -> Workload:
    """A Child-Sum TreeLSTM classifying standard-library functions by statement count."""
    cfg = _CONFIGS[size]
    pool = function_trees(cfg["max_nodes"])
    classes = len(_STMT_BUCKETS) + 1
    torch.manual_seed(seed)
    model = TreeLSTMClassifier(len(NODE_TYPES), cfg["d_embed"], cfg["hidden"], classes)
    n = cfg["trees"]

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        pick = torch.randint(len(pool), (n,), generator=generator(seed, step)).tolist()
        return collate([pool[i] for i in pick])

    return Workload(
        name="treelstm",
        summary=(
            f"Child-Sum TreeLSTM, hidden {cfg['hidden']}, over ASTs of stdlib functions "
            f"(<= {cfg['max_nodes']} nodes, {n} per batch), statement-count classes"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=False,
        extra=dict(cfg, pool=len(pool), classes=classes, vocab=len(NODE_TYPES)),
    )
