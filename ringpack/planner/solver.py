"""CP-SAT refinement of the DP packing: exact-ish answers for small or hard global batches.

Used when ``PlanConfig.solver_time_limit_s > 0`` and the heuristic packing is more than
:data:`GAP_THRESHOLD` above the step's lower bound. The model is the packing problem itself (every
sample in one non-empty bin within ``cp * tokens_per_rank`` tokens, minimise the largest DP-rank
load, or the largest over price scenarios), warm-started from the heuristic; the better answer on
the exact float costs is kept. It runs with one worker, a fixed seed and a deterministic time
limit (never wall-clock), so every rank gets the same answer with the same OR-Tools version.
``ortools`` is imported here only, lazily.

See docs/planner.md, "The CP-SAT refinement".
"""

from __future__ import annotations

import numpy as np

from ringpack.cost import scale_to_int
from ringpack.planner.packing import PackingProblem

__all__ = ["refine", "GAP_THRESHOLD", "MAX_BOOLEANS"]

#: Relative gap to the lower bound under which the heuristic answer is kept without solving.
GAP_THRESHOLD = 1e-3
#: Largest model (samples x bins) handed to CP-SAT; larger steps keep the heuristic answer.
MAX_BOOLEANS = 40_000
#: Integer resolution of costs in the model (largest sample cost maps to this).
COST_RESOLUTION = 1_000_000


def refine(problem: PackingProblem, bins: np.ndarray, lower_bound: float, time_limit_s: float) -> np.ndarray:
    """Improve ``bins`` (the bin of every sample) with CP-SAT under a deterministic time limit.

    Returns ``bins`` itself unless the solver finds a packing whose heaviest DP rank is lighter
    (never a worse one). Skips the solver when ``time_limit_s <= 0``, with fewer than two bins,
    within :data:`GAP_THRESHOLD` of ``lower_bound``, or above :data:`MAX_BOOLEANS`.
    """
    n = len(bins)
    dp, m, nbins = problem.dp, problem.m, problem.num_bins
    w = problem.columns  # one column per price scenario
    best = float(problem.heights(bins).max())
    if time_limit_s <= 0 or nbins < 2 or best <= lower_bound * (1 + GAP_THRESHOLD) or n * nbins > MAX_BOOLEANS:
        return bins
    from ortools.sat.python import cp_model

    wi, _ = scale_to_int(w, COST_RESOLUTION)  # one scale for every column: heights stay comparable
    t = np.asarray(problem.tokens, dtype=np.int64)
    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{i}_{b}") for b in range(nbins)] for i in range(n)]
    for i in range(n):
        model.AddExactlyOne(x[i])
    for b in range(nbins):
        column = [x[i][b] for i in range(n)]
        model.Add(sum(int(t[i]) * column[i] for i in range(n)) <= problem.capacity)
        model.AddBoolOr(column)  # no empty micro-batch
    top = model.NewIntVar(0, int(wi.sum(axis=0).max()), "top")
    for d in range(dp):
        for k in range(wi.shape[1]):  # the rank's load in every scenario is at most top
            terms = (int(wi[i, k]) * x[i][b] for i in range(n) for b in range(d * m, (d + 1) * m))
            model.Add(sum(terms) <= top)
    model.Minimize(top)
    for i in range(n):
        for b in range(nbins):
            model.AddHint(x[i][b], int(bins[i]) == b)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = float(time_limit_s)
    solver.parameters.log_search_progress = False
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return bins
    new = np.array([next(b for b in range(nbins) if solver.BooleanValue(x[i][b])) for i in range(n)], dtype=np.int64)
    new_top = float(problem.heights(new).max())
    return new if new_top < best * (1 - 1e-12) else bins
