"""Several stages per rank, placed in a loop (stage ``s`` on rank ``s % pp_size``).

* Looped BFS: every forward of the rank's first stage, then of its next stage, ...; backwards
  in the reverse order (breadth first).
* Interleaved 1F1B: micro-batches go through the rank's stages in rounds of
  ``n_microbatches // rounds`` (depth first), warm-up then one forward / one backward.
* Interleaved Zero Bubble (ZB1P): the same skeleton with the backward split into input (``I``)
  and weight (``W``) parts; the weight parts fill what would be bubbles.

Orders per rank equal PyTorch 2.13's for the same sizes, so results can match bitwise.

See Also:
    :pt:`torch.distributed.pipelining.ScheduleLoopedBFS`,
    :pt:`torch.distributed.pipelining.ScheduleInterleaved1F1B`,
    :pt:`torch.distributed.pipelining.ScheduleInterleavedZeroBubble`
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.generators._checks import check_sizes, require_looped_stages

__all__ = [
    "interleaved_1f1b",
    "interleaved_1f1b_named",
    "interleaved_zero_bubble",
    "looped_bfs",
]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT


def looped_bfs(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """Breadth first: all micro-batches of a local stage before the next local stage.

    Raises:
        ValueError: ``num_stages`` not a multiple of ``pp_size``, or a size below 1.
    """
    check_sizes("LoopedBFS", pp_size, num_stages, n_microbatches)
    require_looped_stages("LoopedBFS", pp_size, num_stages)
    table: ScheduleTable = {}
    for rank in range(pp_size):
        stages = range(rank, num_stages, pp_size)
        slots: list[Action | None] = [None] * rank
        for stage in stages:
            slots += [Action(stage, _F, mb) for mb in range(n_microbatches)]
        slots += [None] * (2 * (pp_size - 1 - rank))
        for stage in reversed(stages):
            slots += [Action(stage, _B, mb) for mb in reversed(range(n_microbatches))]
        table[rank] = slots
    return table


@dataclass(frozen=True)
class _Rounds:
    """How an interleaved schedule groups micro-batches: ``count`` rounds of ``size``."""

    count: int
    size: int

    @classmethod
    def of(cls, name: str, pp_size: int, n_microbatches: int) -> _Rounds:
        count = max(1, n_microbatches // pp_size)
        if n_microbatches % count != 0:
            raise ValueError(
                f"{name} runs micro-batches in max(1, n_microbatches // pp_size) = {count} "
                f"rounds: n_microbatches must be a multiple of {count}, got "
                f"n_microbatches={n_microbatches}, pp_size={pp_size}"
            )
        return cls(count, n_microbatches // count)


def interleaved_1f1b(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """Interleaved (depth-first) 1F1B over the rank's looped stages.

    Raises:
        ValueError: ``num_stages`` not a multiple of ``pp_size``, or ``n_microbatches`` not a
            multiple of the number of rounds ``max(1, n_microbatches // pp_size)``.
    """
    return interleaved_1f1b_named(
        "Interleaved1F1B", pp_size=pp_size, num_stages=num_stages, n_microbatches=n_microbatches
    )


def interleaved_1f1b_named(
    name: str, *, pp_size: int, num_stages: int, n_microbatches: int
) -> ScheduleTable:
    """:func:`interleaved_1f1b` whose errors name ``name`` (for schedules built on it)."""
    check_sizes(name, pp_size, num_stages, n_microbatches)
    local = require_looped_stages(name, pp_size, num_stages)
    rounds = _Rounds.of(name, pp_size, n_microbatches)
    return {
        rank: _InterleavedRank(rank, pp_size, local, n_microbatches, rounds, 2, False).ops()
        for rank in range(pp_size)
    }


def interleaved_zero_bubble(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """ZB1P: interleaved 1F1B with split backwards; weight passes fill the bubbles.

    Raises:
        ValueError: as :func:`interleaved_1f1b`.
    """
    name = "InterleavedZeroBubble"
    check_sizes(name, pp_size, num_stages, n_microbatches)
    local = require_looped_stages(name, pp_size, num_stages)
    rounds = _Rounds.of(name, pp_size, n_microbatches)
    table = {
        rank: _InterleavedRank(rank, pp_size, local, n_microbatches, rounds, 1, True).ops()
        for rank in range(pp_size)
    }
    return _insert_dependency_bubbles(table, num_stages)


class _InterleavedRank:
    """Builds one rank's interleaved order: warm-up forwards, 1F1B pairs, cool-down backwards."""

    def __init__(
        self,
        rank: int,
        pp_size: int,
        local_stages: int,
        n_microbatches: int,
        rounds: _Rounds,
        hop_factor: int,
        zero_bubble: bool,
    ) -> None:
        self.rank = rank
        self.pp_size = pp_size
        self.local_stages = local_stages
        self.zero_bubble = zero_bubble
        total = local_stages * n_microbatches
        # The last rank warms up one round per extra local stage; each hop further from it
        # adds ``hop_factor`` forwards (2 for 1F1B: a forward and a backward per hop).
        self.warmup = min(
            (local_stages - 1) * rounds.size + hop_factor * (pp_size - 1 - rank), total
        )
        self.steady = total - self.warmup
        self.cooldown = self.warmup
        self.round_size = rounds.size

    def _forward_stage(self, step: int) -> int:
        return ((step // self.round_size) % self.local_stages) * self.pp_size + self.rank

    def _backward_stage(self, step: int) -> int:
        local = (
            self.local_stages - 1 - ((step - self.warmup) // self.round_size) % self.local_stages
        )
        return local * self.pp_size + self.rank

    def ops(self) -> list[Action | None]:
        next_mb: dict[tuple[ActionType, int], int] = defaultdict(int)

        def take(kind: ActionType, stage: int) -> Action:
            mb = next_mb[(kind, stage)]
            next_mb[(kind, stage)] = mb + 1
            return Action(stage, kind, mb)

        backward_kind = _I if self.zero_bubble else _B
        slots: list[Action | None] = [None] * self.rank
        if self.zero_bubble:
            wait = self.pp_size - 1 - self.rank
        else:
            first_backward_slot = self.local_stages * self.pp_size + 2 * (
                self.pp_size - 1 - self.rank
            )
            wait = first_backward_slot - (self.warmup + self.rank)
        backward_steps: list[int] = []
        weights_done = 0
        # ZB1P delays rank r's first weight passes by r pairs so they land in the bubbles.
        weight_delay = self.rank

        def maybe_weight(step: int) -> None:
            nonlocal weights_done
            if self.zero_bubble and step - self.warmup >= weight_delay:
                slots.append(take(_W, self._backward_stage(backward_steps[weights_done])))
                weights_done += 1

        total = self.warmup + self.steady + self.cooldown
        for step in range(total):
            if step < self.warmup:
                slots.append(take(_F, self._forward_stage(step)))
                if step == self.warmup - 1:
                    slots.extend([None] * wait)
            elif step < self.warmup + self.steady:
                slots.append(take(_F, self._forward_stage(step)))
                slots.append(take(backward_kind, self._backward_stage(step)))
                backward_steps.append(step)
                maybe_weight(step)
            else:
                if not self.zero_bubble:
                    slots.append(None)
                slots.append(take(backward_kind, self._backward_stage(step)))
                backward_steps.append(step)
                maybe_weight(step)
        while self.zero_bubble and weights_done < len(backward_steps):
            slots.append(take(_W, self._backward_stage(backward_steps[weights_done])))
            weights_done += 1
        return slots


def _insert_dependency_bubbles(table: ScheduleTable, num_stages: int) -> ScheduleTable:
    """Delay actions (insert ``None``) until, in lock-step time, their inputs exist.

    A forward of stage ``s > 0`` waits for the forward of ``s - 1``; a full backward waits for
    the backward of ``s + 1`` (on the last stage, for its own forward). Split backwards are not
    delayed here (the executor waits for their gradients). Only needed when there are too few
    micro-batches to fill the ZB1P steady state.
    """
    done: set[tuple[int, ActionType, int]] = set()
    cursor = dict.fromkeys(table, 0)
    result: ScheduleTable = {rank: [] for rank in table}

    def blocked(action: Action) -> bool:
        stage, kind, mb = action.stage_index, action.type, action.microbatch_index
        assert mb is not None
        if kind is _F:
            return stage != 0 and (stage - 1, _F, mb) not in done
        if kind is _B:
            upstream = (stage, _F, mb) if stage == num_stages - 1 else (stage + 1, _B, mb)
            return upstream not in done
        return False

    while any(cursor[rank] < len(table[rank]) for rank in table):
        finished_now: set[tuple[int, ActionType, int]] = set()
        for rank in sorted(table):
            if cursor[rank] >= len(table[rank]):
                continue
            action = table[rank][cursor[rank]]
            if action is not None and blocked(action):
                result[rank].append(None)
                continue
            result[rank].append(action)
            cursor[rank] += 1
            if action is not None and action.microbatch_index is not None:
                finished_now.add((action.stage_index, action.type, action.microbatch_index))
        done |= finished_now
    return result
