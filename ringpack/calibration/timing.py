"""GPU timing for ``ringpack calibrate``: one rank shard's attention and the linear layers' GEMMs.

Ranks are timed one at a time on one GPU with a transport that serves remote K/V from memory, so
a rank's time is its compute; communication is the comm model's business. torch is imported
inside the functions, so the analysis package stays importable without it.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack.attention.engine import ContextParallelAttention
from ringpack.attention.kernels import accum_dtype
from ringpack.calibration.cases import Case
from ringpack.calibration.config import AttentionShape
from ringpack.calibration.features import compiled_schedule
from ringpack.cost import ModelShape


class _ComputeOnlyTransport:
    """A :class:`~ringpack.attention.kv_transport.KVTransport` without communication: remote K/V come from memory."""

    send_capacity = None

    def __init__(self, buffers: list, home) -> None:
        self._buffers, self._home = buffers, home

    def begin(self, kv, grad_dtype=None) -> None:
        self._grad_dtype = grad_dtype

    def start(self) -> None:
        pass

    def buffer(self, i: int):
        return self._buffers[i]

    def push_grad(self, i: int, dkv) -> None:
        pass

    def finish(self):
        # dK/dV come home in the dtype the engine asked for (the input dtype with one remote step);
        # converted once per dtype, so the timed repetitions see no extra kernel
        if self._home is not None and self._home.dtype != self._grad_dtype:
            self._home = self._home.to(self._grad_dtype)
        return self._home


def compute_only_transport(schedule: Any, shape: AttentionShape, dtype: Any, generator: Any = None) -> Any:
    """A K/V transport for ``schedule`` (on its device) that serves random remote K/V from memory and sends nothing.

    Every remote step reads a ``[2, tokens, kv_heads, head_dim]`` buffer of ``dtype`` drawn once;
    dK/dV of remote K/V are dropped. The engine then computes exactly what the rank computes in
    training, without the communication.
    """
    import torch

    device = schedule.device
    kw = dict(device=device, dtype=dtype, generator=generator)
    kv = (shape.kv_heads, shape.head_dim)
    buffers = [torch.randn(2, schedule.buffer_tokens[schedule.source(step)], *kv, **kw) for step in schedule.steps]
    own = schedule.buffer_tokens[schedule.cp_rank]
    home = torch.zeros(2, own, *kv, device=device, dtype=accum_dtype(dtype)) if own else None
    return _ComputeOnlyTransport(buffers, home)


class Clock:
    """CUDA events on a GPU, ``perf_counter`` (after nothing to sync) on the CPU.

    ``queued=True`` (the ``gpu`` timer): before a batch of repetitions the GPU is put to sleep
    (``torch.cuda._sleep``) for longer than the host needs to launch them, so every repetition's
    kernels are already queued when its start event fires and the events measure the GPU's
    execution alone. Without it (the ``wall`` timer) a shard whose kernels finish before the host
    has launched the next ones is timed at the host's pace (~0.4 ms for one attention layer's
    forward+backward with ringpack's engine, ~1 ms with a ring step): a floor that the linear
    cost model cannot fit and that a training step, whose GPU queue the host keeps ahead of, does
    not see.
    """

    def __init__(self, device, queued: bool = True) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self._torch = torch
        self.queued = self.cuda and queued and hasattr(torch.cuda, "_sleep")
        self._hz = 0.0

    @property
    def kind(self) -> str:
        return "gpu" if self.queued else "wall" if self.cuda else "host"

    def _sleep(self, seconds: float) -> None:
        torch = self._torch
        if not self._hz:  # cycles per second of torch.cuda._sleep, measured once
            for _ in range(2):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                torch.cuda._sleep(1_000_000)
                stop.record()
                stop.synchronize()
                self._hz = 1e6 / max(start.elapsed_time(stop) * 1e-3, 1e-6)
        torch.cuda._sleep(int(min(seconds, 2.0) * self._hz))

    def measure(self, fn: Callable[[], None], warmup: int, reps: int) -> list[float]:
        torch = self._torch
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            torch.cuda.synchronize()
            if self.queued:
                t0 = time.perf_counter()
                fn()  # the host's launch time of one repetition (its kernels run meanwhile)
                host = time.perf_counter() - t0
                torch.cuda.synchronize()
                self._sleep(1.5 * host * reps + 2e-4)
            for start, stop in events:
                start.record()
                fn()
                stop.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(stop) * 1e-3 for start, stop in events]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times


@dataclass(frozen=True)
class TimingSetup:
    """Where and how rank shards and GEMMs are timed.

    Attributes:
        shape: the attention heads timed.
        backend: the kernel backend (resolved, not ``"auto"``).
        device, dtype: the torch device and dtype of the random inputs.
        clock: the :class:`Clock` that times the repetitions.
        reps: timed repetitions per shard (the median is taken); ``warmup``: untimed runs first.
        generator: the torch generator the inputs are drawn from.
    """

    shape: AttentionShape
    backend: str
    device: Any
    dtype: Any
    clock: Clock
    reps: int = 5
    warmup: int = 1
    generator: Any = None


def time_case(case: Case, setup: TimingSetup) -> float:
    """Median seconds of one forward+backward of this rank's attention (compute only, no communication).

    Shards slower than 50 ms get at most 3 repetitions.
    """
    import torch

    shape, device, dtype, clock = setup.shape, setup.device, setup.dtype, setup.clock
    schedule = compiled_schedule(case).to(device)
    t = schedule.num_tokens
    kw = dict(device=device, dtype=dtype, generator=setup.generator)
    q = torch.randn(t, shape.heads, shape.head_dim, **kw).requires_grad_()
    k = torch.randn(t, shape.kv_heads, shape.head_dim, **kw).requires_grad_()
    v = torch.randn(t, shape.kv_heads, shape.head_dim, **kw).requires_grad_()
    dout = torch.randn(t, shape.heads, shape.head_dim, **kw)
    transport = compute_only_transport(schedule, shape, dtype, setup.generator)
    scale = shape.head_dim**-0.5

    def step() -> None:
        q.grad = k.grad = v.grad = None
        out = ContextParallelAttention.apply(q, k, v, schedule, lambda _: transport, scale, setup.backend)
        out.backward(dout)

    first = clock.measure(step, warmup=setup.warmup, reps=1)[0]
    more = (setup.reps if first < 0.05 else min(setup.reps, 3)) - 1  # long shards: 3 repetitions are plenty
    times = [first] + (clock.measure(step, warmup=0, reps=more) if more > 0 else [])
    return float(np.median(times))


def time_linear(model: ModelShape, tokens: int, setup: TimingSetup) -> dict[str, float]:
    """Seconds per token of one decoder layer's GEMMs and of the output head, forward+backward.

    Each weight ``W [in, out]`` costs ``Y = X @ W``, ``dX = dY @ W^T`` and ``dW = X^T @ dY``, on
    ``tokens`` rows. Returns ``layer_token_s``, ``head_token_s``, ``gemm_tflops`` and ``tokens``.
    """
    import torch

    device, dtype = setup.device, setup.dtype
    h, hd = model.hidden, model.head_dim
    layer = ((h, (model.heads + 2 * model.kv_heads) * hd), (model.heads * hd, h), (h, 2 * model.ffn), (model.ffn, h))
    head = ((h, model.vocab),) if model.vocab else ()

    def gemms(shapes) -> tuple[float, float]:
        if not shapes:
            return 0.0, 0.0
        mats = [
            (
                torch.randn(tokens, i, device=device, dtype=dtype),
                torch.randn(i, o, device=device, dtype=dtype),
                torch.randn(tokens, o, device=device, dtype=dtype),
            )
            for i, o in shapes
        ]

        def step() -> None:
            for x, w, dy in mats:
                torch.mm(x, w)
                torch.mm(dy, w.t())
                torch.mm(x.t(), dy)

        seconds = float(np.median(setup.clock.measure(step, setup.warmup, setup.reps)))
        flops = sum(6.0 * tokens * i * o for i, o in shapes)
        return seconds / tokens, flops / seconds

    layer_s, layer_flops = gemms(layer)
    head_s, _ = gemms(head)
    return dict(layer_token_s=layer_s, head_token_s=head_s, gemm_tflops=layer_flops / 1e12, tokens=tokens)


def device_name(device) -> str:
    """The GPU's name as CUDA reports it, or ``"cpu"``: what a report records as its device."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
