"""Lowering a compute-only table to an executable one: sends, receives and FSDP actions.

:func:`add_communication` walks every rank's compute actions in lock-step rounds. An action
runs once its input exists: a forward of stage ``s`` needs the forward of ``s - 1``, a
backward (``B`` or ``I``) of stage ``s`` needs the backward of ``s + 1`` (the last stage needs
its own forward). When the producer runs on another rank, the producer's rank gets a
``SEND`` right after it and the consumer's rank gets the matching ``RECV`` at that same moment,
so each rank's receives come in the order its peer sends them (point-to-point messages between
two ranks match in posting order) and a rank never waits for a send that has not been issued.
Stages on the same rank pass tensors directly: no transfer is added.

:func:`add_reduce_grad` and :func:`add_unshard_reshard` add the per-stage data-parallel work
of stages whose module is sharded (FSDP).

See Also:
    :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime` (its lowering of
    ``pipeline_order`` into ``pipeline_order_with_comms``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.generators.mapping import stage_to_rank

__all__ = ["add_communication", "add_reduce_grad", "add_unshard_reshard", "leaf_actions"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT
_PRE_F = ActionType.PREPROCESS_F
_PRE_B = ActionType.PREPROCESS_B
_GRAD_INPUT_KINDS = (_B, _I)
_PER_STAGE = (ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD)


def leaf_actions(action: Action) -> tuple[Action, ...]:
    """The compute actions an action stands for (the sub-actions of ``OVERLAP_F_B``)."""
    return action.sub_actions if action.sub_actions is not None else (action,)


class _Lowering:
    """State of one lowering: what each rank has done and the table being built."""

    def __init__(
        self, num_stages: int, rank_of: Callable[[int], int], preprocess_rank: dict[int, int]
    ) -> None:
        self.num_stages = num_stages
        self.rank_of = rank_of
        # MPipe: micro-batch -> the rank that runs its transposed preprocess forward.
        self.preprocess_rank = preprocess_rank
        self.done: dict[int, set[tuple[int, ActionType, int]]] = defaultdict(set)
        self.received: dict[int, set[tuple[int, ActionType, int]]] = defaultdict(set)

    def _producer(self, action: Action) -> tuple[int, tuple[ActionType, ...]] | None:
        """The stage whose output ``action`` consumes and the kinds that produce it."""
        stage = action.stage_index
        if action.type is _F:
            return (stage - 1, (_F,)) if stage > 0 else None
        if action.type in _GRAD_INPUT_KINDS:
            if stage == self.num_stages - 1:
                return stage, (_F,)
            return stage + 1, _GRAD_INPUT_KINDS
        if action.type is _W:
            return stage, (_I,)
        return None

    def ready(self, rank: int, action: Action) -> bool:
        mb = action.microbatch_index
        assert mb is not None
        if action.type is _PRE_B:
            return any((0, kind, mb) in self.done[rank] for kind in _GRAD_INPUT_KINDS)
        if action.type is _F and action.stage_index == 0 and mb in self.preprocess_rank:
            if self.preprocess_rank[mb] == rank:
                return (0, _PRE_F, mb) in self.done[rank]
            return (0, ActionType.RECV_PRE, mb) in self.received[rank]
        producer = self._producer(action)
        if producer is None:
            return True
        stage, kinds = producer
        if self.rank_of(stage) == rank:
            return any((stage, kind, mb) in self.done[rank] for kind in kinds)
        recv = ActionType.RECV_F if action.type is _F else ActionType.RECV_B
        return (action.stage_index, recv, mb) in self.received[rank]

    def transfer(self, rank: int, action: Action) -> tuple[Action, int, Action] | None:
        """(send on this rank, receiving rank, recv there) if ``action``'s output crosses ranks."""
        stage, mb = action.stage_index, action.microbatch_index
        if action.type is _PRE_F:
            to_rank = self.rank_of(0)
            if to_rank == rank:
                return None
            return Action(0, ActionType.SEND_PRE, mb), to_rank, Action(0, ActionType.RECV_PRE, mb)
        if action.type is _F and stage < self.num_stages - 1:
            to_stage, send, recv = stage + 1, ActionType.SEND_F, ActionType.RECV_F
        elif action.type in _GRAD_INPUT_KINDS and stage > 0:
            to_stage, send, recv = stage - 1, ActionType.SEND_B, ActionType.RECV_B
        else:
            return None
        to_rank = self.rank_of(to_stage)
        if to_rank == self.rank_of(stage):
            return None
        return Action(stage, send, mb), to_rank, Action(to_stage, recv, mb)


