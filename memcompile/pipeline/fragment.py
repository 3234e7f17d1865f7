"""How one fragment is decided and rewritten, stage by stage.

AOTAutograd hands the partitioner a joint forward+backward graph; :func:`plan_partition` runs
the stages below in this order and returns a :class:`Decided`: the forward and backward graphs
and their plan. It changes nothing outside the graphs; the backend then applies what was decided
(an infeasible plan raises before any parameter moves to the host tier)::

    1  in place         loss heads, dying gradients' elementwise ops  rewrites/losshead, inplace
    2  aligned?         may this fragment's parameters move to the host
       fast no          a budget below every plan's lower bound: BelowBound, at once (less
                        what the rest of the step may give way: search.movable)
       cached plan      what an earlier run's search decided: replayed, 3 to 10 skipped  plan_cache
    3  fetch placed     parameters an earlier fragment put on the host    rewrites/params
    4  plan             the planner, for budget - resident                planning/planner
    5  heads by blocks  kept aside: tried only where nothing else fits    rewrites/linearce
    6  dropouts         recomputable (saved masks, then replayed)         rewrites/dropout
    7  host parameters  offload_params: their bytes leave the resident    rewrites/params
    8  reserve cut      the pilot's prefetch reserve gives way to a fit
       quick no         a budget under 1/4 of the plans: built without late rewrites (error)
    9  build            partition, swaps; late rewrites of built graphs   rewrites/; built.py
       quick no         a budget under 1/2 of the built plan: no alternatives (error)
    10 alternatives     recompute only, swap only, floors, heads by blocks; choose()  search.py
                        (not the first three where only the backward's own values are live
                        at the plan's peak: JointModel.decided_at_peak)

The forward compiler then finishes both graphs (``finish.py``: where the pilot predicts, and
reloads hoisted where their copies hide).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import fx
from torch._functorch import partitioners as P

from memcompile.errors import MemoryBudgetWarning, format_bytes
from memcompile.pipeline import features, plan_cache, stage
from memcompile.pipeline.env import FragmentEnv, FragmentSpec
from memcompile.pipeline.plan_cache import DERIVATION, LATE, CachedPlan, derived
from memcompile.pipeline.search import Built, Candidate, FragmentSearch, choose
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.dropout import dropout_pass, saved_after
from memcompile.rewrites.linearce import LinearCrossEntropy, find_linear_ce, linear_ce_pass

__all__ = ["BelowBound", "Decided", "plan_partition"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decided:
    """A fragment's graphs and plan as decided by :func:`plan_partition`.

    Attributes:
        fw, bw: the forward and backward graphs.
        plan: their plan (its ``host_params`` and ``linear_ce`` named).
        hosted: input positions whose parameters this plan moves to the host tier (with their
            aliases); ``placed``: those an earlier fragment put there (fetched too).
        host_peak: the smallest peak found with the parameters on the host, when tried.
        prefetch_reserve: bytes the plan leaves to the pilot's prefetch cache.
        held_outputs: bytes of the user outputs the plan counts as held through the backward.
        joint: the joint graph the plan names (how it was derived from AOT's: its ``meta``,
            ``plan_cache.DERIVATION``).
        cached: the plan cache's key when the plan was replayed from it, else ``None``.
        quick_no: the plan does not fit and no other was searched (a quick "no",
            :func:`_quick_no`), so a smaller plan may exist: ``"built"``, the first plan built;
            ``"planned"``, the first plan as planned, its graphs built without the late
            rewrites; ``""``: the search ran to its end.
        fixed_peak: the plan peaks where no saved or recomputed value is live, as planned
            (``JointModel.decided_at_peak``): no plan of another saved set goes lower.
    """

    fw: fx.GraphModule
    bw: fx.GraphModule
    plan: FragmentPlan
    hosted: tuple[int, ...]
    placed: tuple[int, ...]
    host_peak: int | None
    prefetch_reserve: int
    held_outputs: int
    joint: fx.GraphModule
    cached: str | None = None
    quick_no: Literal["", "built", "planned"] = ""
    fixed_peak: bool = False


#: A quick "no" (:func:`_quick_no`) when the budget is under this share of the built plan's
#: peak. Counted on 181 searches that reached the alternatives (2026-11-30, two scratch runs:
#: the zoo, tiny and small, and HF Llama and GPT-2 at 0.05-0.7x their peaks, best_effort;
#: the suite's planner, tiling and loss-head tests), the alternatives besides the loss heads
#: by blocks lowered the lower of the first plan's and the blocks' peaks by 3.5 % at most
#: (GPT-2 at 0.2x; the one budget they made fit was 0.05 % under the first plan's peak:
#: tests/test_linearce.py); the heads by blocks lowered the first plan's by up to 31 % (tiny
#: GPT, 283,272 -> 195,028 B), so a quick "no" still builds them. Half the peak is far
#: outside what the rest reach.
QUICK_NO_SHARE = 0.5

#: What the late rewrites of a plan's built graphs (in place, row tiling, rematerialization:
#: ``search.build``) may take off its planned peak: a budget under ``QUICK_NO_SHARE * (1 -
#: LATE_CUT)`` of the planned peak gets its quick "no" before they run (they profile the
#: graphs many times: 43 s of a 52 s "no" on a 6-layer Llama). The most seen on 380 builds of
#: the same runs was 39 % (zoo branchy, small, its rows tiled).
LATE_CUT = 0.5


def plan_partition(
    traced: fx.GraphModule,
    num_fwd_outputs: int,
    static: Sequence[int],
    spec: FragmentSpec,
    env: FragmentEnv,
) -> Decided:
    """The stages of the module docstring, in order, for the joint graph ``traced``."""
    search = FragmentSearch(spec, env, num_fwd_outputs, static)
    joint = search.in_place(traced)  # 1
    aligned = _aligned(joint, spec, env)  # 2
    placed = search.host_placed() if aligned else []
    _fast_no(search, placed, aligned)
    key = None
    if env.config.budget is not None and features.current().plan_cache:
        host = search.host_candidates() if aligned else []
        key = plan_cache.fragment_key(traced, num_fwd_outputs, static, spec, env, host)
        cached = plan_cache.load(key)
        if cached is not None:
            stage.say("replaying a cached plan")
            decided = _replayed(search, traced, joint, cached, placed)
            if decided is not None:
                return dataclasses.replace(decided, cached=key)
    decided = _searched(search, joint, traced, placed, aligned)
    if key is not None and not decided.quick_no:  # (a replay would skip the alternatives)
        plan_cache.store(key, _cached(decided))
    return decided


def _searched(
    search: FragmentSearch,
    joint: fx.GraphModule,
    traced: fx.GraphModule,
    placed: Sequence[int],
    aligned: bool,
) -> Decided:
    """Stages 3 to 10 of the module docstring."""
    spec = search.spec
    if placed:  # 3: another fragment moved some of these parameters: fetch them here too
        joint = search.fetch(joint, placed)
    cand = search.plan(joint, start=spec.replan_start)  # 4
    blocked = _heads_by_blocks(search, traced, cand.plan, placed)  # 5
    cand = _with_dropouts(search, cand)  # 6
    cand, hosted, host_peak = _with_host_params(search, cand, blocked, aligned)  # 7
    cand = _cut_reserve(search, cand, hosted)  # 8
    # The joint graph with the loss heads by blocks and this plan's parameters fetched, made
    # once when first asked (the quick no plans it, the alternatives build it); None: no heads
    # are left to make by blocks.
    heads: Callable[[], fx.GraphModule] | None = None
    if blocked is not None and not cand.joint.meta.get("memcompile_linear_ce"):
        heads = functools.cache(lambda: search.fetch(blocked, hosted) if hosted else blocked)
    planned = _planned_no(search, cand, heads, hosted)
    if planned is not None:
        # (Built only for the error's sake: the late rewrites are what costs.)
        built = search.build(planned, late=())
        return dataclasses.replace(
            _decided(built, search, hosted, placed, host_peak), quick_no="planned"
        )
    built = search.build(cand)  # 9: changes nothing outside the graphs
    quick = False
    if not built.plan.feasible and spec.replan_resident is None:  # 10
        built, quick = _alternatives(search, built, heads, hosted)
    decided = _decided(built, search, hosted, placed, host_peak)
    return dataclasses.replace(decided, quick_no="built" if quick else "")


def _replayed(
    search: FragmentSearch,
    traced: fx.GraphModule,
    in_place: fx.GraphModule,
    cached: CachedPlan,
    placed: Sequence[int],
) -> Decided | None:
    """The fragment as ``cached`` decided it: its joint graph derived again from ``traced``
    (``in_place``: ``search.in_place(traced)``, made already), its plan built with the
    recorded late rewrites; ``None`` (logged) where the graphs built are not those the entry
    was made from."""
    spec = search.spec
    try:
        joint = traced
        for name, *args in cached.derivation:
            if name == "in_place":
                joint = in_place if joint is traced else search.in_place(joint)
            elif name == "fetch":
                joint = search.fetch(joint, [int(i) for i in args[0]])
            elif name == "dropouts":
                joint = _with_dropout_rewrite(search, joint, replay=bool(args[0]))
            elif name == "heads":
                joint = _with_heads(search, joint, _find_heads(search, joint))
            else:
                raise ValueError(f"unknown derivation step {name!r}")
        model = search._joint_model(joint)
        built = search.build(Candidate(joint, model, cached.plan), late=cached.late)
    except Exception as e:  # a rewrite that no longer applies: the entry is stale
        log.info("%s: cached plan not replayed (%s): planning", spec.name, e)
        return None
    digest = plan_cache.graphs_digest(built.fw, built.bw)
    if digest != cached.graphs:
        log.info("%s: cached plan builds other graphs than it was made from: planning", spec.name)
        return None
    search.prefetch_reserve = cached.prefetch_reserve
    log.info(
        "%s: plan from the cache (%s, predicted peak %s)",
        spec.name,
        "fits" if cached.plan.feasible else "does not fit",
        format_bytes(cached.plan.predicted_peak),
    )
    return _decided(built, search, cached.hosted, placed, cached.host_peak)


def _cached(decided: Decided) -> CachedPlan:
    """What :func:`_replayed` needs to build ``decided`` again."""
    return CachedPlan(
        derivation=decided.joint.meta.get(DERIVATION, ()),
        late=decided.fw.meta.get(LATE, ()),
        plan=decided.plan,
        hosted=decided.hosted,
        host_peak=decided.host_peak,
        prefetch_reserve=decided.prefetch_reserve,
        graphs=plan_cache.graphs_digest(decided.fw, decided.bw),
    )


class BelowBound(Exception):
    """The budget is below every plan's lower bound (:meth:`FragmentSearch.lower_bound`): no
    plan was searched. The backend tells the user (``backends/advice.below_bound``).

    Attributes:
        bound: no plan peaks below it, bytes.
        resident: what stays on the device whatever the plan, bytes.
        largest: the largest parameter fetched whole from the host tier, bytes.
        hostable: the parameters may move to the host tier (else they are in ``resident``).
    """

    def __init__(self, bound: int, resident: int, largest: int, hostable: bool) -> None:
        super().__init__(f"budget below every plan's peak ({bound} bytes)")
        self.bound, self.resident, self.largest, self.hostable = bound, resident, largest, hostable


def _fast_no(search: FragmentSearch, placed: Sequence[int], aligned: bool) -> None:
    """A budget below what no plan can go under is told at once, before any plan is searched
    (the search would end in the same error, minutes later on a large graph): with
    ``on_infeasible="error"``, for a fragment's first plan.

    Raises:
        BelowBound: the budget is below the bound.
    """
    config, spec = search.env.config, search.spec
    budget = config.budget
    if (
        budget is None
        or not features.current().fast_no
        or config.on_infeasible != "error"
        or spec.replan_resident is not None
        or spec.host_replan
    ):
        return
    hostable = aligned and config.offload_params is not False
    bound, resident, largest = search.lower_bound(placed, hostable=hostable)
    if budget < bound:
        movable = search.movable(search.host_candidates() if hostable else [])
        if budget + movable >= bound:
            # Counted with the rest of the step as it is now: the step's re-planning decides.
            log.info(
                "F%d: budget %d is below every plan's peak (%d) by no more than the rest of "
                "the step may give way (%d): searching",
                spec.index,
                budget,
                bound,
                movable,
            )
            return
        log.info(
            "F%d: budget %d is below every plan's peak (%d): no search", spec.index, budget, bound
        )
        raise BelowBound(bound, resident, largest, hostable)


def _quick_no(
    search: FragmentSearch,
    plan: FragmentPlan,
    hosted: Sequence[int],
    what: str = "the first plan",
    *,
    share: float = QUICK_NO_SHARE,
    say: bool = True,
) -> bool:
    """Whether the budget is so far under ``plan`` (``what``: which, for the log) that no
    other plan is searched: with ``on_infeasible="error"`` (a "no" is all the user is told;
    ``best_effort`` runs the smallest plan, so it searches them all), for a fragment's first
    plan, when the budget is under ``share`` of the plan's peak. The alternatives build up to
    eleven more plans (a second or more each on a graph of a few hundred nodes) for a peak
    lower by a third at most; the error then says that no other plan was searched, and that
    ``best_effort`` searches them. What the rest of the step may still give way
    (``search.movable``, with the parameters at ``hosted`` on the host) counts as budget here:
    the step's re-planning decides what it holds. ``say``: log the decision."""
    config, spec = search.env.config, search.spec
    budget = config.budget
    if (
        budget is None
        or plan.feasible
        or not features.current().fast_no
        or config.on_infeasible != "error"
        or spec.replan_resident is not None
        or spec.host_replan
        or budget >= share * plan.predicted_peak
        or budget + search.movable(hosted) >= share * plan.predicted_peak
    ):
        return False
    if not say:
        return True
    log.info(
        "F%d: budget %s is under %.0f%% of the peak of %s (%s): no other plan searched",
        spec.index,
        format_bytes(budget),
        100 * share,
        what,
        format_bytes(plan.predicted_peak),
    )
    return True


