"""Two stages per rank in a V (stages ``r`` and ``2 * pp_size - 1 - r`` on rank ``r``).

* ZBV zero bubble: warm-up forwards of both local stages, then forward / backward-input /
  backward-weight triples, weight passes deferred in the cool-down to fill the bubbles.
* DualPipeV: DeepSeek's schedule in its V form; in the steady state a forward of one local
  stage runs together with a full backward of the other (``OVERLAP_F_B``).

Orders per rank equal PyTorch 2.13's for the same sizes.

See Also:
    :pt:`torch.distributed.pipelining.ScheduleZBVZeroBubble`,
    :pt:`torch.distributed.pipelining.ScheduleDualPipeV`
"""

from __future__ import annotations

from collections import defaultdict, deque

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.generators._checks import check_sizes, require_v_stages

__all__ = ["dualpipe_v", "zbv_zero_bubble"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT


def zbv_zero_bubble(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """The ZB-V schedule (zero bubble when forward, input- and weight-backward cost the same).

    Raises:
        ValueError: ``num_stages != 2 * pp_size`` or a size below 1.
    """
    check_sizes("ZBVZeroBubble", pp_size, num_stages, n_microbatches)
    require_v_stages("ZBVZeroBubble", pp_size, num_stages)
    return {rank: _zbv_rank(rank, pp_size, n_microbatches) for rank in range(pp_size)}


def _zbv_rank(rank: int, pp_size: int, n_microbatches: int) -> list[Action | None]:
    # The V needs 2 * pp_size - 1 micro-batches to fill; with fewer, the slots of the
    # missing micro-batches stay idle.
    padded = max(2 * pp_size - 1, n_microbatches)
    down, up = rank, 2 * pp_size - 1 - rank
    count: dict[tuple[ActionType, int], int] = defaultdict(int)
    slots: list[Action | None] = [None] * rank

    def emit(kind: ActionType, stage: int) -> None:
        mb = count[(kind, stage)]
        count[(kind, stage)] = mb + 1
        slots.append(Action(stage, kind, mb) if mb < n_microbatches else None)

    def emit_backward(stage: int) -> None:
        # Input and weight backward of the same micro-batch, back to back.
        emit(_I, stage)
        emit(_W, stage)

    for _ in range(2 * (pp_size - rank) - 1):
        emit(_F, down)
    for _ in range(rank):
        emit(_F, up)
        emit(_F, down)
    for _ in range(pp_size - rank):
        emit(_F, up)
        emit_backward(up)
    while count[(_F, up)] < count[(_F, down)] or count[(_F, down)] < padded:
        if count[(_F, down)] < padded:
            emit(_F, down)
        emit_backward(down)
        emit(_F, up)
        emit_backward(up)
    # Cool-down: input backwards first, weight backwards deferred to fill the drain.
    for _ in range(rank):
        emit(_I, down)
        emit(_I, up)
    for _ in range(pp_size - rank):
        emit(_I, down)
        emit(_W, down)
    while count[(_W, up)] < count[(_I, up)]:
        emit(_W, up)
    while count[(_W, down)] < count[(_I, down)]:
        emit(_W, down)
    return slots


def dualpipe_v(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """DualPipeV: V-shaped DualPipe with overlapped forward+backward pairs.

    Raises:
        ValueError: ``num_stages != 2 * pp_size``, or fewer micro-batches than stages.
    """
    check_sizes("DualPipeV", pp_size, num_stages, n_microbatches)
    require_v_stages("DualPipeV", pp_size, num_stages)
    if n_microbatches < num_stages:
        raise ValueError(
            f"DualPipeV needs n_microbatches >= num_stages, got n_microbatches="
            f"{n_microbatches}, num_stages={num_stages}"
        )
    return {rank: _DualPipeVRank(rank, pp_size, n_microbatches).ops() for rank in range(pp_size)}


class _DualPipeVRank:
    """One rank's DualPipeV order; counters give each stage's next micro-batch per kind."""

    def __init__(self, rank: int, pp_size: int, n_microbatches: int) -> None:
        self.rank = rank
        self.pp_size = pp_size
        self.n_microbatches = n_microbatches
        self.down = rank
        self.up = 2 * pp_size - 1 - rank
        self.forwards: dict[int, int] = defaultdict(int)
        self.backwards: dict[int, int] = defaultdict(int)
        self.pending_weights: deque[tuple[int, int]] = deque()
        self.slots: list[Action | None] = []

    def _forward(self, stage: int) -> Action:
        mb = self.forwards[stage]
        self.forwards[stage] += 1
        return Action(stage, _F, mb)

    def _backward(self, stage: int, kind: ActionType) -> Action:
        mb = self.backwards[stage]
        self.backwards[stage] += 1
        if kind is _I:
            self.pending_weights.append((stage, mb))
        return Action(stage, kind, mb)

    def _overlap(self, forward_stage: int, backward_stage: int) -> None:
        sub = (self._forward(forward_stage), self._backward(backward_stage, _B))
        self.slots.append(Action(sub[0].stage_index, ActionType.OVERLAP_F_B, None, sub))

    def _weight_if_pending(self) -> None:
        if self.pending_weights:
            stage, mb = self.pending_weights.popleft()
            self.slots.append(Action(stage, _W, mb))

    def ops(self) -> list[Action | None]:
        p, r, down, up, add = self.pp_size, self.rank, self.down, self.up, self.slots.append
        for _ in range(2 * (p - r - 1)):
            add(self._forward(down))
        for _ in range(r + 1):
            add(self._forward(down))
            add(self._forward(up))
        for _ in range(p - r - 1):
            add(self._backward(up, _I))
            self._weight_if_pending()
            add(self._forward(up))
        for i in range(self.n_microbatches - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                # The last rank starts the steady state unpaired: pairing would add a bubble.
                add(self._forward(down))
                add(self._backward(up, _B))
            else:
                self._overlap(down, up)
            self._overlap(up, down)
        for _ in range(p - r - 1):
            add(self._backward(up, _B))
            self._overlap(up, down)
        # The second half of the drain splits backwards so weight passes can fill bubbles;
        # odd ranks switch before their first-half up-stage backward, even ranks after.
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(self._backward(up, _I if split else _B))
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(self._backward(down, _I if split else _B))
        for _ in range(p - r - 1):
            self._weight_if_pending()
            add(self._backward(down, _I if split else _B))
        for _ in range(r + 1):
            self._weight_if_pending()
        return self.slots
