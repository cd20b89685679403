"""Varlen context-parallel attention that executes any shard plan exactly (DESIGN.md section 4).

Per micro-batch, on the host: ``schedule = compile_schedule(microbatch, cp_rank).to(device)``.
Per layer: ``out = ring_attention(q, k, v, schedule, group=cp_group, mode="ring" | "allgather")``.

This package imports only torch, numpy and the balancer's plan types (no ortools, datasets or
pyarrow), so it runs on GPU machines with a bare PyTorch install.
"""

from ringpack.attention.api import MODES, RingAttention, ring_attention, verify_schedule
from ringpack.attention.kernels import BACKENDS, available_backends, resolve_backend, varlen_attn_bwd, varlen_attn_fwd
from ringpack.attention.schedule import KernelCall, RingStep, Schedule, ScheduleMismatchError, compile_schedule

__all__ = [
    "BACKENDS",
    "MODES",
    "KernelCall",
    "RingAttention",
    "RingStep",
    "Schedule",
    "ScheduleMismatchError",
    "available_backends",
    "compile_schedule",
    "resolve_backend",
    "ring_attention",
    "varlen_attn_bwd",
    "varlen_attn_fwd",
    "verify_schedule",
]
