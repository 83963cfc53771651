"""How the executor moves tensors between ranks: batches of sends and receives, no tags.

A rank's plan (:func:`plan_rank`) is read off its row of a table with transfers (what
:func:`hp_pp.add_communication` produces: a ``SEND`` right after the compute that produces a
message, and the matching ``RECV`` on the consumer at that same moment of the lock-step
lowering): transfer actions that follow each other with no compute in between become one
:class:`Exchange`, posted as one batch (``dist.batch_isend_irecv``) in the order written, and a
compute waits for the batches holding its receives. ``UNSHARD``/``RESHARD``/``REDUCE_GRAD``
between transfers run after the batch.

Why this order works on NCCL (:mod:`hp_pp.p2p_model`): each direction of a rank pair carries
its messages in the order the sender produces them, and the receiver posts its receives in that
same order (the lowering appends the receive when the send is issued); operations posted
together progress together, so a rank waiting for a receive never holds back a send its peer
needs. Receives posted later, at the moment they are consumed, deadlock most schedules under
these rules (every rank's send waits for a receive its peer has not posted), which is why
:func:`defer_receives` is checked before use.

:func:`plan_programs` turns the plans of all ranks into the programs the model replays: that
is how :func:`hp_pp.validate_schedule` checks a table before it runs.

See Also:
    :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`: torch's executor,
    which lowers its table the same way and batches each action's transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.comm_lowering import leaf_actions
from hp_pp.p2p_model import P2POp, Post, Wait

__all__ = ["Exchange", "Message", "RankPlan", "defer_receives", "plan_programs", "plan_rank"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_PRE_F = ActionType.PREPROCESS_F
_SEND = {ActionType.SEND_F: "F", ActionType.SEND_B: "B", ActionType.SEND_PRE: "PRE"}
_RECV = {ActionType.RECV_F: "F", ActionType.RECV_B: "B", ActionType.RECV_PRE: "PRE"}


@dataclass(frozen=True)
class Message:
    """One transfer between two ranks: what a stage sends for one micro-batch.

    Attributes:
        what: ``"F"`` (activations, sent forward), ``"B"`` (input gradients, sent back) or
            ``"PRE"`` (MPipe's preprocess output, shipped to stage 0's rank).
        stage: The sending stage (``0`` for ``"PRE"``).
        mb: The micro-batch.
        src: The sending pipeline rank.
        dst: The receiving pipeline rank.
    """

    what: str
    stage: int
    mb: int
    src: int
    dst: int

    @property
    def to_stage(self) -> int:
        """The stage that consumes the message."""
        if self.what == "F":
            return self.stage + 1
        if self.what == "B":
            return self.stage - 1
        return 0

    def __str__(self) -> str:
        return f"{self.what}(stage {self.stage}, mb {self.mb})"


@dataclass
class Exchange:
    """Post ``sends`` and ``recvs`` as one batch, then wait for the batch if ``wait``."""

    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)
    wait: bool = False

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)


#: A step of a rank's plan: a batch of transfers, or an action to run (compute, FSDP, ...).
Step = Exchange | Action


@dataclass
class RankPlan:
    """One rank's steps and, per compute position, the messages it must have received."""

    steps: list[Step]
    needs: dict[int, list[Message]]  # id(action) -> messages it consumes


def produced(rank: int, leaf: Action, placement: dict[int, int], num_stages: int) -> Message | None:
    """The message ``leaf`` (run on ``rank``) produces for another rank, if any."""
    mb = leaf.microbatch_index
    if mb is None:
        return None
    stage = leaf.stage_index
    if leaf.type is _PRE_F:
        dst = placement.get(0, rank)
        return None if dst == rank else Message("PRE", 0, mb, rank, dst)
    if leaf.type is _F and stage < num_stages - 1:
        dst = placement.get(stage + 1, rank)
        return None if dst == rank else Message("F", stage, mb, rank, dst)
    if leaf.type in (_B, _I) and stage > 0:
        dst = placement.get(stage - 1, rank)
        return None if dst == rank else Message("B", stage, mb, rank, dst)
    return None


def consumed(
    rank: int,
    leaf: Action,
    placement: dict[int, int],
    num_stages: int,
    preprocess_rank: dict[int, int],
) -> Message | None:
    """The message ``leaf`` (run on ``rank``) needs from another rank, if any."""
    mb = leaf.microbatch_index
    if mb is None:
        return None
    stage = leaf.stage_index
    if leaf.type is _F:
        if stage == 0:
            runner = preprocess_rank.get(mb)
            if runner is None or runner == rank:
                return None
            return Message("PRE", 0, mb, runner, rank)
        src = placement.get(stage - 1, rank)
        return None if src == rank else Message("F", stage - 1, mb, src, rank)
    if leaf.type in (_B, _I) and stage < num_stages - 1:
        src = placement.get(stage + 1, rank)
        return None if src == rank else Message("B", stage + 1, mb, src, rank)
    return None


def _is_work(action: Action) -> bool:
    return (
        action.type.is_compute or action.type.is_preprocess or action.type is ActionType.OVERLAP_F_B
    )


def _placement(table: ScheduleTable) -> tuple[dict[int, int], dict[int, int]]:
    placement: dict[int, int] = {}
    preprocess_rank: dict[int, int] = {}
    for rank, row in table.items():
        for action in row:
            if action is None:
                continue
            for leaf in leaf_actions(action):
                if leaf.type.is_compute:
                    placement.setdefault(leaf.stage_index, rank)
                elif leaf.type is _PRE_F and leaf.microbatch_index is not None:
                    preprocess_rank.setdefault(leaf.microbatch_index, rank)
    return placement, preprocess_rank