def _planned_no(
    search: FragmentSearch,
    cand: Candidate,
    heads: Callable[[], fx.GraphModule] | None,
    hosted: Sequence[int],
) -> Candidate | None:
    """The quick "no" before any build: the candidate to build without late rewrites for the
    error (the lower planned peak of ``cand`` and, where its loss heads may still be made by
    blocks, of the plan of ``heads()``, the joint graph with them), when the budget is under
    ``QUICK_NO_SHARE * (1 - LATE_CUT)`` of both; else ``None``. The plan with the heads by
    blocks costs a planner call here, where building both took a minute on an unrolled LSTM
    (rematerialization's trials)."""
    share = QUICK_NO_SHARE * (1 - LATE_CUT)
    if not _quick_no(search, cand.plan, hosted, share=share, say=False):
        return None
    found = cand
    if heads is not None:
        other = search.plan(heads(), host=hosted, reserve=search.prefetch_reserve)
        if not _quick_no(search, other.plan, hosted, share=share, say=False):
            return None
        if other.plan.predicted_peak < cand.plan.predicted_peak:
            found = other
    _quick_no(search, found.plan, hosted, "the smallest plan as planned", share=share)  # (logs)
    return found


def _aligned(joint: fx.GraphModule, spec: FragmentSpec, env: FragmentEnv) -> bool:
    """Whether the joint graph's primals are the fragment's inputs, in order: host placement
    needs them to be (AOTAutograd may rewrite them, e.g. for mutated inputs that alias)."""
    primals = [p for p in joint.graph.find_nodes(op="placeholder") if not P._is_tangent(p)]
    aligned = len(primals) == len(spec.example_inputs)
    if not aligned and env.config.offload_params is True:
        warnings.warn(
            f"memcompile: {spec.name}: AOTAutograd changed this fragment's inputs, so its "
            "parameters stay on the device (offload_params=True)",
            MemoryBudgetWarning,
            stacklevel=3,
        )
    return aligned


