"""Every rank of a head-parallel CP group in one process: one thread per rank, exchanges through memory.

:func:`run_head_parallel` runs ``mode="ulysses"``, ``"ulysses+ring"`` or ``"ulysses+p2p"`` for every
CP rank of a micro-batch through the runtime's own code (the autograd function's forward and
backward, or the traced op's pair), each rank in a thread: the all-to-alls go through
:class:`ThreadedGroup` (the relayout's pluggable exchange), the K/V between nodes through
:class:`ThreadedTransports` (a :class:`~ringpack.attention.kv_transport.KVTransport` over memory). The
autograd engine is not used: it runs a device's backward passes on one thread, where ranks waiting
for each other would deadlock. Every wait has a timeout, so a bug fails instead of hanging.
Imports only torch and ringpack.attention (it runs on GPU machines without ortools or datasets).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter
from types import SimpleNamespace

import torch

TIMEOUT_S = 120.0


class ThreadedExchange:
    """The all-to-alls of a group of ``size`` ranks that are threads of this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list = [None] * size

    def member(self, rank: int) -> ThreadedGroup:
        return ThreadedGroup(self, rank)


class ThreadedGroup:
    """One rank's view of a :class:`ThreadedExchange`: what the relayout calls instead of ``dist.all_to_all_single``."""

    def __init__(self, exchange: ThreadedExchange, rank: int) -> None:
        self.exchange, self.rank = exchange, rank

    def exchange_rows(self, out, send, out_splits, in_splits) -> None:
        ex, me = self.exchange, self.rank
        ex.slots[me] = (send, list(in_splits))
        ex.barrier.wait()
        row = 0
        for src, (theirs, splits) in enumerate(ex.slots):
            start, n = sum(splits[:me]), splits[me]
            assert n == out_splits[src], f"rank {me} expects {out_splits[src]} rows from {src}, which sends {n}"
            out[row : row + n].copy_(theirs[start : start + n])
            row += n
        assert row == out.shape[0]
        ex.barrier.wait()  # every rank has read the slots before any overwrites its own


class ThreadedTransports:
    """A transport factory over the schedules of a group of threads (``schedules[r]``: rank ``r``'s).

    ``mode="ring"``: step ``i`` of a rank reads the compact buffer of ``schedule.source(step)``;
    ``"p2p"``: the targeted exchange's steps, the rows of the source's buffer its maps route to
    the rank (straight or through a proxy), followed as ``tests.helpers.attention.LoopbackTargeted``
    does. Buffers, dK/dV sums and arrival counts are kept per pass (each rank counts its passes).
    """

    def __init__(self, schedules: list, mode: str) -> None:
        from ringpack.attention.p2p import targeted_schedule

        self.mode, self.schedules = mode, schedules
        self.steps = [targeted_schedule(s).steps if mode == "p2p" else s.steps for s in schedules]
        self.origins = [self._origins(r) for r in range(len(schedules))]
        self.expected = Counter(src for origins in self.origins for src in origins)  # dK/dV pushes per buffer
        self.cond = threading.Condition()
        self.kv: dict = {}
        self.dkv: dict = {}
        self.pushed: Counter = Counter()
        self.passes = Counter()

    def _origins(self, rank: int) -> list[int]:
        sched = self.schedules[rank]
        if self.mode == "p2p":
            return list(sched.exchange.sources)
        return [sched.source(step) for step in sched.steps]

    def pass_schedule(self, schedule):
        if self.mode != "p2p":
            return schedule
        from ringpack.attention.p2p import targeted_schedule

        return targeted_schedule(schedule)

    def rows(self, rank: int, i: int) -> torch.Tensor | None:
        """The rows of source ``i``'s compact buffer that ``rank`` receives (None: all of them)."""
        if self.mode != "p2p":
            return None
        from tests.helpers.attention import LoopbackTargeted

        return LoopbackTargeted(None, self.schedules).rows(rank, i)

    def __call__(self, schedule) -> ThreadedTransport:
        rank = schedule.cp_rank
        with self.cond:
            self.passes[rank] += 1
            number = self.passes[rank]
        return ThreadedTransport(self, rank, number)

    def wait_for(self, ready) -> None:
        if not self.cond.wait_for(ready, timeout=TIMEOUT_S):
            raise TimeoutError("a rank's transfer never arrived")


class ThreadedTransport:
    """One pass of one rank: :class:`~ringpack.attention.kv_transport.KVTransport` over :class:`ThreadedTransports`."""

    send_capacity = None

    def __init__(self, world: ThreadedTransports, rank: int, number: int) -> None:
        self.world, self.rank, self.number = world, rank, number

    def begin(self, kv, grad_dtype=None) -> None:
        self.grad_dtype = grad_dtype
        packed = kv if isinstance(kv, torch.Tensor) else torch.stack(tuple(kv))
        with self.world.cond:
            self.world.kv[self.number, self.rank] = packed
            self.world.cond.notify_all()

    def start(self) -> None:
        pass

    def buffer(self, i: int) -> torch.Tensor:
        origins, world = self.world.origins[self.rank], self.world
        if i >= len(origins):  # a rank that only sends (p2p): an empty step
            return world.kv[self.number, self.rank][:, :0]
        key = (self.number, origins[i])
        with world.cond:
            world.wait_for(lambda: key in world.kv)
            buf = world.kv[key]
        rows = world.rows(self.rank, i)
        return buf if rows is None else buf[:, rows.to(buf.device)]

    def push_grad(self, i: int, dkv) -> None:
        origins, world = self.world.origins[self.rank], self.world
        if i >= len(origins):
            return
        key = (self.number, origins[i])
        rows = world.rows(self.rank, i)
        with world.cond:
            if dkv is not None:
                acc = world.dkv.get(key)
                if acc is None:
                    acc = world.dkv[key] = torch.zeros(
                        world.kv[key].shape, dtype=torch.float64, device=world.kv[key].device
                    )
                for j, grad in enumerate(dkv):
                    if rows is None:
                        acc[j] += grad.to(acc.dtype)
                    else:
                        acc[j].index_add_(0, rows.to(acc.device), grad.to(acc.dtype))
            world.pushed[key] += 1
            world.cond.notify_all()

    def finish(self):
        world, key = self.world, (self.number, self.rank)
        with world.cond:
            world.wait_for(lambda: world.pushed[key] == world.expected[self.rank])
            acc = world.dkv.get(key)
        if acc is None or not acc.shape[1]:
            return None
        return acc.to(self.grad_dtype)


