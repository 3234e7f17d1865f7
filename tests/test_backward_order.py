"""The backward's nodes and order (``JointModel.backward_nodes``, ``backward_groups``) as torch
extracts and orders them: checked against the plain renderings they replaced (a walk of the
whole backward, ``reordering_to_mimic_autograd_engine`` node by node), on random saved sets."""

from __future__ import annotations

import random

import pytest

from helpers import capture_joint


def _reference_groups(model, needed: set[int]) -> list[list[int]]:
    """The previous implementation, node by node (each root looked at whole)."""
    done: set[int] = set()
    groups: list[list[int]] = []

    def insert(root: int) -> None:
        if root in done or root not in needed:
            return
        done.add(root)
        todo = [j for j in model.inputs[root] if j not in done and j in needed]
        seen = [root]
        while todo:
            i = todo.pop()
            if i in done or i not in needed:
                continue
            done.add(i)
            seen.append(i)
            todo.extend(model.inputs[i])
        groups.append(sorted(seen))

    ordered = sorted(needed)
    for i in model._early_copies:
        if i in needed:
            insert(i)
    for i in ordered:
        if i >= model.first_tangent_user:
            insert(i)
    for i in model.bw_outputs:
        insert(i)
    for i in ordered:
        insert(i)
    return groups


def _reference_nodes(model, saved: frozenset[int]) -> tuple[set[int], set[int]]:
    """``backward_nodes`` as it was (the walk from the gradients through the whole backward
    each time, then the side-effect nodes computable from its inputs): (needed, inputs)."""
    needed: set[int] = set()
    inputs: set[int] = set()

    def walk(roots) -> None:
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i in needed or i in inputs:
                continue
            a = model._availability[i]
            view = model._view_base[i] >= 0
            if a is True or (
                a is None
                and not view
                and all(
                    s in saved or s in model.persistent or s in model._must_save
                    for s in model.storages[i]
                )
            ):
                inputs.add(i)
                continue
            needed.add(i)
            stack.extend(model.inputs[i])

    walk(model.bw_outputs)
    roots = [i for i in model._side_effects if i not in needed]
    state: dict[int, bool] = {}
    for root in roots:
        stack = [root]
        while stack:
            i = stack[-1]
            if i in state:
                stack.pop()
            elif i in inputs or not model._side_effect_candidate[i]:
                state[i] = i in inputs
                stack.pop()
            else:
                pending = [j for j in model.inputs[i] if j not in state]
                if pending:
                    stack.extend(pending)
                else:
                    state[i] = all(state[j] for j in model.inputs[i])
                    stack.pop()
    walk([i for i in roots if state[i]])
    return needed, inputs


@pytest.mark.parametrize("name", ["gru", "gpt", "moe", "treelstm"])
def test_the_backward_nodes_and_groups_are_the_plain_renderings(name):
    model = capture_joint(name)["model"]
    saved = sorted(model.default_saved() - model.must_save())
    rng = random.Random(0)
    sets = [frozenset(saved), frozenset()]
    sets += [frozenset(rng.sample(saved, rng.randrange(len(saved) + 1))) for _ in range(20)]
    recomputing = 0
    for kept in sets:
        saved = kept | model.must_save()
        needed, recompute, inputs = model.backward_nodes(saved)
        recomputing += bool(recompute)
        assert (needed, inputs) == _reference_nodes(model, saved - model.persistent)
        groups = model.backward_groups(needed)
        assert groups == _reference_groups(model, needed)
        assert model.backward_order(needed) == [i for g in groups for i in g]
    assert recomputing >= 10  # the sets make the backward recompute forward nodes
