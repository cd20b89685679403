"""The mode table (ringpack/modes.py): its rows, its views and check_mode's one-line refusal."""

from __future__ import annotations

import pytest

from ringpack import comm_model
from ringpack.errors import DataError
from ringpack.modes import (
    HEAD_PARALLEL_MODES,
    HYBRID_MODES,
    MODE_TABLE,
    MODES,
    SEQUENCE_MODES,
    Mode,
    check_mode,
    mode_names,
)


def test_the_modes_keep_their_order():
    """The group check sends a mode as its index in MODES: the order is part of the wire format."""
    assert MODES == ("ring", "allgather", "p2p", "ulysses", "ulysses+p2p", "ulysses+ring")
    assert tuple(MODE_TABLE) == MODES and all(row.name == name for name, row in MODE_TABLE.items())


def test_the_views_split_the_table():
    assert SEQUENCE_MODES == mode_names(head_parallel=False) == ("ring", "allgather", "p2p")
    assert HEAD_PARALLEL_MODES == mode_names(head_parallel=True) == ("ulysses", "ulysses+p2p", "ulysses+ring")
    assert sorted(SEQUENCE_MODES + HEAD_PARALLEL_MODES) == sorted(MODES)
    assert HYBRID_MODES == {"ulysses+p2p": "p2p", "ulysses+ring": "ring"}


@pytest.mark.parametrize("name", MODES)
def test_every_row_is_consistent(name):
    row = MODE_TABLE[name]
    assert isinstance(row, Mode) and row.summary and "\n" not in row.summary
    if row.head_parallel:
        assert row.moves == ("Q", "K", "V", "O")
        assert row.across_nodes is None or row.across_nodes in SEQUENCE_MODES  # a hybrid runs a sequence mode
    else:
        assert row.moves == ("K", "V") and row.across_nodes is None


def test_the_communication_model_prices_every_mode_of_the_table():
    assert comm_model.MODES == MODES
    assert set(comm_model.HEAD_PARALLEL_MODES) == {n for n, row in MODE_TABLE.items() if row.head_parallel}
    assert all(comm_model.HEAD_PARALLEL_MODES[n] == MODE_TABLE[n].across_nodes for n in comm_model.HEAD_PARALLEL_MODES)


def test_check_mode_returns_the_row():
    assert check_mode("p2p") is MODE_TABLE["p2p"]
    assert check_mode("ring", SEQUENCE_MODES).name == "ring"


@pytest.mark.parametrize("name", ["tree", "ulysses", 3, None, ["ring"]])
def test_check_mode_refuses_in_one_line_listing_the_valid_modes(name):
    with pytest.raises(ValueError) as err:
        check_mode(name, SEQUENCE_MODES)
    assert str(err.value) == f"mode must be one of ('ring', 'allgather', 'p2p'), got {name!r}"


def test_check_mode_names_the_argument_and_raises_the_callers_error():
    with pytest.raises(DataError, match=r"^RingpackConfig.mode must be one of \('ring', .*\), got 'x'$"):
        check_mode("x", what="RingpackConfig.mode", error=DataError)