def add_communication(table: ScheduleTable, *, num_stages: int, style: str) -> ScheduleTable:
    """Insert ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` into a compute-only table.

    MPipe's transposed preprocess forwards (``0PRE_F<mb>`` off stage 0's rank) get a
    ``0SEND_PRE<mb>`` after them and a ``0RECV_PRE<mb>`` on stage 0's rank.

    The compute order of every rank is kept; ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` stay where
    they are. An idle slot (``None``) takes one lock-step round (it delays the rank, like in the
    picture) and is then dropped. The result runs under NCCL's point-to-point rules when the
    transfers that follow each other are posted as one batch, as the executor does (see
    :mod:`hp_pp.transport`; :func:`hp_pp.validate_schedule` checks it).

    Args:
        table: ``{rank: [Action | None]}`` with compute actions (``F``, ``B``, ``I``, ``W``,
            ``OVERLAP_F_B``, MPipe's ``PRE_F`` / ``PRE_B``) and per-stage actions, no
            transfers, and ranks ``0 .. len(table) - 1``.
        num_stages: Total number of stages.
        style: ``"loop"`` or ``"v"``: the stage-to-rank placement
            (:func:`hp_pp.stage_to_rank`).

    Raises:
        ValueError: a non-compute action, a stage on the wrong rank, or a table whose compute
            order cannot run (some action waits forever); the message names rank and action.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._add_send_recv`
    """
    pp_size = len(table)
    if sorted(table) != list(range(pp_size)):
        raise ValueError(f"table ranks must be 0..{pp_size - 1}, got {sorted(table)}")

    def rank_of(stage: int) -> int:
        return stage_to_rank(stage, pp_size, style)

    return lower_with_placement(
        table, num_stages=num_stages, rank_of=rank_of, placement_name=f"the {style!r} placement"
    )


def lower_with_placement(
    table: ScheduleTable,
    *,
    num_stages: int,
    rank_of: Callable[[int], int],
    placement_name: str = "the placement",
) -> ScheduleTable:
    """:func:`add_communication` with any stage-to-rank function (the validator uses the
    placement it finds in the table)."""
    pp_size = len(table)
    pending: dict[int, list[Action | None]] = {}
    preprocess_rank: dict[int, int] = {}
    for rank, actions in table.items():
        pending[rank] = list(actions)
        for position, action in enumerate(actions):
            if action is None:
                continue
            if action.type in _PER_STAGE:
                continue  # kept in place (FSDP's UNSHARD / RESHARD / REDUCE_GRAD)
            if not (
                action.type.is_compute
                or action.type.is_preprocess
                or action.type is ActionType.OVERLAP_F_B
            ):
                raise ValueError(
                    f"rank {rank}, position {position}: {action} is not a compute action; "
                    "add_communication takes a compute-only table"
                )
            for leaf in leaf_actions(action):
                if not 0 <= leaf.stage_index < num_stages:
                    raise ValueError(
                        f"rank {rank}: {leaf} names stage {leaf.stage_index}, but there are "
                        f"{num_stages} stages"
                    )
                if leaf.type is _PRE_F:
                    preprocess_rank.setdefault(leaf.microbatch_index or 0, rank)
                elif rank_of(leaf.stage_index) != rank:
                    raise ValueError(
                        f"rank {rank}: {leaf} belongs to rank {rank_of(leaf.stage_index)} under "
                        f"{placement_name} of {num_stages} stages on {pp_size} ranks"
                    )

    state = _Lowering(num_stages, rank_of, preprocess_rank)
    lowered: ScheduleTable = {rank: [] for rank in range(pp_size)}
    cursor = dict.fromkeys(range(pp_size), 0)
    while any(cursor[rank] < len(pending[rank]) for rank in cursor):
        progressed = False
        for rank in range(pp_size):
            if cursor[rank] >= len(pending[rank]):
                continue
            action = pending[rank][cursor[rank]]
            if action is None:
                cursor[rank] += 1
                progressed = True
                continue
            if action.type in _PER_STAGE:
                lowered[rank].append(action)
                cursor[rank] += 1
                progressed = True
                continue
            leaves = leaf_actions(action)
            if not all(state.ready(rank, leaf) for leaf in leaves):
                continue
            lowered[rank].append(action)
            for leaf in leaves:
                assert leaf.microbatch_index is not None
                state.done[rank].add((leaf.stage_index, leaf.type, leaf.microbatch_index))
                crossing = state.transfer(rank, leaf)
                if crossing is not None:
                    send, to_rank, recv = crossing
                    lowered[rank].append(send)
                    lowered[to_rank].append(recv)
                    assert recv.microbatch_index is not None
                    state.received[to_rank].add(
                        (recv.stage_index, recv.type, recv.microbatch_index)
                    )
            cursor[rank] += 1
            progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {rank} at {pending[rank][cursor[rank]]}"
                for rank in range(pp_size)
                if cursor[rank] < len(pending[rank])
            )
            raise ValueError(f"the compute order cannot run: every rank waits ({stuck})")
    return lowered


