"""The table of context-parallel attention modes: every mode's name and facts, declared once.

A :class:`Mode` row says what a mode is (sequence-split or head-parallel, the sequence mode a
hybrid runs between nodes, what it moves); :data:`MODE_TABLE` holds the rows in their canonical
order and :data:`MODES`, :data:`SEQUENCE_MODES`, :data:`HEAD_PARALLEL_MODES` and
:data:`HYBRID_MODES` are views of it. The attention runtime (:mod:`ringpack.attention.dispatch`),
the communication model, the planner's layout choice and the command line read their mode names
here. Pure Python, no torch: the bottom layer may read it.

A new mode is one new module plus one row here: a sequence mode's transport module, its row, and
its line in ``ringpack/attention/transports.py``; a hybrid of an existing sequence mode is its
row alone (a sequence mode the planner weighs also needs its formula in ``ringpack/comm_model.py``).
Tests hold the runtime and this table to each other. See docs/attention.md, "Modes".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HEAD_PARALLEL_MODES",
    "HYBRID_MODES",
    "MODES",
    "MODE_TABLE",
    "SEQUENCE_MODES",
    "Mode",
    "check_mode",
    "mode_names",
]

#: What a sequence-split mode moves between ranks (dK/dV travel back in backward).
_KV = ("K", "V")
#: What a head-parallel mode's all-to-alls move (dO in, dQ/dK/dV back in backward).
_QKVO = ("Q", "K", "V", "O")


@dataclass(frozen=True)
class Mode:
    """One context-parallel attention mode.

    Attributes:
        name: the ``mode=`` string of :func:`~ringpack.attention.ring_attention`.
        head_parallel: whether ranks split heads (all-to-all, whole samples per rank) rather than
            running the sequence engine over pieces of samples and merging partial results.
        across_nodes: for a hybrid, the sequence mode it runs between nodes (Ulysses runs within
            each node); ``None`` for every other mode.
        moves: the tensors the mode's exchange moves between ranks in forward (their gradients
            go back in backward): ``("K", "V")`` or ``("Q", "K", "V", "O")``. A hybrid's sequence
            mode between nodes moves K/V only.
        summary: one line on how it moves them.
    """

    name: str
    head_parallel: bool
    across_nodes: str | None
    moves: tuple[str, ...]
    summary: str


#: Every mode, by name, in canonical order (the group check sends a mode as its index here).
MODE_TABLE: dict[str, Mode] = {
    row.name: row
    for row in (
        Mode("ring", False, None, _KV, "K/V pass around the group point to point, double-buffered"),
        Mode("allgather", False, None, _KV, "one all-gather of K/V; dK/dV home by one reduce-scatter"),
        Mode("p2p", False, None, _KV, "the targeted exchange: each needed K/V piece straight to its ranks"),
        Mode("ulysses", True, None, _QKVO, "one all-to-all to H / cp heads of whole samples, one back"),
        Mode("ulysses+p2p", True, "p2p", _QKVO, "Ulysses within each node, the targeted exchange between"),
        Mode("ulysses+ring", True, "ring", _QKVO, "Ulysses within each node, the ring between nodes"),
    )
}


def mode_names(*, head_parallel: bool | None = None) -> tuple[str, ...]:
    """The names of the table's modes in canonical order: all of them, or (``head_parallel``
    True/False) only the head-parallel or only the sequence-split ones."""
    return tuple(
        name for name, row in MODE_TABLE.items() if head_parallel is None or row.head_parallel == head_parallel
    )


#: Every mode's name: what ``ring_attention(mode=...)`` accepts.
MODES = mode_names()
#: The sequence-split modes: the engine runs pieces of samples and moves K/V.
SEQUENCE_MODES = mode_names(head_parallel=False)
#: The modes that split heads over (some of) the CP group.
HEAD_PARALLEL_MODES = mode_names(head_parallel=True)
#: The hybrid modes and the sequence mode each runs between nodes.
HYBRID_MODES: dict[str, str] = {
    name: row.across_nodes for name, row in MODE_TABLE.items() if row.across_nodes is not None
}


def check_mode(
    name: object, valid: tuple[str, ...] = MODES, *, what: str = "mode", error: type[ValueError] = ValueError
) -> Mode:
    """The table's row of mode ``name``, which must be one of ``valid``.

    Args:
        name: the mode given (any object: a non-string is refused like an unknown name).
        valid: the names the caller accepts (:data:`MODES`, or a part such as :data:`SEQUENCE_MODES`).
        what: how the message names the argument.
        error: the ``ValueError`` subclass raised.

    Returns:
        the :class:`Mode` row.

    Raises:
        ValueError: (``error``) ``name`` not in ``valid``, in one line listing ``valid``.
    """
    if not isinstance(name, str) or name not in valid:
        raise error(f"{what} must be one of {valid}, got {name!r}")
    return MODE_TABLE[name]