class _Ctx(SimpleNamespace):
    """What an autograd function's forward and backward see of ``ctx``, without the autograd engine."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def run_head_parallel(
    problem,
    mode: str,
    scale: float | None = None,
    backend: str = "reference",
    device: str | torch.device = "cpu",
    gpus_per_node: int | None = None,
    traced: bool = False,
    dense_threshold: int | None = 4096,
    dense_buckets: int | None = 8,
) -> list[dict[str, torch.Tensor]]:
    """Forward and backward of every CP rank of ``problem`` (``tests.helpers.attention.Problem``)
    under a head-parallel ``mode``, each rank a thread of this process, through the runtime's code:
    :class:`~ringpack.attention.ulysses.UlyssesAttention`'s forward and backward (``traced``: the
    traced op's ``heads_forward_op``/``heads_backward_op``) on the parts ``ring_attention`` builds,
    with threaded exchanges in place of process groups. Returns each rank's out/dq/dk/dv."""
    from ringpack.attention import compile_schedule
    from ringpack.attention.engine import PassConfig
    from ringpack.attention.ulysses import HeadSplit, UlyssesAttention, heads_backward_op, heads_forward_op
    from ringpack.modes import HYBRID_MODES

    cp = len(problem.mb.shards)
    g = cp if mode == "ulysses" else gpus_per_node
    options = dict(dense_threshold=dense_threshold, dense_buckets=dense_buckets, hybrid_layout=mode in HYBRID_MODES)
    schedules = [compile_schedule(problem.mb, r, gpus_per_node=gpus_per_node, **options).to(device) for r in range(cp)]
    layouts = [s.head_layout if mode == "ulysses" else s.node_layout for s in schedules]
    nodes = [ThreadedExchange(g) for _ in range(cp // g)]
    columns = [
        ThreadedTransports([layouts[r].attention for r in range(j, cp, g)], HYBRID_MODES[mode])
        for j in range(g if mode != "ulysses" else 0)
    ]
    q, k, v, dout = ([problem.local(t, r) for r in range(cp)] for t in (problem.q, problem.k, problem.v, problem.dout))
    scale = q[0].shape[-1] ** -0.5 if scale is None else scale
    results: list = [None] * cp

    def rank_main(r: int) -> None:
        split = HeadSplit(heads=q[r].shape[1], kv_heads=k[r].shape[1], cp=g, mode=mode)
        transport = columns[r % g] if columns and cp // g > 1 else None
        parts = (layouts[r], split, nodes[r // g].member(r % g), PassConfig(scale, backend, transport))
        if traced:
            out, lse = heads_forward_op(q[r], k[r], v[r], *parts)
            dq, dk, dv = heads_backward_op(dout[r], q[r], k[r], v[r], out, lse, *parts)
        else:
            ctx = _Ctx()
            out = UlyssesAttention.forward(ctx, q[r], k[r], v[r], *parts)
            dq, dk, dv, *_ = UlyssesAttention.backward(ctx, dout[r])
        results[r] = {"out": out, "dq": dq, "dk": dk, "dv": dv}

    with _one_kernel_call_at_a_time() if torch.device(device).type == "cuda" else contextlib.nullcontext():
        run_threads(rank_main, cp, [node.barrier for node in nodes])
    return results


#: The engine's kernel entry points that :func:`_one_kernel_call_at_a_time` serialises.
KERNEL_ENTRY_POINTS = ("varlen_attn_fwd", "varlen_attn_bwd", "dense_attn_fwd_parts", "dense_attn_bwd_parts")


@contextlib.contextmanager
def _one_kernel_call_at_a_time():
    """Rank threads call the engine's kernels one at a time. A real rank is a process; threads of one
    process would otherwise build flash-attn-4's JIT kernels (and cuDNN graphs) concurrently on first
    use, which those libraries do not support. Launches stay asynchronous: only the host side of a
    call holds the lock, never a wait on another rank."""
    from ringpack.attention import engine

    lock = threading.Lock()
    saved = {name: getattr(engine, name) for name in KERNEL_ENTRY_POINTS}

    def serialised(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with lock:
                out = fn(*args, **kwargs)
                return list(out) if inspect.isgenerator(out) else out

        return call

    for name, fn in saved.items():
        setattr(engine, name, serialised(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(engine, name, fn)


def run_threads(fn, count: int, barriers: list[threading.Barrier]) -> None:
    """``fn(i)`` for ``i < count``, each in a thread; re-raises the first failure (a failed rank
    breaks the ``barriers``, so the others fail too instead of waiting)."""
    errors: list = []

    def main(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # reported to the caller below
            errors.append((i, exc))
            for barrier in barriers:
                barrier.abort()

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * TIMEOUT_S)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank's thread did not finish")
    if errors:
        rank, exc = min(errors, key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
        raise RuntimeError(f"rank {rank} failed: {exc!r}") from exc
