"""The action vocabulary of pipeline schedules: a schedule is a per-rank list of actions.

An action names a stage, what to do, and (for per-micro-batch work) which micro-batch. Its text
form is the compact notation PyTorch's pipelining uses, so tables read and write as CSV:
``0F1`` (stage 0, forward of micro-batch 1), ``1B0`` (full backward), ``2I3`` (backward for the
input), ``2W3`` (backward for the weights), ``0SEND_F1`` / ``1RECV_F1`` / ``1SEND_B0`` /
``0RECV_B0`` (point-to-point transfers of activations and gradients), ``0UNSHARD`` /
``0RESHARD`` / ``0REDUCE_GRAD`` (per-stage data-parallel work), and
``(0F1;1B0)OVERLAP_F_B`` (a forward and a backward run together so one's communication hides
behind the other's compute). HyperParallel's MPipe adds ``0PRE_F2`` (rank 2 runs the forward
of stage 0's preprocess block for micro-batch 2), ``0SEND_PRE2`` / ``0RECV_PRE2`` (its output
and input shipped to stage 0's rank) and ``0PRE_B2`` (stage 0's rank recomputes that
preprocess forward and runs its backward).

See Also:
    :pt:`torch.distributed.pipelining.schedules._Action`: the same notation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Action", "ActionType", "ScheduleTable"]


class ActionType(str, Enum):
    """What an action does. The value is its suffix in the compact notation.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._ComputationType`
    """

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OVERLAP_F_B = "OVERLAP_F_B"
    PREPROCESS_F = "PRE_F"
    PREPROCESS_B = "PRE_B"
    SEND_PRE = "SEND_PRE"
    RECV_PRE = "RECV_PRE"

    @property
    def is_compute(self) -> bool:
        """Forward or one of the backward kinds (the work a simulator charges compute for)."""
        return self in _COMPUTE

    @property
    def is_communication(self) -> bool:
        """A point-to-point send or receive between stages."""
        return self in _COMMUNICATION

    @property
    def is_preprocess(self) -> bool:
        """MPipe's transposed preprocess work (``PRE_F`` on any rank, ``PRE_B`` on stage 0's)."""
        return self in (ActionType.PREPROCESS_F, ActionType.PREPROCESS_B)

    @property
    def needs_microbatch(self) -> bool:
        """Whether actions of this kind name a micro-batch."""
        return self not in _PER_STAGE


_COMPUTE = frozenset(
    {
        ActionType.FORWARD,
        ActionType.FULL_BACKWARD,
        ActionType.BACKWARD_INPUT,
        ActionType.BACKWARD_WEIGHT,
    }
)
_COMMUNICATION = frozenset(
    {
        ActionType.SEND_F,
        ActionType.RECV_F,
        ActionType.SEND_B,
        ActionType.RECV_B,
        ActionType.SEND_PRE,
        ActionType.RECV_PRE,
    }
)
_PER_STAGE = frozenset(
    {ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD, ActionType.OVERLAP_F_B}
)

# Longest suffixes first so "SEND_F" is not read as "F".
_SUFFIXES = "|".join(sorted((re.escape(t.value) for t in ActionType), key=len, reverse=True))
_SIMPLE = re.compile(rf"^(\d+)({_SUFFIXES})(\d*)$")
_OVERLAP = re.compile(r"^\((.+)\)OVERLAP_F_B$")


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule.

    Attributes:
        stage_index: The pipeline stage the action belongs to (for ``OVERLAP_F_B``, the stage
            of its first sub-action).
        type: What the action does.
        microbatch_index: The micro-batch, for per-micro-batch kinds; ``None`` for
            ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD`` and ``OVERLAP_F_B``.
        sub_actions: For ``OVERLAP_F_B`` only: the compute actions run together.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._Action`
    """

    stage_index: int
    type: ActionType
    microbatch_index: int | None = None
    sub_actions: tuple[Action, ...] | None = None

    def __post_init__(self) -> None:
        if self.stage_index < 0:
            raise ValueError(f"stage_index must be >= 0, got {self.stage_index}")
        if self.type is ActionType.OVERLAP_F_B:
            if not self.sub_actions or any(not a.type.is_compute for a in self.sub_actions):
                raise ValueError(f"OVERLAP_F_B needs compute sub-actions, got {self.sub_actions!r}")
        elif self.sub_actions is not None:
            raise ValueError(f"only OVERLAP_F_B has sub_actions, not {self.type.name}")
        if self.type.needs_microbatch and (
            self.microbatch_index is None or self.microbatch_index < 0
        ):
            raise ValueError(
                f"{self.type.name} needs a micro-batch index >= 0, got {self.microbatch_index}"
            )
        if not self.type.needs_microbatch and self.microbatch_index is not None:
            raise ValueError(f"{self.type.name} takes no micro-batch index")

    def __str__(self) -> str:
        if self.sub_actions is not None:
            return f"({';'.join(str(a) for a in self.sub_actions)})OVERLAP_F_B"
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.type.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action from its compact notation (``"0F1"``, ``"(0F1;1B0)OVERLAP_F_B"``).

        Raises:
            ValueError: ``text`` is not an action in the compact notation.
        """
        text = text.strip()
        overlap = _OVERLAP.match(text)
        if overlap is not None:
            subs = tuple(cls.parse(part) for part in overlap.group(1).split(";"))
            return cls(subs[0].stage_index, ActionType.OVERLAP_F_B, None, subs)
        simple = _SIMPLE.match(text)
        if simple is None:
            raise ValueError(
                f"{text!r} is not an action; expected e.g. '0F1', '1B0', '2W3', '0SEND_F1', "
                "'0UNSHARD' or '(0F1;1B0)OVERLAP_F_B'"
            )
        stage, kind, mb = simple.groups()
        return cls(int(stage), ActionType(kind), int(mb) if mb else None)


ScheduleTable = dict[int, list[Action | None]]
"""A schedule: for each pipeline rank, its actions in order (``None`` marks an idle slot)."""
