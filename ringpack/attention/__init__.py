"""Varlen context-parallel attention that executes any shard plan exactly (docs/attention.md).

Per micro-batch, on the host: ``schedule = compile_schedule(microbatch, cp_rank).to(device)``.
Per layer: ``out = ring_attention(q, k, v, schedule, group=cp_group, mode="ring" | "allgather" | "p2p" | "ulysses")``.
Sequence-mixing layers (convolutions, recurrences) run on whole samples between
``sequence_to_heads(x, schedule, group)`` and ``heads_to_sequence(y, schedule, group)``.

This package imports only torch, numpy and ringpack's plan, traffic and mode-table modules (no
ortools, datasets or pyarrow), so it runs on GPU machines with a bare PyTorch install. Kernel-level entry
points live in :mod:`ringpack.attention.kernels`, the schedule's parts in
:mod:`ringpack.attention.schedule`.
"""

from ringpack.attention.api import MODES, RingAttention, ring_attention
from ringpack.attention.kernels import BACKENDS, available_backends, warm_up_kernels
from ringpack.attention.mode_choice import ModeChoice
from ringpack.attention.relayout import heads_to_sequence, sequence_to_heads
from ringpack.attention.schedule import Schedule, ScheduleMismatchError, ScheduleOptions, compile_schedule

__all__ = [
    "BACKENDS",
    "MODES",
    "ModeChoice",
    "RingAttention",
    "Schedule",
    "ScheduleMismatchError",
    "ScheduleOptions",
    "available_backends",
    "compile_schedule",
    "heads_to_sequence",
    "ring_attention",
    "sequence_to_heads",
    "warm_up_kernels",
]