def _heads_by_blocks(
    search: FragmentSearch, traced: fx.GraphModule, plan: FragmentPlan, placed: Sequence[int]
) -> fx.GraphModule | None:
    """The joint graph with its loss heads made by blocks, for a plan that does not fit: tried
    where nothing else fits (it costs two matmuls of the head's size, or three copies of its
    log-softmax to the host tier and back)."""
    config = search.env.config
    if config.budget is None or plan.feasible or not features.current().linear_ce_blocks:
        return None
    heads = _find_heads(search, traced)
    if not heads:
        return None
    blocked = search.in_place(_with_heads(search, traced, heads))
    return search.fetch(blocked, placed) if placed else blocked


def _find_heads(search: FragmentSearch, traced: fx.GraphModule) -> tuple[LinearCrossEntropy, ...]:
    """The loss heads of ``traced`` to make by blocks. With the host tier allowed, a head may
    keep its log-softmax there (cheaper than making the logits again where copies cost less
    than matmuls: a CPU)."""
    config = search.env.config
    host_tier = config.swap and config.offload_to == "host"
    cost = search.env.cost_profile(search.spec.example_inputs) if host_tier else None
    ctx = PassContext(fragment=search.spec.name, graph="joint")
    return find_linear_ce(traced, ctx, host_profile=cost)