def plan_rank(
    table: ScheduleTable,
    rank: int,
    *,
    num_stages: int,
    placement: dict[int, int] | None = None,
    preprocess_rank: dict[int, int] | None = None,
) -> RankPlan:
    """The transport plan of ``rank``'s row of ``table`` (see the module docstring).

    Args:
        table: The action table (only ``rank``'s row is read when ``placement`` and
            ``preprocess_rank`` are given).
        rank: The pipeline rank.
        num_stages: Number of stages.
        placement: ``{stage: rank}``; found from the table's compute actions when ``None``.
        preprocess_rank: MPipe: ``{micro-batch: rank running its preprocess forward}``; found
            from the table when ``None``.

    Returns:
        The :class:`RankPlan`: batches of transfers and the actions between them, and what
        each compute action consumes from other ranks.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
    """
    found, found_pre = _placement(table)
    placement = dict(found if placement is None else placement)
    preprocess_rank = dict(found_pre if preprocess_rank is None else preprocess_rank)
    row = [a for a in table[rank] if a is not None]
    steps: list[Step] = []
    needs: dict[int, list[Message]] = {}
    current = Exchange()
    held: list[Action] = []  # UNSHARD / RESHARD / REDUCE_GRAD between transfers

    def flush() -> None:
        nonlocal current
        if current:
            steps.append(current)
            current = Exchange()
        steps.extend(held)
        held.clear()

    for action in row:
        kind = action.type
        mb = action.microbatch_index
        if kind in _SEND and mb is not None:
            what = _SEND[kind]
            if what == "PRE":
                dst = placement.get(0, rank)
            elif what == "F":
                dst = placement.get(action.stage_index + 1, rank)
            else:
                dst = placement.get(action.stage_index - 1, rank)
            current.sends.append(Message(what, action.stage_index, mb, rank, dst))
            continue
        if kind in _RECV and mb is not None:
            what = _RECV[kind]
            if what == "PRE":
                msg = Message("PRE", 0, mb, preprocess_rank.get(mb, rank), rank)
            elif what == "F":
                stage = action.stage_index - 1
                msg = Message("F", stage, mb, placement.get(stage, rank), rank)
            else:
                stage = action.stage_index + 1
                msg = Message("B", stage, mb, placement.get(stage, rank), rank)
            current.recvs.append(msg)
            continue
        if not _is_work(action):
            held.append(action)
            continue
        flush()
        needs[id(action)] = [
            m
            for leaf in leaf_actions(action)
            if (m := consumed(rank, leaf, placement, num_stages, preprocess_rank)) is not None
        ]
        steps.append(action)
    flush()
    return RankPlan(steps, needs)


def _op(msg: Message, kind: str, pp_rank_to_global: dict[int, int] | None) -> P2POp:
    peer = msg.dst if kind == "send" else msg.src
    if pp_rank_to_global is not None:
        peer = pp_rank_to_global[peer]
    return P2POp(kind, peer, (msg.stage, msg.mb, msg.what, "data"))


def plan_programs(table: ScheduleTable, *, num_stages: int) -> dict[int, list[Post | Wait]]:
    """The programs (posts and waits) all ranks would issue for ``table``, for
    :func:`hp_pp.p2p_model.replay`.

    Every message is one operation here (a live run may split one into several tensors and a
    one-time description; the executor's recorded trace shows those).

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute`: torch's dry run,
        which lets sends complete without their receive.
    """
    placement, _ = _placement(table)
    programs: dict[int, list[Post | Wait]] = {}
    for rank in table:
        plan = plan_rank(table, rank, num_stages=num_stages, placement=placement)
        program: list[Post | Wait] = []
        batch = 0
        where: dict[Message, int] = {}
        all_batches: list[int] = []
        for step in plan.steps:
            if isinstance(step, Exchange):
                ops = [_op(m, "send", None) for m in step.sends]
                ops += [_op(m, "recv", None) for m in step.recvs]
                for m in step.recvs:
                    where[m] = batch
                program.append(Post(batch, tuple(ops)))
                all_batches.append(batch)
                batch += 1
                continue
            for msg in plan.needs.get(id(step), []):
                if msg in where:
                    program.append(Wait(where[msg]))
        program += [Wait(b) for b in all_batches]
        programs[rank] = program
    return programs


def defer_receives(table: ScheduleTable) -> ScheduleTable:
    """Move every receive of a table with transfers to just before the compute that consumes
    it (keeping the order of receives from one peer): less receive-buffer memory, but under
    NCCL's rules most schedules then deadlock, so check the result (the schedule classes do).

    See Also:
        :pt:`torch.distributed.pipelining.schedules._add_send_recv`
    """
    out: ScheduleTable = {}
    for rank, row in table.items():
        result: list[Action | None] = []
        held: list[Action] = []
        for action in row:
            if action is None:
                continue
            if action.type in _RECV:
                held.append(action)
                continue
            if _is_work(action):
                wanted = set()
                for leaf in leaf_actions(action):
                    mb = leaf.microbatch_index
                    if leaf.type is _F:
                        wanted.add((leaf.stage_index, ActionType.RECV_F, mb))
                        wanted.add((0, ActionType.RECV_PRE, mb))
                    elif leaf.type in (_B, _I):
                        wanted.add((leaf.stage_index, ActionType.RECV_B, mb))
                last = [
                    i
                    for i, h in enumerate(held)
                    if (h.stage_index, h.type, h.microbatch_index) in wanted
                ]
                if last:
                    cut = last[-1] + 1
                    result += held[:cut]
                    held = held[cut:]
            result.append(action)
        result += held
        out[rank] = result
    return out