def add_reduce_grad(table: ScheduleTable, *, n_microbatches: int) -> ScheduleTable:
    """Append ``REDUCE_GRAD`` for a stage right after its last weight-gradient action.

    A stage's gradients are complete once ``n_microbatches`` of its ``B``/``W`` actions (and
    all of its MPipe ``PRE_B``) ran; the data-parallel reduction of that stage can start there.
    Idle slots are dropped.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._add_reduce_grad`
    """
    result: ScheduleTable = {}
    for rank, actions in table.items():
        # MPipe: stage 0's preprocess gradients come from its PRE_B actions, so they count too.
        needed: dict[int, int] = defaultdict(lambda: n_microbatches)
        for action in actions:
            if action is not None and action.type is _PRE_B:
                needed[action.stage_index] += 1
        counts: dict[int, int] = defaultdict(int)
        out: list[Action | None] = []
        for action in actions:
            if action is None:
                continue
            out.append(action)
            for leaf in leaf_actions(action):
                if leaf.type in (_B, _W, _PRE_B):
                    counts[leaf.stage_index] += 1
                    if counts[leaf.stage_index] == needed[leaf.stage_index]:
                        out.append(Action(leaf.stage_index, ActionType.REDUCE_GRAD))
        result[rank] = out
    return result


def add_unshard_reshard(table: ScheduleTable, *, max_active_stages: int = 3) -> ScheduleTable:
    """Add ``UNSHARD`` before a stage computes and ``RESHARD`` when it leaves the look-ahead.

    Each rank keeps at most ``max_active_stages`` stages unsharded: before each compute action
    it looks at the next stages it will use, reshards the active ones not among them and
    unshards (prefetches) the missing ones, in use order. Everything is resharded at the end.
    Other actions (transfers, ``REDUCE_GRAD``) pass through, so the two FSDP passes compose in
    either order.

    Raises:
        ValueError: ``max_active_stages < 1``.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._add_unshard_reshard`
    """
    if max_active_stages < 1:
        raise ValueError(f"max_active_stages must be >= 1, got {max_active_stages}")
    result: ScheduleTable = {}
    for rank, actions in table.items():
        present = [a for a in actions if a is not None]
        active: set[int] = set()
        out: list[Action | None] = []
        for index, action in enumerate(present):
            if not (action.type.is_compute or action.type is ActionType.OVERLAP_F_B):
                out.append(action)  # transfers, REDUCE_GRAD, MPipe's preprocess: no change
                continue
            upcoming: list[int] = []
            for later in present[index:]:
                for leaf in leaf_actions(later):
                    if leaf.type.is_compute and leaf.stage_index not in upcoming:
                        upcoming.append(leaf.stage_index)
                if len(upcoming) >= max_active_stages:
                    break
            upcoming = upcoming[:max_active_stages]
            for stage in sorted(active - set(upcoming)):
                active.discard(stage)
                out.append(Action(stage, ActionType.RESHARD))
            for stage in upcoming:
                if stage not in active:
                    active.add(stage)
                    out.append(Action(stage, ActionType.UNSHARD))
            out.append(action)
        out.extend(Action(stage, ActionType.RESHARD) for stage in sorted(active))
        result[rank] = out
    return result