def _with_heads(
    search: FragmentSearch, traced: fx.GraphModule, heads: tuple[LinearCrossEntropy, ...]
) -> fx.GraphModule:
    """``traced`` with ``heads`` made by blocks (derivation step ``heads``)."""
    ctx = PassContext(fragment=search.spec.name, graph="joint")
    return derived(traced, linear_ce_pass(traced, ctx, decided=heads), "heads")


def _with_dropouts(search: FragmentSearch, cand: Candidate) -> Candidate:
    """Dropout outputs (and all that is computed from them) become recomputable once rebuilt
    from the saved mask, and the masks too once replayed from the generator's state; each costs
    forward time, so only when needed, the cheaper first."""
    config, mode = search.env.config, features.current().dropout_rewrite
    if config.budget is None or not config.recompute or mode == "never":
        return cand
    original, plain = cand.joint, cand.plan
    kept = [d.tensor for d in plain.decisions if d.action != "recompute"]
    for replay in (False, True):
        forced = mode == ("replay" if replay else "always")
        if not forced and (cand.plan.feasible or mode != "auto"):
            continue
        rewritten = _with_dropout_rewrite(search, original, replay=replay)
        rewrites = rewritten.meta["memcompile_dropouts"]
        if not rewrites or (replay and all(r.state is None for r in rewrites)):
            continue
        # The search also starts from the plain plan's choices carried over (greedy ends
        # depend on the start: seen 75.4 MB from eager's set, 65.4 MB from there).
        other = search.plan(rewritten, start=saved_after(kept, rewrites))
        log.info(
            "F%d: with recomputable dropouts%s the plan peaks at %s (%s without)",
            search.spec.index,
            " and replayed masks" if replay else "",
            format_bytes(other.plan.predicted_peak),
            format_bytes(cand.plan.predicted_peak),
        )
        better = other.plan.feasible or other.plan.predicted_peak < cand.plan.predicted_peak
        if better or forced:
            cand = other
    return cand


