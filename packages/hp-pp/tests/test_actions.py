"""The action vocabulary: compact notation round trips, kinds, and clear errors."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from hp_pp.actions import Action, ActionType

_CELLS = [
    "0F1",
    "1B0",
    "2I3",
    "2W3",
    "0SEND_F1",
    "1RECV_F1",
    "1SEND_B0",
    "0RECV_B0",
    "0UNSHARD",
    "0RESHARD",
    "0REDUCE_GRAD",
    "(0F1;3B0)OVERLAP_F_B",
    "12F345",
]


@pytest.mark.parametrize("cell", _CELLS)
def test_round_trip_and_torch_agrees(cell: str) -> None:
    action = Action.parse(cell)
    assert str(action) == cell
    assert Action.parse(f"  {cell} ") == action
    theirs = torch_schedules._Action.from_str(cell)
    assert repr(theirs) == cell


@pytest.mark.parametrize("cell", ["0PRE_F2", "0PRE_B1", "0SEND_PRE2", "0RECV_PRE2"])
def test_mpipe_cells_round_trip(cell: str) -> None:
    assert str(Action.parse(cell)) == cell


def test_kinds() -> None:
    assert Action.parse("0F0").type.is_compute
    assert not Action.parse("0SEND_F0").type.is_compute
    assert Action.parse("0SEND_PRE1").type.is_communication
    assert Action.parse("0PRE_F1").type.is_preprocess
    assert not Action.parse("0PRE_F1").type.is_compute
    assert not ActionType.UNSHARD.needs_microbatch
    overlap = Action.parse("(0F1;3B0)OVERLAP_F_B")
    assert overlap.stage_index == 0
    assert overlap.sub_actions == (
        Action(0, ActionType.FORWARD, 1),
        Action(3, ActionType.FULL_BACKWARD, 0),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0X1", "is not an action"),
        ("F1", "is not an action"),
        ("0F", "FORWARD needs a micro-batch index"),
        ("0UNSHARD3", "UNSHARD takes no micro-batch index"),
        ("(0SEND_F1;1B0)OVERLAP_F_B", "OVERLAP_F_B needs compute sub-actions"),
    ],
)
def test_bad_cells(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Action.parse(text)


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="stage_index must be >= 0, got -1"):
        Action(-1, ActionType.FORWARD, 0)
    with pytest.raises(ValueError, match="only OVERLAP_F_B has sub_actions"):
        Action(0, ActionType.FORWARD, 0, (Action(0, ActionType.FORWARD, 0),))
