"""The layout choice: which CP size, or the pool, and which K/V exchange, for a user's lengths and cluster.

:func:`choose_layout` plans the first global batches of the lengths with every fixed CP size
(powers of two, up to the nodes the longest sample needs) and with the pool (``dp=1, cp=world``,
split node by node), times each step under every attention mode: ring, all-gather and targeted
(``p2p``) exchange, head-parallel ``ulysses`` and the hybrids ``ulysses+p2p`` / ``ulysses+ring`` where
the model's heads and the nodes allow them (the cost model's compute plus
:mod:`~ringpack.comm_model`'s communication, the slowest rank), and ranks the layouts by predicted
tokens/s, with a one-line reason for the winner. A layout whose proven lower bound on the compute
alone already leaves it slower than a layout timed before it is stopped there, unplanned (the most
promising fixed size and the pool are always timed): layouts are planned in order of that bound,
most promising first. It lives here, not in the planner, because it needs the communication model.

See docs/planner.md, "Choosing the layout".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringpack.comm_model import (
    HEAD_PARALLEL_MODES,
    MODES,
    CommModel,
    exchange_inputs,
    exchange_volumes,
    microbatch_partners,
    rank_partners,
    rank_seconds,
)
from ringpack.cost import MAX_SAMPLE_TOKENS, CostModel
from ringpack.errors import PlanError
from ringpack.lengths import check_lengths
from ringpack.planner.bounds import critical_path, step_lower_bound
from ringpack.planner.epoch import GlobalBatches, global_batches, overflow_documents, plan_step
from ringpack.shard_plan import MAX_CP, MAX_DP, MicroBatch, Plan, PlanConfig, global_batch_samples

__all__ = ["AUTO", "DEFAULT_GPUS_PER_NODE", "LayoutCandidate", "LayoutChoice", "TIE", "choose_layout", "cp_sizes"]

#: Layouts whose predicted tokens/s is within this fraction of the fastest's tie; the simplest of
#: them wins (the smallest CP size, a fixed size before the pool, ring before all-gather before p2p).
TIE = 0.005


#: ``cp="auto"`` (``--cp auto``): choose the layout.
AUTO = "auto"
#: GPUs per node assumed where a layout choice is not told (at most the cluster's GPUs).
DEFAULT_GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class LayoutCandidate:
    """One layout and exchange, as planned and timed on the sampled steps.

    Attributes:
        name: ``"cp=8"`` (fixed CP size, ``dp = world / 8``) or ``"pool"`` (``dp=1, cp=world``,
            planned node by node).
        mode: the K/V exchange timed (``"ring"``, ``"allgather"``, ``"p2p"``).
        dp, cp, gpus_per_node: the :class:`~ringpack.shard_plan.PlanConfig` fields of the layout
            (``gpus_per_node`` set where the CP group spans several nodes: the pool, and fixed
            sizes beyond one node, planned node by node).
        feasible: whether the layout plans these lengths; ``note`` says why not.
        step_seconds: mean predicted step time (compute and exposed communication, slowest rank).
        compute_seconds: mean step time of the compute alone (the cost model's critical path; under a
            head-parallel mode, each rank attending its all-to-all group's pairs over the group).
        tokens_per_second: tokens of the sampled steps over their predicted time.
        inter_node_bytes: mean K/V bytes per step (all layers, forward) the node-relayed targeted
            exchange sends between nodes: each needed piece once per other node that needs it
            (``ExchangeVolumes.send_inter``); 0 for a layout inside one node.
        partners_median, partners_max: the ranks a GPU exchanges with point to point over the sampled
            steps, median and largest over GPUs (:func:`~ringpack.comm_model.rank_partners`: NCCL keeps a
            connection's buffers once made, so this is the union over the micro-batches).
        partner_memory_bytes: the GPU memory those connections hold on the GPU with the most,
            ``partners_max * comm.partner_buffer_bytes`` (an estimate of NCCL's buffers).
        microbatch_partners_median, microbatch_partners_max: a GPU's partners in one micro-batch,
            median and largest over every rank of every sampled micro-batch: what the plan's
            partner budget (``max_partners``) bounds (:func:`~ringpack.comm_model.microbatch_partners`).
        ring_fallback: sampled micro-batches over the partner budget, timed as the ring (``"p2p"``).
        max_partners: the plans' partner budget (``PlanConfig.max_partners``, 0: none).
        microbatch: the sampled micro-batch with the most pieces (None where not planned), whose
            schedule's host time a report may measure.
        note: what kept the layout out (or stopped it), or ``""``.
        stopped: the layout plans these lengths, but the lower bound of its compute on the sampled
            steps (``bound_tokens_per_second``) already leaves it slower than a layout timed before
            it, so it was not planned: no figures but the bound.
        bound_tokens_per_second: the most tokens/s any plan of the layout could make on the sampled
            steps (their tokens over the planner's lower bounds of their compute); ``nan`` where
            not computed.
    """

    name: str
    mode: str
    dp: int
    cp: int
    gpus_per_node: int | None
    feasible: bool
    step_seconds: float = float("nan")
    compute_seconds: float = float("nan")
    tokens_per_second: float = 0.0
    inter_node_bytes: float = 0.0
    partners_median: float = float("nan")
    partners_max: int = 0
    partner_memory_bytes: float = 0.0
    microbatch_partners_median: float = float("nan")
    microbatch_partners_max: int = 0
    ring_fallback: int = 0
    max_partners: int = 0
    microbatch: MicroBatch | None = dataclasses.field(default=None, repr=False, compare=False)
    note: str = ""
    stopped: bool = False
    bound_tokens_per_second: float = float("nan")

    @property
    def timed(self) -> bool:
        """Whether the layout was planned and timed (feasible and not stopped)."""
        return self.feasible and not self.stopped

    @property
    def exposed_seconds(self) -> float:
        """Mean step time beyond the compute: what the exchange leaves exposed (0 below rounding)."""
        exposed = self.step_seconds - self.compute_seconds
        return exposed if exposed > 1e-9 * self.step_seconds else 0.0

    @property
    def label(self) -> str:
        """``"pool, p2p"``, ``"cp=8, ring"``."""
        return f"{self.name}, {self.mode}"

    def plan_kwargs(self) -> dict[str, Any]:
        """The :func:`ringpack.plan` keywords of the layout: ``dp``, ``cp`` and, for a CP group over
        several nodes, ``gpus_per_node``."""
        out: dict[str, Any] = {"dp": self.dp, "cp": self.cp}
        if self.gpus_per_node is not None:
            out["gpus_per_node"] = self.gpus_per_node
        return out


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """Every candidate, fastest first (infeasible ones last), and why the first won.

    Attributes:
        candidates: the :class:`LayoutCandidate` of every layout and mode.
        reason: one line: the winner, its tokens/s against the runner-up, and where the runner-up's
            time goes.
        steps: the global batches planned and timed.
    """

    candidates: tuple[LayoutCandidate, ...]
    reason: str
    steps: int

    @property
    def best(self) -> LayoutCandidate:
        return self.candidates[0]


def cp_sizes(world: int, gpus_per_node: int, longest: int, tokens_per_rank: int) -> list[int]:
    """The fixed CP sizes compared: the powers of two dividing the node, then twice as many ranks each
    time (whole nodes, dividing ``world``, below it) until a CP group holds the longest sample, and
    one size more."""
    sizes = [c for c in (1 << i for i in range(gpus_per_node.bit_length())) if gpus_per_node % c == 0]
    extra = 1  # one size of whole nodes beyond the first that holds the longest sample
    c = sizes[-1]
    while c * tokens_per_rank < longest or extra:
        if c * tokens_per_rank >= longest:
            extra -= 1
        c *= 2
        if c >= world or world % c:
            break
        sizes.append(c)
    return [c for c in sizes if c < world and world % c == 0]


def choose_layout(
    lengths: Any,
    world: int,
    gpus_per_node: int,
    tokens_per_rank: int,
    cost: CostModel | None = None,
    comm: CommModel | None = None,
    *,
    modes: Sequence[str] = MODES,
    sizes: Sequence[int] | None = None,
    steps: int = 3,
    samples_per_step: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    partner_memory_budget: float | None = None,
    **config: Any,
) -> LayoutChoice:
    """Rank the fixed CP sizes and the pool, under each exchange, by predicted tokens/s on ``lengths``.

    Args:
        lengths: tokens of every sample (a 1-D integer sequence or array, each >= 1).
        world: GPUs of the cluster; a multiple of ``gpus_per_node``.
        gpus_per_node: GPUs of one node.
        tokens_per_rank: every rank's token budget per micro-batch.
        cost: the cost model (default the ``llama3-8b`` FLOP model).
        comm: the links (default :meth:`CommModel.for_model` of ``cost``: NVLink within a node, IB
            across); its ``mode`` and ``gpus_per_node`` are set per candidate.
        modes: the exchanges to time (:data:`~ringpack.comm_model.MODES`).
        sizes: the fixed CP sizes (default :func:`cp_sizes`); each must divide ``world``.
        steps: global batches planned and timed per layout (the first ones of the epoch).
        samples_per_step: the global batch in samples, the same for every layout (default
            :func:`~ringpack.shard_plan.global_batch_samples` ``"auto"`` of the pool: ``world x
            tokens_per_rank`` tokens of mean-length samples).
        progress: called as ``progress(done, total)`` after each layout is planned or stopped.
        partner_memory_budget: bytes of GPU memory NCCL's point-to-point connections may take per GPU
            (:attr:`LayoutCandidate.partner_memory_bytes`); a layout and mode over it is listed as
            infeasible, naming its partners and their memory. None: no budget.
        **config: other :class:`~ringpack.shard_plan.PlanConfig` fields for every plan (``strategy``,
            ``overflow``, ``seed``, ``pair_price_range``, ...; not ``dp``, ``cp``, ``gpus_per_node``).

    Returns:
        :class:`LayoutChoice`. The config's ``overflow`` (``"split"`` or ``"drop"``) applies once,
        at the pool's capacity, so every layout plans the same documents; a fixed size whose CP
        group cannot hold the longest of them is listed as infeasible.

    Raises:
        PlanError: bad lengths (none at all among them); ``world``, ``gpus_per_node``,
            ``tokens_per_rank``, ``steps`` or ``sizes`` out of range; ``config`` naming ``dp``,
            ``cp`` or ``gpus_per_node``; an unknown mode; or no layout that plans the lengths.
    """
    L = check_lengths(lengths, error=PlanError)
    if not L.size:
        raise PlanError("lengths: no samples, so no layout to choose (give at least one sample length)")
    _check_shape(world, gpus_per_node, steps, config, modes)
    L, config, cut = _pool_documents(L, world, tokens_per_rank, config)
    cost = CostModel.preset("llama3-8b") if cost is None else cost
    comm = CommModel.for_model(cost) if comm is None else comm
    if sizes is None:
        sizes = cp_sizes(world, gpus_per_node, int(L.max()), tokens_per_rank)
    bad = [c for c in sizes if not (isinstance(c, int) and c >= 1 and world % c == 0)]
    if bad:
        raise PlanError(f"sizes: CP size {bad[0]!r} does not divide world={world}")
    if samples_per_step is None:
        samples_per_step = global_batch_samples(L, "auto", dp=1, cp=world, tokens_per_rank=tokens_per_rank)
    base = {"tokens_per_rank": tokens_per_rank, "cost": cost, "samples_per_step": samples_per_step, **config}
    # a CP group over several nodes is planned node by node, and its schedules then relay the
    # targeted exchange across nodes, as the model times it
    layouts = [(f"cp={c}", world // c, c, gpus_per_node if c > gpus_per_node else None) for c in sizes]
    layouts.append(("pool", 1, world, gpus_per_node))
    # every layout's batches and the bound of its compute first (no planning), then the layouts
    # planned most promising first, each stopped once its bound cannot reach the fastest timed
    shared: dict[Any, GlobalBatches] = {}
    sized = []
    for name, dp, cp, node in layouts:
        beyond = _beyond_a_plan(dp, cp, tokens_per_rank)
        cfg = PlanConfig(dp=dp, cp=cp, gpus_per_node=node, **base) if not beyond else None
        batches = beyond or _batches(L, cfg, shared)
        ceiling = float("nan") if isinstance(batches, str) else _bound_tokens_per_second(batches, cfg, steps)
        sized.append((name, dp, cp, node, cfg, batches, ceiling))
    order = sorted(range(len(sized)), key=lambda k: -np.nan_to_num(sized[k][6], nan=-1.0))
    by_layout: dict[int, list[LayoutCandidate]] = {}
    fastest = 0.0
    kinds: set[bool] = set()  # the most promising fixed size and the pool are always timed: the reason's rivals
    for done, k in enumerate(order, 1):
        name, dp, cp, node, cfg, batches, ceiling = sized[k]
        kind = name == "pool"
        # a hybrid inside one node is ulysses; a mode the heads or nodes cannot run is listed, unplanned
        links = {
            m: dataclasses.replace(comm, mode=m, gpus_per_node=gpus_per_node)
            for m in modes
            if not (HEAD_PARALLEL_MODES.get(m) and cp <= gpus_per_node)
        }
        unfit = {m: link.unfit_reason(cp) for m, link in links.items()}
        if isinstance(batches, str):
            by_layout[k] = [LayoutCandidate(name, m, dp, cp, node, False, note=batches + cut) for m in links]
        elif ceiling * (1.0 + TIE) < fastest and kind in kinds:
            note = f"stopped: at most {ceiling:,.0f} tokens/s by the lower bound, below the fastest's {fastest:,.0f}"
            by_layout[k] = [
                LayoutCandidate(name, m, dp, cp, node, False, note=unfit[m])
                if unfit[m]
                else LayoutCandidate(
                    name, m, dp, cp, node, True, note=note, stopped=True, bound_tokens_per_second=ceiling
                )
                for m in links
            ]
        else:
            planned = _plan_steps(batches, cfg, steps)
            if not isinstance(planned, str):
                kinds.add(kind)
            by_layout[k] = []
            for mode, link in links.items():
                if isinstance(planned, str) or unfit[mode]:
                    note = planned + cut if isinstance(planned, str) else unfit[mode]
                    by_layout[k].append(LayoutCandidate(name, mode, dp, cp, node, False, note=note))
                else:
                    timed = dataclasses.replace(_timed(name, mode, planned, link), bound_tokens_per_second=ceiling)
                    timed = _within_budget(timed, partner_memory_budget)
                    by_layout[k].append(timed)
                    if timed.feasible:
                        fastest = max(fastest, timed.tokens_per_second)
        if progress is not None:
            progress(done, len(order))
    candidates = [c for k in range(len(sized)) for c in by_layout[k]]
    ranked = _rank(candidates)
    if not ranked[0].feasible:
        raise PlanError(f"no layout of {world:,} GPUs plans these lengths: {_why_none(ranked)}")
    return LayoutChoice(tuple(ranked), _reason(ranked), steps)


def _beyond_a_plan(dp: int, cp: int, tokens_per_rank: int) -> str:
    """Why a layout is larger than any plan holds (in the layout's terms, not a flag's), or ``""``."""
    if cp > MAX_CP:
        return f"one CP group of {cp:,} GPUs, more than the {MAX_CP:,} ranks a plan holds"
    if dp > MAX_DP:
        return f"{dp:,} DP ranks, more than the {MAX_DP:,} a plan holds"
    if cp * tokens_per_rank > MAX_SAMPLE_TOKENS:
        return (
            f"{cp:,} ranks x {tokens_per_rank:,} tokens = {cp * tokens_per_rank:,} tokens per CP group, more than "
            f"the {MAX_SAMPLE_TOKENS:,} (2**31) a plan holds"
        )
    return ""


def _why_none(ranked: list[LayoutCandidate]) -> str:
    """Every layout's reason, once per layout: the first clause of each, then each distinct rest (the
    hints, alike for most layouts) once, at the end."""
    heads: dict[str, str] = {}
    rests: dict[str, None] = {}
    for c in ranked:
        if c.name not in heads:
            head, _, rest = c.note.partition("; ")
            heads[c.name] = head
            if rest:
                rests[rest] = None
    return "; ".join([*(f"{name}: {head}" for name, head in heads.items()), *rests])


def _pool_documents(L: np.ndarray, world: int, tokens_per_rank: int, config: dict) -> tuple[np.ndarray, dict, str]:
    """The documents every layout plans: ``overflow="split"`` or ``"drop"`` applied once, at the
    pool's capacity, and ``"error"`` for every layout after that (each CP size applying it at its
    own would compare other data: a small group would win by cutting long samples apart); and
    what to add to the note of a layout that cannot hold them."""
    overflow = config.get("overflow", "error")
    if overflow == "error":
        return L, config, ""
    # a pool beyond what a plan holds applies it at the largest CP group a plan holds
    cp = min(world, MAX_CP, max(MAX_SAMPLE_TOKENS // tokens_per_rank, 1))
    pool = PlanConfig(dp=1, cp=cp, tokens_per_rank=tokens_per_rank, **config)
    capacity = pool.group_capacity
    where = "the pool's" if cp == world else "the largest CP group's"
    docs = overflow_documents(L, pool)
    if not docs.size:
        raise PlanError(f"overflow='drop' drops every sample: none fits {where} {capacity:,} tokens")
    note = f" (overflow={overflow!r} applies at {where} {capacity:,} tokens: every layout plans the same documents)"
    return docs, {**config, "overflow": "error"}, note


def _check_shape(world: Any, node: Any, steps: Any, config: dict, modes: Sequence[str]) -> None:
    for name, value in (("world", world), ("gpus_per_node", node), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    if world % node:
        raise PlanError(f"world={world} is not a whole number of nodes of gpus_per_node={node}")
    named = [k for k in ("dp", "cp", "gpus_per_node") if k in config]
    if named:
        raise PlanError(f"choose_layout sets {named[0]} itself for every layout; leave it out")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise PlanError(f"modes must be some of {MODES}, got {list(modes)!r}")


def _batches(L: np.ndarray, config: PlanConfig, shared: dict[Any, GlobalBatches]) -> GlobalBatches | str:
    """``config``'s global batches of ``L``, or why it cannot cut them. Layouts whose batches are
    cut alike (no batch window, the same fewest samples a batch keeps) share one cut: the shuffle
    depends on neither ``dp`` nor ``cp``, and every layout plans the documents as they are
    (``overflow="error"``, :func:`_pool_documents`), so a group that holds the longest keeps them all
    and one that does not is refused by :func:`global_batches` itself."""
    key = None if config.batch_window else ("cut", config.dp * max(config.microbatches_per_rank, 1))
    fits = config.overflow == "error" and int(L.max()) <= config.group_capacity
    if key is not None and fits and key in shared:
        return shared[key]
    try:
        batches = global_batches(L, config)
    except PlanError as exc:
        return str(exc)
    if key is not None and fits:
        shared[key] = batches
    return batches


def _bound_tokens_per_second(batches: GlobalBatches, config: PlanConfig, steps: int) -> float:
    """The most tokens/s any plan of ``config`` makes on the first ``steps`` batches: their tokens over
    the sum of the planner's lower bounds of each step's compute (:func:`step_lower_bound`)."""
    tokens, seconds = 0, 0.0
    for ids in list(batches.windows[: min(steps, len(batches.windows))]):
        L = batches.lengths[ids]
        bound = step_lower_bound(config.cost.sample_cost(L), L, config.dp, config.cp, config.cost)
        tokens += int(L.sum())
        seconds += float(config.cost.seconds(bound))
    return tokens / seconds if seconds > 0 else float("inf")


def _plan_steps(batches: GlobalBatches, config: PlanConfig, steps: int) -> Plan | str:
    """The first ``steps`` steps of ``config``'s plan of ``batches`` as a plan, or why it cannot be planned."""
    try:
        planned = tuple(plan_step(batches, s, config) for s in range(min(steps, len(batches.windows))))
    except PlanError as exc:
        return str(exc)
    return Plan(config=config, lengths=tuple(batches.lengths.tolist()), steps=planned)


def _timed(name: str, mode: str, plan: Plan, comm: CommModel) -> LayoutCandidate:
    """A planned layout timed under ``comm``: per rank compute and exposed communication, the critical path."""
    cfg = plan.config
    comm = dataclasses.replace(comm, max_partners=cfg.max_partners)  # the plan's budget: p2p over it runs the ring
    a = plan.piece_arrays
    M = max(len(step.microbatches[0]) for step in plan.steps)
    shape = (plan.num_steps, cfg.dp, M)
    inputs = exchange_inputs(a, cfg.cp, shape, comm)
    seconds, exposed = rank_seconds(a, cfg.cp, shape, cfg.cost, comm, inputs)
    compute = critical_path(seconds - exposed)[1]
    step = critical_path(seconds)[1]
    inter = 0.0
    if comm.gpus_per_node is not None and cfg.cp > comm.gpus_per_node:
        # the targeted exchange's volumes: those just timed under p2p, counted apart for the other modes
        moved = inputs.volumes if comm.mode == "p2p" else exchange_volumes(a, cfg.cp, shape, comm.gpus_per_node)
        inter = float(moved.send_inter.sum())
        inter *= comm.kv_bytes_per_token / plan.num_steps
    total_tokens = float(np.sum(a["stop"] - a["start"]))
    partners = rank_partners(a, cfg.cp, shape, comm)
    exists = np.zeros(shape, dtype=bool)
    for s, st in enumerate(plan.steps):
        for d, mbs in enumerate(st.microbatches):
            exists[s, d, : len(mbs)] = True
    per_mb = (inputs.partners if inputs.partners is not None else microbatch_partners(a, cfg.cp, shape, comm))[exists]
    mbs = [mb for st in plan.steps for rank in st.microbatches for mb in rank]
    return LayoutCandidate(
        name,
        comm.mode,
        cfg.dp,
        cfg.cp,
        cfg.gpus_per_node,
        True,
        step_seconds=float(step.mean()),
        compute_seconds=float(compute.mean()),
        tokens_per_second=total_tokens / float(step.sum()) if step.sum() > 0 else 0.0,
        inter_node_bytes=inter,
        partners_median=float(np.median(partners)),
        partners_max=int(partners.max()),
        partner_memory_bytes=float(partners.max()) * comm.partner_buffer_bytes,
        microbatch_partners_median=float(np.median(per_mb)),
        microbatch_partners_max=int(per_mb.max()),
        ring_fallback=int(inputs.fallback.sum()) if inputs.fallback is not None else 0,
        max_partners=cfg.max_partners,
        microbatch=max(mbs, key=lambda mb: sum(len(shard.pieces) for shard in mb.shards)),
    )


def _within_budget(candidate: LayoutCandidate, budget: float | None) -> LayoutCandidate:
    """``candidate``, or it made infeasible when its NCCL partners' buffers exceed ``budget`` bytes per GPU."""
    if budget is None or candidate.partner_memory_bytes <= budget:
        return candidate
    note = (
        f"NCCL buffers for {candidate.partners_max} partners on one GPU take about "
        f"{candidate.partner_memory_bytes / 2**30:.2f} GiB, over the budget of {budget / 2**30:.2f} GiB"
    )
    return dataclasses.replace(candidate, feasible=False, note=note)


def _rank(candidates: list[LayoutCandidate]) -> list[LayoutCandidate]:
    """Most tokens/s first; within :data:`TIE` of the fastest, the simplest first; then the stopped ones
    (highest bound first); infeasible ones last."""
    feasible = sorted((c for c in candidates if c.timed), key=lambda c: -c.tokens_per_second)
    if feasible:
        fastest = feasible[0].tokens_per_second
        tied = [c for c in feasible if c.tokens_per_second * (1.0 + TIE) >= fastest]
        simplest = min(tied, key=lambda c: (c.name == "pool", c.cp, MODES.index(c.mode)))
        feasible.remove(simplest)
        feasible.insert(0, simplest)
    stopped = sorted((c for c in candidates if c.stopped), key=lambda c: -c.bound_tokens_per_second)
    return feasible + stopped + [c for c in candidates if not c.feasible]


def _reason(ranked: list[LayoutCandidate]) -> str:
    """One line on why the winner won: its tokens/s against the best layout of the other kind (or
    the runner-up), and where each one's step time goes."""
    best = ranked[0]
    others = [c for c in ranked[1:] if c.timed]
    other_kind = [c for c in others if (c.name == "pool") != (best.name == "pool")]
    rival = other_kind[0] if other_kind else (others[0] if others else None)

    def split(c: LayoutCandidate) -> str:
        return (
            f"{c.step_seconds:.3g} s a step = {c.compute_seconds:.3g} s compute + "
            f"{c.exposed_seconds:.3g} s exposed communication"
        )

    if rival is None:
        return f"{best.label}: the only layout that plans these lengths ({split(best)})"
    ratio = best.tokens_per_second / rival.tokens_per_second if rival.tokens_per_second > 0 else float("inf")
    why = "the same speed, and simpler" if ratio < 1.0 + TIE else f"{ratio:.2f}x the tokens/s"
    planned = {c.name for c in ranked if c.feasible}
    infeasible = [name for name in dict.fromkeys(c.name for c in ranked) if name not in planned]
    cannot = f"; {', '.join(infeasible)}: cannot plan these lengths" if infeasible else ""
    return f"{best.label}: {why} of {rival.label} ({split(best)}, against {split(rival)}){cannot}"