def _with_dropout_rewrite(
    search: FragmentSearch, joint: fx.GraphModule, *, replay: bool
) -> fx.GraphModule:
    """``joint`` with its dropouts recomputable (derivation step ``dropouts``)."""
    ctx = PassContext(fragment=search.spec.name, graph="joint")
    return derived(joint, dropout_pass(joint, ctx, replay=replay), "dropouts", replay)


def _with_host_params(
    search: FragmentSearch, cand: Candidate, blocked: fx.GraphModule | None, aligned: bool
) -> tuple[Candidate, tuple[int, ...], int | None]:
    """Parameters to the host tier: their bytes leave the resident set, and each reader fetches
    its own copy (rewrites/params.py); ``"auto"`` only when nothing else fits. Returns the
    candidate, the positions it moves and the smallest peak found with them there (when
    tried); sets the search's prefetch reserve."""
    config, spec, env = search.env.config, search.spec, search.env
    hosted: tuple[int, ...] = ()
    host_reserve, host_peak = 0, None
    candidates = search.host_candidates() if aligned else []
    wants = config.offload_params is True or (
        config.offload_params == "auto"
        and config.budget is not None
        and (not cand.plan.feasible or env.resident.host_step)
    )
    if wants and candidates:
        fetched = search.fetch(cand.joint, candidates)
        other = search.plan(fetched, host=candidates)
        if not other.plan.feasible and blocked is not None:
            # Neither plan fits: with the parameters on the host the head may be what is left
            # (its matmuls cost less than a plan that does not fit).
            third = search.plan(search.fetch(blocked, candidates), host=candidates)
            log.info(
                "F%d: with its loss heads made by blocks and the parameters on the host the "
                "plan peaks at %s (%s without blocks)",
                spec.index,
                format_bytes(third.plan.predicted_peak),
                format_bytes(other.plan.predicted_peak),
            )
            if third.plan.feasible:
                fetched, other = third.joint, third
        host_peak = other.plan.predicted_peak
        log.info(
            "F%d: with %d parameters on the host the plan peaks at %s (%s without)",
            spec.index,
            len(spec.own_inputs(candidates)),
            format_bytes(other.plan.predicted_peak),
            format_bytes(cand.plan.predicted_peak),
        )
        reserve = search.reserve(candidates)
        if config.offload_params == "auto" and not other.plan.feasible and reserve:
            # The pilot's reserve is a speed-up, the host tier what fits: rather than keep
            # the parameters on the device over the budget, give the cache what is left.
            room, bare = search.room_without_reserve(fetched, candidates)
            if room is not None:
                reserve = min(reserve, room)
                # (No room left: the plan without a reserve is the one that measured it.)
                other = search.plan(fetched, host=candidates, reserve=reserve) if reserve else bare
                log.info(
                    "F%d: the pilot's prefetch reserve is cut to %s for the host tier to fit "
                    "(plan peaks at %s)",
                    spec.index,
                    format_bytes(reserve),
                    format_bytes(other.plan.predicted_peak),
                )
        if (
            config.offload_params is True
            or other.plan.feasible
            or other.plan.predicted_peak < cand.plan.predicted_peak
        ):
            cand, hosted, host_reserve = other, tuple(candidates), reserve
    search.prefetch_reserve = host_reserve if hosted else search.reserve(hosted)
    return cand, hosted, host_peak


