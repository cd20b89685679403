"""Run Hugging Face causal LMs context-parallel on packed data: ``attn_implementation="ringpack"``.

:func:`register` adds ringpack to transformers' ``AttentionInterface`` (done on import of this
module, and by :mod:`ringpack.integrations.autoregister` once transformers' models load). The name
is absent from transformers' mask interface, so no dense ``[T, T]`` mask is built: the schedule is
the mask. Any model whose attention calls the standard interface (Llama, Qwen2/3, Mistral, Gemma,
...) then runs each layer through :func:`ringpack.attention.ring_attention`; no model code is
copied or patched. Per forward, pass the collator's ``input_ids`` and ``position_ids`` (``[None]``),
``ringpack_schedule=batch["schedule"]`` and ``ringpack_group=mesh["cp"]``; do not pass labels
(they are already shifted per sample: :func:`causal_lm_loss_sum`).

See docs/training.md, "Hugging Face transformers".
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ringpack.attention import ring_attention
from ringpack.errors import DataError

ATTENTION_NAME = "ringpack"


def ringpack_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ringpack_schedule: Any = None,
    ringpack_group: Any = None,
    ringpack_mode: str = "ring",
    ringpack_backend: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``attn_implementation="ringpack"``.

    Args:
        module: the calling attention module (unused).
        query: ``(1, H, T, D)``, this CP rank's packed tokens.
        key, value: ``(1, H_kv, T, D)``.
        attention_mask: must be None (the schedule is the mask).
        dropout: must be 0.
        scaling: the softmax scale (default ``1 / sqrt(D)``).
        ringpack_schedule: this rank's :class:`~ringpack.attention.Schedule` on the device.
        ringpack_group, ringpack_mode, ringpack_backend: ``group`` (a ProcessGroup or a 1-D
            DeviceMesh such as ``mesh["cp"]``), ``mode`` and ``backend`` of
            :func:`~ringpack.attention.ring_attention`.

    Returns:
        ``(out, None)`` with ``out`` of shape ``(1, T, H, D)`` (no attention weights).

    Raises:
        DataError: (a ``ValueError``) no schedule, query/key/value that are not 4-D tensors, a
            batch other than 1, dropout, or an attention mask; and whatever
            :func:`~ringpack.attention.ring_attention` raises.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise DataError(
                f"ringpack attention: {name} must be a (batch, heads, tokens, head_dim) tensor, got {shape}"
            )
    if ringpack_schedule is None:
        raise DataError(
            "attn_implementation='ringpack' needs ringpack_schedule=... in the model's forward call "
            "(the schedule PackedCollator builds for this CP rank)"
        )
    if query.shape[0] != 1:
        raise DataError(
            f"ringpack attention takes one packed sequence per CP rank (batch 1), got batch {query.shape[0]}"
        )
    if dropout:
        raise DataError("ringpack attention does not implement attention dropout; set attention_dropout=0")
    if attention_mask is not None:
        raise DataError("ringpack attention builds its own per-sample causal mask; do not pass attention_mask")
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = ring_attention(
        q,
        k,
        v,
        ringpack_schedule,
        group=ringpack_group,
        mode=ringpack_mode,
        softmax_scale=scaling,
        backend=ringpack_backend,
    )
    return out.unsqueeze(0), None


def register() -> str:
    """Register ringpack with transformers' ``AttentionInterface`` (idempotent).

    Returns:
        The ``attn_implementation`` name, ``"ringpack"``.

    Raises:
        ImportError: transformers is not installed, or too old to have ``AttentionInterface``.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            "attn_implementation='ringpack' needs transformers >= 4.48 (AttentionInterface): pip install 'ringpack[hf]'"
        ) from exc
    AttentionInterface.register(ATTENTION_NAME, ringpack_attention_forward)
    return ATTENTION_NAME


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over already-shifted labels (``-100`` ignored), in >= fp32.

    Divide by the global batch's loss tokens (``Step.loss_tokens``) and all-reduce the gradient
    (sum) over DP x CP to get exactly the single-device per-token mean.

    Args:
        logits: ``(..., T, V)`` floating-point scores.
        labels: integer ``(..., T)`` targets, as many as ``logits`` has rows.

    Raises:
        DataError: ``logits`` or ``labels`` not tensors of those kinds, or of other token counts.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2 or not logits.is_floating_point():
        raise DataError(f"logits must be a floating-point (..., tokens, vocab) tensor, got {_describe(logits)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise DataError(f"labels must be an integer tensor of target ids, got {_describe(labels)}")
    if labels.numel() * logits.shape[-1] != logits.numel():
        raise DataError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}: one label per row")
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.float16, torch.bfloat16):  # low-precision logits: reduce in fp32
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")


def _describe(x: Any) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


# importing this module is enough for attn_implementation="ringpack"; without transformers,
# causal_lm_loss_sum still works and register() says what to install
with contextlib.suppress(ImportError):
    register()