def _cut_reserve(search: FragmentSearch, cand: Candidate, hosted: Sequence[int]) -> Candidate:
    """The same for parameters an earlier fragment put on the host (the GRU's longer buckets: a
    196 KiB reserve in a 144 KiB budget): the reserve is a speed-up and gives way to what fits,
    and to nothing where nothing fits (the smallest plan)."""
    old = search.prefetch_reserve
    if search.env.config.budget is None or cand.plan.feasible or not old:
        return cand
    room, cand = search.room_without_reserve(cand.joint, hosted)
    reserve = 0 if room is None else min(old, room)
    if reserve:  # else the plan without a reserve is this one
        cand = search.plan(cand.joint, host=hosted, reserve=reserve)
    log.info(
        "F%d: the pilot's prefetch reserve is cut from %s to %s: the plan does not fit with it "
        "(plan peaks at %s)",
        search.spec.index,
        format_bytes(old),
        format_bytes(reserve),
        format_bytes(cand.plan.predicted_peak),
    )
    search.prefetch_reserve = reserve
    return cand


def _alternatives(
    search: FragmentSearch,
    built: Built,
    heads: Callable[[], fx.GraphModule] | None,
    hosted: Sequence[int],
) -> tuple[Built, bool]:
    """The rewrites of a plan over its target (in place, blocks of rows, reloads by rows) act
    on what the plan recomputes and what it swaps differently, which the planner does not
    price: a plan with one of the two only may end lower. Then the loss heads by blocks, where
    nothing else fits (their matmuls are not in the plans' times) and the joint model's peak
    was not theirs: the rewrites of the built graphs may bring the rest below the head (bench
    GPT, parameters on the host: 22.9 MiB planned either way, 20.05 MiB built, 16 MiB of it
    the head).

    ``heads``: the joint graph with the loss heads by blocks (``None``: none left to make).
    Under a quick "no" (:func:`_quick_no`: the budget is far under the plan) only the heads by
    blocks are built, which can take a third off; not the alternatives. Returns the plan
    chosen and whether it was a quick "no"."""

    def with_heads() -> Built:
        assert heads is not None
        return search.build_blocks(heads(), hosted, built.plan)

    by_blocks: Built | None = None
    if _quick_no(search, built.plan, hosted):
        if heads is None:
            return built, True
        by_blocks = with_heads()
        if _quick_no(search, by_blocks.plan, hosted, "the plan with its loss heads by blocks"):
            return choose([built, by_blocks]), True
        # Within reach of the budget with the heads by blocks: the whole search after all.
    tried = search.with_alternatives(hosted, built)
    if not any(t.plan.feasible for t in tried) and heads is not None:
        tried += search.with_alternatives(hosted, by_blocks or with_heads())
    return choose(tried), False


def _decided(
    built: Built,
    search: FragmentSearch,
    hosted: tuple[int, ...],
    placed: Sequence[int],
    host_peak: int | None,
) -> Decided:
    """``built`` as decided: its plan names the loss heads made by blocks and the inputs fetched
    from the host tier."""
    plan, joint = built.plan, built.joint
    heads = joint.meta.get("memcompile_linear_ce", ())
    if heads:
        plan = dataclasses.replace(plan, linear_ce=tuple(h.describe() for h in heads))
    fetched = hosted + tuple(placed)
    if fetched:
        names = [p.name for p in joint.graph.find_nodes(op="placeholder")]
        plan = dataclasses.replace(plan, host_params=tuple(names[i] for i in sorted(fetched)))
    held = sum(built.model.nbytes[s] for s in built.model.held_outputs)
    reserve = search.prefetch_reserve
    return Decided(
        built.fw,
        built.bw,
        plan,
        hosted,
        tuple(placed),
        host_peak,
        reserve,
        held,
        joint,
        fixed_peak=built.peak_decided == 0,
    )
